"""Engine routing the request or the schema contradicts (issue 16 items 3, 5, 6): the SGLang
fused shared-expert width is stated, never guessed; routing on a layer the schema calls
dense is reported in every path; a row-count mismatch is named as one; hints only where they
apply; a multi-turn merge keeps the earlier turn's rows whatever the list order."""
import base64
import json

import numpy as np
import pytest

from engine_patches.sglang.records import record_from_response
from engine_patches.vllm.records import record_from_parts
from routereplay import wire
from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, checked_moe_ids
from routereplay.schema import RoutingSchema
from tests.conftest import run_py

# top-6 of 16 experts in 3 MoE layers, one fused shared expert (id 16 = num_experts)
FUSED = RoutingSchema(num_hidden_layers=3, moe_layer_ids=(0, 1, 2), top_k=6, num_experts=16)
# layer 0 dense, 8 experts, top-2
DENSE0 = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=2, num_experts=8)


def _routed(schema, rows, seed=0, dense_zero=True):
    """Valid engine rows [rows, num_hidden_layers, top_k] (dense layers zero)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, schema.num_hidden_layers, schema.num_experts)), -1)
    ids = ids[..., :schema.top_k].astype(np.int32)
    if dense_zero:
        ids[:, list(schema.dense_layer_ids())] = 0
    return ids


def _response(arr, prompt, gen, rid="req-x"):
    return {"text": "", "output_ids": list(range(100, 100 + gen)),
            "meta_info": {"id": rid, "prompt_tokens": prompt, "completion_tokens": gen,
                          "routed_experts": wire.sglang_b64_int32(arr).decode()}}


@pytest.mark.parametrize("prompt", [8, 9])            # 12 and 13 rows
def test_fused_shared_expert_width_is_stated_never_guessed(prompt):
    rows = prompt + 5 - 1
    routed = _routed(FUSED, rows)
    wide = np.concatenate([routed, np.full((rows, 3, 1), 16, np.int32)], axis=2)   # [rows, 3, 7]
    resp = _response(wide, prompt, 5)
    # 12 x 3 x 7 ints also divide into 14 rows of width 6: trying width 6 first refused it
    rec = record_from_response(resp, FUSED, num_fused_shared_experts=1)
    assert rec.start == 0 and np.array_equal(rec.expert_ids, routed)
    rec = record_from_response(resp, FUSED, num_fused_shared_experts=1, start_len=0)
    assert np.array_equal(rec.expert_ids, routed)
    # the width not stated: a row-count mismatch when the start is known, with the fix
    with pytest.raises(RecordError, match="req-x.*row-count mismatch.*pass "
                                          "num_fused_shared_experts=1"):
        record_from_response(resp, FUSED, start_len=0)
    # ... and without the start, the byte count fits no row count the tokens allow
    with pytest.raises(RecordError, match="req-x.*num_fused_shared_experts(=| in \\[)1"):
        record_from_response(resp, FUSED)


def test_convert_takes_the_fused_shared_expert_count(tmp_path):
    routed = _routed(FUSED, 12, seed=1)
    wide = np.concatenate([routed, np.full((12, 3, 1), -1, np.int32)], axis=2)
    src = tmp_path / "routes.txt"
    src.write_text(json.dumps(_response(wide, 8, 5, "req-f")) + "\n")
    out = tmp_path / "s.rrsc"
    args = ["-m", "routereplay.cli", "convert", "--from", "sglang-b64", str(src), "--out",
            str(out), "--num-experts", "16", "--top-k", "6", "--num-layers", "3"]
    p = run_py(args + ["--num-fused-shared-experts", "1"], timeout=120)
    assert p.returncode == 0, p.stderr
    from routereplay.sidecar import SidecarReader
    assert np.array_equal(SidecarReader(str(out)).read("req-f").expert_ids, routed)
    src2 = tmp_path / "responses.jsonl"
    src2.write_text(json.dumps(_response(wide, 8, 5, "req-g")) + "\n")
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 0,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_layer_freq": 1}))
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-json", str(src2), "--out",
                str(tmp_path / "j.rrsc"), "--config", str(cfg), "--num-fused-shared-experts", "1"],
               timeout=120)
    assert p.returncode == 0, p.stderr
    p = run_py(args[:-1] + ["3", "--num-fused-shared-experts", "-1"], timeout=120)
    assert p.returncode == 2 and "--num-fused-shared-experts" in p.stderr


def test_routing_on_a_dense_layer_is_reported_in_every_path(tmp_path):
    full = _routed(DENSE0, 9)
    full[4, 0] = [3, 5]               # the engine routed token 4 on layer 0, "dense" per schema
    want = r"token 4, layer 0: the engine routed this token to experts \[3, 5\] on a layer " \
           "the schema calls dense"
    with pytest.raises(RecordError, match="sample 'v'.*" + want):                  # vLLM
        record_from_parts("v", DENSE0, prompt=list(range(6)), generated=[1, 2, 3, 4],
                          routed_experts=full.astype(np.uint8))
    with pytest.raises(RecordError, match="sample 'req-x'.*" + want):              # SGLang
        record_from_response(_response(full, 6, 4), DENSE0)
    np.save(tmp_path / "s0.npy", full.astype(np.uint8))                            # convert
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "vllm", str(tmp_path / "s0.npy"),
                "--out", str(tmp_path / "o.rrsc"), "--num-experts", "8", "--top-k", "2",
                "--moe-layers", "1-3", "--num-layers", "4"], timeout=120)
    assert p.returncode != 0 and "dense" in p.stderr and "token 4, layer 0" in p.stderr


def test_adapter_errors_are_not_wrapped_twice_and_say_what_failed():
    full = _routed(DENSE0, 9)
    bad = full.copy()
    bad[5, 2, 1] = 9
    with pytest.raises(RecordError) as e:
        record_from_response(_response(bad, 6, 4), DENSE0)
    assert "malformed" not in str(e.value) and "RecordError" not in str(e.value)
    assert "token 5, layer 2: expert id 9 outside [0, 8)" in str(e.value)
    # too many rows with the start unknown: a row-count mismatch, not a bad start_len
    with pytest.raises(RecordError, match="row-count mismatch: 9 rows for 5 prompt \\+ 4 output") as e:
        record_from_response(_response(full, 5, 4), DENSE0)
    assert "start_len -1" not in str(e.value)


def test_eplb_replica_hint_only_where_it_applies():
    full = _routed(DENSE0, 6).astype(np.uint8)
    slot = full.copy()
    slot[2, 3, 0] = 9                                           # vLLM: a physical slot id
    with pytest.raises(RecordError, match="physical EPLB replica slot"):
        checked_moe_ids(slot, DENSE0, "a")
    wrapped = full.copy()
    wrapped[2, 3, 0] = 255                                      # a -1 sentinel stored as uint8
    with pytest.raises(RecordError, match="-1 sentinel") as e:
        checked_moe_ids(wrapped, DENSE0, "a")
    assert "EPLB" not in str(e.value)
    shared = _routed(DENSE0, 9)
    shared[3, 1, 1] = 8                                         # SGLang: a shared-expert id
    with pytest.raises(RecordError, match="fused shared-expert id") as e:
        record_from_response(_response(shared, 6, 4), DENSE0)
    assert "EPLB" not in str(e.value)


def test_multi_turn_merge_keeps_the_earlier_turn_in_any_order():
    from routereplay.multi_turn import merge_segments
    s = DENSE0
    full = _routed(s, 20, seed=3)[:, 1:].astype(np.uint8)
    t1 = RoutingRecord("turn1", full[:10].copy())
    resent = full.copy()                          # turn 2 resent in full after an update:
    resent[3:6] = resent[3:6, :, ::-1]            # rows 3-5 recomputed differently
    resent[4, 0] = [7, 6]
    t2 = RoutingRecord("turn2", resent)
    for order in ([t1, t2], [t2, t1]):
        m = merge_segments(order, "conv", assume_extends=True)   # no token ids: stated
        assert np.array_equal(m.expert_ids[:10], full[:10])       # turn 1's rows, never dropped
        assert np.array_equal(m.expert_ids[10:], resent[10:])
        assert m.recomputed == [(4, 5)] or m.recomputed == [(3, 6)]


def test_sample_keys_follow_the_caller_never_renamed():
    from engine_patches.vllm.records import sample_key
    assert sample_key("uid-7") == sample_key("uid-7", 0) == "uid-7"
    assert sample_key("uid-7", 2) == "uid-7@2"
    assert sample_key("uid-7", aborted=True) == "uid-7!aborted"
    assert sample_key("uid-7", 1, aborted=True) == "uid-7@1!aborted"
    for bad in (-1, True, "2"):
        with pytest.raises(RecordError, match="uid-7.*attempt must be an integer"):
            sample_key("uid-7", bad)
