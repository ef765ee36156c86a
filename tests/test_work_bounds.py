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
from routereplay.sidecar import record_meta as _meta
from routereplay.sidecar.limits import SECTION_FLOOR
from tests import crafted
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


def _write(schema, codec, t=9, n=3, **kw):
    w = SidecarWriter(None, schema, codec=codec, background=False, **kw)
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


@pytest.mark.parametrize("codec", _codec.WRITER_CODECS)
def test_writer_keeps_tiny_grids_above_the_section_floor(codec):
    """A one-token x one-layer grid: before, the writer wrote 1-row sections of 17-33 bytes
    (read at 1.2-5 s of CPU per MiB); now every record holds at least SECTION_FLOOR bytes
    per routing section beyond its first, and it reads back exactly."""
    data, recs = _write(SCHEMA, codec, **TINY_GRID)
    frames = _frames(data)
    assert len(frames) == len(recs)
    for _, payload in frames:
        h = _meta.head_length(payload[:16], len(payload))
        meta = _meta.decode_head(payload[:h], SCHEMA, len(payload))
        assert meta.grid.n_routing >= 2                     # still a grid, not one section
        assert len(payload) >= SECTION_FLOOR * (meta.grid.n_routing - 1)
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
    meta = _meta.encode_meta(sid, t, 1, 1)
    return _payload.assemble(meta, secs), rec


@pytest.mark.parametrize("codec", ["xl-zstd", "ctx-zstd", "raw-lm"])
def test_reader_refuses_a_tiny_grid_below_the_section_floor(codec):
    """The stream the writer wrote before the floor (one-row x one-layer sections), built
    directly: refused by its head (naming the sample), before any section is decoded."""
    payload, _ = _tiny_grid_record(SCHEMA, codec)
    h = _meta.head_length(payload[:16], len(payload))
    with pytest.raises(SidecarError, match="below the reader's floor of 96 bytes") as ei:
        _meta.decode_head(payload[:h], SCHEMA, len(payload))
    assert ei.value.sample_id == "tiny"
    data = crafted.stream(SCHEMA, [payload])
    with SidecarReader(io.BytesIO(data)) as r:
        assert list(r.records(strict=False)) == []
        assert "floor" in str(r.errors[0])


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
    for c, blob in (("ctx-zstd", cut), ("xl-zstd", b"\0" + cut)):
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


def test_streams_of_earlier_writers_below_the_floors_stay_readable_on_request(
        tmp_path, monkeypatch):
    """Nothing written before is lost: a stream of tiny grids as earlier writers wrote it
    (no floor: emulated by switching the writer's floor off) is refused by default, naming
    the way to read it, and reads exactly with floors=False, as a file, through
    open_sidecar and through `convert --from sidecar --no-floors`, which re-codes it into a
    stream that reads with the floors."""
    from routereplay.sidecar import open_sidecar
    from tests.conftest import run_py
    schema = RoutingSchema(4, (1, 2, 3), 4, 16)
    with monkeypatch.context() as m:
        m.setattr(_payload, "grid_fits", lambda *a, **k: True)
        data, recs = _write(schema, "xl-zstd", t=30, n=4, **TINY_GRID)
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
