"""Rows never written and starts never given (issue 28 items 1 and 6).

Item 1: a run of rows that is expert 0 in every MoE layer (a capturer never bound, P/D
prefill rows not written, dense layers read as MoE) passes every id check on a top-1 model;
it is refused at each boundary where engine payloads become records (SGLang adapter, vLLM
record path, ``routereplay convert``), and genuine top-1 rows that use expert 0 are kept.
Item 6: a payload whose row count fits more than one start is refused without start_len.

Payloads: SGLang 0.5.23's own capturer output (tests/fixtures/sglang), reshaped top-1.
"""
import base64
import json
import os

import numpy as np
import pytest

from engine_patches.sglang.records import record_from_response
from engine_patches.vllm.records import record_from_parts
from routereplay import wire
from routereplay.errors import RecordError
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from tests.conftest import run_py

FIX = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang",
                                  "sglang_0.5.23_payloads.json")))
CASES = FIX["cases"]
CAUSES = "capturer was never bound.*prefill/decode disaggregation.*dense layers"


def _top1(truth):
    """A fixture's [T, 4, 2] rows (layer 0 dense) as a Llama-4-Maverick-like top-1 payload:
    each top-2 layer becomes two top-1 layers, tiled 4 times -> [T, 32, 1], 24 MoE layers."""
    t = np.asarray(truth, dtype=np.int32)
    return np.tile(t.reshape(t.shape[0], 8, 1), (1, 4, 1))


TOP1 = RoutingSchema(num_hidden_layers=32, top_k=1, num_experts=8,
                     moe_layer_ids=tuple(i for i in range(32) if i % 8 >= 2))


def _resp(name, rows, **extra):
    r = json.loads(json.dumps(CASES[name]["response"]))
    r["meta_info"]["routed_experts"] = wire.sglang_b64_int32(rows).decode()
    r.update(extra)
    return r


