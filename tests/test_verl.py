"""trainer_hooks.verl against verl 0.9.1's real code (installed by scripts/bootstrap.sh at
.venv/verl-0.9.1, ``--no-deps`` with the few packages its imported modules need).

The in-process tests build verl batches with verl's own ``DataProto``,
``left_right_2_no_padding`` and ``rearrange_micro_batches``; the ``trainer`` test runs
verl's own router replay and routereplay's on the tiny model in megatron-core
(tests/verl_checks.py, a subprocess) and compares expert choices, log-probs and gradients.
"""
import json
import logging
import os
import sys

import numpy as np
import pytest
import torch

from routereplay.errors import AlignmentError, ConfigError
from routereplay.memory_source import InMemorySource
from routereplay.schema import RoutingSchema
from tests.conftest import REPO, run_py

VERL_DIR = os.path.join(REPO, ".venv", "verl-0.9.1")
if os.path.isdir(VERL_DIR) and VERL_DIR not in sys.path:
    sys.path.append(VERL_DIR)
_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)
try:
    import verl.protocol  # noqa: F401
except ImportError as e:      # NOTE: fail, never skip: scripts/bootstrap.sh installs it
    raise ImportError("tests/test_verl.py needs verl 0.9.1: scripts/bootstrap.sh installs it at "
                      ".venv/verl-0.9.1 (users: pip install 'routereplay[verl]')") from e
# NOTE: importing verl calls logging.basicConfig(level=WARNING): give the session its
# root logger back
_root.setLevel(_level)
for _h in [h for h in _root.handlers if h not in _handlers]:
    _root.removeHandler(_h)

SCHEMA = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4, num_experts=16)


def verl_batch(seed=0, n_prompts=3, n=2, P=8, R=6):
    """A verl DataProto as the agent loop leaves it: n samples per uid, prompts left-padded,
    responses right-padded, routed_experts int16 [b, s, L_all, K] with the engine's N-1
    rows after the left padding (dense layer 0 zero, the last real row zero)."""
    from verl.protocol import DataProto
    rng = np.random.default_rng(seed)
    b, s = n_prompts * n, P + R
    am = np.zeros((b, s), np.int64)
    ids = np.zeros((b, s), np.int64)
    routed = np.zeros((b, s, 4, 4), np.int16)
    for j in range(b):
        p, r = int(rng.integers(2, P + 1)), int(rng.integers(1, R + 1))
        am[j, P - p:P + r] = 1
        ids[j, P - p:P + r] = rng.integers(3, 500, p + r)
        rows = np.argsort(rng.random((p + r - 1, 3, 16)), -1)[..., :4]
        routed[j, P - p:P + r - 1, 1:] = rows
    t = {k: torch.from_numpy(v) for k, v in dict(
        input_ids=ids, attention_mask=am, position_ids=np.clip(am.cumsum(-1) - 1, 0, None),
        responses=ids[:, P:], prompts=ids[:, :P], response_mask=am[:, P:],
        routed_experts=routed).items()}
    uids = np.array([f"u{i}" for i in range(n_prompts) for _ in range(n)], object)
    return DataProto.from_dict(tensors=t, non_tensors={"uid": uids})


