"""The ``routereplay`` argument parser: every command's options (routereplay.cli.main runs
them)."""
from __future__ import annotations

import argparse

from routereplay.cli.convert_cmd import cmd_convert
from routereplay.cli.demo_cmd import cmd_demo
from routereplay.cli.export_cmd import cmd_export
from routereplay.cli.inspect_cmd import cmd_inspect
from routereplay.cli.verify_cmd import cmd_verify
from routereplay.codec import REMOVED_CODECS, WRITER_CODECS
from routereplay.errors import ConfigError

NO_FLOORS_HELP = ("read sections below the reader floors (docs/FORMAT.md 'Reader limits'): "
                  "streams of earlier writers with tiny grids; trusted streams only (their "
                  "CPU per MiB is then unbounded)")


def _int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is not >= {minimum}")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _layers(text: str) -> list[int]:
    from routereplay.convert import parse_layers
    try:
        return parse_layers(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _codec(text: str) -> str:
    """argparse type of --codec: a writer codec, or a removed one (convert refuses it with
    the removal text; it is left out of the help)."""
    if text in WRITER_CODECS or text in REMOVED_CODECS:
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                     + ", ".join(map(repr, WRITER_CODECS)) + ")")


def _format_version(text: str) -> int:
    """argparse type of --format-version: 3, or 2 (removed: convert refuses it with the
    removal text)."""
    if text in ("2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 3)")


