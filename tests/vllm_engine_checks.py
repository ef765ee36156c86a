"""Engine side of tests/test_vllm_engine.py, in its own process (vLLM offline LLM, in-process
engine core): the routereplay vLLM plugin (one stream per weight version, caller-owned
sample ids, rotation on request), WeightSync on an offline engine (validation before the
pause, FromTensors from a dict, FromDistributed as far as CPU goes, after_weight_update
after a framework's own update path, a third-party worker extension composed with ours),
multi-turn segments, and chunked prefill with preemption. Writes sidecars and a JSON
summary to OUT.

    ROUTEREPLAY_SIDECAR=OUT/plugin.rrsc python tests/vllm_engine_checks.py \
        --model M --v2 M_V2 --out OUT

The plugin is loaded by vLLM itself (entry point vllm.general_plugins) because
ROUTEREPLAY_SIDECAR is set; this script also builds records from the returned outputs
(engine_patches.vllm.records) so the test can compare both.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_patches.vllm.harness import triton_cpu  # noqa: E402

triton_cpu.install()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from engine_patches.vllm.records import record_from_output  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import write_records  # noqa: E402

# NOTE: a framework's own worker extension with ours mixed in (tests/vllm_third_party_ext.py)
ENGINE = dict(dtype="float32", enable_return_routed_experts=True, enable_prefix_caching=True,
              max_model_len=1024, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
              worker_extension_cls="tests.vllm_third_party_ext.WorkerExtension")


def long_prompt_ids(n: int, seed: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def part_plugin_sync_multiturn(model: str, v2: str, out: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_patches.vllm import plugin
    from engine_patches.vllm.weight_sync import FromCheckpoint, FromTensors, WeightSync
    llm = LLM(model=model, max_num_batched_tokens=2048, **ENGINE)
    schema = RoutingSchema.from_hf_config(model)
    res: dict = {"plugin_installed": plugin.installed()}
    own: list = []

    def gen(prompts, sp, ids, start=0):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for o, sid in zip(outs, ids):
            if len(o.outputs) > 1:
                for i, c in enumerate(o.outputs):
                    one = type(o)(request_id=o.request_id, prompt=o.prompt,
                                  prompt_token_ids=o.prompt_token_ids, prompt_logprobs=None,
                                  outputs=[c], finished=True,
                                  num_cached_tokens=o.num_cached_tokens)
                    own.append(record_from_output(one, schema, sample_id=f"{o.request_id}/{i}",
                                                  start=start))
            else:
                own.append(record_from_output(o, schema, sample_id=o.request_id, start=start))
        return outs

    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True, logprobs=0)
    # 1. plain requests, n=2, and routed_experts_prompt_start
    gen([TokensPrompt(prompt_token_ids=long_prompt_ids(20 + i, i)) for i in range(3)], sp,
        ["a", "b", "c"])
    res["request_ids_batch1"] = [r.sample_id for r in own]
    spn = SamplingParams(max_tokens=16, temperature=1.0, seed=2, n=2, ignore_eos=True, logprobs=0)
    gen([TokensPrompt(prompt_token_ids=long_prompt_ids(30, 7))], spn, ["n2"])
    sps = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, logprobs=0,
                         routed_experts_prompt_start=3)
    gen([TokensPrompt(prompt_token_ids=long_prompt_ids(25, 8))], sps, ["ps"], start=3)

    # 2. stale prefix: a 300-token prompt before and after an update
    sync = WeightSync(llm, initial_version="v1")
    stale = long_prompt_ids(300, 11)
    spg = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    o0 = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    o0b = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    rep = sync.sync(FromCheckpoint(v2), "v2", mode="abort")
    o1 = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    o1b = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    res["same_version"] = part_same_version(llm, sync, v2, stale)
    from safetensors.torch import load_file
    v1_tensors = load_file(os.path.join(model, "model.safetensors"))      # a dict
    rep3 = sync.sync(FromTensors(v1_tensors), "v3", mode="abort")
    o3 = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    stale_recs = []
    for name, o in (("before", o0), ("before_again", o0b), ("after_v2", o1),
                    ("after_v2_again", o1b), ("after_v3", o3)):
        stale_recs.append(record_from_output(o, schema, sample_id=name))
    write_records(os.path.join(out, "stale.rrsc"), schema, stale_recs)
    res["stale_cached_tokens"] = {r.sample_id: int(o.num_cached_tokens)
                                  for r, o in zip(stale_recs, (o0, o0b, o1, o1b, o3))}
    res["sync_reports"] = [rep.__dict__, rep3.__dict__]

    # 3. multi-turn: turn 2 resends nothing already stored (prompt start = turn 1's rows)
    t1_prompt = long_prompt_ids(40, 21)
    sp_t = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, logprobs=0)
    t1 = llm.generate([TokensPrompt(prompt_token_ids=t1_prompt)], sp_t, use_tqdm=False)[0]
    t1_full = t1_prompt + list(t1.outputs[0].token_ids)
    t2_prompt = t1_full + long_prompt_ids(10, 22)
    start2 = len(t1_full) - 1        # turn 1 stored rows for positions 0 .. len(t1_full) - 2
    sp_t2 = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=0,
                           routed_experts_prompt_start=start2)
    t2 = llm.generate([TokensPrompt(prompt_token_ids=t2_prompt)], sp_t2, use_tqdm=False)[0]
    # the same turn 2 re-sending everything, after an update: its overlap was recomputed
    sync.sync(FromCheckpoint(v2), "v4", mode="abort")
    sp_t2full = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    t2u = llm.generate([TokensPrompt(prompt_token_ids=t2_prompt)], sp_t2full, use_tqdm=False)[0]
    write_records(os.path.join(out, "turns.rrsc"), schema, [
        record_from_output(t1, schema, sample_id="conv/turn0"),
        record_from_output(t2, schema, sample_id="conv/turn1", start=start2),
        record_from_output(t2u, schema, sample_id="conv/turn1-after-update")])
    res.update(part_capture_api(llm, sync, v2, stale, schema, out))
    sync.close()
    res["closed_at_end"] = plugin.rotate()      # the last version's stream, indexed
    res["plugin_stats"] = plugin.stats()
    write_records(os.path.join(out, "own.rrsc"), schema, own)
    return res


def part_same_version(llm, sync, v2, stale) -> dict:
    """An update under the current label ("v2"): refused before the pause by sync and
    after_weight_update (the next request still hits the prefix cache: nothing was reset);
    then a deliberate reload with reload_same_version=True (keep mode)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_patches.vllm.version_salt import _salt
    from engine_patches.vllm.weight_sync import FromCheckpoint, after_weight_update
    from routereplay.errors import WeightSyncError
    res: dict = {"current": llm.get_weight_version(), "refused": []}
    for call in (lambda: sync.sync(FromCheckpoint(v2), "v2", mode="keep"),
                 lambda: after_weight_update(llm, "v2")):
        try:
            call()
            res["refused"].append(None)
        except WeightSyncError as e:
            res["refused"].append(str(e))

    def again(sid):
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0,
                            extra_args={"routereplay_sample_id": sid})
        return int(llm.generate([TokensPrompt(prompt_token_ids=stale)], sp,
                                use_tqdm=False)[0].num_cached_tokens)
    res["cached_after_refusal"] = again("same-refused")
    rep = sync.sync(FromCheckpoint(v2), "v2", mode="keep", reload_same_version=True)
    res["reload_report"] = rep.as_dict()
    res["salt_after_reload"] = _salt(llm).tag()
    res["cached_after_reload"] = again("same-reloaded")
    return res


