"""Issue 27 items 9-10: a stream's read work is bounded per stored byte (floors on tiny
sections), and truncated zstd frames are refused in every section, by both readers.

No timed assertions: the structural rules (refusal, floors) are asserted here;
benchmarks/robustness.py prints the CPU per MiB they give."""
import io

import numpy as np
import pytest
import zstandard

from routereplay import codec as _codec
from routereplay.errors import SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader, SidecarWriter
from routereplay.sidecar import payload as _payload
from routereplay.testing import crafted
from tests import spec_reader

SCHEMA = RoutingSchema(num_hidden_layers=6, moe_layer_ids=tuple(range(6)), top_k=4,
                       num_experts=32)
TINY_GRID = dict(token_block=1, layer_group=1, one_section_bytes=0, min_section_bytes=0)


def _records(schema, n, t, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        ids = np.argsort(rng.random((t, schema.num_moe_layers, schema.num_experts)), -1)
        yield RoutingRecord(sample_id=f"r{i}",
                            expert_ids=ids[..., :schema.top_k].astype(schema.id_dtype))


def _write(schema, codec, t=9, n=3, version=3, **kw):
    w = SidecarWriter(None, schema, codec=codec, background=False, format_version=version, **kw)
    recs = list(_records(schema, n, t))
    for r in recs:
        w.write(r)
    w.close()
    return w.getvalue(), recs


def _frames(data):
    """(offset, payload) of every record frame (kind 1) of a stream."""
    from routereplay.sidecar.layout import FRAME_HEADER_SIZE, KIND_RECORD, parse_frame_header
    hlen = 20 + int.from_bytes(data[12:16], "little")
    pos, out = hlen, []
    while pos + FRAME_HEADER_SIZE <= len(data) and data[pos:pos + 4] == b"RRFM":
        fh = parse_frame_header(data[pos:pos + FRAME_HEADER_SIZE], pos, len(data))
        if fh.kind == KIND_RECORD:
            out.append((pos, data[pos + FRAME_HEADER_SIZE:pos + FRAME_HEADER_SIZE + fh.payload_len]))
        pos += FRAME_HEADER_SIZE + fh.payload_len
    return out


@pytest.mark.parametrize("codec", [c for c in _codec.WRITER_CODECS if c not in
                                   ("xl-ans", "ctx-ans-sorted")])
def test_writer_keeps_tiny_grids_above_the_section_floor(codec):
    """A one-token x one-layer grid: before, the writer wrote 1-row sections of 17-33 bytes
    (read at 1.2-5 s of CPU per MiB; ctx-ans 16-37); now every record holds at least
    SECTION_FLOOR bytes per routing section beyond its first, its ctx-ans sections are at
    or above ctx-ans's floor, and it reads back exactly."""
    data, recs = _write(SCHEMA, codec, **TINY_GRID)
    frames = _frames(data)
    assert len(frames) == len(recs)
    for _, payload in frames:
        h = _payload.head_length(payload[:16], len(payload))
        meta = _payload.decode_head(payload[:h], SCHEMA, len(payload))
        assert meta.grid.n_routing >= 2                     # still a grid, not one section
        assert len(payload) >= _payload.SECTION_FLOOR * (meta.grid.n_routing - 1)
    with SidecarReader(io.BytesIO(data)) as r:
        for rec in recs:
            np.testing.assert_array_equal(r.read(rec.sample_id).expert_ids, rec.expert_ids)


def _tiny_grid_record(schema, codec, t=9, sid="tiny"):
    """A version-3 payload of ids [t - 1 rows] as a grid of one-row x one-layer sections
    of ``codec``, each section valid: what the writer wrote before the floor."""
    rec = next(_records(schema, 1, t))
    ids = rec.expert_ids
    nl = schema.num_moe_layers
    cid = {c: i for i, c in enumerate(crafted.CODECS_V3)}
    secs = [(cid[codec], _codec.encode(np.ascontiguousarray(ids[b:b + 1, g:g + 1]), codec,
                                       schema.num_experts))
            for g in range(nl) for b in range(t)]
    meta = _payload.encode_meta(sid, t, 1, 1)
    return _payload.assemble(meta, secs), rec


@pytest.mark.parametrize("codec", ["xl-zstd", "ctx-zstd", "raw-lm", "zstd-lm", "ctx-ans"])
def test_reader_refuses_a_tiny_grid_below_the_section_floor(codec):
    """The stream the writer wrote before the floor (one-row x one-layer sections), built
    directly: refused by its head (naming the sample), before any section is decoded."""
    payload, _ = _tiny_grid_record(SCHEMA, codec)
    h = _payload.head_length(payload[:16], len(payload))
    with pytest.raises(SidecarError, match="below the reader's floor of 96 bytes") as ei:
        _payload.decode_head(payload[:h], SCHEMA, len(payload))
    assert ei.value.sample_id == "tiny"
    data = crafted.stream(SCHEMA, [payload])
    with SidecarReader(io.BytesIO(data)) as r:
        assert list(r.records(strict=False)) == []
        assert "floor" in str(r.errors[0])


@pytest.mark.parametrize("schema", [SCHEMA, RoutingSchema(num_hidden_layers=2,
                                                          moe_layer_ids=(0, 1), top_k=8,
                                                          num_experts=65536)])
def test_ctx_ans_section_under_its_floor_is_refused_and_never_written(schema):
    """ctx-ans's floor (per row block, layer and expert): a valid one-section ctx-ans record
    of 8 rows (before: read at 16-37 s per MiB; 223-293 s at E=65536) is refused by the
    section check naming it; the writer stores such a section as ctx-zstd instead, in both
    format versions."""
    t = 9
    rec = next(_records(schema, 1, t))
    blob = _codec.encode(rec.expert_ids, "ctx-ans", schema.num_experts)
    least = _codec.ctx_ans.least_bytes(t - 1, schema.num_moe_layers, schema.num_experts)
    assert len(blob) < least
    cid = crafted.CODECS_V3.index("ctx-ans")
    payload = _payload.assemble(_payload.encode_meta("short", t - 1), [(cid, blob)])
    with SidecarReader(io.BytesIO(crafted.stream(schema, [payload]))) as r:
        assert list(r.records(strict=False)) == []
        msg = str(r.errors[0])
        assert "below the reader's floor" in msg and "MoE layers [0, " in msg
    for version in (3, 2):
        data, recs = _write(schema, "ctx-ans", t=t, n=2, version=version)
        with SidecarReader(io.BytesIO(data)) as r:
            for x in recs:
                np.testing.assert_array_equal(r.read(x.sample_id).expert_ids, x.expert_ids)
            assert not r.errors
        assert b"ctx-zstd" in data                         # named in v2 metas / the v3 table
        if version == 3:
            for _, p in _frames(data):
                h = _payload.head_length(p[:16], len(p))
                meta = _payload.decode_head(p[:h], schema, len(p))
                codec_byte = p[h + meta.grid.table_len + 4]
                assert SidecarReader(io.BytesIO(data)).header["codecs"][codec_byte] == "ctx-zstd"


def test_long_ctx_ans_sections_stay_ctx_ans():
    """Sections above the floor keep their codec: 512-row ctx-ans sections of E=32 top-4."""
    data, recs = _write(SCHEMA, "ctx-ans", t=2049, n=1)
    r = SidecarReader(io.BytesIO(data))
    codecs = r.header["codecs"]
    _, p = _frames(data)[0]
    h = _payload.head_length(p[:16], len(p))
    meta = _payload.decode_head(p[:h], SCHEMA, len(p))
    g = meta.grid
    ends = [0] + list(np.frombuffer(p[h:h + g.table_len], "<u4")) + [len(p) - h - g.table_len]
    body = p[h + g.table_len:]
    used = {codecs[body[ends[i] + 4]] for i in range(g.n_routing)}
    assert used == {"ctx-ans"}
    np.testing.assert_array_equal(r.read("r0").expert_ids, recs[0].expert_ids)


def _truncated_token_id_stream():
    """A one-record stream whose token-id section is its zstd frame less its last byte
    (the frame's content is whole: only the frame's end is missing)."""
    rec = crafted.record(SCHEMA, "cut", 40, 0)

    def edit(meta, parts):
        i = next(j for j, s in enumerate(meta["sections"]) if s[0] == "token_ids")
        assert meta["sections"][i][1] == "zstd"
        frame = zstandard.ZstdCompressor(write_checksum=True).compress(
            np.asarray(rec.token_ids, "<i4").tobytes())
        parts[i] = frame[:-1]
    return crafted.forged(SCHEMA, rec, edit)


def _truncated_ctx_zstd_frame():
    ids = next(_records(SCHEMA, 1, 41)).expert_ids
    frame = _codec.encode(ids, "ctx-zstd", SCHEMA.num_experts)
    return ids, frame[:-1]


def test_truncated_zstd_frames_are_refused_everywhere_by_our_reader():
    """One rule (FORMAT.md "Conventions"): before, a token-id section's frame cut before its
    end was accepted (its blocks held every id) while ctx-zstd refused it."""
    data = _truncated_token_id_stream()
    with SidecarReader(io.BytesIO(data)) as r:
        assert list(r.records(strict=False)) == []
        assert "truncated" in str(r.errors[0])
    ids, cut = _truncated_ctx_zstd_frame()
    for c, blob in (("ctx-zstd", cut), ("xl-zstd", b"\0" + cut),
                    ("zstd-lm", _codec.encode(ids, "zstd-lm")[:-1])):
        with pytest.raises(SidecarError):
            _codec.decode(blob, c, ids.shape, ids.dtype, SCHEMA.num_experts)


def test_truncated_zstd_frames_are_refused_everywhere_by_the_spec_reader():
    """tests/spec_reader.py (written from FORMAT.md): before, it accepted the truncated
    ctx-zstd frame (decompressobj returns what it has) and refused the others; now one
    rule refuses both, and whole frames (with bytes after them) still read."""
    ids, cut = _truncated_ctx_zstd_frame()
    t, g, k = ids.shape
    with pytest.raises(AssertionError, match="truncated"):
        spec_reader.ctx_zstd(cut, t, g, k, SCHEMA.num_experts)
    whole = _codec.encode(ids, "ctx-zstd", SCHEMA.num_experts)
    got = spec_reader.ctx_zstd(whole + b"tail", t, g, k, SCHEMA.num_experts)
    assert got == ids.tolist()
    tok = np.arange(40, dtype="<i4")
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(tok.tobytes())
    with pytest.raises(AssertionError, match="truncated"):
        spec_reader.array("token_ids", "zstd", frame[:-1], 40)
    assert spec_reader.array("token_ids", "zstd", frame, 40) == tok.tolist()


@pytest.mark.parametrize("version", [2, 3])
def test_streams_of_earlier_writers_below_the_floors_stay_readable_on_request(
        tmp_path, monkeypatch, version):
    """Nothing written before is lost: a ctx-ans stream of 30-token records as earlier
    writers wrote it (no floors: emulated by switching the writer's floor off) is refused
    by default, naming the way to read it, and reads exactly with floors=False, as a file,
    through open_sidecar and through `convert --from sidecar --no-floors`, which re-codes
    it into a stream that reads with the floors."""
    from routereplay.sidecar import open_sidecar
    from tests.conftest import run_py
    schema = RoutingSchema(4, (1, 2, 3), 4, 16)
    with monkeypatch.context() as m:
        m.setattr(_payload, "section_floor", lambda *a, **k: 0)
        data, recs = _write(schema, "ctx-ans", t=30, n=4, version=version)
    old = tmp_path / "old.rrsc"
    old.write_bytes(data)
    with pytest.raises(SidecarError, match=r"below the reader's floor .*floors=False.*"
                                           r"--no-floors"):
        SidecarReader(str(old)).read("r0")
    for r in (SidecarReader(str(old), floors=False), open_sidecar(str(old), floors=False),
              open_sidecar([str(old), str(old)][:1], floors=False)):
        assert r.sample_ids() == [x.sample_id for x in recs]
        assert all(np.array_equal(r.read(x.sample_id).expert_ids, x.expert_ids) for x in recs)
    out = tmp_path / "new.rrsc"
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sidecar", str(old), "--out",
                str(out), "--no-floors"], timeout=60)
    assert p.returncode == 0, p.stderr
    new = SidecarReader(str(out))
    assert new.complete and all(np.array_equal(new.read(x.sample_id).expert_ids, x.expert_ids)
                                for x in recs)
