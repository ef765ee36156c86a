"""Prefill/decode disaggregation (issue 28 item 5): a request's prefill leg and decode leg,
recorded by two engines under leg keys, merge into the request's record; rows the decode
engine never computed are never taken from it nor listed as recomputed, and a leg is never
used alone as a whole request."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from tests.conftest import run_py

SCHEMA = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4, num_experts=16)
P, N = 12, 30                       # prompt tokens, sequence tokens: rows for positions 0..28


def _rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n, SCHEMA.num_moe_layers, SCHEMA.num_experts)), axis=-1)
    return ids[..., :SCHEMA.top_k].astype(SCHEMA.id_dtype)


def _legs(engine: str, decode_from: int, seed: int = 0) -> tuple[dict, RoutingRecord, RoutingRecord]:
    """The request's true routing and its two legs as the engines record them: the prefill
    leg (prompt + its sampled first token, rows 0..P-1) and the decode leg asked from
    ``decode_from``, whose rows before the engine's first computed row hold another
    request's routing (a reused buffer: valid-looking, wrong)."""
    from routereplay.disaggregation import decode_start, leg_key
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 500, N).astype(np.int32)
    truth = _rows(N - 1, seed)
    first = decode_start(P, engine)
    stale = _rows(N - 1, seed + 100)
    dec_rows = np.concatenate([stale[:first], truth[first:]])
    p_toks = np.concatenate([toks[:P], [int(toks[P]) + 1]]).astype(np.int32)   # vLLM's decode
    prefill = RoutingRecord(leg_key("u7", "prefill"), truth[:P].copy(), prompt_len=P,   # re-samples
                            token_ids=p_toks, logprobs=np.zeros(1, np.float32),
                            weight_versions=[WeightVersionSpan("v3", 0, P + 1)],
                            prefix_cached=[(0, 4)], engine=engine)
    decode = RoutingRecord(leg_key("u7", "decode"), dec_rows[decode_from:].copy(),
                           start=decode_from, prompt_len=P, token_ids=toks,
                           logprobs=-rng.random(N - P).astype(np.float32),
                           weight_versions=[WeightVersionSpan("v3", 0, N)], engine=engine)
    for r in (prefill, decode):
        r.validate(SCHEMA)
    return dict(toks=toks, truth=truth, first=first), prefill, decode


@pytest.mark.parametrize("engine,first", [("vllm 0.32.0", P - 1), ("sglang 0.5.23", P)])
def test_decode_leg_rows_are_taken_from_its_first_computed_row(engine, first):
    from routereplay.disaggregation import decode_start, merge_pd_legs
    assert decode_start(P, engine) == first
    for decode_from in (first, 0, first - 1):         # the recipe's start, and earlier ones
        c, prefill, decode = _legs(engine, decode_from)
        m = merge_pd_legs(prefill, decode)
        assert m.sample_id == "u7" and (m.start, m.prompt_len, m.engine) == (0, P, engine)
        np.testing.assert_array_equal(m.expert_ids, c["truth"])
        assert m.recomputed == []                 # never-computed rows neither taken nor listed
        assert m.token_ids.tolist() == c["toks"].tolist()
        np.testing.assert_array_equal(m.logprobs, decode.logprobs)
        assert [(s.version, s.start, s.end) for s in m.weight_versions] == \
            [("v3", 0, first), ("v3", first, N - 1)]
        assert m.prefix_cached == [(0, 4)]
        m.validate(SCHEMA)


def test_a_row_both_legs_computed_is_the_decode_legs_and_flagged_when_it_differs():
    from routereplay.disaggregation import merge_pd_legs
    c, prefill, decode = _legs("vllm 0.32.0", P - 1)
    decode.expert_ids[0, 2] = decode.expert_ids[0, 2, ::-1]     # row P-1 recomputed, other order
    m = merge_pd_legs(prefill, decode)
    np.testing.assert_array_equal(m.expert_ids[P - 1], decode.expert_ids[0])   # it sampled token P
    assert m.recomputed == [(P - 1, P)]
    assert merge_pd_legs(prefill, decode, compare="set").recomputed == []


