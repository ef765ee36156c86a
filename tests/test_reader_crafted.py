"""Crafted frames the reader must refuse where the writer would (issue 27 item 8).

A record whose weight-version, ``recomputed`` or ``prefix_cached`` spans run beyond its
sequence (``RoutingRecord.validate`` refuses it) is never returned, in formats 2 and 3,
found by a scan or through the index. (Item 11, ``xl-ans`` model frames nested in other
frames, went with the codec in 0.3.0: tests/test_legacy_streams.py.)
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from routereplay.sidecar.layout import KIND_INDEX, encode_frame, encode_index, encode_trailer
from tests import crafted

SCHEMA = RoutingSchema(4, (1, 2, 3), 4, 16)
FAR = 1 << 62


def _with_index(data: bytes, entries: list[tuple[str, int]], version: int) -> bytes:
    """``data`` (a stream without index) closed with an index of ``entries`` and a trailer."""
    idx = encode_index(entries) if version == 3 else \
        json.dumps({"records": [list(e) for e in entries]}).encode()
    return data + encode_frame(KIND_INDEX, idx) + encode_trailer(len(data))


# --------------------------------------------------------------------------- item 8: spans

SPANS = [("weight_versions", [["v0", 0, FAR]], f"weight-version span [0, {FAR})"),
         ("weight_versions", [["v0", 0, 2], ["v1", 2, 5]], "weight-version span [2, 5)"),
         ("recomputed", [[2, 6]], "recomputed span [2, 6)"),
         ("prefix_cached", [[0, 1], [5, 5]], "prefix_cached span [5, 5)")]


@pytest.mark.parametrize("indexed", [False, True], ids=["scanned", "indexed"])
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("field,spans,shown", SPANS)
def test_a_span_beyond_the_records_sequence_is_refused(field, spans, shown, version, indexed):
    rec = crafted.record(SCHEMA, "s0", 4, seed=1)          # 3 rows: a 4-token sequence
    # the writer's own check refuses the record these spans would make
    forged_rec = RoutingRecord("s0", rec.expert_ids, prompt_len=rec.prompt_len, **{
        field: [WeightVersionSpan(*s) for s in spans] if field == "weight_versions"
        else [tuple(s) for s in spans]})
    with pytest.raises(RecordError, match="4-token sequence"):
        forged_rec.validate(SCHEMA)

    def edit(meta, parts):
        meta[field] = spans

    data = crafted.forged(SCHEMA, rec, edit, version=version)
    if indexed:
        data = _with_index(data, [("s0", SidecarReader(data)._data_start)], version)
    r = SidecarReader(data)
    assert r.complete is indexed
    for read in (lambda: r.read("s0"), lambda: r.read("s0", moe_layers=[1], tokens=(0, 1)),
                 lambda: r.fetch("s0", [0], [(0, 2)])):
        with pytest.raises(SidecarError) as e:
            read()
        assert e.value.sample_id == "s0"
        msg = str(e.value)
        assert "'s0'" in msg and shown in msg and "4-token sequence" in msg, msg
    scanned = SidecarReader(data)
    scanned.scan()
    assert any(shown in m and "'s0'" in m for m in scanned.errors), scanned.errors
    assert "s0" not in scanned.sample_ids()
    with pytest.raises(SidecarError, match=re.escape(shown)):
        list(scanned.records())


@pytest.mark.parametrize("version", [2, 3])
def test_spans_up_to_the_end_of_the_sequence_read_back(version):
    rec = crafted.record(SCHEMA, "s0", 4, seed=1)
    spans = {"weight_versions": [["v0", 0, 1], ["v1", 1, 4]], "recomputed": [[0, 4]],
             "prefix_cached": [[4, 4], [0, 0]]}
    data = crafted.forged(SCHEMA, rec, lambda meta, parts: meta.update(spans),
                          version=version)
    got = SidecarReader(data).read("s0")
    got.validate(SCHEMA)
    assert got.weight_versions == [WeightVersionSpan("v0", 0, 1), WeightVersionSpan("v1", 1, 4)]
    assert got.recomputed == [(0, 4)] and got.prefix_cached == [(4, 4), (0, 0)]
    assert np.array_equal(got.expert_ids, rec.expert_ids)


def test_the_spec_reader_applies_the_same_rules():
    """tests/spec_reader.py (written from docs/FORMAT.md alone) refuses a span beyond the
    record and a section of a removed codec, and reads the well-formed streams."""
    from tests import spec_reader
    rec = crafted.record(SCHEMA, "s0", 4, seed=1)
    for version in (2, 3):
        def edit(meta, parts):
            meta["recomputed"] = [[0, 1 << 62]]
        with pytest.raises(AssertionError, match="span beyond the record"):
            spec_reader.read_stream(crafted.forged(SCHEMA, rec, edit, version=version))
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "legacy", "xl-ans.rrsc"),
              "rb") as f:
        xl = f.read()
    with pytest.raises(AssertionError, match="'xl-ans-rows' was removed in routereplay 0.3.0"):
        spec_reader.read_stream(xl)
    rec = crafted.record(SCHEMA, "s0", 40, seed=2)
    _, recs = spec_reader.read_stream(crafted.forged(SCHEMA, rec, lambda meta, parts: None))
    assert [r["sample_id"] for r in recs] == ["s0"]
    assert np.array_equal(np.array(recs[0]["routing"]), rec.expert_ids)


# ------------------------------------------------- attacker review of issue 29 (0.3.0)

ROWS = crafted.record(SCHEMA, "x", 30, 0).num_tokens


def _with_good_first(bad: bytes, version: int) -> tuple[bytes, bytes]:
    """A stream of a valid record 'ok' followed by the crafted one-record stream's frame."""
    from routereplay.sidecar import encode_record_payload
    head = crafted.v2_header(SCHEMA) if version == 2 else None
    good = crafted.v2_payload(crafted.record(SCHEMA, "ok", 30, 1), SCHEMA) if version == 2 \
        else encode_record_payload(crafted.record(SCHEMA, "ok", 30, 1), SCHEMA,
                                   codecs=crafted.CODECS_V3)
    first = crafted.stream(SCHEMA, [good], version)
    hlen = len(head) if head is not None else crafted._first_frame(SCHEMA, first)
    return first + bad[hlen:], good


