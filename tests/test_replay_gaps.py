"""Issue 28 item 9 (b, d, e): gaps a framework author met in the replay path.

- A stream written with ``column_order="sorted"`` lost the engine's top-k slot order; the
  replayer now says so once per step (a RuntimeWarning naming the samples) and counts them
  (``ReplayStats.sorted_order_samples``), from ``routereplay.source.sorted_order_samples``.
- megatron-core 0.16.1 and 0.19.2 crash in ``TopKRouter._apply_expert_bias`` when a
  grad-enabled forward gets ``padding_mask=`` on a model with
  ``moe_router_enable_expert_bias=True``; the replayer refuses that call with a ConfigError
  naming the ways around it, before megatron's shape error.

The megatron checks run real megatron-core on CPU (gloo, world size 1) in a subprocess.
"""
import json
import os

import numpy as np
import pytest

from routereplay.errors import ConfigError
from routereplay.sidecar import MultiSidecarReader, SidecarReader, write_records
from routereplay.source import (InMemorySource, NoRouting, TokenRowSource, as_source,
                                sorted_order_samples)
from tests.conftest import REPO, random_record, run_py

MCORE_019 = os.path.join(REPO, ".venv", "mcore-0.19.2")


def test_sorted_order_samples_per_source(schema, tmp_path):
    """Sidecar readers answer from their header, a multi-stream reader per sample from the
    stream holding it; in-memory, token-row and empty sources are engine order."""
    recs = {s: random_record(schema, s, 9 + i, seed=i) for i, s in enumerate("abcd")}
    eng, srt = tmp_path / "e.rrsc", tmp_path / "s.rrsc"
    write_records(str(eng), schema, [recs["a"], recs["b"]])
    write_records(str(srt), schema, [recs["c"], recs["d"]], column_order="sorted")
    with SidecarReader(str(eng)) as r:
        assert sorted_order_samples(r, ["a", "b"]) == []
    with SidecarReader(str(srt)) as r:
        assert sorted_order_samples(r, ["d", "c"]) == ["d", "c"]
        # the sorted stream stores each row ascending: the slot order is really gone
        (ids, first), = r.fetch("c", [0, 1, 2], [(0, 100)])
        assert first == 0 and (ids == np.sort(recs["c"].expert_ids, -1)).all()
        assert not (ids == recs["c"].expert_ids).all()
    with MultiSidecarReader([str(eng), str(srt)]) as m:
        assert sorted_order_samples(m, ["a", "c", "b", "d"]) == ["c", "d"]
    with MultiSidecarReader([str(srt)]) as m:
        assert sorted_order_samples(m, ["c", "d"]) == ["c", "d"]
    assert sorted_order_samples(InMemorySource(recs, schema), list(recs)) == []
    assert sorted_order_samples(TokenRowSource(schema), ["a"]) == []
    assert sorted_order_samples(NoRouting(schema), ["a"]) == []

    class Declared(InMemorySource):          # a third-party source declaring its order
        column_order = "sorted"
    src = as_source(Declared(recs, schema), schema)
    assert sorted_order_samples(src, ["b"]) == ["b"]
    src.column_order = "ascending"
    with pytest.raises(ConfigError, match="column_order 'ascending' is neither"):
        sorted_order_samples(src, ["b"])


