"""The HF transformers reference replay hook (trainer_hooks/hf): Qwen3-MoE and Mixtral."""
import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the engine extra (transformers)")
import torch  # noqa: E402

from routereplay.record import RoutingRecord  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from trainer_hooks.hf.replay import hf_replay, moe_routers, replay_ids, token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tiny_model):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return m, RoutingSchema.from_hf_config(tiny_model)


def _own_record(model, schema, ids, start=0):
    """A record of the model's own routing (what an fp32 engine with this model records)."""
    with torch.no_grad():
        _, used = token_logprobs(model, ids, schema)
    n = len(ids)
    return RoutingRecord("s", used[start:n - 1].astype(schema.id_dtype), start=start,
                         prompt_len=n // 2, token_ids=np.asarray(ids, np.int32))


def test_replay_of_own_routing_changes_nothing(qwen):
    m, schema = qwen
    ids = np.random.default_rng(0).integers(3, 500, 40)
    rec = _own_record(m, schema, ids)
    with torch.no_grad():
        lp0, used0 = token_logprobs(m, ids, schema)
        lp1, used1 = token_logprobs(m, ids, schema, record=rec)
    np.testing.assert_array_equal(lp0, lp1)
    np.testing.assert_array_equal(used1[:-1], rec.expert_ids)


def test_perturbed_router_follows_the_record_and_keeps_gradients(qwen):
    m, schema = qwen
    ids = np.random.default_rng(1).integers(3, 500, 48)
    rec = _own_record(m, schema, ids, start=5)
    saved = [r.weight.detach().clone() for r in moe_routers(m)]
    try:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for r in moe_routers(m):
                r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.1)
            _, own = token_logprobs(m, ids, schema)
        assert (own[5:-1] != rec.expert_ids).any()                         # the router changed its mind
        m.zero_grad(set_to_none=True)
        x = torch.as_tensor(ids)[None]
        with hf_replay(m, replay_ids(rec, schema, len(ids))) as used:
            lp = torch.log_softmax(m(x).logits[0, :-1], -1).gather(-1, x[0, 1:, None]).sum()
            (-lp).backward()
        used = torch.stack(used, 1).numpy()
        np.testing.assert_array_equal(used[5:-1], rec.expert_ids)          # recorded experts, in order
        np.testing.assert_array_equal(used[:5], own[:5])            # rows without routing: own
        assert all(r.weight.grad is not None and r.weight.grad.norm() > 0 for r in moe_routers(m))
    finally:
        with torch.no_grad():
            for r, w in zip(moe_routers(m), saved):
                r.weight.copy_(w)
    assert all("forward" not in r.__dict__ for r in moe_routers(m))   # patch removed


def test_mixtral_replay():
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                        num_experts_per_tok=2, max_position_embeddings=64)
    m = MixtralForCausalLM(cfg).eval()
    schema = RoutingSchema.from_hf_config(cfg.to_dict())
    ids = np.random.default_rng(2).integers(0, 64, 20)
    rng = np.random.default_rng(3)
    forced = np.stack([np.stack([rng.permutation(6)[:2] for _ in range(19)]) for _ in range(2)], 1)
    rec = RoutingRecord("mx", forced.astype(np.uint8), token_ids=ids.astype(np.int32))
    with torch.no_grad():
        lp, used = token_logprobs(m, ids, schema, record=rec)
        lp_own, _ = token_logprobs(m, ids, schema)
    np.testing.assert_array_equal(used[:-1], forced)
    assert np.isfinite(lp).all() and np.abs(lp - lp_own).max() > 1e-4


def test_exact_ties_replay_is_deterministic(qwen):
    """A router with exact ties (duplicated rows): the recorded tie-break (the higher id,
    the opposite of torch.topk here) is used in forward and recompute, so per-expert token
    counts equal the record's every time."""
    m, schema = qwen
    r0 = moe_routers(m)[0]
    saved = r0.weight.detach().clone()
    try:
        with torch.no_grad():
            r0.weight[1] = r0.weight[0]                  # experts 0 and 1 always tie
        ids = np.random.default_rng(4).integers(3, 500, 64)
        with torch.no_grad():
            _, own = token_logprobs(m, ids, schema)
        tied = (np.isin(own[:, 0], [0, 1])).sum(-1) == 1       # rows holding exactly one of 0/1
        assert tied.any()
        rec_ids = own[:-1].copy()
        lay = rec_ids[:, 0]
        lay[np.isin(lay, [0, 1])] ^= 1                    # the engine broke the tie the other way
        rec = RoutingRecord("tie", rec_ids.astype(schema.id_dtype), token_ids=ids.astype(np.int32))
        counts = []
        for _ in range(2):                                # forward, then recompute
            with torch.no_grad():
                _, used = token_logprobs(m, ids, schema, record=rec)
            counts.append(np.bincount(used[:-1, 0].ravel(), minlength=schema.num_experts))
        want = np.bincount(rec_ids[:, 0].ravel(), minlength=schema.num_experts)
        np.testing.assert_array_equal(counts[0], want)
        np.testing.assert_array_equal(counts[1], want)
        assert not np.array_equal(np.bincount(own[:-1, 0].ravel(), minlength=schema.num_experts), want)
    finally:
        with torch.no_grad():
            r0.weight.copy_(saved)


def test_bad_replay_ids_are_clear_errors(qwen):
    from routereplay.errors import AlignmentError
    m, schema = qwen
    x = torch.arange(3, 13)[None]
    ok = torch.full((10, schema.top_k), -1, dtype=torch.long)
    for bad, why in [(torch.full((10, schema.top_k), 99), "outside"),
                     (torch.tensor([[0, -1, 2, 3]] * 10), "partly -1"),
                     (torch.tensor([[0, 0, 2, 3]] * 10), "repeat"),
                     (torch.zeros(10, schema.top_k), "integer"),
                     (torch.full((9, schema.top_k), -1), "do not match")]:
        with pytest.raises(AlignmentError, match=why):
            with torch.no_grad(), hf_replay(m, [bad, ok, ok]):
                m(x)
    rec = RoutingRecord("late", np.zeros((2, 3, 4), np.uint8), start=50)
    with pytest.raises(AlignmentError, match="past the 10-token sequence"):
        replay_ids(rec, schema, 10)


def test_token_logprobs_builds_inputs_on_the_model_device(qwen):
    """A model on another device (here `meta`, the one non-CPU device of a CPU machine) gets
    its input ids, and replay ids, on that device (they were built on the CPU, so
    `verify --trainer hf` failed on CUDA)."""
    import copy
    m, schema = qwen
    meta = copy.deepcopy(m).to("meta")
    seen = {}

    class Stop(Exception):
        pass

    def grab(mod, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        seen["input"] = x.device.type
        raise Stop

    h = meta.register_forward_pre_hook(grab, with_kwargs=True)
    ids = np.random.default_rng(5).integers(3, 500, 12)
    rec = RoutingRecord("m", np.tile(np.arange(schema.top_k, dtype=np.uint8), (11, 3, 1)),
                        token_ids=ids.astype(np.int32))
    try:
        with pytest.raises(Stop):
            token_logprobs(meta, ids, schema, record=rec)
    finally:
        h.remove()
    assert seen["input"] == "meta"
    from trainer_hooks.hf.replay import model_inputs
    x, forced = model_inputs(meta, ids, schema, rec)
    assert x.device.type == "meta" and all(f.device.type == "cpu" for f in forced)
    # hf_replay checks the forced ids on the host, then moves them to each router's device
    with hf_replay(meta, forced):
        pass
