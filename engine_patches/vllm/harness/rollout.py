"""Roll prompts out in the real vLLM engine with routed-experts capture into a sidecar.

Run as a module in its own process (the demo does); on a machine without CUDA it installs
the Triton interpreter shim before vLLM is imported:

    python -m engine_patches.vllm.harness.rollout --model DIR --prompts prompts.json \
        --sidecar out.rrsc --summary summary.json [--dtype bfloat16] [--max-tokens 48]

The summary JSON holds counts, timings and the sizes of the same routing in vLLM's and
SGLang's own wire formats (bytes), for the demo's size line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine_patches.vllm.harness import triton_cpu

triton_cpu.install()          # NOTE: before anything imports vllm

from engine_patches.vllm import VLLM_VERSION  # noqa: E402
from engine_patches.vllm.records import record_from_output  # noqa: E402
from engine_patches.vllm.worker_extension import WORKER_EXTENSION  # noqa: E402
from routereplay import wire  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import SidecarWriter  # noqa: E402


def make_llm(model: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 512,
             kv_cache_bytes: int = 64 << 20, max_num_batched_tokens: int = 2048, **kw):
    """Start an in-process vLLM ``LLM`` with routed-experts capture on.

    NOTE: the AuxOutput connector that captures routing needs prefix caching, and on CPU
    kv_cache_memory_bytes must be set (auto-sizing takes a large share of RAM).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    return LLM(model=model, dtype=dtype, seed=seed, enable_return_routed_experts=True,
               enable_prefix_caching=True, max_model_len=max_model_len,
               max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=kv_cache_bytes,
               enforce_eager=True, **kw)


def generate_with_update(llm, prompts: list[str], sp, weights_path: str,
                         version: str = "step-1") -> tuple[list, dict]:
    """Generate ``prompts`` and, once half of their new tokens exist, update the weights
    from ``weights_path`` in keep mode (engine_patches.vllm.weight_sync.WeightSync): the
    requests in flight continue on the new weights and their weight-version spans cover
    the switch.

    Returns:
        (finished RequestOutputs in prompt order, the SyncReport as a dict).
    """
    from engine_patches.vllm.weight_sync import FromCheckpoint, WeightSync
    sync = WeightSync(llm, initial_version="step-0")
    eng = llm.llm_engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)
    total = len(prompts) * sp.max_tokens
    made: dict[str, int] = {}
    done: dict[str, object] = {}
    report = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            made[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o
        if report is None and sum(made.values()) >= total // 2:
            report = sync.sync(FromCheckpoint(weights_path), version, mode="keep").as_dict()
    sync.close()
    return [done[r] for r in ids], report or {}


def rollout(llm, prompts: list[str], sidecar: str, *, max_tokens: int = 48, seed: int = 0,
            temperature: float = 1.0, sample_prefix: str = "s", codec: str | None = None,
            update_from: str | None = None) -> dict:
    """Generate one completion per prompt and stream every record into ``sidecar``.

    ``update_from``: a checkpoint folder loaded halfway through the rollout
    (:func:`generate_with_update`, keep mode, versions "step-0" then "step-1").

    Returns:
        summary dict: num_records, num_rows (token, MoE layer rows), generate_s (seconds),
        sidecar_bytes, vllm_b64_bytes and sglang_b64_bytes (the same routing in the
        engines' wire formats, dense layers included as they ship it), weight_versions
        (distinct versions over all records, in order of appearance), weight_sync (the
        sync report, with update_from).
    """
    from vllm import SamplingParams
    schema = RoutingSchema.from_hf_config(llm.llm_engine.model_config.hf_config)
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed,
                        ignore_eos=True)
    t0 = time.perf_counter()
    sync_report = None
    if update_from:
        outs, sync_report = generate_with_update(llm, prompts, sp, update_from)
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    vllm_b = sglang_b = rows = 0
    versions: list[str] = []
    # NOTE: replace=True: the demo reruns into its --workdir and replaces its own stream
    with SidecarWriter(sidecar, schema, codec=codec, replace=True,
                       extra_header={"engine": f"vllm {VLLM_VERSION}"}) as w:
        for i, o in enumerate(outs):
            rec = record_from_output(o, schema, sample_id=f"{sample_prefix}{i}",
                                     engine=f"vllm {VLLM_VERSION}")
            w.write(rec)
            versions += [s.version for s in rec.weight_versions if s.version not in versions]
            full = o.outputs[0].routed_experts
            vllm_b += len(wire.vllm_b64_npy(full))
            sglang_b += len(wire.sglang_b64_int32(full))
            rows += rec.num_tokens * schema.num_moe_layers
    return {"num_records": len(outs), "num_rows": rows, "generate_s": gen_s,
            "sidecar_bytes": os.path.getsize(sidecar), "vllm_b64_bytes": vllm_b,
            "sglang_b64_bytes": sglang_b, "schema": schema.to_dict(), "vllm_version": VLLM_VERSION,
            "weight_versions": versions, "weight_sync": sync_report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    p.add_argument("--sidecar", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default=None, help="routing codec of the sidecar (default xl-zstd)")
    p.add_argument("--update-from", help="checkpoint folder loaded halfway through (keep mode)")
    a = p.parse_args(argv)
    with open(a.prompts) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    llm = make_llm(a.model, dtype=a.dtype, seed=a.seed,
                   **({"worker_extension_cls": WORKER_EXTENSION} if a.update_from else {}))
    start_s = time.perf_counter() - t0
    summary = rollout(llm, prompts, a.sidecar, max_tokens=a.max_tokens, seed=a.seed,
                      codec=a.codec, update_from=a.update_from)
    summary["engine_start_s"] = start_s
    summary["dtype"] = a.dtype
    with open(a.summary, "w") as f:
        json.dump(summary, f)
    sys.stdout.flush()
    # NOTE: skip interpreter teardown of the engine (it can hang on CPU builds);
    # everything is written and flushed above.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