def test_package_imports_no_verl_and_gates_versions():
    """Importing trainer_hooks.verl imports neither verl nor megatron; the gate names the
    version found and the supported range."""
    p = run_py(["-c", "import sys, trainer_hooks.verl as v; print(sorted(v.__all__)); "
                "print([k for k in sys.modules if k.startswith(('verl', 'megatron'))]); "
                "print(v.check_verl_version('0.9.1'))"], timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    face, loaded, ok = p.stdout.strip().splitlines()
    assert "VerlReplayer" in face and "sample_keys" in face
    assert loaded == "[]" and ok == "0.9.1"
    from trainer_hooks.verl import check_verl_version
    with pytest.raises(ImportError, match=r"verl 0\.8\.2 is not supported .*>=0\.9,<0\.10"):
        check_verl_version("0.8.2")


def test_sample_keys_follow_the_vllm_n_convention():
    """uid is verl's GRPO group id (shared by n samples): keys are <uid>/<i>, the keys the
    vLLM capture writes for the n completions of one request."""
    from trainer_hooks.verl import sample_keys
    assert sample_keys(["a", "a", "b", "a", "b"]) == ["a/0", "a/1", "b/0", "a/2", "b/1"]
    with pytest.raises(AlignmentError, match="sample #1: uid 'x/1'"):
        sample_keys(["a", "x/1"])
    src = open(os.path.join(REPO, "engine_patches", "vllm", "capture.py")).read()
    assert 'uid = f"{uid}/{state.request_index}"' in src


def test_from_batch_takes_verl_jagged_tensors():
    """InMemorySource.from_batch on the nested tensors of verl's left_right_2_no_padding:
    the same records as the padded DataProto; the engine's N-1 rows (align_r3 form) too;
    wrong row counts and other tensor subclasses are refused by name, not by torch."""
    from verl.workers.utils.padding import left_right_2_no_padding
    dp = verl_batch()
    keys = [f"s{j}" for j in range(len(dp))]
    td = left_right_2_no_padding(dp.to_tensordict())
    routed, ids = td["routed_experts"], td["input_ids"]
    assert routed.is_nested and routed.layout == torch.jagged
    pad = InMemorySource.from_batch(dp.batch["routed_experts"], dp.batch["attention_mask"],
                                    keys, SCHEMA, input_ids=dp.batch["input_ids"])
    jag = InMemorySource.from_batch(routed, None, keys, SCHEMA, input_ids=ids)
    short = torch.nested.as_nested_tensor([r[:-1] for r in routed.unbind()],
                                          layout=torch.jagged)
    eng = InMemorySource.from_batch(short, None, keys, SCHEMA, input_ids=ids)
    for k in keys:
        for s in (jag, eng):
            assert np.array_equal(pad.record(k).expert_ids, s.record(k).expert_ids)
            assert np.array_equal(pad.record(k).token_ids, s.record(k).token_ids)
    n0 = int(ids.offsets().diff()[0])
    bad = torch.nested.as_nested_tensor([r[:-2] for r in routed.unbind()], layout=torch.jagged)
    with pytest.raises(AlignmentError, match=rf"sample 's0': {n0 - 2} routing rows for "
                       rf"{n0} tokens"):
        InMemorySource.from_batch(bad, None, keys, SCHEMA, input_ids=ids)
    with pytest.raises(AlignmentError, match="attention_mask is a nested"):
        InMemorySource.from_batch(dp.batch["routed_experts"], ids, keys, SCHEMA)


def test_uid_group_ids_are_keyed_not_refused():
    """verl's uid is shared by the n samples of a prompt: as sample ids it is refused naming
    both rows and the convention; from_verl keys the batch <uid>/<i> on its own."""
    from routereplay.errors import RecordError
    dp = verl_batch(4, 3, 2)
    uids = list(dp.non_tensor_batch["uid"])
    with pytest.raises(RecordError, match=r"sample 'u0' given twice \(batch rows 0 and 1\).*"
                       r"f'\{uid\}/\{i\}' \(trainer_hooks.verl.sample_keys"):
        InMemorySource.from_batch(dp.batch["routed_experts"], dp.batch["attention_mask"],
                                  uids, SCHEMA)
    from trainer_hooks.verl import from_verl
    vb = from_verl(dp, SCHEMA)
    assert vb.sample_ids == ["u0/0", "u0/1", "u1/0", "u1/1", "u2/0", "u2/1"]
    first = int(dp.batch["attention_mask"][1].argmax())
    assert np.array_equal(vb.source.record("u0/1").expert_ids,
                          dp.batch["routed_experts"][1, first:first + vb.source.record(
                              "u0/1").expert_ids.shape[0], 1:].numpy())


def test_from_verl_maps_dynamic_micro_batches():
    """rearrange_micro_batches reorders samples: microbatch k is named by its index list,
    each slot checked against the batch row (length, uid); a micro-batch reordered after
    its index list was computed is refused naming the slot."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding
    from trainer_hooks.verl import from_verl, sample_keys
    dp = verl_batch(1, 4, 3)
    keys = sample_keys(dp.non_tensor_batch["uid"])
    td = left_right_2_no_padding(dp.to_tensordict())
    mbs, idx = rearrange_micro_batches(td, max_token_len=30)
    assert [i for k in idx for i in k] != list(range(12))          # reordered
    vb = from_verl(td, SCHEMA, mbs, idx)
    lens = td["input_ids"].offsets().diff().tolist()
    for k, mb in vb.microbatches.items():
        assert mb.sample_ids == tuple(keys[i] for i in idx[k])
        assert mb.layout.lengths == tuple(lens[i] for i in idx[k])
        assert mb.layout.packed
        assert all(np.array_equal(t, td["input_ids"][i].numpy())
                   for t, i in zip(mb.tokens, idx[k]))
    assert set(vb.source.sample_ids()) == set(keys)
    # verl's THD packing from its tf_config (here tp=2, FP8): verl_thd_layout per micro-batch
    from types import SimpleNamespace
    from routereplay.align import verl_thd_layout
    from trainer_hooks.verl.batch import thd_args_of
    args = thd_args_of(SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=1,
                                       fp8="e4m3"))
    assert args == dict(tp=2, cp=1, cp_layout="zigzag", fp8=True, min_local_rows=None)
    vb8 = from_verl(td, SCHEMA, mbs, idx, thd=args)
    assert all(vb8.microbatches[k].layout == verl_thd_layout([lens[i] for i in idx[k]], **args)
               for k in vb8.microbatches)
    assert vb8.microbatches[0].layout.cu_seqlens_padded[-1] % 256 == 0
    rev = tu.index_select_tensor_dict(mbs[0], torch.arange(len(idx[0]) - 1, -1, -1))
    with pytest.raises(AlignmentError, match="micro-batch 0 slot 0"):
        from_verl(td, SCHEMA, [rev] + list(mbs[1:]), idx)
    with pytest.raises(ConfigError, match="do not name each of the batch's 12 samples once"):
        from_verl(td, SCHEMA, mbs, [idx[0]] * len(idx))
    # a stored routereplay_id column wins over uid (it survives reorders and mini-batches)
    # and travels with its rows through verl's balance_batch reorder (DataProto.reorder)
    dp.non_tensor_batch["routereplay_id"] = np.array(keys, object)
    perm = [3, 0, 7, 1, 11, 2, 4, 10, 5, 9, 6, 8]
    dp.reorder(torch.tensor(perm))
    td2 = left_right_2_no_padding(dp.to_tensordict())
    vb2 = from_verl(td2, SCHEMA)
    assert vb2.sample_ids == [keys[i] for i in perm]
    assert all(np.array_equal(vb2.source.record(k).expert_ids, vb.source.record(k).expert_ids)
               for k in keys)


@pytest.mark.trainer
def test_verl_r3_r2_match_verl_on_megatron(tiny_model):
    """verl's own R3 (align_r3_router_replay_data, build_r3_replay_mask,
    set_router_replay_data, its RouterReplay patch) and trainer_hooks.verl on the same
    DataProto batches (6 prompts x n=3, mixed padding, dynamic batch size that reorders
    samples; full recompute; perturbed routers): the same experts in every router call
    (forward and recompute, fallback rows included), identical log-probs and gradients; R2
    (record in the old-log-prob pass, replay in the update cut into other micro-batches)
    identical too."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, VERL_DIR]))
    p = run_py(["tests/verl_checks.py", tiny_model], timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.split("RESULT ")[1])
    assert res["verl_patch_router_replay"] == "verl.utils.megatron.router_replay_patch"
    assert res["r3_reordered"]
    for tag, calls in (("r3_old_logprob", 15), ("r3_train", 30)):
        r = res[tag]
        assert (r["router_calls"], r["differing_calls"]) == (calls, 0), r
        assert r["max_abs_dlogp"] == 0.0 and r["max_abs_dgrad"] == 0.0, r
        assert r["verl_replayed_agreement"] == r["rr_replayed_agreement"] == 1.0
        assert 0.9 < r["replayed_fraction"] < 1.0          # last token of each sample: own
    assert res["r3_train"]["grads"] > 100
    assert res["r3_train"]["recompute_calls_same"] == [[15, 15], [15, 15]]
    assert res["own_routing_agreement"] < 0.05             # without replay: other experts
    assert "micro-batch 0 slot 0" in res["reorder_refused"]
    assert res["dynamic_cp_refused"].startswith("ConfigError: verl's dynamic context")
    assert res["padded_equals_jagged"]
    for tag, calls in (("sidecar_old_logprob", 15), ("sidecar_train", 30)):   # stream path
        r = res[tag]
        assert (r["router_calls"], r["differing_calls"]) == (calls, 0), r
        assert r["max_abs_dlogp"] == 0.0 and r["max_abs_dgrad"] == 0.0, r
    assert res["sidecar_bytes"] < res["tensor_bytes"] / 2
    # a sample without response tokens: verl leaves its rows native, routereplay replays
    # its prompt rows; no other row, response log-prob or gradient differs
    e = res["empty_response"]
    assert e["rows_differing"]["other_samples"] == 0 and e["rows_differing"]["empty_sample"] > 0
    assert e["max_abs_dlogp_other_samples"] == 0.0 and e["max_abs_dgrad"] == 0.0
    assert res["r2_without_keys_refused"].startswith("ConfigError: R2 replays a recording")
    r2 = res["r2_update"]
    assert r2["record_microbatches"] != r2["update_microbatches"]
    assert (r2["differing_calls"], r2["max_abs_dlogp"], r2["max_abs_dgrad"]) == (0, 0.0, 0.0)
    assert r2["router_calls"] == 18 and r2["replayed_fraction"] == 1.0


