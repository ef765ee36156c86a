"""`xl-ans` streams (docs/FORMAT.md "### `xl-ans`", "#### Model payload (kind 3)") read by
the independent spec reader (tests/spec_reader.py), and corrupt ones refused by both it and
routereplay's reader."""
import contextlib
import math
import struct
import zlib
from functools import lru_cache

import numpy as np
import pytest
import zstandard

from routereplay.errors import SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader, SidecarWriter
from tests.test_xl_ans_rows import writers_before_rows
from routereplay.testing import CrossLayerRouting
from tests import spec_reader

# (L_moe, E, K, record lengths): C = binom(8, 2) = 28 > 0 (joint table), then records too
# short for xl-ans (its floor); E=16 K=4: C = 0 (1820 x 16 > 8192); the last record of the third is a
# grid (1400 x 12 x 4 > 65536 id bytes: 3 token blocks x 2 layer groups of 8, so l0 = 8).
# Top-2 of 8 experts is coded xl-ans-rows; "-cols" cases are written with xl-ans alone (as
# before xl-ans-rows; their streams must still read), E8K3 has a joint table and columns.
CASES = {
    "E8K2": (6, 8, 2, (300,) * 90 + (1, 2, 3, 17)),
    "E8K2-cols": (6, 8, 2, (300,) * 40 + (1, 17)),
    "E8K1": (5, 8, 1, (300,) * 40 + (1, 2)),
    "E8K3": (6, 8, 3, (300,) * 40),
    "E16K4": (6, 16, 4, (300,) * 30),
    "grid": (12, 16, 4, (300,) * 10 + (1400,)),
    "gridE8": (10, 8, 2, (300,) * 15 + (3400,)),     # 3400 x 10 x 2 > 65536, C > 0
}
ROWS = {"E8K2", "E8K1", "gridE8"}                     # cases whose sections are xl-ans-rows
XL = ("xl-ans", "xl-ans-rows")


@lru_cache(maxsize=None)
def build(case):
    """-> (stream bytes, input ids per record) written by routereplay's xl-ans writer."""
    lmoe, e, k, lens = CASES[case]
    rng = np.random.default_rng(11)
    src = CrossLayerRouting.make(np.random.default_rng(7), lmoe, e, k)
    schema = RoutingSchema(lmoe + 1, tuple(range(1, lmoe + 1)), k, e)
    with writers_before_rows() if case.endswith("-cols") else contextlib.nullcontext():
        w = SidecarWriter(None, schema, codec="xl-ans", background=False)
    ids_in = []
    for i, t in enumerate(lens):
        ids, _ = src.sample(rng, t)
        ids = np.ascontiguousarray(ids, dtype=np.uint8)
        w.write(RoutingRecord(f"s{i}", ids))
        ids_in.append(ids)
    w.close()
    return w.getvalue(), tuple(ids_in)


def frames(data):
    """-> [(offset, kind, payload length)] of the frames after the header."""
    (j,) = struct.unpack("<I", data[12:16])
    off, out = 20 + j, []
    while off + 24 <= len(data) and data[off:off + 4] == b"RRFM":
        kind, plen = data[off + 4], struct.unpack("<Q", data[off + 8:off + 16])[0]
        out.append((off, kind, plen))
        off += 24 + plen
    return out


