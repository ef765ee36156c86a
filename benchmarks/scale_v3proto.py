"""PROTOTYPE (benchmarks only, not the product): a sidecar layout for ranged, per-rank reads.

This is the layout docs/FORMAT-v3-draft.md proposes, written just far enough to measure it
in benchmarks/scale.py against today's format (version 2). It is not imported by the
product and has none of the product reader's recovery (scan, torn tail, resync) or limits.

What differs from version 2 (docs/FORMAT.md):

- routing sections are blocked along tokens as well as layers: section (g, b) holds MoE
  layers ``[g*G, (g+1)*G)`` for rows ``[b*B, (b+1)*B)`` (G = layer_group, B = token_block),
  each coded on its own with the product codec (``routereplay.codec``);
- sections lie group-major (all token blocks of group 0, then group 1 ...), so one pipeline
  stage's rows for one token run are one contiguous byte range;
- the record payload starts with a small head (meta length, meta JSON) and a table of
  u32 section end offsets; each section starts with its own CRC-32 (of the section index
  and its bytes), so a reader checks exactly what it read. The frame header's CRC field
  covers the head only (meta length + meta), not the whole payload;
- a reader needs two small reads per record (frame header + head; then the table entries
  of its layer groups), then one read per contiguous run of sections.

Stream, frame header, index frame and trailer are version 2's (docs/FORMAT.md), with
format version 3 in the stream header.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from typing import Any, BinaryIO, Sequence

import numpy as np
import zstandard

from routereplay import codec as _codec
from routereplay.errors import ConfigError, RecordError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (FRAME_HEADER_SIZE, FRAME_MAGIC, HEADER_FIXED_SIZE,
                                        KIND_INDEX, KIND_RECORD, MAGIC, TRAILER_SIZE, crc32,
                                        decode_index, encode_index, encode_trailer,
                                        parse_trailer)

VERSION = 3
_FIXED = struct.Struct("<8sHHI")
_FRAME = struct.Struct("<4sB3xQI")
HEAD_GUESS = 512          # bytes read speculatively for frame header + meta (one request)
TABLE_GAP = 1024          # table entries (4 bytes each) this close are read in one request
_U32 = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Section grid of the prototype: ``layer_group`` MoE layers x ``token_block`` rows.

    With ``divisor`` > 0 the token block is chosen per record (a writer policy; the record
    meta stores the block it used): the power of two nearest below T / divisor, clamped to
    ``[token_block, max_block]``.
    """

    token_block: int
    layer_group: int
    divisor: int = 0
    max_block: int = 4096

    def __str__(self) -> str:
        b = f"T/{self.divisor}@{self.token_block}-{self.max_block}" if self.divisor \
            else str(self.token_block)
        return f"B={b},G={self.layer_group}"

    def block(self, num_tokens: int) -> int:
        """Token block for a record of ``num_tokens`` rows."""
        if not self.divisor:
            return self.token_block
        b = 1 << max(0, int(max(num_tokens, 1) // self.divisor).bit_length() - 1)
        return min(max(b, self.token_block), self.max_block)

    @classmethod
    def parse(cls, s: str) -> "Geometry":
        """'512:2' -> Geometry(512, 2); 'T/32@256-4096:1' -> per-record blocks T/32
        clamped to [256, 4096], 1 MoE layer per group."""
        try:
            b, g = s.split(":")
            if b.startswith("T/"):
                d, _, rng = b[2:].partition("@")
                lo, _, hi = (rng or "256-4096").partition("-")
                geo = cls(int(lo), int(g), int(d), int(hi))
            else:
                geo = cls(int(b), int(g))
        except ValueError:
            raise ConfigError(f"geometry {s!r}: expected TOKEN_BLOCK:LAYER_GROUP or "
                              "T/DIVISOR@MIN-MAX:LAYER_GROUP") from None
        if geo.token_block < 1 or geo.layer_group < 1 or geo.max_block < geo.token_block:
            raise ConfigError(f"geometry {s!r}: sizes must be >= 1 (and MIN <= MAX)")
        return geo


def _frame(kind: int, payload: bytes, crc_len: int) -> bytes:
    hdr = _FRAME.pack(FRAME_MAGIC, kind, len(payload), crc32(payload[:crc_len]))
    return hdr + _U32.pack(crc32(hdr)) + payload


def _section_crc(index: int, blob: bytes) -> int:
    return zlib.crc32(blob, zlib.crc32(_U32.pack(index))) & 0xFFFFFFFF


def encode_record(record: RoutingRecord, schema: RoutingSchema, geo: Geometry,
                  codec: str = _codec.DEFAULT_CODEC) -> tuple[bytes, int, int]:
    """Prototype record payload; returns (payload, head bytes covered by the frame CRC,
    number of routing sections)."""
    ids, t = record.expert_ids, record.num_tokens
    nl = schema.num_moe_layers
    bsize = geo.block(t)
    blobs: list[bytes] = []
    for l0 in range(0, nl, geo.layer_group):
        l1 = min(l0 + geo.layer_group, nl)
        for r0 in range(0, max(t, 1), bsize):
            blobs.append(_codec.encode(np.ascontiguousarray(ids[r0:r0 + bsize, l0:l1]),
                                       codec, schema.num_experts))
    n_routing = len(blobs)
    arrays = []
    if record.token_ids is not None:
        tok = np.ascontiguousarray(record.token_ids, dtype="<i4")
        blobs.append(zstandard.ZstdCompressor(level=3).compress(tok.tobytes()))
        arrays.append(["token_ids", "zstd", int(tok.shape[0])])
    if record.logprobs is not None:
        lp = np.ascontiguousarray(record.logprobs, dtype="<f4")
        blobs.append(lp.tobytes())
        arrays.append(["logprobs", "raw", int(lp.shape[0])])
    meta: dict[str, Any] = {"sample_id": record.sample_id, "num_tokens": t,
                            "token_block": bsize, "layer_group": geo.layer_group,
                            "codec": codec}
    if record.start:
        meta["start"] = record.start
    if record.prompt_len is not None:
        meta["prompt_len"] = record.prompt_len
    if arrays:
        meta["arrays"] = arrays
    js = json.dumps(meta, separators=(",", ":")).encode()
    ends, pos, body = [], 0, []
    for i, b in enumerate(blobs):
        sec = _U32.pack(_section_crc(i, b)) + b
        body.append(sec)
        pos += len(sec)
        ends.append(pos)
    head = _U32.pack(len(js)) + js
    table = struct.pack(f"<{len(ends)}I", *ends)
    return head + table + b"".join(body), len(head), n_routing


class Writer:
    """Prototype stream writer (synchronous): header, record frames, index, trailer."""

    def __init__(self, path: str | os.PathLike, schema: RoutingSchema, geo: Geometry):
        self.schema, self.geo = schema, geo
        self._f = open(path, "wb")
        self.bytes_written = 0
        self.routing_sections = 0
        self._index: list[tuple[str, int]] = []
        meta = {"schema": schema.to_dict(), "codec": _codec.DEFAULT_CODEC,
                "column_order": "engine", "layer_group": geo.layer_group,
                "token_block": geo.token_block}
        js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        self._emit(_FIXED.pack(MAGIC, VERSION, 0, len(js)) + js + _U32.pack(crc32(js)))

    def _emit(self, b: bytes) -> None:
        self._f.write(b)
        self.bytes_written += len(b)

    def write(self, record: RoutingRecord) -> None:
        payload, crc_len, n = encode_record(record, self.schema, self.geo)
        self._index.append((record.sample_id, self.bytes_written))
        self.routing_sections += n
        self._emit(_frame(KIND_RECORD, payload, crc_len))

    def close(self) -> None:
        off = self.bytes_written
        self._emit(_frame(KIND_INDEX, encode_index(self._index), 1 << 62))
        self._emit(encode_trailer(off))
        self._f.close()


@dataclasses.dataclass
class _Head:
    offset: int            # frame offset
    payload_end: int       # absolute offset just past the payload
    num_tokens: int
    start: int
    geo: Geometry
    codec: str
    n_sections: int        # routing sections + arrays
    table_at: int          # absolute offset of the table
    body_at: int           # absolute offset of the body


class Reader:
    """Prototype reader with the product's RoutingSource ``fetch`` semantics.

    Args:
        f: a seekable binary file object (the benchmark passes a byte-counting wrapper).

    Reads: the stream header, trailer and index at open; per record, one speculative read
    of HEAD_GUESS bytes (frame header + meta; a second only if the meta is longer), cached
    for the reader's life; per fetch, the table entries of the needed layer groups and
    token blocks (one read per group) and the needed sections (one read per contiguous
    range of sections).
    """

    def __init__(self, f: BinaryIO):
        self._f = f
        f.seek(0, os.SEEK_END)
        self.size = f.tell()
        fixed = self._at(0, HEADER_FIXED_SIZE)
        magic, version, _, jlen = _FIXED.unpack(fixed)
        if magic != MAGIC or version != VERSION:
            raise SidecarError("not a prototype v3 stream", offset=0)
        js = self._at(HEADER_FIXED_SIZE, jlen + 4)
        if _U32.unpack(js[-4:])[0] != crc32(js[:-4]):
            raise SidecarError("v3 header checksum mismatch", offset=0)
        hdr = json.loads(js[:-4])
        self.schema = RoutingSchema.from_dict(hdr["schema"])
        data_start = HEADER_FIXED_SIZE + jlen + 4
        off = parse_trailer(self._at(self.size - TRAILER_SIZE, TRAILER_SIZE))
        if off is None:
            raise SidecarError("prototype reader needs a closed stream (no trailer)")
        fh = self._at(off, FRAME_HEADER_SIZE)
        _, kind, plen, pcrc = _FRAME.unpack(fh[:20])
        payload = self._at(off + FRAME_HEADER_SIZE, plen)
        if kind != KIND_INDEX or crc32(payload) != pcrc:
            raise SidecarError("prototype index frame corrupt", offset=off)
        self._offsets = dict(decode_index(payload, data_start, off) or [])
        self._heads: dict[str, _Head] = {}

    def _at(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        b = self._f.read(n)
        if len(b) != n:
            raise SidecarError(f"short read at offset {offset}", offset=offset)
        return b

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._offsets

    def sample_ids(self) -> list[str]:
        return list(self._offsets)

    def _head(self, sid: str) -> _Head:
        h = self._heads.get(sid)
        if h is not None:
            return h
        if sid not in self._offsets:
            raise UnknownSampleError(f"sample {sid!r} not in sidecar", sid)
        off = self._offsets[sid]
        n = min(HEAD_GUESS, self.size - off)
        b = self._at(off, n)
        magic, kind, plen, pcrc = _FRAME.unpack(b[:20])
        if magic != FRAME_MAGIC or _U32.unpack(b[20:24])[0] != crc32(b[:20]) or kind != KIND_RECORD:
            raise SidecarError(f"sample {sid!r}: corrupt frame header at offset {off}",
                               offset=off, sample_id=sid)
        (mlen,) = _U32.unpack(b[24:28])
        if 28 + mlen > len(b):
            b += self._at(off + len(b), 28 + mlen - len(b))
        if crc32(b[24:28 + mlen]) != pcrc:
            raise SidecarError(f"sample {sid!r}: record head checksum mismatch at offset {off}",
                               offset=off, sample_id=sid)
        m = json.loads(b[28:28 + mlen])
        geo = Geometry(int(m["token_block"]), int(m["layer_group"]))
        t = int(m["num_tokens"])
        nl = self.schema.num_moe_layers
        n_sec = -(-nl // geo.layer_group) * max(1, -(-t // geo.token_block)) + len(m.get("arrays", []))
        table_at = off + 28 + mlen
        h = _Head(off, off + FRAME_HEADER_SIZE + plen, t, int(m.get("start", 0)), geo,
                  str(m["codec"]), n_sec, table_at, table_at + 4 * n_sec)
        if h.body_at > h.payload_end:
            raise SidecarError(f"sample {sid!r}: section table runs past the frame", offset=off,
                               sample_id=sid)
        self._heads[sid] = h
        return h

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, int]]:
        """Same contract as ``routereplay.source.RoutingSource.fetch``."""
        schema = self.schema
        want = [int(x) for x in moe_layers]
        k, dt = schema.top_k, schema.id_dtype
        if not want:                       # no MoE layer in this chunk: nothing to read
            return [(np.zeros((0, 0, k), dt), int(lo)) for lo, _ in runs]
        h = self._head(sample_id)
        B, G = h.geo.token_block, h.geo.layer_group
        nb = max(1, -(-h.num_tokens // B))
        rows: list[tuple[int, int]] = []
        for lo, hi in runs:
            a = min(max(int(lo) - h.start, 0), h.num_tokens)
            rows.append((a, min(max(int(hi) - h.start, a), h.num_tokens)))
        blocks = sorted({b for a, e in rows if e > a for b in range(a // B, (e - 1) // B + 1)})
        groups = sorted({x // G for x in want})
        out = [np.empty((e - a, len(want), k), dt) for a, e in rows]
        # NOTE: each section is decoded, scattered into the outputs and dropped, so the
        # reader holds the rank's rows plus one read range and one decoded section.
        by_group: dict[int, list[int]] = {}
        for i, x in enumerate(want):
            by_group.setdefault(x // G, []).append(i)
        if blocks:
            needed = [g * nb + b for g in groups for b in blocks]          # section indices
            ends = self._table(h, needed)
            spans = [(i // nb, i % nb, ends[i - 1] if i else 0, ends[i]) for i in needed]
            j = 0
            while j < len(spans):         # one read per run of adjacent sections
                e = j
                while e + 1 < len(spans) and spans[e + 1][2] == spans[e][3]:
                    e += 1
                s0, s1 = spans[j][2], spans[e][3]
                if not 0 <= s0 <= s1 or h.body_at + s1 > h.payload_end:
                    raise SidecarError(f"sample {sample_id!r}: section offsets out of the frame",
                                       offset=h.offset, sample_id=sample_id)
                buf = memoryview(self._at(h.body_at + s0, s1 - s0))
                for g, b, a0, a1 in spans[j:e + 1]:
                    sec = buf[a0 - s0:a1 - s0]
                    blob = bytes(sec[4:])
                    if len(sec) < 4 or _U32.unpack(sec[:4])[0] != _section_crc(g * nb + b, blob):
                        raise SidecarError(
                            f"sample {sample_id!r}: section (layer group {g}, token block {b}) "
                            f"checksum mismatch (frame at offset {h.offset})",
                            offset=h.offset, sample_id=sample_id)
                    l0, l1 = g * G, min((g + 1) * G, schema.num_moe_layers)
                    b0, b1 = b * B, min((b + 1) * B, h.num_tokens)
                    d = _codec.decode(blob, h.codec, (b1 - b0, l1 - l0, k), dt, schema.num_experts)
                    for o, (a, e2) in zip(out, rows):
                        r0, r1 = max(a, b0), min(e2, b1)
                        if r1 > r0:
                            for i in by_group[g]:
                                o[r0 - a:r1 - a, i] = d[r0 - b0:r1 - b0, want[i] - l0]
                    del d
                j = e + 1
        layer_ids = [schema.moe_layer_ids[x] for x in want]
        for o, (a, _) in zip(out, rows):
            try:
                RoutingRecord(sample_id, o, start=h.start + a).validate_ids(schema, layer_ids)
            except RecordError as err:
                raise SidecarError(f"frame at offset {h.offset}: {err}", offset=h.offset,
                                   sample_id=sample_id) from None
        return [(o, h.start + a) for o, (a, _) in zip(out, rows)]

    def _table(self, h: _Head, needed: list[int]) -> dict[int, int]:
        """End offsets of sections ``needed`` and of the sections just before them, read
        in ranges (entries less than TABLE_GAP apart share one read)."""
        want = sorted({i for x in needed for i in (x - 1, x) if i >= 0})
        out: dict[int, int] = {}
        j = 0
        while j < len(want):
            e = j
            while e + 1 < len(want) and want[e + 1] - want[e] <= TABLE_GAP:
                e += 1
            i0, i1 = want[j], want[e]
            if i1 >= h.n_sections:
                raise SidecarError(f"section {i1} beyond the record's table", offset=h.offset)
            vals = struct.unpack(f"<{i1 - i0 + 1}I", self._at(h.table_at + 4 * i0, 4 * (i1 - i0 + 1)))
            out.update(zip(range(i0, i1 + 1), vals))
            j = e + 1
        return out

    def close(self) -> None:
        self._f.close()


def roundtrip_check(records: Sequence[RoutingRecord], schema: RoutingSchema, geo: Geometry) -> None:
    """Write ``records`` to a temporary prototype stream and read every layer back (used by
    the benchmark's self-check)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.rrsc")
        w = Writer(p, schema, geo)
        for r in records:
            w.write(r)
        w.close()
        rd = Reader(open(p, "rb"))
        for r in records:
            (got, first), = rd.fetch(r.sample_id, range(schema.num_moe_layers),
                                     [(r.start, r.start + r.num_tokens)])
            if first != r.start or not np.array_equal(got, r.expert_ids):
                raise AssertionError(f"prototype round trip failed for {r.sample_id}")
        rd.close()


__all__ = ["Geometry", "Writer", "Reader", "encode_record", "roundtrip_check"]
