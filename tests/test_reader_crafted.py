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