def test_legs_are_refused_alone_or_mismatched():
    from routereplay.disaggregation import check_request_key, merge_pd_legs, split_leg_key
    from routereplay.multi_turn import merge_segments
    c, prefill, decode = _legs("vllm 0.32.0", 0)
    # a decode leg used as a whole request: its rows 0..P-2 are another request's
    with pytest.raises(RecordError, match=r"'u7#decode' is the decode leg of P/D request 'u7'.*"
                                          "merge_pd_legs"):
        merge_segments([decode], "u7")
    with pytest.raises(RecordError, match=r"'u7#decode' is the decode leg of P/D request 'u7'.*"
                                          "never computed"):
        check_request_key("u7#decode")
    with pytest.raises(RecordError, match=r"prefill leg of P/D request 'u7@2'"):
        check_request_key("u7#prefill@2")
    check_request_key("u7")
    check_request_key("u7#decoder")
    assert split_leg_key("u7#decode@1!aborted") == ("u7@1!aborted", "decode")
    assert split_leg_key("a#b#decode") == ("a#b", "decode")
    with pytest.raises(RecordError, match="swapped"):
        merge_pd_legs(decode, prefill)
    other = RoutingRecord("u8#decode", decode.expert_ids, prompt_len=P, token_ids=decode.token_ids,
                          engine=decode.engine)
    with pytest.raises(RecordError, match=r"legs of two requests \('u7', 'u8'\)"):
        merge_pd_legs(prefill, other)
    bare = RoutingRecord("req", decode.expert_ids, prompt_len=P, engine=decode.engine)
    with pytest.raises(RecordError, match="pass sample_id="):
        merge_pd_legs(RoutingRecord("p", prefill.expert_ids, prompt_len=P), bare)
    late = RoutingRecord("u7#decode", c["truth"][P + 2:].copy(), start=P + 2, prompt_len=P,
                         token_ids=c["toks"], engine="sglang 0.5.23")     # asked past the prompt
    with pytest.raises(RecordError, match=r"sample 'u7': token positions \[\(12, 14\)\] have no "
                                          r"routing.*decode_start\(prompt_len, engine\) = 12"):
        merge_pd_legs(prefill, late)
    short = RoutingRecord("u7#decode", decode.expert_ids, prompt_len=P - 1, engine=decode.engine)
    with pytest.raises(RecordError, match=r"prompt_len of the prefill leg \(12\) and the decode "
                                          r"leg \(11\)"):
        merge_pd_legs(prefill, short)
    toks = c["toks"].copy()
    toks[5] += 1
    with pytest.raises(RecordError, match="prompts differ from token position 5"):
        merge_pd_legs(prefill, RoutingRecord("u7#decode", decode.expert_ids, prompt_len=P,
                                             token_ids=toks, engine=decode.engine))
    with pytest.raises(RecordError, match=r"engine 'tokenspeed'.*first_row="):
        merge_pd_legs(prefill, RoutingRecord("u7#decode", decode.expert_ids, prompt_len=P,
                                             engine="tokenspeed"))
    m = merge_pd_legs(prefill, RoutingRecord("u7#decode", decode.expert_ids, prompt_len=P,
                                             engine="tokenspeed"), first_row=P - 1)
    np.testing.assert_array_equal(m.expert_ids, c["truth"])


ENGINE = r"""
import sys, numpy as np
from routereplay.sidecar import SidecarWriter
from tests.test_pd_legs import SCHEMA, _legs
leg, path = sys.argv[1], sys.argv[2]
_, prefill, decode = _legs("vllm 0.32.0", 0)
w = SidecarWriter(path, SCHEMA)
w.write(prefill if leg == "prefill" else decode)
w.close()
"""


def test_legs_written_by_two_engine_processes_merge_into_the_request(tmp_path):
    from routereplay.disaggregation import merge_pd_legs
    from routereplay.sidecar import open_sidecar
    from routereplay.source import InMemorySource
    paths = {leg: str(tmp_path / f"{leg}-engine" / "step-0.rrsc") for leg in ("prefill", "decode")}
    for leg, p in paths.items():                  # each engine writes its own stream
        (tmp_path / f"{leg}-engine").mkdir()
        res = run_py(["-c", ENGINE, leg, p], timeout=120)
        assert res.returncode == 0, res.stderr
    reader = open_sidecar(list(paths.values()))
    assert sorted(reader.sample_ids()) == ["u7#decode", "u7#prefill"]
    merged = merge_pd_legs(reader.read("u7#prefill"), reader.read("u7#decode"))
    src = InMemorySource([merged], SCHEMA)
    (ids, first), = src.fetch("u7", [0, 1, 2], [(0, N - 1)])
    c, _, _ = _legs("vllm 0.32.0", 0)
    assert first == 0
    np.testing.assert_array_equal(ids, c["truth"])


def test_the_merge_keeps_the_decode_legs_sampling_and_never_allocates_a_gap():
    """(Attacker review) merge_pd_legs dropped the decode leg's SamplingInfo (verify then
    compared its log-probs as a full-vocabulary log-softmax); merges allocated rows for the
    whole position span before naming a gap (turns at 0 and 2^28: 1.8 GB)."""
    import dataclasses
    import time

    from routereplay.disaggregation import merge_pd_legs
    from routereplay.multi_turn import merge_segments
    from routereplay.record import SamplingInfo
    c, prefill, decode = _legs("vllm 0.32.0", P - 1)
    smp = SamplingInfo("processed_logprobs", temperature=0.7, top_p=0.9)
    assert merge_pd_legs(prefill, dataclasses.replace(decode, sampling=smp)).sampling == smp
    a = RoutingRecord("t0", _rows(10, 1))
    far = RoutingRecord("t1", _rows(10, 2), start=1 << 28)
    t0 = time.perf_counter()
    with pytest.raises(RecordError, match=r"token positions \[\(10, 268435456\)\] have no "):
        merge_segments([a, far], "conv", assume_extends=True)
    assert time.perf_counter() - t0 < 1.0
