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
from engine_patches.vllm.worker_extension import WORKER_EXTENSION  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import write_records  # noqa: E402

ENGINE = dict(dtype="float32", enable_return_routed_experts=True, enable_prefix_caching=True,
              max_model_len=512, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, seed=0, worker_extension_cls=WORKER_EXTENSION)


async def keep_update(model, v2, out, switch_at=16):
    """Keep-mode update in the middle of a generation through WeightSync.sync_async, the
    stale-prefix case around it, then an abort-mode update (summary in sync.json)."""
    import json

    import numpy as np
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_patches.vllm import plugin
    from routereplay.errors import RecordError
    from engine_patches.vllm.weight_sync import (FromCheckpoint, WeightSync,
                                                 after_weight_update_async)
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))
    sync = WeightSync(eng)
    await sync.set_version_async("v1")                  # the first version, public API
    schema = RoutingSchema.from_hf_config(model)
    long_prompt = TokensPrompt(prompt_token_ids=np.random.default_rng(11).integers(
        3, 500, 300).tolist())
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    async def run(prompt, sp, rid):
        final = None
        async for o in eng.generate(prompt, sp, request_id=rid):
            final = o
        return final

    # 1. a long prompt finishes under v1: its full blocks stay in the prefix cache
    warm = await run(long_prompt, greedy, "warm")
    # 2. keep mode: the update happens while "keep" is in flight (it holds blocks, so the
    #    prefix-cache reset cannot succeed; the version salt protects later requests)
    sp = SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    final, rep = None, None
    async for o in eng.generate("The quick brown fox jumps over the lazy dog", sp, request_id="keep"):
        final = o
        if rep is None and len(o.outputs[0].token_ids) >= switch_at:
            rep = await sync.sync_async(FromCheckpoint(v2), "v2", mode="keep")
    # 3. the long prompt again, after the update
    after = await run(long_prompt, greedy, "after")
    # 4. abort mode: a request in flight is aborted, never recorded with partial routing
    sp_long = SamplingParams(max_tokens=400, temperature=1.0, seed=4, ignore_eos=True, logprobs=0)
    aborted, rep_abort = None, None
    async for o in eng.generate("abort me", sp_long, request_id="abortme"):
        aborted = o
        if rep_abort is None and len(o.outputs[0].token_ids) >= 8:
            rep_abort = await sync.sync_async(FromCheckpoint(model), "v3", mode="abort")
    abort_error, extra = None, []
    try:     # vLLM returns the rows of the tokens an aborted request did generate
        extra.append(record_from_output(aborted, schema, engine="vllm"))
    except RecordError as e:
        abort_error = str(e)
    post = await run(long_prompt, greedy, "post-abort")
    # 5. wait mode: the update waits until the request in flight has finished
    sp_wait = SamplingParams(max_tokens=24, temperature=1.0, seed=6, ignore_eos=True, logprobs=0)
    waited, rep_wait = None, None
    async for o in eng.generate("wait for me", sp_wait, request_id="waitme"):
        waited = o
        if rep_wait is None and len(o.outputs[0].token_ids) >= 4:
            sync_task = asyncio.create_task(
                sync.sync_async(FromCheckpoint(v2), "v4", mode="wait"))
            rep_wait = True
    rep_wait = await sync_task
    after_wait = await run(long_prompt, greedy, "after-wait")
    # 6. a framework's own update path (vLLM's reload, here), then what must follow it
    await eng.collective_rpc("reload_weights", kwargs={"weights_path": model})
    rep_own = await after_weight_update_async(eng, "v5")
    after_own = await run(long_prompt, greedy, "after-own")
    write_records(os.path.join(out, "keep.rrsc"), schema, [
        record_from_output(x, schema, engine="vllm")
        for x in (final, warm, after, post, waited, after_wait, after_own)] + extra)
    closed_last = plugin.rotate()                       # close the last version's stream
    with open(os.path.join(out, "sync.json"), "w") as f:
        json.dump({"keep": rep.__dict__, "abort": rep_abort.__dict__, "wait": rep_wait.__dict__,
                   "own": rep_own.as_dict(), "closed_last": closed_last,
                   "waited_finish_reason": waited.outputs[0].finish_reason,
                   "cached": {"warm": warm.num_cached_tokens, "after": after.num_cached_tokens,
                              "post-abort": post.num_cached_tokens,
                              "after-own": after_own.num_cached_tokens},
                   "aborted_finish_reason": aborted.outputs[0].finish_reason,
                   "aborted_tokens": len(aborted.outputs[0].token_ids),
                   "abort_error": abort_error, "plugin": plugin.stats()}, f)
    sync.close()
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
