import io
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay import codec
from routereplay import sidecar as sc
from routereplay.errors import RecordError, RouteReplayError, SidecarError
from routereplay.sidecar import SidecarReader, SidecarWriter, write_records
from tests import crafted
from tests.conftest import random_record


def _records(schema, n=4):
    return [random_record(schema, f"r{i}", 12 + 5 * i, i) for i in range(n)]


def _assert_same(a, b):
    assert a.sample_id == b.sample_id and a.start == b.start and a.prompt_len == b.prompt_len
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.weight_versions == b.weight_versions


@pytest.mark.parametrize("background", [True, False])
def test_roundtrip_file(tmp_path, schema, background):
    recs = _records(schema)
    p = tmp_path / "a.rrsc"
    write_records(str(p), schema, recs, background=background)
    with SidecarReader(str(p)) as r:
        assert r.schema == schema and r.sample_ids() == [x.sample_id for x in recs]
        for a, b in zip(recs, r.records()):
            _assert_same(a, b)
        assert r.errors == [] and r.torn_tail is None


def test_in_memory_and_fsspec(schema):
    recs = _records(schema, 2)
    w = write_records(None, schema, recs)
    _assert_same(recs[1], SidecarReader(w.getvalue()).read("r1"))
    write_records("memory://rr/test.rrsc", schema, recs)
    _assert_same(recs[0], SidecarReader("memory://rr/test.rrsc").read("r0"))


def test_partial_reads(schema):
    rec = random_record(schema, "p", 30, 9)
    data = write_records(None, schema, [rec]).getvalue()
    r = SidecarReader(data)
    part = r.read("p", layers=[2], tokens=(5, 9), arrays=False)
    np.testing.assert_array_equal(part.expert_ids, rec.expert_ids[5:9, [2]])
    assert part.start == 5 and part.token_ids is None


def test_duplicate_sample_id_rejected_nothing_lost(tmp_path, schema):
    p = tmp_path / "d.rrsc"
    w = SidecarWriter(str(p), schema)
    a = random_record(schema, "x", 10, 1)
    w.write(a)
    with pytest.raises(RecordError, match="already written"):
        w.write(random_record(schema, "x", 10, 2))
    bad = random_record(schema, "bad", 10, 3)
    bad.expert_ids[0, 0, 0] = 99
    with pytest.raises(RecordError, match="sample 'bad', token 0"):
        w.write(bad)
    w.close()
    _assert_same(a, SidecarReader(str(p)).read("x"))
    assert SidecarReader(str(p)).sample_ids() == ["x"]


def test_torn_tail_recovers_complete_frames(schema):
    recs = _records(schema, 3)
    w = SidecarWriter(None, schema, background=False)
    for x in recs:
        w.write(x)
    w.flush()
    full = w.getvalue()                       # no index, no trailer: like a killed writer
    last = SidecarReader(full).scan()[-1].offset
    torn = full[:last + 30]
    r = SidecarReader(torn)
    assert r.sample_ids() == ["r0", "r1"]
    assert r.torn_tail == last and "torn tail" in r.errors[0]
    with pytest.raises(SidecarError, match="torn"):
        list(r.records(strict=True))
    assert [x.sample_id for x in r.records(strict=False)] == ["r0", "r1"]


def test_corrupt_payload_names_offset_and_sample(schema):
    recs = _records(schema, 3)
    data = bytearray(write_records(None, schema, recs).getvalue())
    frames = SidecarReader(bytes(data)).scan()
    off = frames[1].offset
    data[frames[2].offset - 10] ^= 0xFF       # inside r1's last section
    r = SidecarReader(bytes(data))
    with pytest.raises(SidecarError, match=f"sample 'r1'.*offset {off}"):
        r.read("r1")
    r2 = SidecarReader(bytes(data))
    r2.scan()
    assert any(f"offset {off}" in e and "'r1'" in e for e in r2.errors)
    _assert_same(recs[2], r2.read("r2"))
    _assert_same(recs[0], r2.read("r0"))