@pytest.mark.parametrize("where", ["routing layer bound", "token_ids count", "unknown name"])
def test_a_huge_v2_section_integer_is_a_corrupt_record_not_an_overflow(where):
    """A format-2 section integer of 10**400 behind a valid CRC: OverflowError escaped the
    scan (np.prod in float64), and the stream's valid record was lost with it."""
    def edit(m, parts):
        secs = m["sections"]
        if where == "routing layer bound":
            secs[0][4] = 10 ** 400
        elif where == "token_ids count":
            next(s for s in secs if s[0] == "token_ids")[3] = 10 ** 400
        else:
            secs.append(["future", "raw", 0, 10 ** 400])
    bad = crafted.forged(SCHEMA, crafted.record(SCHEMA, "bad", 30, 0), edit, version=2)
    data, _ = _with_good_first(bad, 2)
    r = SidecarReader(data)
    assert r.read("ok").num_tokens == ROWS
    if where == "unknown name":           # FORMAT.md: an unknown well-formed entry is skipped
        assert r.read("bad").num_tokens == ROWS
    else:
        with pytest.raises(SidecarError, match="sample 'bad'"):
            r.read("bad")


def test_a_v2_meta_of_many_section_entries_is_refused_before_work_per_entry():
    """63,500 tiny unknown-name entries cost 1.3-1.5 s per MiB to scan and read (over the
    1 s target); 0.2 writers wrote at most L_moe + 2 entries."""
    def edit(m, parts):
        m["sections"] += [["a", "r", 0, 1]] * (SCHEMA.num_moe_layers + 65)
    bad = crafted.forged(SCHEMA, crafted.record(SCHEMA, "bad", 30, 0), edit, version=2)
    with pytest.raises(SidecarError, match=r"sample 'bad'.*sections, more than 3 MoE layers \+ 64"):
        SidecarReader(bad).read("bad")
    ok = crafted.forged(SCHEMA, crafted.record(SCHEMA, "ok2", 30, 0),
                        lambda m, p: m["sections"].extend([["a", "r", 0, 1]] * 60), version=2)
    assert SidecarReader(ok).read("ok2").num_tokens == ROWS


@pytest.mark.parametrize("version", [2, 3])
def test_an_unknown_routing_codec_is_found_by_the_scan_like_a_removed_one(version):
    """A routing section naming a codec the reader does not know passed scan, check() and
    `inspect` (exit 0), then failed on read; a removed codec is caught by the scan."""
    def edit(m, parts):
        m["sections"][0][1] = "bogus"
    bad = crafted.forged(SCHEMA, crafted.record(SCHEMA, "bad", 30, 0), edit, version=version)
    r = SidecarReader(bad)
    with pytest.raises(SidecarError, match=r"unknown routing codec 'bogus'"):
        r.check()
    assert any("sample 'bad'" in e and "unknown routing codec 'bogus'" in e for e in r.errors)


@pytest.mark.parametrize("version", [2, 3])
def test_a_routing_section_that_does_not_decode_is_named(version):
    """The error of a section whose bytes do not decode named the sample and frame, not the
    section's MoE layers and rows."""
    def edit(m, parts):
        parts[0] = bytes(len(parts[0]))      # zeros: the CRC is resealed, the bytes are junk
    bad = crafted.forged(SCHEMA, crafted.record(SCHEMA, "bad", 30, 0), edit, version=version)
    with pytest.raises(SidecarError, match=r"sample 'bad'.*MoE layers \[0, \d\), rows \[0, \d+\)"):
        SidecarReader(bad).read("bad")