def test_rule_boundaries_and_spans():
    from routereplay.record import UNWRITTEN_MIN_CELLS, UNWRITTEN_MIN_TOKENS, check_written_rows
    rng = np.random.default_rng(0)
    for layers in (1, 3, 8, 16, 24, 48):
        need = max(UNWRITTEN_MIN_TOKENS, -(-UNWRITTEN_MIN_CELLS // layers))
        ids = rng.integers(1, 8, (2 * need + 20, layers, 1)).astype(np.uint8)
        ids[2:2 + need - 1] = 0                         # one row short of the rule: kept
        check_written_rows(ids, "s", start=5)
        a = need + 10
        ids[a:a + need] = 0                             # the rule: refused, span named
        with pytest.raises(RecordError, match=f"sample 's', tokens \\[{5 + a}, {5 + a + need}"
                                              f"\\): {need} consecutive rows .* all {layers} MoE"):
            check_written_rows(ids, "s", start=5)
    # 10 rows of expert 0 in all but one of 24 layers: genuine top-1 routing, kept
    ids = np.zeros((40, 24, 1), np.uint8)
    ids[:, 17] = 3
    check_written_rows(ids, "s")
    # many runs (every other row zero) cost one pass; the first long run is the one named
    ids = np.zeros((1 << 16, 24, 1), np.uint16)
    ids[::2] = 1
    ids[1000:1008] = 0
    with pytest.raises(RecordError, match="tokens \\[999, 1008\\)"):
        check_written_rows(ids, "s")


def test_sglang_adapter_refuses_unwritten_rows_and_keeps_expert_0():
    truth = _top1(CASES["basic"]["truth"])                # 6 prompt + 4 output, 9 rows
    rec = record_from_response(_resp("basic", truth), TOP1)
    np.testing.assert_array_equal(rec.expert_ids, truth[:, list(TOP1.moe_layer_ids)])
    assert (rec.expert_ids == 0).sum() > 20               # genuine expert-0 cells kept
    pd = truth.copy()
    pd[:6] = 0                                            # P/D: the prompt rows unwritten
    with pytest.raises(RecordError, match="sample 'req-basic', tokens \\[0, 6\\): 6 "
                                          "consecutive rows are expert 0 in all 24 MoE layers.*"
                                          + CAUSES):
        record_from_response(_resp("basic", pd), TOP1)
    with pytest.raises(RecordError, match="'req-basic', tokens \\[0, 9\\)"):   # never bound
        record_from_response(_resp("basic", np.zeros_like(truth)), TOP1)
    short = truth.copy()
    short[:3] = 0                                         # 3 rows: below the token minimum
    assert record_from_response(_resp("basic", short), TOP1).num_tokens == 9
    # a later turn (rows from position 7): the span is in token positions
    rows = np.zeros_like(_top1(CASES["turn2"]["truth"])[7:])
    with pytest.raises(RecordError, match="'req-turn2', tokens \\[7, 13\\)"):
        record_from_response(_resp("turn2", rows), TOP1, start_len=7)


def test_vllm_record_path_refuses_unwritten_rows():
    # Llama-4-Maverick-like: 48 decoder layers, MoE on the odd ones, 128 experts, top-1
    schema = RoutingSchema(num_hidden_layers=48, top_k=1, num_experts=128,
                           moe_layer_ids=tuple(range(1, 48, 2)))
    rng = np.random.default_rng(1)
    full = np.zeros((10 + 5 - 1, 48, 1), np.uint8)        # vLLM layout, dense layers zero
    full[:, 1::2] = rng.integers(0, 3, (14, 24, 1))       # expert 0 in about 1/3 of the cells
    parts = dict(prompt=list(range(10)), generated=[7, 8, 9, 10, 11])
    rec = record_from_parts("v", schema, routed_experts=full, **parts)
    assert rec.num_tokens == 14 and (rec.expert_ids == 0).any()
    pd = full.copy()
    pd[:10] = 0
    with pytest.raises(RecordError, match="sample 'v', tokens \\[0, 10\\).*" + CAUSES):
        record_from_parts("v", schema, routed_experts=pd, **parts)
    with pytest.raises(RecordError, match="sample 'v', tokens \\[4, 10\\)"):   # prompt start 4
        record_from_parts("v", schema, routed_experts=pd[4:], start=4, **parts)
    with pytest.raises(RecordError, match="sample 'v', tokens \\[0, 14\\)"):
        record_from_parts("v", schema, routed_experts=np.zeros_like(full), **parts)


def test_ambiguous_start_is_refused_not_guessed():
    schema = RoutingSchema.from_hf_config(FIX["config"])  # the fixture's own model, top-2
    truth = np.array(CASES["basic"]["truth"], np.int32)
    complete = record_from_response(CASES["basic"]["response"], schema)  # 9 rows: start 0
    assert complete.start == 0 and complete.num_tokens == 9
    with pytest.raises(RecordError, match="request 'req-basic': 6 routing rows for 6 prompt "
                                          "\\+ 4 output tokens .*start_len 3 with complete "
                                          "rows, or start_len 0 with a payload truncated by 3 "
                                          "rows.*pass start_len="):
        record_from_response(_resp("basic", truth[:6]), schema)
    # a later turn sent with routed_experts_start_len 7: refused unless the start is given
    with pytest.raises(RecordError, match="'req-turn2'.*start_len 7 with complete rows"):
        record_from_response(CASES["turn2"]["response"], schema)
    rec = record_from_response(CASES["turn2"]["response"], schema, start_len=7)
    np.testing.assert_array_equal(rec.expert_ids,
                                  np.array(CASES["turn2"]["truth"])[7:, 1:])
    stored = dict(CASES["turn2"]["response"], routed_experts_start_len=7)
    assert record_from_response(stored, schema).start == 7


def test_convert_cli_refuses_unwritten_rows_and_ambiguous_starts(tmp_path):
    truth = _top1(CASES["basic"]["truth"])
    pd = truth.copy()
    pd[:6] = 0
    layers = ",".join(map(str, TOP1.moe_layer_ids))
    schema_args = ["--num-experts", "8", "--top-k", "1", "--moe-layers", layers,
                   "--num-layers", "32"]
    src = tmp_path / "routes.txt"
    src.write_text(wire.sglang_b64_int32(truth).decode() + "\n"
                   + wire.sglang_b64_int32(pd).decode() + "\n")
    out = tmp_path / "s.rrsc"
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-b64", str(src), "--out",
                str(out)] + schema_args, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "sample 'routes-2', tokens [0, 6): 6 consecutive rows are expert 0" in p.stderr
    assert SidecarReader(str(out)).sample_ids() == ["routes-1"]      # the one before, kept
    # sglang-b64 lines with token counts: the stored start places the rows; without it
    # only the complete count is accepted
    turn2 = _top1(CASES["turn2"]["truth"])
    start_resp = _resp("turn2", turn2[7:])
    src.write_text(json.dumps({**start_resp, "routed_experts_start_len": 7}) + "\n"
                   + json.dumps(_resp("basic", truth)) + "\n"
                   + json.dumps(start_resp) + "\n")
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-b64", str(src), "--out",
                str(out)] + schema_args, timeout=120)
    assert p.returncode == 1, p.stderr
    assert ("sample 'req-turn2': 6 routing rows for 11 prompt + 3 output tokens (13 rows from "
            "position 0) and no routed_experts_start_len: start_len 7 with complete rows, or "
            "start_len 0 with a payload truncated by 7 rows") in p.stderr
    r = SidecarReader(str(out))
    assert r.sample_ids() == ["req-turn2", "req-basic"]
    assert r.read("req-turn2").start == 7 and r.read("req-basic").start == 0
    np.testing.assert_array_equal(r.read("req-turn2").expert_ids,
                                  turn2[7:, list(TOP1.moe_layer_ids)])
    # sglang-json (the adapter): the same, the line named
    src.write_text(json.dumps(_resp("basic", truth)) + "\n" + json.dumps(start_resp) + "\n")
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-json", str(src), "--out",
                str(tmp_path / "j.rrsc")] + schema_args, timeout=120)
    assert p.returncode == 1 and "routes.txt:2: request 'req-turn2': 6 routing rows" in p.stderr


def test_a_batch_buffer_never_filled_is_refused_by_from_batch():
    """verl-style batch tensors: a top-1 routed_experts buffer whose prompt rows were never
    filled (zeros: P/D prefill, an engine that did not return them) is refused naming the
    sample and span; the same batch filled with real routing reads."""
    from routereplay.source import InMemorySource
    schema = RoutingSchema(num_hidden_layers=24, moe_layer_ids=tuple(range(24)), top_k=1,
                           num_experts=128)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (2, 20, 24, 1)).astype(np.int16)
    mask = np.ones((2, 20), np.int64)
    InMemorySource.from_batch(ids, mask, ["a", "b"], schema)
    ids[1, :8] = 0                                   # sample b's first 8 rows never written
    with pytest.raises(RecordError, match=r"'b'.*\[0, 8\)"):
        InMemorySource.from_batch(ids, mask, ["a", "b"], schema)
