import numpy as np
import pytest

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord
from tests.conftest import random_record


def test_valid_record_passes(schema):
    random_record(schema, "a", 20, 0).validate(schema)


def test_out_of_range_names_sample_token_layer(schema):
    r = random_record(schema, "s7", 20, 1)
    r.expert_ids[5, 2, 1] = 16
    r.expert_ids[5, 2, 0] = 3 if r.expert_ids[5, 2, 1] != 3 else 4
    with pytest.raises(RecordError, match=r"sample 's7', token 5, layer 3: expert id 16"):
        r.validate(schema)


def test_duplicate_ids_and_all_zero_hint(schema):
    r = random_record(schema, "z", 10, 2)
    r.expert_ids[3, 0] = 0
    with pytest.raises(RecordError, match=r"token 3, layer 1: duplicate .*capturer was never bound"):
        r.validate(schema)


def test_row_count_must_match_tokens(schema):
    r = random_record(schema, "n", 10, 3)
    r.expert_ids = r.expert_ids[:-1]
    with pytest.raises(RecordError, match=r"sample 'n': 8 routing rows but 10 tokens"):
        r.validate(schema)


def test_logprob_count(schema):
    r = random_record(schema, "lp", 10, 4, prompt_len=4)
    r.logprobs = r.logprobs[:-1]
    with pytest.raises(RecordError, match="5 log-probs for 6 generated tokens"):
        r.validate(schema)


def test_wrong_layer_axis(schema):
    r = random_record(schema, "w", 10, 5)
    r.expert_ids = np.concatenate([np.zeros_like(r.expert_ids[:, :1]), r.expert_ids], 1)   # dense layer kept
    with pytest.raises(RecordError, match="does not match the schema"):
        r.validate(schema)


def test_vllm_weight_version_spans_map_to_rows():
    pytest.importorskip("vllm", reason="engine extra")
    from routereplay.weight_versions import output_spans_to_rows
    # P=3, G=4: rows are token positions 0..5; output token i comes from row P+i-1
    spans = output_spans_to_rows([("v1", 0, 2), ("v2", 2, 4)], prompt_len=3)
    assert [(s.version, s.start, s.end) for s in spans] == [("v1", 0, 4), ("v2", 4, 6)]


def test_vllm_ids_checked_before_narrowing(schema):
    pytest.importorskip("vllm", reason="engine extra")
    from types import SimpleNamespace
    from engine_patches.vllm.records import record_from_output
    from routereplay.errors import RecordError
    full = np.zeros((5, 4, 4), np.int32)          # vLLM layout [P+G-1, num_hidden_layers, k]
    full[:, 1:] = np.arange(4)
    full[2, 3, 1] = 258                           # would wrap to 2 in uint8
    out = SimpleNamespace(request_id="req-1", prompt_token_ids=[1, 2, 3], num_cached_tokens=0,
                          outputs=[SimpleNamespace(token_ids=[4, 5, 6], routed_experts=full,
                                                   logprobs=None, weight_versions=None)])
    with pytest.raises(RecordError, match=r"sample 'req-1', token 2, layer 3: expert id 258"):
        record_from_output(out, schema)
    out.outputs[0].routed_experts = None
    with pytest.raises(RecordError, match="--enable-return-routed-experts"):
        record_from_output(out, schema)


def test_merge_segments_earlier_wins_and_flags_disagreement(schema):
    from routereplay.record import RoutingRecord, WeightVersionSpan
    from routereplay.multi_turn import merge_segments
    from tests.conftest import random_record
    full = random_record(schema, "c", 31, 0).expert_ids                    # 30 rows
    a = RoutingRecord("t1", full[:12].copy(), weight_versions=[WeightVersionSpan("v1", 0, 12)])
    later = full[8:].copy()
    later[1] = later[1][:, ::-1]                                     # position 9 recomputed differently
    b = RoutingRecord("t2", later, start=8, weight_versions=[WeightVersionSpan("v2", 8, 30)],
                      prefix_cached=[(0, 8)])
    m = merge_segments([b, a], "conv", assume_extends=True)       # no token ids: stated
    np.testing.assert_array_equal(m.expert_ids, full)                       # earlier turn's rows kept
    assert m.recomputed == [(9, 10)]
    assert [(s.version, s.start, s.end) for s in m.weight_versions] == [("v1", 0, 12), ("v2", 12, 30)]
    assert m.prefix_cached == []                                     # t2's cached span lies in t1's rows
    # a turn contained in another: the one reaching furthest gives the tokens
    toks = np.arange(31, dtype=np.int32)
    long = RoutingRecord("L", full.copy(), token_ids=toks)
    short = RoutingRecord("S", full[:5].copy(), token_ids=toks[:6])
    assert len(merge_segments([long, short], "c2").token_ids) == 31
    other = RoutingRecord("X", full[:5].copy(), token_ids=toks[:6] + 1)
    with pytest.raises(RecordError, match="not a prefix"):
        merge_segments([long, other], "c3")
    gap = RoutingRecord("t3", full[20:].copy(), start=20)
    with pytest.raises(RecordError, match=r"sample 'conv'.*\[\(12, 20\)\]"):
        merge_segments([a, gap], "conv", assume_extends=True)
