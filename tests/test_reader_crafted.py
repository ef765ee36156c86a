"""Crafted frames the reader must refuse where the writer would (issue 27 items 8 and 11).

Item 8: a record whose weight-version, ``recomputed`` or ``prefix_cached`` spans run beyond
its sequence (``RoutingRecord.validate`` refuses it) is never returned, in formats 2 and 3,
found by a scan or through the index. Item 11: an ``xl-ans`` model frame nested inside
another frame's bytes is not a frame (a scan never sees it), so a record naming it is
refused, whether the stream is scanned (live, unindexed) or read through its index; model
frames that are frames of the stream still serve whole and partial (ranged) reads.
"""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

from routereplay.codec import xl_ans
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from routereplay.sidecar.layout import (KIND_INDEX, KIND_MODEL, KIND_RECORD, encode_frame,
                                        encode_header, encode_index, encode_trailer)
from routereplay.sidecar.payload import encode_record_payload
from routereplay.testing import CrossLayerRouting, crafted

SCHEMA = RoutingSchema(4, (1, 2, 3), 4, 16)
FAR = 1 << 62


def _with_index(data: bytes, entries: list[tuple[str, int]], version: int) -> bytes:
    """``data`` (a stream without index) closed with an index of ``entries`` and a trailer."""
    return (data + encode_frame(KIND_INDEX, encode_index(entries, version))
            + encode_trailer(len(data)))


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


# --------------------------------------------------------------------------- item 11: models

NL, E, K = 6, 8, 2
XL_SCHEMA = RoutingSchema(NL, tuple(range(NL)), K, E)
CODECS = ("xl-ans", "xl-ans-rows", "xl-zstd", "ctx-zstd", "raw-lm", "zstd", "raw")


@pytest.fixture(scope="module")
def routing():
    """(model, ids of 3 records) of one cross-layer source: the model codes them smaller."""
    rng = np.random.default_rng(3)
    src = CrossLayerRouting.make(rng, NL, E, K)
    m = xl_ans.XlModel.empty(NL, E, K)
    for _ in range(4):
        m.count(src.sample(rng, 512)[0])
    payload = m.to_bytes()
    return payload, [src.sample(rng, t)[0] for t in (700, 300, 900)]


def _build(routing, *, before=b"", nested=False, plain_first=False, index=True,
           pad=b"\0" * 40):
    """A version-3 xl-ans stream: header, ``before`` (raw bytes), an optional plain record
    ``p``, then the model frame (``nested``: inside the payload of an unknown-kind frame,
    after ``pad``), then records ``s0..s2`` coded with it; with an index and trailer.
    Returns (stream, model offset the records name, record ids by sample id)."""
    payload, recs = routing
    model = xl_ans.XlModel.from_bytes(payload, NL, E, K)
    out = [encode_header(XL_SCHEMA, "xl-ans", codecs=CODECS, stream_id="00" * 8), before]
    pos = len(out[0]) + len(before)
    entries, ids = [], {}
    if plain_first:
        x = recs[1][:50]
        p = encode_record_payload(RoutingRecord("p", x), XL_SCHEMA, "xl-zstd", codecs=CODECS)
        out.append(encode_frame(KIND_RECORD, p))
        entries.append(("p", pos))
        ids["p"] = x
        pos += len(out[-1])
    mframe = encode_frame(KIND_MODEL, payload)
    if nested:
        out.append(encode_frame(7, pad + mframe + pad))
        moff = pos + 24 + len(pad)
    else:
        out.append(mframe)
        moff = pos
    pos += len(out[-1])
    for i, x in enumerate(recs):
        p = encode_record_payload(RoutingRecord(f"s{i}", x), XL_SCHEMA, "xl-ans",
                                  codecs=CODECS, model=(moff, model))
        out.append(encode_frame(KIND_RECORD, p))
        entries.append((f"s{i}", pos))
        ids[f"s{i}"] = x
        pos += len(out[-1])
    data = b"".join(out)
    return (_with_index(data, entries, 3) if index else data), moff, ids


class _Counting(io.BytesIO):
    """A seekable stream that counts the bytes read from it."""
    bytes_read = 0

    def read(self, n=-1):
        got = super().read(n)
        self.bytes_read += len(got)
        return got


