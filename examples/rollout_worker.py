"""Rollout worker for both examples: vLLM with routing capture, one closed stream per
policy version, and verl-style batch tensors built from the same outputs.

    python examples/rollout_worker.py --model MODEL_DIR --out OUT [--versions 2]

What it writes to OUT, per policy version v (``policy-0``, ``policy-1``, ...):

- ``streams/``: the routereplay vLLM plugin's streams, one closed, indexed stream per
  version, records keyed by the framework's sample id (slime-style trainers read these);
  ``streams.json`` lists them (path, weight_version, records, closed);
- ``samples-<v>.json``: per-sample data as slime carries it (uid, tokens, response_length,
  rollout_log_probs); the routing is in the stream, under the uid;
- ``batch-<v>.npz``: the batch as verl's agent loop carries it (prompt left-padded,
  response right-padded): ``input_ids``, ``attention_mask``, ``response_mask``,
  ``routed_experts`` int16 [b, s, num_hidden_layers, K] (vLLM's layout, dense layers zero,
  row c = the token in column c), ``rollout_log_probs`` [b, s] and ``uids``.

Between versions the framework would push the trainer's weights into the engine (its own
path: CUDA IPC, NCCL) and then call ``after_weight_update`` (docs/integration.md "Weight
sync"); this CPU example keeps the weights and makes only that call, which closes the
version's stream.
"""
import argparse
import json
import os

from engine_patches.vllm.harness import triton_cpu

triton_cpu.install()             # CPU machines only (no CUDA): before `import vllm`
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from engine_patches.vllm import plugin  # noqa: E402
from engine_patches.vllm.weight_sync import after_weight_update  # noqa: E402


def verl_batch(outputs, uids):
    """verl's padded batch from vLLM outputs (left-padded prompts, right-padded responses)."""
    prompts = [list(o.prompt_token_ids) for o in outputs]
    responses = [list(o.outputs[0].token_ids) for o in outputs]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    b, s = len(outputs), p_len + r_len
    routed0 = outputs[0].outputs[0].routed_experts            # [N - 1, num_hidden_layers, K]
    batch = {"input_ids": np.zeros((b, s), np.int64), "attention_mask": np.zeros((b, s), np.int64),
             "response_mask": np.zeros((b, s), np.int64),
             "rollout_log_probs": np.zeros((b, s), np.float32),
             "routed_experts": np.zeros((b, s) + routed0.shape[1:], np.int16),
             "uids": np.array(uids)}
    for j, (o, p, r) in enumerate(zip(outputs, prompts, responses)):
        a = p_len - len(p)                                     # first column of the prompt
        seq = p + r
        batch["input_ids"][j, a:a + len(seq)] = seq
        batch["attention_mask"][j, a:a + len(seq)] = 1
        batch["response_mask"][j, p_len:p_len + len(r)] = 1
        batch["rollout_log_probs"][j, p_len:p_len + len(r)] = [
            lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, r)]
        routed = o.outputs[0].routed_experts                   # no row for the last token
        batch["routed_experts"][j, a:a + len(routed)] = routed
    return batch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    # capture on: every finished request goes to a stream, one per weight version
    plugin.install(os.path.join(a.out, "streams") + "/")
    llm = LLM(a.model, dtype="float32", enable_return_routed_experts=True,
              enable_prefix_caching=True, max_model_len=512, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 << 20)
    llm.update_weight_version("policy-0")           # the version of the starting weights
    from routereplay.cli.demo.tiny_model import demo_prompts
    prompts = demo_prompts(a.prompts)
    for v in range(a.versions):
        version = f"policy-{v}"
        uids = [f"{version}/{i}" for i in range(len(prompts))]       # the framework's ids
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=v * 100 + i, logprobs=0,
                                 ignore_eos=True, extra_args={"routereplay_sample_id": uid})
                  for i, uid in enumerate(uids)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        np.savez(os.path.join(a.out, f"batch-{version}.npz"), **verl_batch(outputs, uids))
        with open(os.path.join(a.out, f"samples-{version}.json"), "w") as f:
            json.dump([{"uid": uid, "tokens": list(o.prompt_token_ids) + list(c.token_ids),
                        "response_length": len(c.token_ids),
                        "rollout_log_probs": [lp[t].logprob for lp, t in
                                              zip(c.logprobs, c.token_ids)]}
                       for uid, o in zip(uids, outputs) for c in o.outputs[:1]], f)
        # ... the framework's own weight update would go here; then what must follow it
        # (closes this version's stream; no expert weights were written in this example)
        after_weight_update(llm, f"policy-{v + 1}", updated_experts=[])
    plugin.rotate()                  # nothing is written after the last update: no stream
    with open(os.path.join(a.out, "streams.json"), "w") as f:
        json.dump([{"path": i.path, "weight_version": i.weight_version, "records": i.records,
                    "closed": i.closed} for i in plugin.streams()], f, indent=1)
    os._exit(0)       # NOTE: skip interpreter teardown of the CPU engine (it can hang)


if __name__ == "__main__":
    main()
