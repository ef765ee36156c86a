"""trainer_hooks.fsdp: replay into transformers MoE models around the trainer's forward
(CPU; tiny random models of each family, crafted records of a perturbed copy's routing).

What trainer_hooks.hf (the reference replay of verify) lacks and these tests need:
microbatch keying and gradient accumulation over keyed microbatches, checks beyond shapes
(sample ids at step entry, token identity, every router reached), FSDP2 ``fully_shard`` on
gloo world size 2 (one launch: tests/fsdp_models.py), per-rank reading, Ulysses slices, R2.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the engine extra (transformers)")
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from routereplay.errors import AlignmentError, UnknownSampleError  # noqa: E402
from tests.conftest import REPO, run_py  # noqa: E402
from tests.fsdp_models import (FAMILIES, capture, padded, perturbed_records,  # noqa: E402
                               routers, tiny, write_dist_sidecar)
from trainer_hooks.fsdp import (FSDPReplayer, Microbatch, ReplayStateError,  # noqa: E402
                                UnsupportedRouterError)
from trainer_hooks.fsdp.replayer import hf_token_map  # noqa: E402

RNG = np.random.default_rng(0)
SEQS = [RNG.integers(3, 120, n) for n in (9, 12, 7, 11)]


def expected_rows(recs, sids, mb, own_ids):
    """Per router row: the record's ids where it has a row, else the model's own (the
    fallback), padding rows -1; and the mask of rows with a record. own_ids: int64
    [N, L, K] of the model unpatched (a fallback row's own choice is only known in the
    first MoE layer: replay changes the hidden states of the layers after it)."""
    tm = hf_token_map(mb.layout)
    exp = own_ids.copy()
    recorded = np.zeros(tm.num_rows, bool)
    for r, (j, p) in enumerate(zip(tm.sample, tm.position)):
        if j < 0:
            exp[r] = -1
            continue
        rec = recs[sids[j]]
        if p - rec.start < rec.num_tokens:
            exp[r] = rec.expert_ids[p - rec.start]
            recorded[r] = True
    return exp, recorded, (tm.sample >= 0) & ~recorded


def run_native(model, **kw):
    calls, rm = capture(model)
    with torch.no_grad():
        out = model(**kw).logits
    rm()
    return out, torch.stack(calls, 1).numpy()


# NOTE: qwen3_next and gpt_oss (the slowest to run on CPU): the own-routing test below
@pytest.mark.parametrize("family", FAMILIES[:5])
def test_update_step_replays_every_family_padded_with_router_grads(family):
    model, schema = tiny(family)
    recs = perturbed_records(model, SEQS)
    sids = list(recs)
    ids, mask = padded(SEQS, ["left", "right", "mixed", "left"])
    mb = Microbatch.from_attention_mask(sids, mask, input_ids=ids)
    x, am = torch.as_tensor(ids), torch.as_tensor(mask)
    _, own = run_native(model, input_ids=x, attention_mask=am)
    exp, real, fb = expected_rows(recs, sids, mb, own)
    rep = FSDPReplayer(model, schema)
    calls, rm = capture(model)
    model.zero_grad(set_to_none=True)
    with rep.step(recs, {0: mb}) as step:
        with rep.microbatch(0):
            logits = model(input_ids=x, attention_mask=am).logits
        logits.float().logsumexp(-1).mul(am).sum().backward()
    rm()
    used = torch.stack(calls, 1).numpy()
    assert (used[real] == exp[real]).all()                              # agreement 1.0
    assert fb.sum() == len(SEQS) and (used[fb, 0] == own[fb, 0]).all()  # fallback: own
    n_layers = len(schema.moe_layer_ids)
    assert step.stats.fallback_rows == len(SEQS) * n_layers             # each last token
    assert step.stats.replayed_rows == (sum(map(len, SEQS)) - len(SEQS)) * n_layers
    assert step.stats.token_checked_samples == len(SEQS)
    assert (used[real] != own[real]).any()                              # replay changed routing
    assert all(r.weight.grad is not None and r.weight.grad.norm() > 0 for r in routers(model))
    assert all("forward" not in r.__dict__ for r in routers(model))     # patch removed
    assert step.stats.as_metrics()["routereplay/replayed_fraction"] == pytest.approx(
        step.stats.replayed_rows / (step.stats.replayed_rows + step.stats.fallback_rows))


@pytest.mark.parametrize("family", ["deepseek_v3"])     # qwen3_moe: the world-size-2 test
def test_packed_layout_with_position_ids(family):
    model, schema = tiny(family)
    recs = perturbed_records(model, SEQS)
    sids = list(recs)
    cu = np.cumsum([0] + [len(q) for q in SEQS])
    flat = torch.as_tensor(np.concatenate(SEQS))[None]
    pos = torch.as_tensor(np.concatenate([np.arange(len(q)) for q in SEQS]))[None]
    from routereplay.align import Layout
    mb = Microbatch(sample_ids=sids, layout=Layout(lengths=[len(q) for q in SEQS],
                                                   cu_seqlens_padded=tuple(cu)),
                    tokens=[np.asarray(q) for q in SEQS])
    _, own = run_native(model, input_ids=flat, position_ids=pos)
    exp, real, _ = expected_rows(recs, sids, mb, own)
    rep = FSDPReplayer(model, schema)
    calls, rm = capture(model)
    with torch.no_grad(), rep.step(recs, [mb]) as step:                # old-log-prob pass
        with rep.microbatch(0):
            model(input_ids=flat, position_ids=pos)
    rm()
    assert (torch.stack(calls, 1).numpy()[real] == exp[real]).all()
    assert step.stats.microbatches == 1 and not rep.held


# NOTE: transformers' non-reentrant and torch's reentrant checkpoint_wrapper: the
# world-size-2 test (under fully_shard)
@pytest.mark.parametrize("how", ["torch_non_reentrant", "hf_reentrant"])
def test_recompute_takes_the_first_forwards_ids_fallback_rows_too(how):
    model, schema = tiny("qwen3_moe")
    recs = perturbed_records(model, SEQS[:2])
    ids, mask = padded(SEQS[:2], ["left", "right"])
    mb = Microbatch.from_attention_mask(list(recs), mask, input_ids=ids)
    x, am = torch.as_tensor(ids), torch.as_tensor(mask)
    if how.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"})
    rep = FSDPReplayer(model, schema)
    per_layer = {i: [] for i in range(len(routers(model)))}
    hooks = [r.register_forward_hook(lambda mod, a, o, i=i: per_layer[i].append(o[2].clone()))
             for i, r in enumerate(routers(model))]
    with rep.step(recs, [mb]) as step:
        with rep.microbatch(0):
            if how.startswith("hf"):
                out = model(input_ids=x, attention_mask=am).logits
            else:
                emb = model.get_input_embeddings()(x)
                out = checkpoint(lambda e: model(inputs_embeds=e, attention_mask=am).logits,
                                 emb, use_reentrant=how == "torch_reentrant")
        with torch.no_grad():        # the own routing of fallback rows would now differ
            for r in routers(model):
                r.weight.mul_(-1)
        out.float().logsumexp(-1).sum().backward()
    for h in hooks:
        h.remove()
    for calls in per_layer.values():
        assert len(calls) == 2 and torch.equal(calls[0], calls[1])
    n = len(routers(model))
    assert step.stats.fallback_rows == 2 * n                # counted once, not per forward
    assert all(r.weight.grad.norm() > 0 for r in routers(model))


def test_gradient_accumulation_and_r2_record_then_replay():
    model, schema = tiny("glm4_moe")
    groups = [SEQS[:2], SEQS[2:]]
    mbs = {}
    for k, g in enumerate(groups):
        ids, mask = padded(g, ["left", "right"])
        mbs[k] = (Microbatch.from_attention_mask([f"u{k}{j}" for j in range(2)], mask),
                  torch.as_tensor(ids), torch.as_tensor(mask))
    rep = FSDPReplayer(model, schema)
    calls, rm = capture(model)
    with torch.no_grad(), rep.step(None, {k: v[0] for k, v in mbs.items()}, record=True) as st:
        for k, (_, x, am) in mbs.items():
            with rep.microbatch(k):
                model(input_ids=x, attention_mask=am)
    first = [c.clone() for c in calls]
    calls.clear()
    with torch.no_grad():                     # the policy moved: its own routing differs
        for r in routers(model):
            r.weight.add_(torch.randn(r.weight.shape) * 2)
    model.zero_grad(set_to_none=True)
    with rep.step(st.source(), {k: v[0] for k, v in mbs.items()}) as st2:
        for k, (_, x, am) in mbs.items():
            with rep.microbatch(k):
                out = model(input_ids=x, attention_mask=am).logits
            out.float().logsumexp(-1).mul(am).sum().backward()   # accumulates
    rm()
    for k in mbs:
        real = hf_token_map(mbs[k][0].layout).sample >= 0
        for a, b in zip(first[2 * k:2 * k + 2], calls[2 * k:2 * k + 2]):
            assert torch.equal(a[real], b[real])
    assert st.stats.recorded_rows == st2.stats.replayed_rows > 0
    assert st2.stats.fallback_rows == 0 and st2.stats.microbatches == 2


def test_refusals_and_checks():
    model, schema = tiny("qwen3_moe")
    recs = perturbed_records(model, SEQS[:2])
    ids, mask = padded(SEQS[:2], ["left", "right"])
    x, am = torch.as_tensor(ids), torch.as_tensor(mask)
    rep = FSDPReplayer(model, schema)
    with pytest.raises(UnknownSampleError, match="nope"):
        with rep.step(recs, [Microbatch.from_attention_mask(["s0", "nope"], mask)]):
            pass
    bad = ids.copy()
    bad[0, -1] += 1
    with pytest.raises(AlignmentError, match="microbatch 0"):
        with rep.step(recs, [Microbatch.from_attention_mask(list(recs), mask,
                                                            input_ids=bad)]):
            with rep.microbatch(0):
                pass
    with pytest.raises(ReplayStateError, match="reached 0 of"):
        with rep.step(recs, [Microbatch.from_attention_mask(list(recs), mask)]):
            with rep.microbatch(0):
                pass
    # another model instance in the process keeps its own routing during the step
    other, _ = tiny("qwen3_moe", seed=3)
    ref, _ = run_native(other, input_ids=x, attention_mask=am)
    with rep.step(recs, [Microbatch.from_attention_mask(list(recs), mask)]):
        with rep.microbatch(0), torch.no_grad():
            model(input_ids=x, attention_mask=am)
            assert torch.equal(other(input_ids=x, attention_mask=am).logits, ref)
    with pytest.raises(AlignmentError, match="outside FSDPReplayer.microbatch"):
        with rep.step(recs, [Microbatch.from_attention_mask(list(recs), mask)]):
            with torch.no_grad():
                model(input_ids=x, attention_mask=am)

    class FooTopKRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8, 32))
    model.model.layers[1].mlp.extra = FooTopKRouter()
    with pytest.raises(UnsupportedRouterError, match="FooTopKRouter"):
        FSDPReplayer(model, schema)


def test_fully_shard_world_size_2_checkpointing_accumulation_r2_ulysses(tmp_path):
    """Real ``fully_shard`` on gloo world size 2, tiny Qwen3-MoE, 2 keyed microbatches per
    rank (padded mixed, packed) with gradient accumulation, activation checkpointing
    non-reentrant (transformers' gradient checkpointing, as verl) and reentrant (torch's
    checkpoint_wrapper per decoder layer); R2; a Ulysses slice by verl's own split."""
    sc = tmp_path / "d.rrsc"
    write_dist_sidecar(sc)
    p = run_py(["-m", "tests.fsdp_models", str(sc), str(tmp_path)], timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in res:
        for ckpt in ("hf_non_reentrant", "reentrant"):
            c = r[ckpt]
            assert c["agreement"] == 1.0 and c["compared"] > 150, c
            assert c["calls"] == [4, 4, 4]                 # forward + recompute, 2 microbatches
            assert c["recompute_equal"]                   # recompute took the first ids
            assert all(g > 0 for g in c["router_grads"])
            assert c["stats"]["routereplay/microbatches"] == 2
            assert c["stats"]["routereplay/token_checked_samples"] == 4
            assert c["stats"]["routereplay/fallback_rows"] == 4 * 3   # each last token
            # each rank decoded only its own 4 samples' ids
            assert c["bytes_decoded"] == c["own_bytes"] < c["all_bytes"]
            assert not c["patched_left"]
        # the sharded replayed gradients equal the unsharded replica's, averaged over ranks
        assert r["grad_vs_unsharded_max_abs"] < 1e-8
        rb = r["readbacks"]
        assert rb["replay"] == rb["plain"] == rb["replay2"], rb      # 0 read-backs added
        assert r["r2"]["equal"] and r["r2"]["fallback_rows"] == 0
        assert r["r2"]["recorded_rows"] == r["r2"]["replayed_rows"] > 0
        u = r["ulysses"]
        assert u.get("agreement") == 1.0, u
        assert u["tmap_rows"] == u["rows"] == 20 and u["tokens_match"]
    assert res[0]["hf_non_reentrant"]["router_grads"] == res[1]["hf_non_reentrant"]["router_grads"]
    # the two ranks' Ulysses slices cover the packed sequence: 39 tokens + 1 pad
    assert res[0]["ulysses"]["compared"] + res[1]["ulysses"]["compared"] == (39 - 4) * 3 * 2


def test_import_without_megatron():
    """trainer_hooks.fsdp imports and replays with megatron made unimportable."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith(("megatron.", "trainer_hooks.megatron")):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
import trainer_hooks.fsdp as f
from tests.fsdp_models import tiny
m, schema = tiny("qwen3_moe")
f.FSDPReplayer(m, schema)
try:
    import megatron.core
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block")
bad = [n for n in sys.modules if n.startswith(("megatron", "trainer_hooks.megatron"))]
assert not bad, bad
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_verify_trainer_fsdp_on_a_sidecar(tiny_model, tmp_path, capsys):
    """`routereplay verify --trainer fsdp`: the records of a router-perturbed rollout model
    recomputed through FSDPReplayer (padded keyed microbatches, token checks): agreement
    1.0 with replay, below without."""
    from routereplay.cli.main import main
    from routereplay.sidecar import write_records
    from tests.conftest import checkpoint_variant
    from tests.hf_reference import hf_records
    g = torch.Generator().manual_seed(0)
    engine = checkpoint_variant(tiny_model, str(tmp_path / "engine"), lambda k, v: (
        v + 0.05 * torch.randn(v.shape, generator=g) if k.endswith("mlp.gate.weight") else v))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, n).tolist() for n in (24, 20, 28, 18, 22)]
    schema, recs = hf_records(engine, seqs, prompt_len=12)
    sc = tmp_path / "r.rrsc"
    write_records(str(sc), schema, recs)
    out = tmp_path / "v.json"
    assert main(["verify", str(sc), "--model", tiny_model, "--trainer", "fsdp",
                 "--no-progress", "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["trainer"] == "fsdp"
    assert res["replay"]["routing_agreement"] == 1.0
    assert res["no_replay"]["routing_agreement"] < 1.0
    st = res["replay_stats"]
    assert st["routereplay/token_checked_samples"] == 5 and st["routereplay/microbatches"] == 2
    assert st["routereplay/fallback_rows"] == 5 * schema.num_moe_layers     # last tokens


def test_replay_of_own_routing_changes_no_logit_any_family():
    """Gate weights: replaying a model's own routing gives bit-identical logits to the
    model unpatched, for every family (softmax renormalised or not, Mixtral's float32
    weights, sigmoid + bias + group limit + routed_scaling_factor)."""
    from routereplay.record import RoutingRecord
    x = torch.as_tensor(np.random.default_rng(0).integers(3, 120, (2, 8)))
    for family in FAMILIES:
        m, schema = tiny(family)
        m.eval()
        ref, own = run_native(m, input_ids=x)
        own = own.reshape(2, 8, *own.shape[1:])
        recs = {f"a{j}": RoutingRecord(f"a{j}", own[j, :-1].astype(np.uint8),
                                       token_ids=x[j].numpy().astype(np.int32))
                for j in range(2)}
        rep = FSDPReplayer(m, schema)
        mb = Microbatch.from_attention_mask(list(recs), np.ones((2, 8), np.int64),
                                            input_ids=x.numpy())
        with torch.no_grad(), rep.step(recs, [mb]) as st:
            with rep.microbatch(0):
                out = m(input_ids=x).logits
        assert torch.equal(out, ref), family
        assert st.stats.replayed_rows == 2 * 7 * len(schema.moe_layer_ids)
        # other experts (each id + 1 mod E; DeepSeek-V3-style: + 2 keeps the group limit
        # of pairs of groups) are followed, the fallback (last) rows keep their own
        shift = 1 if schema.score_function == "softmax" else 4
        moved = {k: RoutingRecord(k, ((r.expert_ids.astype(np.int64) + shift) %
                                      schema.num_experts).astype(np.uint8),
                                  token_ids=r.token_ids) for k, r in recs.items()}
        calls, rm = capture(m)
        with torch.no_grad(), rep.step(moved, [mb]):
            with rep.microbatch(0):
                m(input_ids=x)
        rm()
        used = torch.stack(calls, 1).reshape(2, 8, *own.shape[2:]).numpy()
        for j in range(2):
            np.testing.assert_array_equal(used[j, :-1], moved[f"a{j}"].expert_ids, family)


# ------------------------------------------- review of issue 31: silent wrong-routing kinds

@pytest.mark.parametrize("reentrant", [False, True])
def test_two_forwards_through_the_decoder_then_one_backward_recompute_each_its_own(reentrant):
    """A trainer with its own head calls model.model for two microbatches, then one
    backward: each microbatch's recompute took the LAST microbatch's ids (the tag was on
    the CausalLM's output only), same shapes, no error."""
    from tests.fsdp_models import capture_layers
    model, schema = tiny("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    recs = perturbed_records(model, SEQS)
    sids = list(recs)
    batches = [padded(SEQS[:2], ["left", "right"]), padded(SEQS[2:], ["left", "left"])]
    mbs = {k: Microbatch.from_attention_mask(sids[2 * k:2 * k + 2], batches[k][1],
                                             input_ids=batches[k][0]) for k in range(2)}
    rep = FSDPReplayer(model, schema)
    per, remove = capture_layers(model)
    try:
        with rep.step(recs, mbs):
            losses = []
            for k, (ids, mask) in enumerate(batches):
                with rep.microbatch(k):
                    h = model.model(input_ids=torch.as_tensor(ids),
                                    attention_mask=torch.as_tensor(mask),
                                    use_cache=False).last_hidden_state
                losses.append(h.float().pow(2).mean())
            sum(losses).backward()
    finally:
        remove()
    for calls in per:                         # fwd 0, fwd 1, then recompute 1, recompute 0
        assert len(calls) == 4 and not torch.equal(calls[0], calls[1])
        assert torch.equal(calls[2], calls[1]) and torch.equal(calls[3], calls[0])


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_backward_after_step_exit_is_refused_not_recomputed_unreplayed(reentrant):
    """backward() after `with step()` ended: reentrant checkpointing recomputed with the
    routers un-patched (the router's own routing, silently); non-reentrant died in a bare
    torch CheckpointError."""
    model, schema = tiny("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    recs = perturbed_records(model, SEQS[:2])
    ids, mask = padded(SEQS[:2], ["left", "right"])
    rep = FSDPReplayer(model, schema)
    with pytest.raises(ReplayStateError, match=r"microbatches 0 ran a forward with grad inside "
                                               r"step\(\) but their backward did not start"):
        with rep.step(recs, {0: Microbatch.from_attention_mask(list(recs), mask, input_ids=ids)}):
            with rep.microbatch(0):
                out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                            use_cache=False).logits
    with pytest.raises(ReplayStateError, match=r"backward of microbatch 0 runs after its "
                                               r"FSDPReplayer.step\(\) ended"):
        out.float().pow(2).mean().backward()


def test_an_moe_layer_without_a_supported_router_is_refused():
    """A schema MoE layer whose gate is not a recognised router class (remote-code
    DeepSeek 'MoEGate'): the replayer ran and that layer routed on its own."""
    from routereplay.errors import SchemaError
    model, schema = tiny("qwen3_moe")
    gate = model.model.layers[2].mlp.gate

    class MoEGate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.top_k = gate.weight, gate.top_k

        def forward(self, x):
            logits = torch.nn.functional.linear(x.reshape(-1, self.weight.shape[1]), self.weight)
            w, i = logits.softmax(-1).topk(self.top_k, -1)
            return logits, w / w.sum(-1, keepdim=True), i
    model.model.layers[2].mlp.gate = MoEGate()
    with pytest.raises(SchemaError, match=r"decoder layers \[2\] are MoE layers of the schema "
                                          r"but hold no supported router"):
        FSDPReplayer(model, schema)
