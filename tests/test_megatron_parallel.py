"""Replay under megatron-core parallel layouts on CPU (gloo, 2 processes), through
megatron's own forward_backward_func.

Each layout runs ``trainer_hooks.megatron.harness.recompute --check-record``, which on every rank:
records the unperturbed model's own routing (RECORD), replays it (ids and log-probs must be
exactly equal), perturbs the routers (own routing then differs), replays again (the recorded
experts are still selected, in forward and in the activation-recompute forward of a
training step; routers get gradients), and finally replays the HF-recorded sidecar (the
engine side) and compares log-probs with HF's.
"""
import json

import numpy as np
import pytest

from routereplay.sidecar import write_records
from tests.conftest import run_py

pytestmark = pytest.mark.trainer
pytest.importorskip("megatron.core", reason="needs the trainer extra")


@pytest.fixture(scope="module")
def sidecar(tiny_model, tmp_path_factory):
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, n).tolist() for n in (40, 33, 47, 29, 36)]
    schema, recs = hf_records(tiny_model, seqs, prompt_len=20)
    p = tmp_path_factory.mktemp("par") / "hf.rrsc"
    write_records(str(p), schema, recs)
    return str(p)


def _run(tiny_model, sidecar, tmp_path, *args):
    out = tmp_path / "r.json"
    p = run_py(["-m", "trainer_hooks.megatron.harness.recompute", "--model", tiny_model, "--sidecar",
                sidecar, "--out", str(out), "--check-record", *args], timeout=420)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def world1(tiny_model, sidecar, tmp_path_factory):
    return _run(tiny_model, sidecar, tmp_path_factory.mktemp("w1"))


def _check(res, ref):
    c = res["checks"]
    # 1. RECORD -> replay on the unperturbed model: bitwise equal ids and log-probs.
    assert c["record_replay"]["ids_equal"] and c["record_replay"]["lp_exact"]
    # 2. perturbed routers: their own routing differs; replay still forces the recorded ids,
    #    in the forward and in the recompute forward of a training step.
    assert c["perturbed_own"]["set_agreement"] < 0.5
    for k in ("perturbed_replay", "perturbed_train"):
        assert c[k]["ids_equal"] and c[k]["set_agreement"] == 1.0, (k, c[k])
    assert c["perturbed_train"]["max_abs_dlogp"] == pytest.approx(
        c["perturbed_replay"]["max_abs_dlogp"], abs=1e-4)
    assert sum(c["recompute_rows_differing"]) == 0
    assert all(g > 0 for g in c["router_grad_norms"])
    # 3. engine (HF) routing replayed: same routing, same log-probs as world size 1.
    for cond in ("no_replay", "replay"):
        assert res[cond]["routing_agreement"] == 1.0
        assert res[cond]["max_abs_dlogp"] < 1e-4
        assert res[cond]["num_rows"] == ref[cond]["num_rows"]
    np.testing.assert_allclose(res["replay_backward"]["router_grad_norms"],
                               ref["replay_backward"]["router_grad_norms"], rtol=1e-4)
    np.testing.assert_allclose(c["router_grad_norms"], ref["checks"]["router_grad_norms"],
                               rtol=1e-4)
    assert res["replay_backward"]["loss"] == pytest.approx(ref["replay_backward"]["loss"],
                                                           rel=1e-5)


def _decoded(res):
    return [s["bytes_decoded"] for s in res["replay"]["replay_stats"]]


def test_world1_reference(world1):
    c = world1["checks"]
    assert c["record_replay"]["ids_equal"] and c["record_replay"]["lp_exact"]
    assert sum(c["recompute_rows_checked"]) > 0 and sum(c["recompute_rows_differing"]) == 0
    assert world1["replay"]["routing_agreement"] == 1.0


@pytest.mark.parametrize("layout", ["ep=2", "ep=2,dispatcher=allgather"])
def test_expert_parallel(tiny_model, sidecar, tmp_path, world1, layout):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", layout)
    assert res["world_size"] == 2
    _check(res, world1)
    # EP ranks are data-parallel ranks: each decodes only its own samples.
    assert sum(_decoded(res)) == _decoded(world1)[0]
    assert max(_decoded(res)) < _decoded(world1)[0]


def test_tensor_parallel_sequence_parallel(tiny_model, sidecar, tmp_path, world1):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", "tp=2,sp")
    _check(res, world1)
    # each TP rank decodes only its part of the sequence: together exactly the batch once
    # (right padding: rank 0 holds positions 0..23, where every sample has rows)
    d = _decoded(res)
    assert sum(d) == _decoded(world1)[0] and 0 < min(d) and max(d) < _decoded(world1)[0]
    assert sum(res["checks"]["recompute_rows_checked"]) > 0


def test_pipeline_1f1b_with_recompute(tiny_model, sidecar, tmp_path, world1):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", "pp=2")
    _check(res, world1)
    # stage 0 holds MoE layer 1, stage 1 layers 2 and 3: decoded in that proportion
    d = _decoded(res)
    assert d[0] * 2 == d[1] and sum(d) == _decoded(world1)[0]
    assert all(n > 0 for n in res["checks"]["recompute_rows_checked"])


def test_virtual_pipeline_interleaved(tiny_model, sidecar, tmp_path, world1):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", "pp=2,vpp=2")
    _check(res, world1)


def test_packed_sequences_with_sequence_parallel(tiny_model, sidecar, tmp_path, world1):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", "tp=2,sp", "--padding", "packed")
    assert res["padding"] == "packed"
    _check(res, world1)


def test_left_padded_batches(tiny_model, sidecar, tmp_path, world1):
    res = _run(tiny_model, sidecar, tmp_path, "--parallel", "ep=2", "--padding", "left")
    assert res["padding"] == "left"
    _check(res, world1)


def test_context_parallel_is_refused_with_reason(tiny_model, sidecar, tmp_path):
    p = run_py(["-m", "trainer_hooks.megatron.harness.recompute", "--model", tiny_model, "--sidecar",
                sidecar, "--out", str(tmp_path / "r.json"), "--parallel", "cp=2"], timeout=120)
    assert p.returncode == 2
    assert "cp > 1 cannot run on CPU" in p.stderr and "TEDotProductAttention" in p.stderr