# Runs under the megatron-core on PYTHONPATH; prints RESULT {json}.
_SCRIPT = r'''
import json, os, sys, warnings
import numpy as np, torch
from trainer_hooks.megatron.harness.parallel import ParallelSpec, build_chunks, free_port, init
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(free_port()))
init(ParallelSpec(), 0, 1)
from routereplay.errors import ConfigError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import MultiSidecarReader, SidecarReader, write_records
from trainer_hooks.megatron import MCORE_VERSION, Layout, Microbatch, RouterReplayer
from trainer_hooks.megatron.harness import qwen3_moe as conv

model_dir, tmp, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
hf = conv.load_hf_config(model_dir)
schema = RoutingSchema.from_hf_config(model_dir)
L, E, K = schema.num_moe_layers, schema.num_experts, schema.top_k
rng = np.random.default_rng(0)
lengths = {"a": 12, "b": 9, "c": 10}
recs = {}
for sid, n in lengths.items():
    ids = np.argsort(rng.random((n - 1, L, E)), -1)[..., :K].astype(schema.id_dtype)
    recs[sid] = RoutingRecord(sample_id=sid, expert_ids=ids,
                              token_ids=rng.integers(3, 500, n).astype(np.int32))
res = {"version": MCORE_VERSION}

def build(**over):
    return build_chunks(hf, conv.transformer_config(hf, **over), ParallelSpec())[0]

def inputs(mb):
    b, s = mb.layout.batch_size, mb.layout.seq_len
    tok = torch.zeros((b, s), dtype=torch.long)
    for j, sid in enumerate(mb.sample_ids):
        tok[j, :lengths[sid]] = torch.from_numpy(recs[sid].token_ids.astype(np.int64))
    return tok, torch.arange(s)[None].expand(b, s).contiguous()

def run(model, rep, source, mbs, grad=False, **kw):
    """Forward every microbatch under replay; (used ids {(key, layer): [N, K]}, stats,
    sorted-order RuntimeWarnings)."""
    used = {}
    rep.on_used = lambda key, ci, li, tm, idx: used.__setitem__((key, li), idx.numpy())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with rep.step(source, mbs) as st, torch.set_grad_enabled(grad):
            for key, mb in mbs.items():
                tok, pos = inputs(mb)
                with rep.microbatch(key, model):
                    model(tok, pos, attention_mask=None, **kw)
    msgs = [str(x.message) for x in w
            if issubclass(x.category, RuntimeWarning) and "sorted column order" in str(x.message)]
    return used, st.stats, msgs

def one(sid, s=12):
    return Microbatch((sid,), Layout(lengths=(lengths[sid],), seq_len=s))

if "sorted" in parts:
    eng, srt, srt_c = (os.path.join(tmp, n) for n in ("e.rrsc", "s.rrsc", "c.rrsc"))
    write_records(eng, schema, [recs["a"], recs["b"]])
    write_records(srt, schema, [recs["a"], recs["b"]], column_order="sorted")
    write_records(srt_c, schema, [recs["c"]], column_order="sorted")
    model = build()
    rep = RouterReplayer(model, schema)
    mbs = {0: one("a"), 1: one("b")}
    out = {}
    for name, src in (("sorted", SidecarReader(srt)), ("engine", SidecarReader(eng))):
        used, st, msgs = run(model, rep, src, mbs)
        eq = all((used[(k, li)][:lengths[sid] - 1] == (np.sort(recs[sid].expert_ids[:, li], -1)
                  if name == "sorted" else recs[sid].expert_ids[:, li])).all()
                 for k, sid in ((0, "a"), (1, "b")) for li in range(L))
        out[name] = {"warnings": msgs, "stat": st.sorted_order_samples, "router_calls": len(used),
                     "replayed_as_stored": bool(eq),
                     "metric": st.as_metrics()["routereplay/sorted_order_samples"]}
    used, st, msgs = run(model, rep, MultiSidecarReader([eng, srt_c]), {0: one("a"), 1: one("c")})
    out["multi"] = {"warnings": msgs, "stat": st.sorted_order_samples}
    res["sorted"] = out

if "bias" in parts:
    model = build(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    rep = RouterReplayer(model, schema)
    mb = Microbatch(("a", "b"), Layout(lengths=(12, 9), seq_len=12))
    tok, pos = inputs(mb)
    pm = torch.zeros(2, 12, dtype=torch.bool)
    pm[1, 9:] = True                                  # True = padding (megatron's convention)
    out = {}
    try:                                              # megatron-core alone: its own crash
        with torch.enable_grad():
            model(tok, pos, attention_mask=None, padding_mask=pm)
        out["plain"] = "ok"
    except RuntimeError as e:
        out["plain"] = str(e)
    try:
        run(model, rep, recs, {0: mb}, grad=True, padding_mask=pm)
        out["replay_grad"] = "ok"
    except ConfigError as e:
        out["replay_grad"] = str(e)
    out["held_after_refusal"] = len(rep.held)
    # the ways around it: no grad (log-probs), or no padding_mask
    used, _, _ = run(model, rep, recs, {0: mb}, grad=False, padding_mask=pm)
    out["no_grad_replayed"] = bool((used[(0, 1)].reshape(12, 2, K)[:11, 0]
                                    == recs["a"].expert_ids[:, 1]).all())
    router = rep.layers[0][0][0]
    before = router.local_tokens_per_expert.sum().item()
    used, _, _ = run(model, rep, recs, {0: mb}, grad=True)
    out["no_mask_replayed"] = bool((used[(0, 1)].reshape(12, 2, K)[:8, 1]
                                    == recs["b"].expert_ids[:, 1]).all())
    out["no_mask_counted"] = router.local_tokens_per_expert.sum().item() - before
    # without the expert bias, padding_mask is accepted
    plain = build()
    _, st, _ = run(plain, RouterReplayer(plain, schema), recs, {0: mb}, grad=True, padding_mask=pm)
    out["no_bias_replayed_rows"] = st.replayed_rows
    res["bias"] = out

print("RESULT " + json.dumps(res))
'''