def test_corrupt_frame_header_resyncs(schema):
    recs = _records(schema, 3)
    data = bytearray(write_records(None, schema, recs).getvalue())
    off = SidecarReader(bytes(data)).scan()[1].offset
    data[off + 8] ^= 0x55                     # length field: header checksum now fails
    r = SidecarReader(bytes(data[:-16]))      # drop trailer: force scanning
    assert r.sample_ids() == ["r0", "r2"]
    assert f"corrupt frame header at offset {off}" in r.errors[0]


def test_wrong_magic_and_version(schema):
    data = bytearray(write_records(None, schema, _records(schema, 1)).getvalue())
    with pytest.raises(SidecarError, match="wrong magic"):
        SidecarReader(b"PK\x03\x04" + bytes(data[4:]))
    # a live stream opened before its writer's first flush: say so, not "wrong magic"
    for cut in (0, 5, 12):
        with pytest.raises(SidecarError, match=rf"empty or partial stream header \({cut} bytes\)"):
            SidecarReader(bytes(data[:cut]))
    data[8:10] = struct.pack("<H", 9)
    with pytest.raises(SidecarError, match="unsupported sidecar format version 9"):
        SidecarReader(bytes(data))


def test_forged_length_no_huge_allocation(schema):
    data = bytearray(write_records(None, schema, _records(schema, 1)).getvalue())
    off = SidecarReader(bytes(data)).scan()[0].offset
    hdr = struct.pack("<4sB3xQI", b"RRFM", 1, 1 << 60, 0)
    data[off:off + 24] = hdr + struct.pack("<I", sc.crc32(hdr))
    r = SidecarReader(bytes(data[:-16]))
    assert r.sample_ids() == [] and r.torn_tail == off


def test_bounded_queue_backpressure(schema):
    class Slow(io.BytesIO):
        pass
    w = SidecarWriter(Slow(), schema, max_queue=2)
    for i in range(10):
        w.write(random_record(schema, f"q{i}", 8, i))
        assert w._q.qsize() <= 2
    w.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_reader_only_raises_our_errors(data):
    from routereplay.schema import RoutingSchema
    schema = RoutingSchema(4, (1, 2, 3), 4, 16)
    base = _FUZZ_BASE.setdefault("b", write_records(None, schema, _records(schema, 2)).getvalue())
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    blob = bytes(buf[:cut])
    try:
        r = SidecarReader(blob)
        for sid in r.sample_ids():
            try:
                r.read(sid)
            except KeyError:
                pass
        list(r.records(strict=False))
    except RouteReplayError:
        pass


_FUZZ_BASE: dict = {}


