"""Engine side of tests/test_mismatch_suite.py, run in its own process (one vLLM engine at a
time): a keep-mode weight update in the middle of a generation (AsyncLLM), and a rollout of
a model whose routers have exact ties.

    python tests/vllm_mixed_versions.py --model M --v2 M_V2 --tie M_TIE --out DIR
"""
import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# NOTE: AsyncLLM pause/resume needs the engine core in its own process (in-process, the
# keep-mode pause never returns); the Triton shim reaches it through engine_env().

from engine_patches.vllm import check_vllm_version  # noqa: E402

check_vllm_version()

from engine_patches.vllm.records import record_from_output  # noqa: E402
from engine_patches.vllm.weights import WORKER_EXTENSION, reload_weights_async  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import write_records  # noqa: E402

ENGINE = dict(dtype="float32", enable_return_routed_experts=True, enable_prefix_caching=True,
              max_model_len=512, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, seed=0, worker_extension_cls=WORKER_EXTENSION)


async def keep_update(model, v2, out, switch_at=16):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))
    await eng.update_weight_version("v1")
    sp = SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    final, done = None, False
    async for o in eng.generate("The quick brown fox jumps over the lazy dog", sp, request_id="keep"):
        final = o
        if not done and len(o.outputs[0].token_ids) >= switch_at:
            done = True
            await eng.pause_generation(mode="keep", clear_cache=False)
            try:
                await reload_weights_async(eng, v2)
                await eng.update_weight_version("v2")
            finally:
                await eng.resume_generation()
    schema = RoutingSchema.from_hf_config(model)
    rec = record_from_output(final, schema, engine="vllm")
    write_records(os.path.join(out, "keep.rrsc"), schema, [rec])
    eng.shutdown()


def tie_rollout(tie, out):
    from vllm import LLM, SamplingParams
    llm = LLM(model=tie, **ENGINE)
    sp = SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    outs = llm.generate([f"tie prompt {i} " * 3 for i in range(6)], sp, use_tqdm=False)
    schema = RoutingSchema.from_hf_config(tie)
    write_records(os.path.join(out, "tie.rrsc"), schema,
                  [record_from_output(o, schema, sample_id=f"t{i}") for i, o in enumerate(outs)])


def main():
    ap = argparse.ArgumentParser()
    for k in ("--model", "--v2", "--tie", "--out"):
        ap.add_argument(k, required=True)
    a = ap.parse_args()
    asyncio.run(keep_update(a.model, a.v2, a.out))
    tie_rollout(a.tie, a.out)
    sys.stdout.flush()
    os._exit(0)      # NOTE: engine teardown can hang on CPU builds; everything is written


if __name__ == "__main__":
    main()
