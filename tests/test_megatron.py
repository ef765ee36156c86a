"""Real megatron-core on CPU (gloo, world size 1), each run in its own process."""
import json

import numpy as np
import pytest

from routereplay.schema import RoutingSchema
from routereplay.sidecar import write_records
from tests.conftest import run_py

pytestmark = pytest.mark.trainer
pytest.importorskip("megatron.core", reason="needs the trainer extra")


@pytest.fixture(scope="module")
def hf_sidecar(tiny_model, tmp_path_factory):
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, n).tolist() for n in (40, 33, 47)]
    schema, recs = hf_records(tiny_model, seqs, prompt_len=20)
    p = tmp_path_factory.mktemp("mc") / "hf.rrsc"
    write_records(str(p), schema, recs)
    return str(p), schema, recs


def _recompute(tiny_model, sidecar, tmp_path, *extra):
    out = tmp_path / "r.json"
    p = run_py(["-m", "trainer_hooks.megatron.harness.recompute", "--model", tiny_model,
                "--sidecar", sidecar, "--out", str(out), *extra], timeout=300)
    return p, (json.loads(out.read_text()) if p.returncode == 0 else None)


def test_product_face_imports_no_harness():
    """trainer_hooks.megatron exports the product and imports nothing of its harness (and
    not megatron-core itself: that happens when a step starts)."""
    p = run_py(["-c", "import sys, trainer_hooks.megatron as m; print(sorted(m.__all__)); "
                "print([k for k in sys.modules if 'harness' in k or k.startswith('megatron')])"],
               timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    face, loaded = p.stdout.strip().splitlines()
    assert face == str(sorted(["RouterReplayer", "Microbatch", "ReplayStats", "ReplayStep",
                               "RouterCall",
                               "Layout", "Shard", "check_config", "ReplayStateError",
                               "UnknownMicrobatchError", "MCORE_VERSION"]))
    assert loaded == "[]"


def test_megatron_matches_hf_fp32(tiny_model, hf_sidecar, tmp_path):
    """HF->Megatron mapping: same log-probs (1e-4) and same routing as HF in fp32."""
    p, res = _recompute(tiny_model, hf_sidecar[0], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for c in ("no_replay", "replay"):
        assert res[c]["max_abs_dlogp"] < 1e-4, (c, res[c]["max_abs_dlogp"])
        assert res[c]["routing_agreement"] == 1.0
    # HF's descending top-k order is megatron's order too
    assert res["no_replay"]["routing_agreement_ordered"] == 1.0
    assert all(g > 0 for g in res["replay_backward"]["router_grad_norms"])


def test_perturbed_router_replay_forces_recorded_experts(tiny_model, hf_sidecar, tmp_path):
    p, res = _recompute(tiny_model, hf_sidecar[0], tmp_path, "--router-perturb", "0.03")
    assert p.returncode == 0, p.stderr[-3000:]
    assert res["no_replay"]["routing_agreement"] < 0.995
    assert res["replay"]["routing_agreement"] == 1.0
    assert res["replay"]["k3_kl"] < res["no_replay"]["k3_kl"]
    assert all(g > 0 for g in res["replay_backward"]["router_grad_norms"])


def test_replayer_fallback_capacity_refusals_mtp(tiny_model, tmp_path):
    """RouterReplayer at world size 1: per-token fallback (own / dummy), capacity-factor
    dropping after replay, refused configs, clear errors, MTP keeps its own routing."""
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 500, n).tolist() for n in (30, 24)]
    schema, recs = hf_records(tiny_model, seqs, prompt_len=10, start=6)
    sc = tmp_path / "fb.rrsc"
    write_records(str(sc), schema, recs)
    p = run_py(["tests/mcore_replay_checks.py", tiny_model, str(sc)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.split("RESULT ")[1])
    own = res["own"]
    assert own["covered_equal"] and own["fallback_equal_own"]
    assert own["covered_differs_from_own"] > 0          # replay really overrode routing
    assert own["fallback_rows_first"] == 2 * 6 * 3       # 2 samples x 6 rows x 3 MoE layers
    # + the last token of each sample (no row), counted by the replayer itself
    assert own["stats_fallback_rows"] == 2 * 6 * 3 + 2 * 3
    assert own["stats_replayed_rows"] == sum(r.num_tokens for r in recs) * 3
    assert own["duplicate_rows"] == 0
    d = res["dummy"]
    assert d["covered_equal"] and d["fallback_rows_are_dummy"] and d["duplicate_rows"] == 0
    cap = res["capacity"]
    assert cap["replayed_selected"] and cap["map_subset_of_replayed"]
    assert cap["dropped_assignments"] > 0
    for name, why in (("fused", "moe_router_fusion=True"), ("sinkhorn", "sinkhorn"),
                      ("disabled", "moe_enable_routing_replay is False")):
        assert why in res["refused"][name], res["refused"]
    # the in-memory source checks ids once, when it takes them (step entry)
    assert res["bad_ids"].startswith("sample 'hf1', token 10, layer 3: duplicate expert ids")
    # an error in a prefetched microbatch is raised when that microbatch is entered
    for ahead in ("0", "2"):
        pe = res["prefetch_errors"][ahead]
        assert pe["entered"] == [0], pe
        assert pe["error"].startswith("microbatch 1: sample 'hf1', token position 3: the "
                                      "trainer has token id "), pe
    assert res["prefetch_errors"]["2"]["prefetched"] >= 1
    # a replayed training step (forward, recompute, backward; fallback rows included) reads
    # no more values back to the host than the plain step of megatron-core
    rb = res["readbacks"]
    assert rb["replay"] == rb["plain"], rb
    assert rb["fallback_rows"] > 0 and rb["replayed_rows"] > 0
    assert all(g > 0 for g in rb["router_grads"])
    assert "outside RouterReplayer.microbatch()" in res["outside"]
    assert "inside microbatch(0)" in res["nested"]
    assert "outside RouterReplayer.microbatch()" in res["after_backward_outside"]
    assert res["held_after_step"] == 0
    mtp = res["mtp"]
    assert mtp["num_mtp_routers"] == 1 and mtp["backbone_layers"] == [1, 2, 3]
    assert mtp["own_equal"] and mtp["rows"] == 2 * 30


def test_schema_mismatch_is_a_clear_error(tiny_model, hf_sidecar, tmp_path):
    _, schema, recs = hf_sidecar
    other = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4, num_experts=32)
    sc = tmp_path / "other.rrsc"
    write_records(str(sc), other, recs)
    p, _ = _recompute(tiny_model, str(sc), tmp_path)
    assert p.returncode == 2
    assert "num_experts: model 16 vs sidecar other.rrsc 32" in p.stderr


