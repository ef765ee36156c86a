"""The ``routereplay`` command line.

Subcommands import what they need lazily; only ``demo`` touches the engine and trainer
packages (in subprocesses).

    routereplay demo [--model DIR] [--json PATH] [--prompts N] [--max-tokens N] ...
    routereplay inspect SIDECAR [--json]
    routereplay convert --from {npy,vllm,vllm-b64,sglang-b64,sglang-json} INPUT --out SIDECAR
                        (--config DIR | --num-experts E --top-k K [--moe-layers 1,3-5])
    routereplay export SIDECAR --sample ID --out FILE.npy [--full-layers]
    routereplay verify SIDECAR --model DIR [--trainer hf|megatron] [--device D] [--json P]
                       [--plot P.png]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from routereplay.errors import RouteReplayError


def _cmd_demo(a: argparse.Namespace) -> int:
    from routereplay.cli.demo.run import DemoConfig, format_report, run_demo
    cfg = DemoConfig(model=a.model, num_prompts=a.prompts, max_tokens=a.max_tokens,
                     engine_dtype=a.engine_dtype, router_perturb=a.router_perturb,
                     router_select_noise=a.router_select_noise,
                     trainer_parallel=a.trainer_parallel, update_midway=a.update_midway,
                     seed=a.seed, workdir=a.workdir)
    print("routereplay demo: building/loading the model, rolling out in vLLM, recomputing in "
          "megatron-core (about 2-4 minutes on 2 CPU cores) ...", file=sys.stderr, flush=True)
    res = run_demo(cfg)
    print(format_report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from routereplay.sidecar import SidecarReader
    out = {"num_records": 0, "num_tokens": 0, "bytes": 0, "bits_per_token_layer": None,
           "errors": [], "records": []}
    try:
        r = SidecarReader(a.sidecar)
    except (RouteReplayError, OSError) as e:
        out["errors"].append(str(e))
        return _emit_inspect(out, a.json, 1)
    with r:
        out["bytes"] = r.size
        schema = r.schema
        frames = r.scan()
        for fi in frames:
            if fi.meta is None:
                continue
            m = fi.meta
            out["records"].append({
                "sample_id": m.sample_id, "num_tokens": m.num_tokens,
                "versions": sorted(set(m.versions()))})
        out["num_records"] = len(out["records"])
        out["num_layers"] = schema.num_moe_layers
        out["versions"] = sorted({v for x in out["records"] for v in x["versions"]})
        out["format_version"] = r.version
        out["codec"] = r.codec
        out["column_order"] = r.column_order
        out["num_tokens"] = sum(x["num_tokens"] for x in out["records"])
        rows = out["num_tokens"] * schema.num_moe_layers
        out["bits_per_token_layer"] = 8.0 * r.size / rows if rows else None
        out["errors"] = list(r.errors)
        out["schema"] = schema.to_dict()
    return _emit_inspect(out, a.json, 1 if out["errors"] else 0)


def _emit_inspect(out: dict, as_json: bool, rc: int) -> int:
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(f"records {out['num_records']}, tokens {out['num_tokens']}, "
              f"MoE layers {out.get('num_layers', '?')}, bytes {out['bytes']}"
              + (f", {out['bits_per_token_layer']:.3f} bits per token-layer"
                 if out["bits_per_token_layer"] else ""))
        if "codec" in out:
            print(f"format v{out['format_version']}, codec {out['codec']}, column order "
                  f"{out['column_order']}, weight versions {out['versions']}")
        if "schema" in out:
            print(f"schema {out['schema']}")
        for rec in out["records"][:20]:
            print(f"  {rec['sample_id']}: {rec['num_tokens']} tokens, versions {rec['versions']}")
        if len(out["records"]) > 20:
            print(f"  ... {len(out['records']) - 20} more")
        for e in out["errors"]:
            print(f"error: {e}")
        if out["errors"]:
            print(f"recovered {out['num_records']} records")
    return rc


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _cmd_convert(a: argparse.Namespace) -> int:
    from routereplay.convert import iter_records, parse_layers, schema_from_args
    from routereplay.sidecar import SidecarWriter
    schema = schema_from_args(a.config, a.num_experts, a.top_k,
                              parse_layers(a.moe_layers) if a.moe_layers else None, a.num_layers)
    local = "://" not in a.out
    if local and os.path.exists(a.out) and os.path.exists(a.input) and (
            os.path.samefile(a.out, a.input) or (os.path.isdir(a.input) and os.path.samefile(
                os.path.dirname(os.path.abspath(a.out)), a.input))):
        raise RouteReplayError(f"refusing to write {a.out}: it is (inside) the input {a.input}")
    if not os.path.exists(a.input):
        raise RouteReplayError(f"input {a.input} does not exist")
    # NOTE: write next to the target and rename at the end, so a failed conversion never
    # truncates an existing file at --out before any input was read.
    dest = a.out + ".partial" if local else a.out
    n = tokens = 0
    # NOTE: records are written as they are read; on a bad sample the writer still closes
    # (index + trailer), so every sample before it stays readable.
    if a.kind == "sglang-json":
        from engine_patches.sglang.records import iter_jsonl   # lazy: engine side
        records = iter_jsonl(a.input, schema, num_fused_shared_experts=a.num_fused_shared_experts)
    else:
        records = iter_records(a.kind, a.input, schema,
                               num_fused_shared_experts=a.num_fused_shared_experts)
    try:
        with SidecarWriter(dest, schema, codec=a.codec, column_order=a.column_order,
                           layer_group=a.layer_group, extra_header={"source": a.kind}) as w:
            for rec in records:
                w.write(rec)
                n += 1
                tokens += rec.num_tokens
    finally:
        if local and os.path.exists(dest):
            if n:
                os.replace(dest, a.out)     # every sample before a bad one is kept
            else:
                os.remove(dest)
    size = os.path.getsize(a.out) if local else w.bytes_written
    rows = tokens * schema.num_moe_layers
    print(f"wrote {n} records, {tokens} tokens, {size} bytes"
          + (f", {8 * size / rows:.3f} bits per token-layer" if rows else "") + f" -> {a.out}")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    import numpy as np

    from routereplay.sidecar import SidecarReader
    with SidecarReader(a.sidecar) as r:
        try:
            rec = r.read(a.sample, arrays=False)
        except KeyError:
            raise RouteReplayError(f"sample {a.sample!r} is not in {a.sidecar}") from None
        ids = rec.expert_ids
        if a.full_layers:                       # vLLM layout: dense layers zero-filled
            full = np.zeros((ids.shape[0], r.schema.num_hidden_layers, ids.shape[2]), ids.dtype)
            full[:, list(r.schema.moe_layer_ids)] = ids
            ids = full
    with open(a.out, "wb") as f:
        np.save(f, ids, allow_pickle=False)
    print(f"sample {a.sample!r}: {ids.shape[0]} tokens from position {rec.start}, "
          f"array {list(ids.shape)} {ids.dtype} -> {a.out}")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from routereplay import verify
    from routereplay.errors import AlignmentError
    from routereplay.schema import RoutingSchema
    from routereplay.sidecar import SidecarReader
    schema = RoutingSchema.from_hf_config(a.model)
    if a.limit is not None and a.limit < 1:
        raise RouteReplayError("--limit must be >= 1")
    with SidecarReader(a.sidecar) as r:
        schema.check_same(r.schema, what=f"sidecar {os.path.basename(a.sidecar)}")
        records = []
        for rec in r.records():
            records.append(rec)
            if a.limit and len(records) >= a.limit:
                break
    for rec in records:
        if rec.token_ids is None or rec.logprobs is None or rec.prompt_len is None:
            raise AlignmentError(f"sample {rec.sample_id!r}: the sidecar holds no token ids, "
                                 "prompt length or engine log-probs to verify against")
    if a.trainer == "hf":
        from trainer_hooks.hf.recompute import recompute     # lazy: trainer side
        summary = verify.summarize(records, recompute(a.model, records, schema,
                                                      device=a.device,
                                                      progress=not a.no_progress))
    else:
        import subprocess
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "trainer_hooks.megatron.harness.recompute",
                   "--model", a.model, "--sidecar", a.sidecar, "--out", out]
            if a.limit:
                cmd += ["--limit", str(a.limit)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            if p.returncode != 0:
                raise RouteReplayError(f"megatron-core recompute failed: {p.stderr[-2000:]}")
            # NOTE: the recompute computed the metrics (verify.summarize) once, from the
            # experts in router column order; they are read back, not recomputed.
            summary = verify.load_summary(out)
    print(verify.format_report(summary))
    if a.json:
        out = {k: v for k, v in summary.items() if k != "deltas"}
        out.update({"trainer": a.trainer, "model": a.model, "sidecar": a.sidecar})
        with open(a.json, "w") as f:
            json.dump(verify.json_safe(out), f, indent=2, allow_nan=False)
    if a.plot:
        verify.plot(summary, a.plot)
        print(f"plot: {a.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="routereplay", description="MoE routing replay tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="end-to-end: vLLM rollout -> sidecar -> megatron-core replay")
    d.add_argument("--model", help="local HF MoE checkpoint folder (default: built-in tiny model)")
    d.add_argument("--json", help="write the figures to this JSON file")
    d.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    d.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt (default 48)")
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
    d.set_defaults(func=_cmd_demo)
    i = sub.add_parser("inspect", help="summarise a sidecar stream")
    i.add_argument("sidecar")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)
    c = sub.add_parser("convert", help="engine routing arrays or wire payloads -> sidecar")
    c.add_argument("--from", dest="kind", required=True,
                   choices=["npy", "vllm", "vllm-b64", "sglang-b64", "sglang-json"])
    c.add_argument("input", help=".npy / .npz / folder (npy, vllm), a text/JSONL file (*-b64), "
                                 "or saved SGLang responses, one JSON object per line (sglang-json)")
    c.add_argument("--out", required=True, help="sidecar path or fsspec URL")
    c.add_argument("--config", help="HF config folder or config.json giving the routing schema")
    c.add_argument("--num-experts", type=int)
    c.add_argument("--top-k", type=int)
    c.add_argument("--moe-layers", help="decoder layers that are MoE, e.g. '1-23' or '1,3,5'")
    c.add_argument("--num-layers", type=int, help="num_hidden_layers (default: max MoE layer + 1)")
    c.add_argument("--codec", default=None, help="routing codec (default ctx-zstd; ctx-ans-sorted "
                   "with --column-order sorted; ctx-ans: smallest, slower)")
    c.add_argument("--column-order", default="engine", choices=["engine", "sorted"])
    c.add_argument("--layer-group", type=int, default=4, help="MoE layers per section")
    c.add_argument("--num-fused-shared-experts", type=_nonneg_int, default=0, metavar="N",
                   help="sglang-b64/sglang-json: fused shared-expert columns each payload row "
                   "carries after the top_k routed ones (default 0; SGLang 0.5.23 strips them); "
                   "the width is never guessed from the byte count")
    c.set_defaults(func=_cmd_convert)
    x = sub.add_parser("export", help="decode one sample of a sidecar to .npy")
    x.add_argument("sidecar")
    x.add_argument("--sample", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--full-layers", action="store_true",
                   help="[T, num_hidden_layers, top_k] with dense layers zero-filled (vLLM "
                        "layout) instead of [T, L_moe, top_k]")
    x.set_defaults(func=_cmd_export)
    v = sub.add_parser("verify", help="log-prob mismatch and routing agreement, with and "
                                      "without replay, of a rollout sidecar")
    v.add_argument("sidecar")
    v.add_argument("--model", required=True, help="HF checkpoint folder of the rollout's weights")
    v.add_argument("--trainer", choices=["hf", "megatron"], default="hf",
                   help="hf: transformers reference replay (default); megatron: megatron-core "
                        "RouterReplay (Qwen3-MoE)")
    v.add_argument("--json", help="write the metrics here")
    v.add_argument("--plot", help="write a PNG: delta logp distributions, per-layer agreement")
    v.add_argument("--limit", type=int, help="only the first N samples")
    v.add_argument("--device", default=None,
                   help="--trainer hf: torch device of the model (default cuda when available, "
                        "else cpu)")
    v.add_argument("--no-progress", action="store_true")
    v.add_argument("--timeout", type=float, default=3600, help="megatron subprocess timeout (s)")
    v.set_defaults(func=_cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (RouteReplayError, OSError, ValueError) as e:
        # NOTE: OSError/ValueError here are bad paths or arguments (missing files, an
        # unknown codec, a bad --moe-layers): a message, not a traceback.
        print(f"routereplay {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