def _version() -> str:
    from routereplay import __version__
    return f"routereplay {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; ``parse_args(argv).func(args)`` runs it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true",
                        help="no progress bars (ours, tqdm's and transformers')")
    p = argparse.ArgumentParser(prog="routereplay", description="MoE routing replay tools")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[common],
                       help="end-to-end: vLLM rollout -> sidecar -> megatron-core replay")
    d.add_argument("--model", help="local HF MoE checkpoint folder (default: built-in tiny model)")
    d.add_argument("--json", help="write the figures to this JSON file")
    d.add_argument("--prompts", type=_positive_int, default=16,
                   help="number of prompts (default 16)")
    d.add_argument("--max-tokens", type=_positive_int, default=48,
                   help="new tokens per prompt (default 48)")
    d.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--router-perturb", type=float, default=0.0,
                   help="add N(0, EPS^2) noise to the trainer's router weights")
    d.add_argument("--router-select-noise", type=float, default=0.0,
                   help="add N(0, EPS^2) noise to the router scores the trainer uses to select "
                        "its own top-k (gate values stay exact): routing flips only")
    d.add_argument("--trainer-parallel", metavar="SPEC",
                   help="megatron-core layout of the trainer side, run as gloo processes on "
                        "this machine: tp=2,sp | ep=2[,dispatcher=allgather] | pp=2[,vpp=2] | "
                        "dp=2 (cp cannot run on CPU: refused with the reason)")
    d.add_argument("--update-midway", action="store_true",
                   help="reload the weights as version step-1 halfway through the rollout "
                        "(WeightSync, keep mode: requests in flight continue; their "
                        "weight-version spans cover the switch)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--workdir", help="keep the sidecar and logs here")
    d.set_defaults(func=cmd_demo)
    i = sub.add_parser("inspect", parents=[common],
                       help="summarise sidecar streams (exit 1 on any error or incomplete stream)")
    i.add_argument("sidecar", nargs="+",
                   help="sidecar stream(s): files, folders (every *.rrsc) or globs, read as one")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    i.set_defaults(func=cmd_inspect)
    c = sub.add_parser("convert", parents=[common],
                       help="engine routing arrays or wire payloads -> sidecar, or re-encode "
                            "sidecar streams")
    c.add_argument("--from", dest="kind", required=True,
                   choices=["npy", "vllm", "vllm-b64", "sglang-b64", "sglang-json", "sidecar"])
    c.add_argument("input", help=".npy / .npz / folder (npy, vllm), a text/JSONL file (*-b64), "
                                 "saved SGLang responses, one JSON object per line (sglang-json), "
                                 "or sidecar streams (a file, folder or glob, read as one) to "
                                 "re-encode as one stream with another codec or geometry "
                                 "(sidecar: schema and every record field kept)")
    c.add_argument("--out", required=True, help="sidecar path or fsspec URL")
    c.add_argument("--config", help="HF config folder or config.json giving the routing schema")
    c.add_argument("--num-experts", type=_positive_int)
    c.add_argument("--top-k", type=_positive_int)
    c.add_argument("--moe-layers", type=_layers,
                   help="decoder layers that are MoE, e.g. '1-23' or '1,3,5'")
    c.add_argument("--num-layers", type=_positive_int,
                   help="num_hidden_layers (default: max MoE layer + 1)")
    c.add_argument("--codec", default=None, type=_codec,
                   metavar="{" + ",".join(WRITER_CODECS) + "}",
                   help="routing codec (default xl-zstd; ctx-zstd: layer-major; raw-lm: "
                        "uncompressed, for debugging)")
    c.add_argument("--column-order", default="engine", choices=["engine", "sorted"])
    c.add_argument("--layer-group", type=_positive_int, default=None,
                   help="MoE layers per routing section of records over 64 KiB of ids "
                        "(default 1)")
    c.add_argument("--token-block", type=_positive_int, default=512,
                   help="tokens per routing section of records over 64 KiB of ids (default 512)")
    c.add_argument("--format-version", type=_format_version, default=3, metavar="{3}",
                   help="the sidecar format written: 3, the only one")
    c.add_argument("--skip-corrupt", action="store_true",
                   help="sidecar: convert past frames and records that do not read, each "
                        "named on stderr (exit status 1 still)")
    c.add_argument("--num-fused-shared-experts", type=_nonneg_int, default=0, metavar="N",
                   help="sglang-b64/sglang-json: fused shared-expert columns each payload row "
                   "carries after the top_k routed ones (default 0; SGLang 0.5.23 strips them); "
                   "the width is never guessed from the byte count")
    c.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    c.set_defaults(func=cmd_convert)
    x = sub.add_parser("export", parents=[common], help="decode one sample of a sidecar to .npy")
    x.add_argument("sidecar", nargs="+",
                   help="sidecar stream(s): files, folders (every *.rrsc) or globs, read as one")
    x.add_argument("--sample", required=True)
    x.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    x.add_argument("--out", required=True)
    x.add_argument("--full-layers", action="store_true",
                   help="[T, num_hidden_layers, top_k] with dense layers zero-filled (vLLM "
                        "layout) instead of [T, L_moe, top_k]")
    x.set_defaults(func=cmd_export)
    v = sub.add_parser("verify", parents=[common],
                       help="log-prob mismatch and routing agreement, with and without replay, "
                            "of a rollout sidecar")
    v.add_argument("sidecar")
    v.add_argument("--model", required=True, help="HF checkpoint folder of the rollout's weights")
    v.add_argument("--trainer", choices=["hf", "fsdp", "megatron"], default="hf",
                   help="hf: transformers reference replay (default); fsdp: the training "
                        "replayer of trainer_hooks.fsdp (padded keyed microbatches, token "
                        "checks; every family it supports); megatron: megatron-core "
                        "RouterReplay (Qwen3-MoE)")
    v.add_argument("--json", help="write the metrics here")
    v.add_argument("--plot", help="write a PNG: CCDF of |delta logp|, 1 - routing agreement per "
                                  "decoder layer and prompt vs response, with and without replay")
    v.add_argument("--limit", type=_positive_int, help="only the first N samples")
    v.add_argument("--device", default=None,
                   help="--trainer hf/fsdp: torch device of the model (default cuda when available, "
                        "else cpu)")
    v.add_argument("--timeout", type=float, default=3600, help="megatron subprocess timeout (s)")
    v.set_defaults(func=cmd_verify)
    return p