def test_row_count_mismatch_names_sample(tiny_model, hf_sidecar, tmp_path):
    _, schema, recs = hf_sidecar
    import dataclasses
    bad = dataclasses.replace(recs[1], expert_ids=recs[1].expert_ids[:-2], start=0)
    sc = tmp_path / "short.rrsc"
    # written with the arrays only (validation would refuse it), like a foreign writer
    from routereplay import sidecar as s
    with open(sc, "wb") as f:
        f.write(s.encode_header(schema))
        for r in (recs[0], bad):
            f.write(s.encode_frame(s.KIND_RECORD, s.encode_record_payload(r, schema)))
    p, _ = _recompute(tiny_model, str(sc), tmp_path)
    assert p.returncode == 2
    # NOTE: the reader applies the writer's rules (issue 16 item 7), so the frame is refused
    # when read, naming the sample and the counts
    assert "sample 'hf1'" in p.stderr and "33 token ids for 30 routing rows" in p.stderr


def test_verify_with_megatron_matches_hf_reference(tiny_model, hf_sidecar, tmp_path):
    """`routereplay verify --trainer megatron` and `--trainer hf` on the same sidecar."""
    out = {}
    for trainer in ("megatron", "hf"):
        path = tmp_path / f"{trainer}.json"
        p = run_py(["-m", "routereplay.cli", "verify", hf_sidecar[0], "--model", tiny_model,
                    "--trainer", trainer, "--json", str(path), "--no-progress"], timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out[trainer] = json.loads(path.read_text())
    for t in out.values():
        assert t["replay"]["routing_agreement"] == 1.0 and t["replay"]["max_abs_dlogp"] < 1e-4
        assert len(t["replay"]["per_sample"]) == 3 and len(t["replay"]["per_layer"]) == 3
        # the engine's column order (HF: descending score) is replayed as is, so the
        # ordered agreement is 1.0 too (it read 0.33 when the recompute sorted its ids)
        assert t["replay"]["routing_agreement_ordered"] == 1.0
    assert out["hf"]["replay"]["max_abs_dlogp"] < 1e-5          # the records came from HF