THD_CASES = [  # tp, cp, cp_layout, fp8, min_local_rows, sequence_parallel
    (1, 1, "zigzag", False, None, False),
    (2, 1, "zigzag", False, None, True),
    (1, 2, "zigzag", False, None, False),
    (2, 2, "zigzag", False, None, True),
    (1, 2, "zigzag", True, None, False),             # FP8: last sequence to align*128
    (2, 1, "zigzag", True, None, True),
    (1, 2, "contiguous", False, None, False),
    (2, 2, "contiguous", False, None, True),
    (1, 4, "contiguous", False, 40, False),          # min_local_rows pads the last sequence
    (1, 2, "contiguous", True, 64, False),
]


@pytest.mark.parametrize("tp,cp,cp_layout,fp8,min_rows,sp", THD_CASES)
def test_thd_layouts_match_verls_preprocess_thd_engine(monkeypatch, tp, cp, cp_layout, fp8,
                                                       min_rows, sp):
    """routereplay.align.verl_thd_layout + token_map put every router row of every CP/SP
    rank at the token position verl's own preprocess_thd_engine puts it (its zigzag and
    contiguous CP layouts, per-sequence alignment tp*cp*(2 if zigzag), FP8 padding of the
    last sequence, min_local_rows), and give verl's cu_seqlens_padded. verl's function runs
    as it is; its parallel-state reads and PackedSeqParams (megatron-core 0.16 has no
    cp_partition_mode) are stand-ins here."""
    import types
    from verl.models.mcore import util
    from routereplay import align
    lengths = [5, 17, 9, 1, 12]
    ids = torch.nested.as_nested_tensor(
        [torch.arange(n) + 1000 * j + 1 for j, n in enumerate(lengths)], layout=torch.jagged)
    monkeypatch.setattr(util, "PackedSeqParams", lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setattr(util, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True)
    lay = align.verl_thd_layout(lengths, tp=tp, cp=cp, cp_layout=cp_layout, fp8=fp8,
                                min_local_rows=min_rows)
    for r in range(cp):
        monkeypatch.setattr(util, "mpu", types.SimpleNamespace(
            get_tensor_model_parallel_world_size=lambda: tp,
            get_context_parallel_world_size=lambda: cp, get_context_parallel_rank=lambda: r))
        rows, psp, _ = util.preprocess_thd_engine(ids, pre_process=True, use_fp8_padding=fp8,
                                                  min_local_rows=min_rows, cp_layout=cp_layout)
        assert tuple(psp.cu_seqlens_q_padded.tolist()) == lay.cu_seqlens_padded
        rows = rows[0].numpy()
        for t in range(tp if sp else 1):
            # sequence parallel: megatron's scatter_to_sequence_parallel_region splits dim 0
            verl_rows = np.split(rows, tp)[t] if sp else rows
            tm = align.token_map(lay, align.Shard(cp_size=cp, cp_rank=r, tp_size=tp,
                                                  tp_rank=t, sequence_parallel=sp,
                                                  cp_layout=cp_layout))
            ours = np.where(tm.sample >= 0, tm.sample * 1000 + tm.position + 1, 0)
            assert np.array_equal(ours, verl_rows), (r, t, ours.tolist(), verl_rows.tolist())


def _verl_thd_rows(monkeypatch, lengths, tp, cp, r, *, local_cp_size=None, **kw):
    """verl's own preprocess_thd_engine on sample j's tokens 1000*j + position + 1 for CP
    rank r: (this rank's rows, cu_seqlens_padded). Its parallel-state reads are stand-ins."""
    import types
    from verl.models.mcore import util
    ids = torch.nested.as_nested_tensor(
        [torch.arange(n) + 1000 * j + 1 for j, n in enumerate(lengths)], layout=torch.jagged)
    monkeypatch.setattr(util, "PackedSeqParams", lambda **a: types.SimpleNamespace(**a))
    monkeypatch.setattr(util, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True)
    monkeypatch.setattr(util, "mpu", types.SimpleNamespace(
        get_tensor_model_parallel_world_size=lambda: tp,
        get_context_parallel_world_size=lambda: cp, get_context_parallel_rank=lambda: r,
        get_dynamic_data_context_parallel_groups=lambda group_size: ("dcp", group_size)))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: r)
    rows, psp, _ = util.preprocess_thd_engine(ids, pre_process=True,
                                              local_cp_size=local_cp_size, **kw)
    return rows[0].numpy(), tuple(psp.cu_seqlens_q_padded.tolist())