@pytest.mark.parametrize("layout", ["first", "after-record", "after-unknown-kind"])
def test_model_frames_of_the_stream_serve_indexed_reads_without_a_scan(routing, layout):
    data, moff, ids = _build(routing, plain_first=layout == "after-record",
                             before=encode_frame(9, b"x" * 30) if layout ==
                             "after-unknown-kind" else b"")
    f = _Counting(data)
    r = SidecarReader(f)
    assert r.complete
    assert r.routing_codecs("s0").get("xl-ans", 0) + r.routing_codecs("s0").get(
        "xl-ans-rows", 0) > 0                          # the model is used
    f.bytes_read = 0
    ((got, first),) = r.fetch("s2", [4, 5], [(100, 400)])
    assert first == 100 and np.array_equal(got, ids["s2"][100:400, 4:6])
    # s2's frame (its head read first: 256 bytes), the model frame, and the header of the
    # frame before the model frame (the walk to it): no scan
    model_frame = 24 + len(routing[0])
    assert f.bytes_read <= r.record_bytes("s2").frame + model_frame + 256 + 24, \
        (f.bytes_read, len(data))
    assert r._frames is None
    for sid, x in ids.items():
        assert np.array_equal(r.read(sid).expert_ids, x)
    assert r._frames is None and r.errors == []
    s = SidecarReader(data)
    s.scan()
    assert s.errors == [] and list(s.model_frames) == [moff]


@pytest.mark.parametrize("index", [False, True], ids=["live", "indexed"])
def test_a_model_frame_nested_in_another_frame_is_refused(routing, index):
    data, moff, ids = _build(routing, nested=True, index=index)
    r = SidecarReader(data)
    assert r.complete is index
    for read in (lambda: r.read("s1"), lambda: r.fetch("s1", [0], [(0, 10)]),
                 lambda: r.read("s2", moe_layers=[5], tokens=(800, 900))):
        with pytest.raises(SidecarError) as e:
            read()
        assert e.value.sample_id in ("s1", "s2")
        msg = str(e.value)
        assert f"model offset {moff}" in msg and repr(e.value.sample_id) in msg, msg
        assert "not the start of a model frame" in msg, msg
    # reading no MoE layer reads no section: the record's head is intact
    ((none, first),) = r.fetch("s1", [], [(0, 10)])
    assert none.shape == (10, 0, K) and first == 0
    s = SidecarReader(data)
    s.scan()
    assert s.model_frames == {} and sorted(s.sample_ids()) == ["s0", "s1", "s2"]


def test_a_corrupt_frame_before_the_model_makes_an_indexed_read_scan(routing):
    """The frames from the index's records do not reach the model frame (a corrupt frame
    header lies between): the reader scans, which resynchronises at the model frame, and
    serves the read from it; the corrupt header is reported."""
    data, moff, ids = _build(routing, before=b"RRFM" + b"\x07" * 60)
    r = SidecarReader(data)
    assert r.complete and r._frames is None
    assert np.array_equal(r.read("s0").expert_ids, ids["s0"])
    assert list(r.model_frames) == [moff]
    assert any("corrupt frame header" in m for m in r.errors), r.errors


def test_a_model_frame_running_into_the_record_is_refused(routing):
    """(Through the reader's model lookup: a frame whose payload holds the record would
    make the record a frame nested in the model frame.)"""
    data, moff, ids = _build(routing)
    r = SidecarReader(data)
    rec_at = r._locate("s0").offset
    with pytest.raises(SidecarError, match=f"model frame at offset {moff} runs past"):
        r._model_at(moff, before=moff + 30)
    assert r._model_at(moff, before=rec_at) is r._model_at(moff, before=rec_at + 1)


def test_a_live_stream_reads_records_appended_after_its_model_frame(routing, tmp_path):
    data, moff, ids = _build(routing, index=False)
    ends = [fi.offset for fi in SidecarReader(data).scan()] + [len(data)]     # s0, s1, s2
    path = tmp_path / "live.rrsc"
    path.write_bytes(data[:ends[1]] + data[ends[1]:ends[1] + 100])       # s0, a torn s1
    r = SidecarReader(str(path))
    assert not r.complete
    assert r.sample_ids() == ["s0"] and r.torn_tail == ends[1]
    assert np.array_equal(r.read("s0").expert_ids, ids["s0"])
    path.write_bytes(data)                                  # the writer appended s1, s2
    assert np.array_equal(r.read("s2", moe_layers=[3]).expert_ids, ids["s2"][:, 3:4])
    assert r.sample_ids() == ["s0", "s1", "s2"] and r.errors == []


def test_the_spec_reader_applies_the_same_rules(routing):
    """tests/spec_reader.py (written from docs/FORMAT.md alone) refuses a span beyond the
    record and a nested model frame, and reads the well-formed streams."""
    from tests import spec_reader
    rec = crafted.record(SCHEMA, "s0", 4, seed=1)
    for version in (2, 3):
        def edit(meta, parts):
            meta["recomputed"] = [[0, 1 << 62]]
        with pytest.raises(AssertionError, match="span beyond the record"):
            spec_reader.read_stream(crafted.forged(SCHEMA, rec, edit, version=version))
    nested, _, _ = _build(routing, nested=True)
    with pytest.raises(AssertionError, match="not a model frame the scan found"):
        spec_reader.read_stream(nested)
    good, _, ids = _build(routing)
    _, recs = spec_reader.read_stream(good)
    assert [r["sample_id"] for r in recs] == ["s0", "s1", "s2"]
    assert np.array_equal(np.array(recs[0]["routing"]), ids["s0"])