def part_capture_api(llm, sync, v2, stale, schema, out) -> dict:
    """Caller-owned sample ids, duplicates, rotation on request, sources refused before
    the pause, FromDistributed on CPU, a framework's own update path + after_weight_update."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_patches.vllm import plugin
    from engine_patches.vllm.weight_sync import after_weight_update
    from routereplay.errors import ConfigError, WeightSyncError
    from routereplay.weight_sync import FromDistributed, FromTensors
    res: dict = {}

    def sp(**extra):
        return SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=0,
                              extra_args=extra or None)
    p = [TokensPrompt(prompt_token_ids=long_prompt_ids(18, 40 + i)) for i in range(3)]
    # 1. the framework's uid (extra_args), an explicit attempt number
    llm.generate(p[:2], [sp(routereplay_sample_id="uid-A"),
                         sp(routereplay_sample_id="uid-B", routereplay_attempt=1)], use_tqdm=False)
    # 2. the same uid again in the same stream: refused, never renamed
    llm.generate(p[2:], sp(routereplay_sample_id="uid-A"), use_tqdm=False)
    res["duplicates_after_reuse"] = plugin.stats()["duplicates"]
    # 3. rotation on request: the open stream is closed (indexed), the next opens a new one
    res["rotated"] = plugin.rotate()
    res["rotated_again"] = plugin.rotate()             # nothing written since: no empty stream
    # the same uid in the next stream of the same version: still refused (a trainer reads a
    # version's streams as one)
    llm.generate(p[2:], sp(routereplay_sample_id="uid-A"), use_tqdm=False)
    res["duplicates_after_rotation"] = plugin.stats()["duplicates"]
    res["rotated_after_duplicate"] = plugin.rotate()   # the refused record opened no stream
    # 4. sources are checked before the pause; the engine is never paused for them
    errors = {}
    for name, make in (("not_a_source", lambda: sync.sync("not a source", "v9")),
                       ("bad_tensors", lambda: sync.sync(FromTensors({"w": "x"}), "v9"))):
        try:
            make()
        except ConfigError as e:
            errors[name] = str(e)
    res["bad_source_errors"] = errors
    llm.generate(p[:1], sp(routereplay_sample_id="after-bad-source"), use_tqdm=False)
    # 5. FromDistributed: vLLM's weight-transfer API; this engine has no transfer back end
    #    (NCCL/IPC need CUDA): the first call fails, weights untouched, engine resumed
    try:
        sync.sync(FromDistributed(["model.layers.1.mlp.gate.weight"], ["float32"], [[16, 64]]),
                  "v9")
        res["distributed_error"] = None
    except WeightSyncError as e:
        res["distributed_error"] = str(e)
    llm.generate(p[1:2], sp(routereplay_sample_id="after-distributed"), use_tqdm=False)
    # 6. the framework's own update path (its worker method), then what must follow it
    res["framework_ping"] = llm.collective_rpc("framework_ping")
    llm.collective_rpc("framework_update", args=(v2,))
    rep = after_weight_update(llm, "own-v5")
    res["after_update_report"] = rep.as_dict()
    spg = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0,
                         extra_args={"routereplay_sample_id": "own-stale"})
    o = llm.generate([TokensPrompt(prompt_token_ids=stale)], spg, use_tqdm=False)[0]
    res["own_stale_cached_tokens"] = int(o.num_cached_tokens)
    write_records(os.path.join(out, "own_update.rrsc"), schema,
                  [record_from_output(o, schema, sample_id="own-stale")])
    return res


def part_chunked_preemption(model: str, out: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    # NOTE: 64-token chunks force chunked prefill; a KV cache of 8 blocks of 128 tokens
    # for 6 requests of up to ~330 tokens forces preemption (recompute) under load.
    llm = LLM(model=model, **dict(ENGINE, kv_cache_memory_bytes=8 * 128 * 2048,
                                  max_model_len=512), max_num_batched_tokens=64,
              enable_chunked_prefill=True, max_num_seqs=6, disable_log_stats=False)
    schema = RoutingSchema.from_hf_config(model)
    sp = SamplingParams(max_tokens=64, temperature=1.0, seed=9, ignore_eos=True, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=long_prompt_ids(200 + 20 * i, 30 + i)) for i in range(6)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    write_records(os.path.join(out, "chunked.rrsc"), schema,
                  [record_from_output(o, schema, sample_id=f"ch{i}") for i, o in enumerate(outs)])
    pre = 0
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            pre += int(getattr(m, "value", 0) or 0)
    return {"num_preemptions": pre}


def main():
    ap = argparse.ArgumentParser()
    for k in ("--model", "--v2", "--out"):
        ap.add_argument(k, required=True)
    a = ap.parse_args()
    res = part_plugin_sync_multiturn(a.model, a.v2, a.out)
    from engine_patches.vllm import plugin
    plugin.uninstall()            # the chunked engine streams nowhere
    res.update(part_chunked_preemption(a.model, a.out))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(res, f, default=str)
    sys.stdout.flush()
    os._exit(0)      # NOTE: engine teardown can hang on CPU builds; everything is written


if __name__ == "__main__":
    main()