def _ours(lay, shard):
    from routereplay import align
    tm = align.token_map(lay, shard)
    return np.where(tm.sample >= 0, tm.sample * 1000 + tm.position + 1, 0)


def test_dynamic_cp_size_per_micro_batch_matches_verl(monkeypatch):
    """verl's dynamic CP (each micro-batch its own local_cp_size, rank in its dynamic
    group): thd_args_of(tf_config, local_cp_size) + token_map give each micro-batch's rows
    as verl's preprocess_thd_engine does, zigzag and contiguous."""
    from types import SimpleNamespace
    from routereplay import align
    from trainer_hooks.verl.batch import thd_args_of
    for variant in (None, "dsv4_hybrid"):
        cfg = SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=4, fp8=None,
                              experimental_attention_variant=variant, csa_window_size=8)
        for lengths, local in (([5, 17, 9], 2), ([30, 3, 12, 7], 4), ([11], 1)):
            args = thd_args_of(cfg, SimpleNamespace(use_fused_kernels=True), local)
            assert args["cp"] == local
            lay = align.verl_thd_layout(lengths, **args)
            for r in range(local):
                rows, cu = _verl_thd_rows(monkeypatch, lengths, 1, 4, r, local_cp_size=local,
                                          min_local_rows=args["min_local_rows"],
                                          cp_layout=args["cp_layout"])
                assert cu == lay.cu_seqlens_padded
                shard = align.Shard(cp_size=local, cp_rank=r, cp_layout=args["cp_layout"])
                assert np.array_equal(_ours(lay, shard), rows), (variant, lengths, r)