def test_layer_groups_decode_only_requested(schema, monkeypatch):
    from routereplay import codec
    rec = random_record(schema, "g", 20, 3)
    calls = []
    real = codec.decode
    monkeypatch.setattr(codec, "decode", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    # a grid of 128-row x 1-layer sections (one_section_bytes=0: even this short record;
    # sections of 8 rows would fall under the reader's section floor: the writer doubles)
    long = random_record(schema, "g", 400, 3)
    data = write_records(None, schema, [long], layer_group=1, token_block=128,
                         one_section_bytes=0, min_section_bytes=0).getvalue()
    part = SidecarReader(data).read("g", layers=[1], tokens=(130, 140), arrays=False)
    np.testing.assert_array_equal(part.expert_ids, long.expert_ids[130:140, [1]])
    assert calls == [(128, 1, 4)]           # one of 4 x 3 sections decoded
    calls.clear()
    v2 = crafted.v2_stream(schema, [rec], layer_group=1)
    np.testing.assert_array_equal(SidecarReader(v2).read("g", layers=[1]).expert_ids,
                                  rec.expert_ids[:, [1]])
    assert calls == [(19, 1, 4)]            # version 2: one of three layer sections
    calls.clear()
    small = write_records(None, schema, [rec]).getvalue()     # 228 bytes of ids: one section
    np.testing.assert_array_equal(SidecarReader(small).read("g", layers=[1]).expert_ids,
                                  rec.expert_ids[:, [1]])
    assert calls == [(19, 3, 4)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_payload_with_valid_checksums(data):
    """Mutate a record payload and re-frame it with valid CRCs (version 3: the head's in the
    frame, every section's own): the metadata, table and codec paths must still only raise
    our errors (and never allocate by forged sizes)."""
    from routereplay.schema import RoutingSchema
    from routereplay.varint import read_varint
    schema = RoutingSchema(4, (1, 2, 3), 4, 16)
    rec = _FUZZ_BASE.setdefault("rec", random_record(schema, "f", 30, 1))
    version = data.draw(st.sampled_from([2, 3]))
    grid = dict(token_block=8, one_section_bytes=0, min_section_bytes=0) \
        if data.draw(st.booleans()) else {}
    payload = bytearray(sc.encode_record_payload(rec, schema, codecs=crafted.CODECS_V3, **grid)
                        if version == 3 else crafted.v2_payload(rec, schema))
    if version == 2:
        mlen = struct.unpack("<I", payload[:4])[0] + 4
    else:
        m, pos = read_varint(payload, 0)
        mlen = pos + m
    for _ in range(data.draw(st.integers(1, 6))):
        # bias mutations towards the meta, where digits change sizes and offsets
        hi = mlen if data.draw(st.booleans()) else len(payload)
        i = data.draw(st.integers(0, hi - 1))
        payload[i] = data.draw(st.sampled_from(list(b'0123456789[]{}",:-e9\x00\x7f\x80\xff'))
                               | st.integers(0, 255))
    if version == 3:
        payload = crafted.reseal(bytes(payload), schema)
    blob = crafted.stream(schema, [payload], version)
    try:
        r = SidecarReader(blob)
        list(r.records(strict=False))
        for sid in r.sample_ids():
            r.read(sid)
            r.fetch(sid, [2], [(3, 20)])
    except (RouteReplayError, KeyError):
        pass


@pytest.mark.parametrize("version", [2, 3])
def test_forged_index_never_returns_another_sample(schema, version):
    recs = _records(schema, 2)
    data = write_records(None, schema, recs).getvalue() if version == 3 else \
        crafted.v2_stream(schema, recs)
    r = SidecarReader(data)
    offs = [f.offset for f in r.scan()]
    index_off = struct.unpack("<Q", data[-16:-8])[0]
    # the index names each sample at the other's frame
    entries = [("r1", offs[0]), ("r0", offs[1])]
    idx = sc.layout.encode_index(entries) if version == 3 else \
        json.dumps({"records": [list(x) for x in entries]}).encode()
    forged = data[:index_off] + sc.encode_frame(sc.KIND_INDEX, idx) + struct.pack(
        "<Q8s", index_off, sc.TRAILER_MAGIC)
    r = SidecarReader(forged)
    _assert_same(recs[0], r.read("r0"))
    _assert_same(recs[1], r.read("r1"))
    assert any("listed in the index" in e for e in r.errors)


def test_deeply_nested_json_is_our_error(schema):
    js = b"[" * 200000
    blob = struct.pack("<8sHHI", sc.MAGIC, 1, 0, len(js)) + js + struct.pack("<I", sc.crc32(js))
    with pytest.raises(SidecarError):
        SidecarReader(blob)


_KILL_CHILD = r"""
import sys, time
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarWriter
from tests.conftest import random_record

class HalfThenHang:
    # writes the 4th record frame half way, tells the parent, then hangs (to be SIGKILLed)
    def __init__(self, path):
        self.f = open(path, "wb"); self.frames = 0
    def write(self, b):
        if b[:4] == b"RRFM":
            self.frames += 1
            if self.frames == 4:
                self.f.write(b[:len(b) // 2]); self.f.flush()
                print("MID", flush=True); time.sleep(600)
        self.f.write(b)
    def flush(self):
        self.f.flush()

schema = RoutingSchema(4, (1, 2, 3), 4, 16)
w = SidecarWriter(HalfThenHang(sys.argv[1]), schema, max_queue=2)
for i in range(6):
    w.write(random_record(schema, f"k{i}", 40, i))
time.sleep(600)
"""


def test_writer_killed_mid_frame_keeps_every_complete_frame(tmp_path, schema):
    """A real writer process (background thread, bounded queue) is SIGKILLed while a frame
    is half written: every complete frame is recovered and the torn tail reported."""
    import signal
    import subprocess
    import sys
    path = tmp_path / "killed.rrsc"
    script = tmp_path / "child.py"
    script.write_text(_KILL_CHILD)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "MID"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
    r = SidecarReader(str(path))
    assert r.sample_ids() == ["k0", "k1", "k2"]
    assert r.torn_tail is not None and "torn tail" in r.errors[0]
    for i in range(3):
        _assert_same(random_record(schema, f"k{i}", 40, i), r.read(f"k{i}"))


def test_format_version_1_is_refused_with_the_removal(schema):
    """Format 1 was removed in 0.3.0 (tests/test_legacy_streams.py reads 0.2's fixture)."""
    hjs = json.dumps({"schema": schema.to_dict(), "codec": "zstd-lm"}).encode()
    data = struct.pack("<8sHHI", sc.MAGIC, 1, 0, len(hjs)) + hjs + struct.pack("<I", sc.crc32(hjs))
    with pytest.raises(SidecarError, match=r"format version 1 was removed in routereplay "
                                           r"0\.3\.0; routereplay 0\.2\.x reads it"):
        SidecarReader(data)


def test_sorted_column_order_stream(schema):
    recs = _records(schema, 2)
    data = write_records(None, schema, recs, column_order="sorted").getvalue()
    r = SidecarReader(data)
    assert r.column_order == "sorted" and r.header["codec"] == "xl-zstd"
    np.testing.assert_array_equal(r.read("r1").expert_ids, np.sort(recs[1].expert_ids, axis=-1))
    with pytest.raises(ValueError, match="column_order"):
        SidecarWriter(None, schema, column_order="ascending")


def test_compact_meta_is_small(schema):
    rec = random_record(schema, "m", 30, 1)
    payload = crafted.v2_payload(rec, schema)
    mlen = struct.unpack("<I", payload[:4])[0]
    meta = payload[4:4 + mlen]
    assert b'"start"' not in meta and b'"recomputed"' not in meta and b'"offset"' not in meta
    assert mlen < 200, meta
    # version 3: binary meta: flags, id, T, prompt_len, counts, one version span, engine
    v3 = sc.encode_record_payload(rec, schema)
    # M, flags, len + 'm', T, prompt_len, N, G, span count + len + 'v0' + start + length,
    # len + 'test'
    assert v3.head_len == 1 + 1 + 2 + 1 + 1 + 1 + 1 + (1 + 3 + 1 + 1) + 5, v3[:v3.head_len]


def test_writer_refuses_what_readers_reject_and_indexes_after_a_failure(schema):
    from routereplay.record import RoutingRecord
    ok = random_record(schema, "ok", 12, 1)
    for bad in (dict(recomputed=[(5, 3)]), dict(prefix_cached=[(-1, 2)]),
                dict(logprobs=np.zeros((2, 2), np.float32)),
                dict(token_ids=np.full(12, 2**40, np.int64))):
        rec = RoutingRecord(**{**ok.__dict__, **bad})
        with pytest.raises(RecordError, match="sample 'ok'"):
            SidecarWriter(None, schema).write(rec)

    class FailSecond(io.BytesIO):
        frames = 0

        def write(self, b):
            if b[:4] == b"RRFM" and b[4] == 1:
                FailSecond.frames += 1
                if FailSecond.frames == 2:
                    raise OSError("disk full")
            return super().write(b)
    f = FailSecond()
    w = SidecarWriter(f, schema)
    w.write(ok)
    w.write(random_record(schema, "lost", 12, 2))
    with pytest.raises(SidecarError, match="disk full"):
        w.close()
    r = SidecarReader(f.getvalue())
    assert r.sample_ids() == ["ok"] and not r.errors          # index and trailer written
    with pytest.raises(ValueError, match="repeat"):
        r.read("ok", layers=[0, 0])


def test_spliced_stream_with_duplicate_ids_keeps_the_first(schema):
    a = write_records(None, schema, [random_record(schema, "x", 10, 1)], background=False)
    b = write_records(None, schema, [random_record(schema, "x", 12, 2)], background=False)
    fa, fb = (SidecarReader(w.getvalue()).scan()[0] for w in (a, b))
    frame = lambda w, fi: w.getvalue()[fi.offset:fi.offset + 24 + fi.payload_len]  # noqa: E731
    data = a.getvalue()[:fa.offset] + frame(a, fa) + frame(b, fb)
    r = SidecarReader(data)
    assert r.sample_ids() == ["x"] and "duplicate sample id 'x'" in r.errors[0]
    assert r.read("x").num_tokens == 9


# --- format version 3: ranged reads, per-section checks, per-record overhead ----------------


class CountingFile(io.BytesIO):
    """A seekable file that counts read requests and bytes (one request per read call)."""

    def __init__(self, data):
        super().__init__(data)
        self.requests = self.bytes = 0

    def read(self, n=-1):
        b = super().read(n)
        self.requests += 1
        self.bytes += len(b)
        return b


def _grid_stream(schema8, n=3, t=3000, **kw):
    from routereplay.record import RoutingRecord
    rng = np.random.default_rng(4)
    recs = []
    for i in range(n):
        ids, _ = __import__("tests.traces", fromlist=["x"]).routing_trace(
            rng, t, schema8.num_moe_layers, schema8.num_experts, schema8.top_k, 0.3, 1.0)
        recs.append(RoutingRecord(f"g{i}", ids, prompt_len=t // 2))
    return recs, write_records(None, schema8, recs, token_block=256, min_section_bytes=0,
                               **kw).getvalue()


@pytest.fixture
def schema8():
    from routereplay.schema import RoutingSchema
    return RoutingSchema(9, tuple(range(1, 9)), 4, 64)


def _sections(reader, sid):
    """(frame offset, head, section boundaries in the body, body offset) of a record."""
    h = reader._head(reader._locate(sid).offset)
    g = h.grid
    payload_at = h.offset + 24
    raw = reader._read(payload_at, h.payload_len)
    ends = [0] + np.frombuffer(raw[g.head_len:g.head_len + g.table_len], "<u4").tolist() \
        + [h.payload_len - h.body_at]
    return h, ends, payload_at + h.body_at


def test_v3_fetch_reads_only_the_head_its_table_entries_and_its_sections(schema8):
    recs, data = _grid_stream(schema8)
    f = CountingFile(data)
    r = SidecarReader(f)
    h, ends, _ = _sections(SidecarReader(data), "g1")
    g = h.grid
    assert (g.token_block, g.layer_group, g.n_blocks, g.n_groups) == (256, 1, 12, 8)
    nb = g.n_blocks
    f.requests = f.bytes = 0
    ids, first = r.fetch("g1", [2, 3], [(300, 700)])[0]
    np.testing.assert_array_equal(ids, recs[1].expert_ids[300:700, [2, 3]])
    assert first == 300
    need = [gi * nb + b for gi in (2, 3) for b in (1, 2)]          # rows [256, 768)
    sections = sum(ends[i + 1] - ends[i] for i in need)
    # the head read (256 bytes at the frame) also holds table entries 2nb .. 3nb+2
    assert h.grid.head_len + 4 * (3 * nb + 3) <= 256 - 24
    assert f.requests == 3                  # the head, then two runs of sections
    assert f.bytes == 256 + sections, (f.bytes, sections)
    assert f.bytes < 0.06 * (24 + h.payload_len)
    # the head is cached: a second fetch reads table entries (6nb-1 .. 7nb) and sections only
    f.requests = f.bytes = 0
    np.testing.assert_array_equal(r.fetch("g1", [6], [(0, 10), (2990, 3100)])[1][0],
                                  recs[1].expert_ids[2990:, [6]])
    need = [6 * nb + 0, 6 * nb + nb - 1]
    assert f.requests == 3 and f.bytes == 4 * (nb + 1) + sum(ends[i + 1] - ends[i] for i in need)


def test_v3_fetch_without_moe_layers_reads_no_section(schema8):
    recs, data = _grid_stream(schema8)
    f = CountingFile(data)
    r = SidecarReader(f)
    f.requests = f.bytes = 0
    (ids, first), = r.fetch("g2", [], [(10, 50)])
    assert ids.shape == (40, 0, 4) and first == 10
    assert f.requests == 1 and f.bytes == 256                     # the head only
    r.fetch("g2", [], [(10, 50)])
    assert f.requests == 1                                        # cached: nothing more


def test_v3_corrupt_section_costs_only_its_rows(schema8):
    recs, data = _grid_stream(schema8)
    h, ends, body_at = _sections(SidecarReader(data), "g0")
    nb = h.grid.n_blocks
    bad = bytearray(data)
    bad[body_at + ends[1 * nb + 0] + 9] ^= 0x10                   # MoE layer 1, rows [0, 256)
    r = SidecarReader(bytes(bad))
    np.testing.assert_array_equal(r.fetch("g0", [0, 2], [(0, 3000)])[0][0],
                                  recs[0].expert_ids[:, [0, 2]])
    np.testing.assert_array_equal(r.fetch("g0", [1], [(256, 400)])[0][0],
                                  recs[0].expert_ids[256:400, [1]])
    with pytest.raises(SidecarError, match=r"sample 'g0' \(frame at offset \d+\): section 12 "
                       r"\(MoE layers \[1, 2\), rows \[0, 256\)\): checksum mismatch"):
        r.fetch("g0", [1], [(100, 300)])
    with pytest.raises(SidecarError, match="'g0'"):
        r.read("g0")
    r2 = SidecarReader(bytes(bad))
    r2.scan()                                                     # a scan checks every byte
    assert any("'g0'" in e and "section 12" in e for e in r2.errors)
    assert r2.sample_ids() == ["g1", "g2"]


def test_v3_forged_table_entry_in_an_indexed_stream(schema8):
    """The table is not checksummed: a forged entry is caught by the sections' CRCs (which
    cover each section's index) or by the entries' order, never read as another section."""
    recs, data = _grid_stream(schema8)
    h, ends, body_at = _sections(SidecarReader(data), "g1")
    table_at = h.offset + 24 + h.grid.head_len
    nb = h.grid.n_blocks
    for i, value, why in ((3, ends[3], "overlapping"),          # section 3 ends where 2 did
                          (3, ends[5], "checksum mismatch"),    # section 3 swallows 4
                          (3, 1 << 31, "overlapping")):         # past the body
        bad = bytearray(data)
        bad[table_at + 4 * i:table_at + 4 * i + 4] = struct.pack("<I", value)
        r = SidecarReader(bytes(bad))
        with pytest.raises(SidecarError, match=f"sample 'g1'.*section 3.*{why}"):
            r.fetch("g1", [0], [(3 * 256, 4 * 256)])
        np.testing.assert_array_equal(r.fetch("g1", [1], [(0, 3000)])[0][0],
                                      recs[1].expert_ids[:, [1]])
        assert nb > 5


def test_v3_per_record_overhead_is_36_plus_twice_the_id(schema):
    """A short routing-only record costs 36 + 2 x len(sample id) bytes beyond its section's
    coded data (docs/FORMAT.md "Per-record overhead")."""
    from routereplay.record import RoutingRecord
    from routereplay.sidecar.layout import encode_header
    recs = [RoutingRecord(f"id{i:03d}", random_record(schema, "x", 100, i).expert_ids)
            for i in range(20)]
    data = write_records(None, schema, recs).getvalue()
    header = len(encode_header(schema, stream_id="0" * 16))      # the writer's stream_id
    coded = sum(len(codec.encode(x.expert_ids, codec.DEFAULT_CODEC, schema.num_experts))
                for x in recs)
    stream_fixed = header + 24 + 1 + 16             # index frame header, count, trailer
    per_record = (len(data) - stream_fixed - coded) / len(recs)
    assert per_record == 36 + 2 * 5, per_record
    v2 = crafted.v2_stream(schema, recs)
    assert (len(v2) - len(data)) / len(recs) > 60          # version 2: about 120 bytes


def test_v2_streams_read_and_writers_write_v3_only(schema):
    recs = _records(schema, 3)
    r = SidecarReader(crafted.v2_stream(schema, recs, layer_group=3))
    assert r.version == 2 and r.layer_group == 3
    for a, b in zip(recs, r.records()):
        _assert_same(a, b)
    assert struct.unpack("<H", write_records(None, schema, recs).getvalue()[8:10]) == (3,)
    with pytest.raises(ValueError, match="format_version"):
        SidecarWriter(None, schema, format_version=4)
    with pytest.raises(ValueError, match="format version 2 was removed in routereplay 0.3.0"):
        SidecarWriter(None, schema, format_version=2)


def test_v3_repetitive_records_get_longer_token_blocks(schema8):
    """Sections that code to less than min_section_bytes on average (90 % repeats) are
    merged along tokens: fewer sections, each about that size, and a smaller record."""
    from routereplay.record import RoutingRecord
    from tests.traces import routing_trace
    ids, _ = routing_trace(np.random.default_rng(3), 4096, 8, 64, 4, 0.95, 1.0)
    rec = RoutingRecord("rep", ids)
    merged = write_records(None, schema8, [rec], token_block=256).getvalue()
    plain = write_records(None, schema8, [rec], token_block=256, min_section_bytes=0).getvalue()
    g = SidecarReader(merged)._head(SidecarReader(merged)._locate("rep").offset).grid
    assert g.token_block > 256 and g.token_block % 256 == 0 and len(merged) < 0.9 * len(plain)
    np.testing.assert_array_equal(SidecarReader(merged).fetch("rep", [3], [(100, 3000)])[0][0],
                                  ids[100:3000, [3]])


# --- issue 13 bug 2: the demo's bytes per row come from the stored section lengths ----------
@pytest.mark.parametrize("format_version", [2, 3])
def test_record_bytes_and_demo_figure_use_stored_section_lengths(tmp_path, schema, format_version):
    """Version 2 (read only) from tests/crafted.py's 0.2 encoder."""
    from routereplay.cli.demo.run import routing_only_bytes
    from routereplay.sidecar import SidecarWriter
    recs = [random_record(schema, f"s{i}", 40 + 13 * i, i) for i in range(4)]
    path = str(tmp_path / "raw.rrsc")
    # a stream stored with the raw codec: a re-encoding with the default codec would
    # report fewer bytes than the stream holds
    if format_version == 2:
        with open(path, "wb") as f:
            f.write(crafted.v2_stream(schema, recs, codec="raw-lm"))
    else:
        write_records(path, schema, recs, codec="raw-lm", background=False)
    k = schema.top_k
    with SidecarReader(path) as r:
        sizes = [r.record_bytes(x.sample_id) for x in recs]
        frames = r.scan()
    for rec, b, fi in zip(recs, sizes, frames):
        raw = rec.expert_ids.size * rec.expert_ids.itemsize
        assert b.routing >= raw                          # the ids are stored raw
        per_section = 5 if format_version == 3 else 0   # v3: CRC + codec byte per section
        assert b.routing - raw == per_section * b.routing_sections
        assert set(b.arrays) == {"token_ids", "logprobs"}
        assert b.arrays["token_ids"] > 0 and b.arrays["logprobs"] > 0
        assert b.routing_frame == b.frame - sum(b.arrays.values())
        assert b.frame == 24 + fi.payload_len              # frame header + payload
    got, rows = routing_only_bytes(path)
    assert rows == sum(x.num_tokens for x in recs) * schema.num_moe_layers
    size = os.path.getsize(path)
    assert got == size - sum(sum(b.arrays.values()) for b in sizes)
    assert got >= rows * k                               # at least the raw ids (uint8)