@lru_cache(maxsize=None)
def spec_read(case):
    return spec_reader.read_stream(build(case)[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_reader_reads_xl_ans(case):
    data, ids_in = build(case)
    header, records = spec_read(case)
    assert header["codecs"][0] == "xl-ans"
    models = [off for off, kind, _ in frames(data) if kind == 3]
    assert models, "the writer wrote no model frame"
    used = [s for r in records for s in r["section_codecs"] if s[0] in XL]
    assert len(used) >= 5, "too few xl-ans sections to test anything"
    assert {s[0] for s in used} == {"xl-ans-rows" if case in ROWS else "xl-ans"}
    assert {s[3] for s in used} <= set(models)
    assert [r["sample_id"] for r in records] == [f"s{i}" for i in range(len(ids_in))]
    for rec, ids in zip(records, ids_in):
        assert rec["routing"] == ids.tolist(), rec["sample_id"]
    if len(models) >= 2:      # (writer policy) a later model is used after it is written
        assert {s[3] for s in used} == set(models)
    if case.startswith("grid"):   # sections whose first layer is not the record's first
        grid = records[-1]["section_codecs"]
        t = CASES[case][3][-1]
        assert len(grid) == 2 * -(-t // 512)          # layer groups of 8, token blocks of 512
        assert any(s[0] in XL and s[1] == 8 for s in grid)
        assert any(s[0] in XL and s[2] > 0 for s in grid)
    # routereplay's reader agrees
    r = SidecarReader(data)
    for i, ids in enumerate(ids_in):
        np.testing.assert_array_equal(r.read(f"s{i}").expert_ids, ids)


def xl_ans_record(case):
    """-> (sample id, frame offset, section data offset, data length) of a one-section
    record whose section is xl-ans or xl-ans-rows."""
    data, _ = build(case)
    _, records = spec_read(case)
    rec_frames = [f for f in frames(data) if f[1] == 1]
    for rec, (off, _, plen) in zip(records, rec_frames):
        if len(rec["section_codecs"]) == 1 and rec["section_codecs"][0][0] in XL:
            m, pos = spec_reader.varint(data, off + 24)
            sec = pos + m                     # S = 1: no table; crc (4), codec (1), data
            return rec["sample_id"], off, sec + 5, off + 24 + plen - sec - 5
    raise AssertionError("no one-section xl-ans record")


def with_section_data(data, sec, n, new):
    """``data`` with the first bytes of a one-section record's section data (at ``sec``,
    ``n`` bytes) replaced by ``new``, its section CRC fixed (section index 0)."""
    b = bytearray(data)
    b[sec:sec + len(new)] = new
    b[sec - 5:sec - 1] = struct.pack("<I", zlib.crc32(struct.pack("<I", 0) + b[sec - 1:sec + n]))
    return bytes(b)


def refused(data, sid):
    with pytest.raises(Exception):
        spec_reader.read_stream(data)
    with pytest.raises(SidecarError):
        SidecarReader(data).read(sid)


def test_corrupt_model_payload_is_refused():
    data, _ = build("E8K2")
    sid, _, sec, _ = xl_ans_record("E8K2")
    model = spec_reader.varint(data, sec)[0]
    (off, kind, plen), = [f for f in frames(data) if f[0] == model]
    assert kind == 3
    b = bytearray(data)
    b[off + 24 + plen // 2] ^= 0x10            # inside the tables' zstd frame; no CRC fixed
    refused(bytes(b), sid)


def test_model_with_wrong_shape_is_refused():
    """A model whose L differs from the stream's (its CRCs fixed) is refused."""
    data, _ = build("E16K4")
    sid, _, sec, _ = xl_ans_record("E16K4")
    off = spec_reader.varint(data, sec)[0]
    plen = struct.unpack("<Q", data[off + 8:off + 16])[0]
    b = bytearray(data)
    assert b[off + 24] == 6
    b[off + 24] = 5
    b[off + 16:off + 20] = struct.pack("<I", zlib.crc32(b[off + 24:off + 24 + plen]))
    b[off + 20:off + 24] = struct.pack("<I", zlib.crc32(b[off:off + 20]))
    refused(bytes(b), sid)


@pytest.mark.parametrize("case", ["E8K2", "E8K2-cols"])
def test_model_offset_must_name_a_model_frame(case):
    data, _ = build(case)
    sid, rec_off, sec, n = xl_ans_record(case)
    o, pos = spec_reader.varint(data, sec)
    (j,) = struct.unpack("<I", data[12:16])
    for bad in (rec_off, 20 + j - 24, o + 1):     # a record frame, the header, not a frame
        enc = varint_bytes(bad)
        assert len(enc) == pos - sec
        refused(with_section_data(data, sec, n, enc), sid)


@pytest.mark.parametrize("case", ["E8K2", "E8K2-cols", "E8K1"])
def test_corrupt_words_are_refused(case):
    """Words changed (section CRC fixed) fail the decoder's own checks."""
    data, _ = build(case)
    sid, _, sec, n = xl_ans_record(case)
    pos = spec_reader.varint(data, sec)[1]
    for at in (pos, pos + (sec + n - pos) // 2, sec + n - 5):
        new = bytearray(data[sec:sec + n])
        new[at - sec] ^= 0x5A
        refused(with_section_data(data, sec, n, bytes(new)), sid)


def varint_bytes(n):
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_model_payload_size_limits():
    """A model payload over `n + floor(n / 64) + 64` bytes is refused before decompressing;
    so are tables re-coded without a declared content size, or behind a skippable frame
    (CRCs fixed; the attacker review found them read by one reader and not the other)."""
    data, ids = build("E8K2")
    fr = frames(data)
    models = [f for f in fr if f[1] == 3]
    off, _, plen = models[0]
    # no index (records found by scanning), no later model (whose offset would move)
    base = data[:min(f[0] for f in fr if f[1] == 2 or f in models[1:])]
    sids = [f"s{i}" for i, f in enumerate(f for f in fr if f[1] == 1) if f[0] < len(base)]
    payload = data[off + 24:off + 24 + plen]
    lmoe, e, k, _ = CASES["E8K2"]
    c = math.comb(e, k)
    assert c * e <= 8192
    n = 2 * lmoe * (6 + e + e * e + c * e)

    def with_payload(p):
        hdr = bytearray(data[off:off + 24])
        hdr[8:16] = struct.pack("<Q", len(p))
        hdr[16:20] = struct.pack("<I", zlib.crc32(p))
        hdr[20:24] = struct.pack("<I", zlib.crc32(bytes(hdr[:20])))
        return base[:off] + bytes(hdr) + p + base[off + 24 + plen:]

    assert payload[:3] == bytes([lmoe, e, k])
    tables = zstandard.ZstdDecompressor().decompressobj().decompress(payload[3:])
    assert len(tables) == n
    sid = xl_ans_record("E8K2")[0]
    assert sid in sids
    plain = with_payload(payload[:3] + zstandard.ZstdCompressor(
        write_content_size=False).compress(tables))
    refused(plain, sid)
    skip = struct.pack("<II", 0x184D2A50, 4) + b"junk"        # a zstd skippable frame
    refused(with_payload(payload[:3] + skip + payload[3:]), sid)
    refused(with_payload(payload + skip), sid)
    same = with_payload(payload)                               # the control: read by both
    _, records = spec_reader.read_stream(same)
    assert any(s[0] in XL for r in records for s in r["section_codecs"])
    big = with_payload(payload + bytes(n + n // 64 + 64 + 1 - len(payload)))
    refused(big, sid)