def test_dsv4_min_local_rows_follow_the_models_forward(monkeypatch):
    """dsv4_hybrid, contiguous CP=4, csa_window_size=40: verl's plain forward
    (model_forward.py) packs without min_local_rows, its fused forward with; verl's replay
    (set_router_replay_data) always with. thd_args_of follows the forward that runs; verl's
    replay buffer with the plain forward has other rows than the model's (measured here)."""
    from types import SimpleNamespace
    from routereplay import align
    from trainer_hooks.verl.batch import thd_args_of
    lengths = [5, 17, 9, 1, 12]
    cfg = SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=4, fp8=None,
                          experimental_attention_variant="dsv4_hybrid", csa_window_size=40)
    plain, fused = thd_args_of(cfg), thd_args_of(cfg, SimpleNamespace(use_fused_kernels=True))
    assert (plain["min_local_rows"], fused["min_local_rows"]) == (None, 40)
    for r in range(4):
        sh = align.Shard(cp_size=4, cp_rank=r, cp_layout="contiguous")
        model, _ = _verl_thd_rows(monkeypatch, lengths, 1, 4, r, cp_layout="contiguous")
        replay, _ = _verl_thd_rows(monkeypatch, lengths, 1, 4, r, cp_layout="contiguous",
                                   min_local_rows=40)
        assert np.array_equal(_ours(align.verl_thd_layout(lengths, **plain), sh), model)
        assert np.array_equal(_ours(align.verl_thd_layout(lengths, **fused), sh), replay)
        # verl's replay hands the rank 40 rows for the model's 14; rank 0's first 14 are the
        # model's, the other ranks' are other tokens (or padding)
        assert (model.shape[0], replay.shape[0]) == (14, 40)
        assert (int((model != replay[:14]).sum()) > 0) == (r > 0), (r, model, replay)