def _run(tiny_model, tmp_path, parts: str, env=None) -> dict:
    p = run_py(["-c", _SCRIPT, tiny_model, str(tmp_path), parts], timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.split("RESULT ")[1])


def _check_bias(b: dict, k: int) -> None:
    # megatron-core alone crashes (the claim in docs/megatron.md): 24 tokens, 16 experts;
    # eager (0.16.1 here) or traced by torch.compile (0.19.2 here: Dynamo's fake tensors)
    assert ("must match the size of tensor b (24) at non-singleton dimension 1" in b["plain"]
            or "broadcast a dimension of length 24" in b["plain"]), b["plain"]
    # the replayer refuses the call first, naming the fix, and holds nothing after it
    msg = b["replay_grad"]
    assert msg.startswith("microbatch 0: padding_mask= in a forward with grad enabled"), msg
    assert "moe_router_enable_expert_bias=True" in msg and "Do not pass padding_mask" in msg
    assert b["held_after_refusal"] == 0
    # the ways around it replay: no grad with padding_mask, grad without it (where
    # megatron counts every token of the [2, 12] batch, padding included, in the bias loads)
    assert b["no_grad_replayed"] and b["no_mask_replayed"]
    assert b["no_mask_counted"] == 2 * 12 * k
    # no expert bias: padding_mask is accepted (3 MoE layers x 18 recorded rows replayed)
    assert b["no_bias_replayed_rows"] == 3 * (11 + 8)


@pytest.mark.trainer
def test_megatron_sorted_stream_warns_once_per_step_and_bias_padding_mask_refused(
        tiny_model, tmp_path):
    pytest.importorskip("megatron.core", reason="needs the trainer extra")
    res = _run(tiny_model, tmp_path, "sorted,bias")
    assert res["version"] == "0.16.1"
    s = res["sorted"]
    srt = s["sorted"]
    # 2 microbatches x 3 MoE routers: one warning for the step, not one per router call
    assert srt["router_calls"] == 6 and len(srt["warnings"]) == 1, srt
    assert srt["warnings"][0].startswith("routereplay: 2 of the step's 2 samples ('a', 'b') are "
                                         "held in sorted column order")
    assert "column_order='engine'" in srt["warnings"][0]
    assert srt["stat"] == 2 and srt["metric"] == 2 and srt["replayed_as_stored"]
    eng = s["engine"]
    assert eng["warnings"] == [] and eng["stat"] == 0 and eng["replayed_as_stored"]
    # several streams: only the samples of the sorted one are named
    assert s["multi"]["stat"] == 1 and len(s["multi"]["warnings"]) == 1
    assert "1 of the step's 2 samples ('c')" in s["multi"]["warnings"][0]
    _check_bias(res["bias"], 4)


@pytest.mark.trainer
def test_megatron_019_bias_padding_mask_refused(tiny_model, tmp_path):
    assert os.path.isdir(os.path.join(MCORE_019, "megatron")), \
        "megatron-core 0.19.2 missing: run scripts/bootstrap.sh"
    res = _run(tiny_model, tmp_path, "bias", env=dict(os.environ, PYTHONPATH=MCORE_019))
    assert res["version"] == "0.19.2"
    _check_bias(res["bias"], 4)
