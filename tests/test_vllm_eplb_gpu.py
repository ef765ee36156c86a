"""GPU check: vLLM with EPLB (redundant experts, rearranged placement), a weight update
through WeightSync, and the replica refresh. Runs only with ``python -m pytest -m gpu`` on a
CUDA machine with the GPU build of vLLM (``pip install 'routereplay[vllm]'``).

After the engine has rearranged experts (EPLB step interval 1, skewed load), the router
weights are updated to a v2 checkpoint through WeightSync; the routing and log-probs of a
greedy generation must then equal those of a fresh engine started on v2 (same EPLB config),
and every recorded id must be logical (< num_experts).
"""
import numpy as np
import pytest

from tests.conftest import require_cuda

pytestmark = pytest.mark.gpu


def _v2(src, dst):
    """New weights for every expert (x1.5) and new routing (router rows rolled by 3)."""
    import torch
    from tests.conftest import checkpoint_variant

    def edit(k, v):
        if "mlp.experts" in k:
            return v * 1.5
        return torch.roll(v, 3, 0) if k.endswith("mlp.gate.weight") else v
    checkpoint_variant(src, dst, edit)


def _llm(model):
    from vllm import LLM
    from engine_patches.vllm.worker_extension import WORKER_EXTENSION
    return LLM(model=model, dtype="float32", enable_return_routed_experts=True,
               enable_prefix_caching=True, enable_eplb=True, enable_expert_parallel=True,
               eplb_config={"num_redundant_experts": 4, "step_interval": 1, "window_size": 2},
               max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
               worker_extension_cls=WORKER_EXTENSION)


def test_weight_update_with_eplb_matches_fresh_engine(tiny_model, tmp_path):
    require_cuda()
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from engine_patches.vllm.records import record_from_output
    from engine_patches.vllm.weight_sync import FromCheckpoint, WeightSync
    from routereplay.schema import RoutingSchema
    v2 = str(tmp_path / "v2")
    _v2(tiny_model, v2)
    schema = RoutingSchema.from_hf_config(tiny_model)
    prompts = [f"eplb prompt {i} " * 8 for i in range(8)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = _llm(tiny_model)
    for _ in range(4):                       # let EPLB observe load and rearrange
        llm.generate(prompts, sp, use_tqdm=False)
    rep = WeightSync(llm).sync(FromCheckpoint(v2), "v2", mode="abort")
    got = llm.generate(prompts, sp, use_tqdm=False)
    del llm
    ref = _llm(v2).generate(prompts, sp, use_tqdm=False)
    assert rep.eplb_layers_refreshed > 0, "EPLB never rearranged: the check proves nothing"
    for a, b in zip(got, ref):
        ra, rb = record_from_output(a, schema), record_from_output(b, schema)
        assert int(ra.expert_ids.max()) < schema.num_experts                 # logical ids
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert np.array_equal(np.sort(ra.expert_ids, -1), np.sort(rb.expert_ids, -1))
        assert np.allclose(ra.logprobs, rb.logprobs, atol=1e-3)
