"""The main job: rollout in vLLM with capture -> sidecar -> recompute in megatron-core.

Each side runs in a process of its own (the engine installs a Triton shim, the trainer a
CPU shim of torch.cuda; neither should leak into the other), started here with a timeout
so that a hang fails fast. The core only launches them: it imports neither side.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
from typing import Any

from routereplay.cli.stage import StageError, run_stage
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader

TRAINER_MODEL_TYPES = ("qwen3_moe",)   # trainer_hooks/megatron/harness/qwen3_moe.py
METRIC_KEYS = ("routing_agreement", "k3_kl", "mean_abs_dlogp", "max_abs_dlogp",
               "extreme_token_fraction")


@dataclasses.dataclass
class DemoConfig:
    """Options of ``routereplay demo`` (defaults: the issue's bf16 engine vs fp32 trainer)."""

    model: str | None = None          # HF MoE checkpoint folder; None = built-in tiny model
    num_prompts: int = 16
    max_tokens: int = 48
    engine_dtype: str = "bfloat16"
    router_perturb: float = 0.0       # std of noise added to the trainer's router weights
    router_select_noise: float = 0.0  # std of noise on router scores for top-k selection only
    trainer_parallel: str | None = None   # megatron layout, e.g. "tp=2,sp", "pp=2,vpp=2"
    update_midway: bool = False       # weight update (keep mode) halfway through the rollout
    seed: int = 0
    workdir: str | None = None        # keep sidecar and intermediate files here
    progress: bool = True             # live progress line per stage (tqdm, on a terminal)
    rollout_timeout_s: float = 900.0
    trainer_timeout_s: float = 600.0


class DemoError(StageError):
    """A demo stage failed; the message holds the stage and its error output."""


def routing_only_bytes(sidecar: str) -> tuple[int, int]:
    """(bytes, rows) of the sidecar's routing, from the stored section lengths.

    The demo's sidecar also carries token ids and log-probs; the engines' formats carry
    only routing, so the comparison counts every record frame without its array sections
    (:meth:`SidecarReader.record_bytes` ``routing_frame``: frame header, meta, section
    table, routing sections), plus the stream header, the index and the trailer. rows:
    (token, MoE layer) rows.
    """
    with SidecarReader(sidecar) as r:
        frames = r.scan()
        ids = [f.meta.sample_id for f in frames if f.meta is not None]
        sizes = [r.record_bytes(i) for i in ids]
        rows = sum(f.meta.num_tokens for f in frames if f.meta is not None)
        record_frames = sum(x.frame for x in sizes)
        stream = r.size
    return stream - record_frames + sum(x.routing_frame for x in sizes), \
        rows * r.schema.num_moe_layers


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the main job; returns the result dict (see :func:`format_report` and --json)."""
    if cfg.model is None:
        from routereplay.cli.demo.tiny_model import demo_prompts, ensure_tiny_model
        model = ensure_tiny_model()
        prompts = demo_prompts(cfg.num_prompts)
    else:
        from routereplay.cli.demo.tiny_model import demo_prompts
        model = os.path.abspath(cfg.model)
        prompts = demo_prompts(cfg.num_prompts)
    schema = RoutingSchema.from_hf_config(model)     # clear error for a model without MoE
    with open(os.path.join(model, "config.json")) as f:
        model_config = json.load(f)
    model_type = model_config.get("model_type")
    if model_type not in TRAINER_MODEL_TYPES:
        # NOTE: fail before the (minutes-long) rollout, not after it.
        raise DemoError(f"model_type {model_type!r} of {model}: the trainer side maps "
                        f"{', '.join(TRAINER_MODEL_TYPES)} checkpoints to megatron-core")

    # NOTE: a bad layout fails here, before the (minutes-long) rollout.
    from trainer_hooks.megatron.harness.parallel import ParallelSpec   # lazy: demo only
    layout = ParallelSpec.parse(cfg.trainer_parallel)
    layout.check_model(model_config)

    work = cfg.workdir or tempfile.mkdtemp(prefix="routereplay-demo-")
    os.makedirs(work, exist_ok=True)
    paths = {k: os.path.join(work, v) for k, v in dict(
        prompts="prompts.json", sidecar="rollout.rrsc", rollout="rollout_summary.json",
        trainer="trainer_result.json", rollout_log="rollout.log", trainer_log="trainer.log").items()}
    with open(paths["prompts"], "w") as f:
        json.dump(prompts, f)

    from engine_patches.vllm.harness.triton_cpu import engine_env   # lazy: only the demo needs it
    _run_stage = functools.partial(run_stage, progress=cfg.progress)
    _run_stage("vLLM rollout", [
        sys.executable, "-m", "engine_patches.vllm.harness.rollout", "--model", model,
        "--prompts", paths["prompts"], "--sidecar", paths["sidecar"],
        "--summary", paths["rollout"], "--dtype", cfg.engine_dtype,
        "--max-tokens", str(cfg.max_tokens), "--seed", str(cfg.seed)]
        + (["--update-from", model] if cfg.update_midway else []),
        env=engine_env(), timeout=cfg.rollout_timeout_s, log=paths["rollout_log"])
    _run_stage("megatron-core recompute", [
        sys.executable, "-m", "trainer_hooks.megatron.harness.recompute", "--model", model,
        "--sidecar", paths["sidecar"], "--out", paths["trainer"],
        "--router-perturb", str(cfg.router_perturb),
        "--router-select-noise", str(cfg.router_select_noise), "--seed", str(cfg.seed),
        "--parallel", cfg.trainer_parallel or ""],
        env=dict(os.environ), timeout=cfg.trainer_timeout_s, log=paths["trainer_log"])

    with open(paths["rollout"]) as f:
        roll = json.load(f)
    with open(paths["trainer"]) as f:
        tr = json.load(f)
    rbytes, rows = routing_only_bytes(paths["sidecar"])
    out: dict[str, Any] = {c: {k: tr[c][k] for k in METRIC_KEYS} for c in ("no_replay", "replay")}
    for c in ("no_replay", "replay"):
        out[c]["routing_agreement_ordered"] = tr[c]["routing_agreement_ordered"]
        out[c]["num_tokens"] = tr[c]["num_tokens"]
        out[c]["num_rows"] = tr[c]["num_rows"]
    out.update({
        "sidecar_bytes_per_token_layer": rbytes / rows,
        "vllm_b64_bytes_per_token_layer": roll["vllm_b64_bytes"] / rows,
        "sglang_b64_bytes_per_token_layer": roll["sglang_b64_bytes"] / rows,
        "sidecar_total_bytes": roll["sidecar_bytes"],
        "num_token_layer_rows": rows,
        "router_grad_norms": tr["replay_backward"]["router_grad_norms"],
        "model": model, "schema": schema.to_dict(), "engine": f"vllm {roll['vllm_version']}",
        "engine_dtype": cfg.engine_dtype, "trainer_dtype": "float32",
        "router_perturb": cfg.router_perturb, "router_select_noise": cfg.router_select_noise,
        "trainer_parallel": layout.describe(), "num_prompts": cfg.num_prompts,
        "weight_versions": roll["weight_versions"], "weight_sync": roll["weight_sync"],
        "max_tokens": cfg.max_tokens, "sidecar": paths["sidecar"],
        "timings_s": {"engine_start": roll["engine_start_s"], "generate": roll["generate_s"],
                      "trainer_build": tr["build_s"]},
    })
    return out


def format_report(res: dict[str, Any]) -> str:
    """The demo's printed table."""
    s = res["schema"]
    lines = [
        f"model {res['model']}",
        f"  {s['num_hidden_layers']} layers, MoE layers {s['moe_layer_ids']}, "
        f"{s['num_experts']} experts, top-{s['top_k']}",
        f"engine {res['engine']} ({res['engine_dtype']}) -> sidecar -> megatron-core "
        f"({res['trainer_dtype']}, {res['trainer_parallel']}); {res['num_prompts']} prompts x "
        f"{res['max_tokens']} new tokens"
        + (f"; trainer router weights perturbed by {res['router_perturb']:g}"
           if res["router_perturb"] else "")
        + (f"; trainer top-k selection noise {res['router_select_noise']:g}"
           if res["router_select_noise"] else ""),
        "",
        f"{'condition':<11}{'routing agreement':>19}{'k3 KL':>11}{'mean |dlogp|':>14}"
        f"{'max |dlogp|':>13}{'extreme tokens':>16}",
    ]
    for c, label in (("no_replay", "no replay"), ("replay", "replay")):
        m = res[c]
        lines.append(f"{label:<11}{m['routing_agreement']:>19.4f}{m['k3_kl']:>11.3e}"
                     f"{m['mean_abs_dlogp']:>14.4f}{m['max_abs_dlogp']:>13.4f}"
                     f"{m['extreme_token_fraction']:>16.4f}")
    n = res["no_replay"]
    lines += [
        f"({n['num_rows']} (token, MoE layer) rows with engine routing; {n['num_tokens']} "
        "generated tokens; extreme = |dlogp| > ln 2)",
        "",
        f"bytes per (token, MoE layer) row: sidecar {res['sidecar_bytes_per_token_layer']:.3f} | "
        f"vLLM base64 .npy {res['vllm_b64_bytes_per_token_layer']:.3f} | "
        f"SGLang base64 int32 {res['sglang_b64_bytes_per_token_layer']:.3f}",
        "weight versions in the rollout: " + ", ".join(res["weight_versions"] or ["(none)"])
        + (f" (keep-mode update halfway: {res['weight_sync']['seconds']['update']:.2f} s "
           "reload)" if res.get("weight_sync") else ""),
        "router grad norms after one training step with replay: "
        + ", ".join(f"{g:.3g}" for g in res["router_grad_norms"]),
        f"sidecar: {res['sidecar']}",
    ]
    return "\n".join(lines)