@pytest.mark.trainer
def test_verl_native_example_prints_routing_agreement(tiny_model, tmp_path):
    """examples/verl_native.py on a rollout folder in examples/rollout_worker.py's format
    (here written from a synthetic verl-shaped batch): verl's data path, dynamic micro-
    batches, routing agreement 1.0 in the old-log-prob pass and the update."""
    rng = np.random.default_rng(0)
    b, P, R = 6, 10, 8
    am = np.zeros((b, P + R), np.int64)
    ids, rm = np.zeros_like(am), np.zeros_like(am)
    routed = np.zeros((b, P + R, 4, 4), np.int16)
    for j in range(b):
        p, r = int(rng.integers(2, P + 1)), int(rng.integers(1, R + 1))
        am[j, P - p:P + r] = 1
        ids[j, P - p:P + r] = rng.integers(3, 500, p + r)
        rm[j, P:P + r] = 1
        routed[j, P - p:P + r - 1, 1:] = np.argsort(rng.random((p + r - 1, 3, 16)), -1)[..., :4]
    np.savez(tmp_path / "batch-policy-0.npz", input_ids=ids, attention_mask=am,
             response_mask=rm, routed_experts=routed, uids=np.array([f"s{i}" for i in range(b)]),
             rollout_log_probs=np.zeros((b, P + R), np.float32))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, VERL_DIR]))
    p = run_py([os.path.join(REPO, "examples", "verl_native.py"), "--model", tiny_model,
                "--rollout", str(tmp_path), "--max-token-len", "40"], timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    (s,) = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(s["microbatches"]) > 1
    assert s["routing_agreement/old_logprob"] == s["routing_agreement/update"] == 1.0
    assert 0.9 < s["old_logprob/replayed_fraction"] == s["update/replayed_fraction"] < 1.0


def test_from_verl_on_the_padded_dataproto():
    """The padded DataProto as verl's trainer holds it (before left_right_2_no_padding):
    bshd as the rows are (mixed padding) or packed; the same records as the jagged form."""
    from trainer_hooks.verl import from_verl, sample_keys
    dp = verl_batch(2)
    keys = sample_keys(dp.non_tensor_batch["uid"])
    bshd = from_verl(dp, SCHEMA, packed=False)
    (mb,) = bshd.microbatches.values()
    assert mb.layout.padding == "mixed" and mb.sample_ids == tuple(keys)
    thd = from_verl(dp, SCHEMA, multiple=4)
    (mb4,) = thd.microbatches.values()
    assert mb4.layout.packed and all(
        (b - a) % 4 == 0 for a, b in zip(mb4.layout.cu_seqlens_padded,
                                         mb4.layout.cu_seqlens_padded[1:]))
    assert all(np.array_equal(bshd.source.record(k).expert_ids, thd.source.record(k).expert_ids)
               for k in keys)
    with pytest.raises(ConfigError, match="no 'routed_experts'"):
        from_verl(_without(dp, "routed_experts"), SCHEMA)



def test_explicit_layouts_of_padded_rows_keep_the_token_check():
    """thd= / layouts= on padded micro-batches still give each Microbatch its tokens (the
    real tokens of each row, in packing order); a routereplay_id column naming one key
    twice is refused with the key and its count."""
    from verl.protocol import DataProto
    from trainer_hooks.verl import KEY_FIELD, from_verl
    dp = verl_batch(3)
    am, ids = dp.batch["attention_mask"].numpy(), dp.batch["input_ids"].numpy()
    real = [row[m != 0] for row, m in zip(ids, am)]
    for kw in (dict(thd=dict(tp=2)),
               dict(layouts=[from_verl(dp, SCHEMA, multiple=4).microbatches[0].layout])):
        (mb,) = from_verl(dp, SCHEMA, **kw).microbatches.values()
        assert mb.layout.packed and mb.tokens is not None
        assert all(np.array_equal(t, r) for t, r in zip(mb.tokens, real))
        (mb,) = from_verl(dp, SCHEMA, check_tokens=False, **kw).microbatches.values()
        assert mb.tokens is None
    keys = np.array([f"k{j}" for j in range(len(real))], object)
    keys[4] = "k1"
    dup = DataProto.from_dict(tensors=dict(dp.batch.items()),
                              non_tensors=dict(dp.non_tensor_batch, **{KEY_FIELD: keys}))
    with pytest.raises(AlignmentError, match="sample key 'k1' is given to 2 samples"):
        from_verl(dup, SCHEMA)

def _without(dp, key):
    from verl.protocol import DataProto
    return DataProto.from_dict(tensors={k: v for k, v in dp.batch.items() if k != key},
                               non_tensors=dict(dp.non_tensor_batch))


def test_docs_glue_is_counted_and_names_exist():
    """docs/verl.md's glue: every numbered line is counted in its heading (tensor path <= 10,
    sidecar path <= 15), and every import in it resolves to a real name."""
    import re
    text = open(os.path.join(REPO, "docs", "verl.md")).read()
    counts = {}
    for path, limit in (("tensor", 10), ("sidecar", 15)):
        sec = re.search(rf"## The {path} path[^\n]*: (\d+) lines\n(.*?)\n## ", text, re.S)
        assert sec, path
        nums = set()
        for tag in re.findall(r"# ([\d, -]+)$", sec.group(2), re.M):
            for part in tag.split(","):
                a, _, b = part.strip().partition("-")
                nums.update(range(int(a), int(b or a) + 1))
        counts[path] = int(sec.group(1))
        assert max(nums) == counts[path] <= limit, (path, sorted(nums))
        for imp in re.findall(r"^(from \S+ import \S+)", sec.group(2), re.M):
            exec(imp, {})
    assert counts == {"tensor": 7, "sidecar": 14}
