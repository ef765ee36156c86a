"""Crafted sidecar inputs: valid checksums around forged sizes, bombs and junk (issue 16).

Each builder returns bytes that a reader must handle within its limits (docs/FORMAT.md
"Reader limits"): refused with a RouteReplayError, or read, at a cost bounded by the
input's size. Used by tests/test_fuzz_bounds.py and benchmarks/robustness.py.

A record payload is edited as ``(meta, parts)`` (:func:`split_payload`), the same shape for
every version: ``meta`` the record's fields, with ``meta["sections"]`` a list of
``[name, codec, length, a, b]`` (routing: version 2 ``l0, l1``, version 3 layer group
``g`` and token block ``b``) or ``[name, codec, length, count]`` (arrays), and ``parts``
the sections' data. :func:`join_payload` re-encodes it with valid checksums (version 3:
head CRC in the frame, a CRC per section, the table from the parts), so the forgeries
reach the meta and codec checks behind them. Version 3 also takes ``meta["table"]`` (forged
section-table entries) and ``meta["bad_crc"]`` (section indices whose CRC is left wrong).
Version-3 crafted streams declare the codec table :data:`CODECS_V3`, so a section may name
any codec, a bogus one and those removed in 0.3.0 included. Version-2 streams (read only
since 0.3.0) are written by :func:`v2_payload` / :func:`v2_stream`, the 0.2 encoder kept
here for tests of the reader.
"""
from __future__ import annotations

import json
import struct
from typing import Callable

import numpy as np
import zstandard

from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar import payload as _payload
from routereplay.sidecar import record_meta as _meta
from routereplay import codec as _codec
from routereplay.sidecar.layout import (FORMAT_VERSION, KIND_INDEX, KIND_RECORD, MAGIC, crc32,
                                        encode_frame, encode_header, encode_trailer)
from routereplay.sidecar.payload import FALLBACK, encode_record_payload, section_fits
from routereplay.varint import read_varint

# the codec table of crafted version-3 streams (a section's codec byte indexes it)
CODECS_V3 = ("ctx-zstd", "raw-lm", "zstd", "raw", "ctx-ans", "ctx-ans-sorted", "zstd-lm",
             "xl-zstd", "bogus")

MiB = 1 << 20


def record(schema: RoutingSchema, sample_id: str, num_tokens: int, seed: int,
           arrays: bool = True) -> RoutingRecord:
    """A valid record with ``num_tokens`` tokens (``num_tokens - 1`` rows)."""
    rng = np.random.default_rng(seed)
    t = num_tokens - 1
    ids = np.argsort(rng.random((t, schema.num_moe_layers, schema.num_experts)), axis=-1)
    ids = ids[..., :schema.top_k].astype(schema.id_dtype)
    p = max(1, num_tokens // 2)
    return RoutingRecord(
        sample_id=sample_id, expert_ids=ids, prompt_len=p,
        token_ids=rng.integers(0, 500, num_tokens).astype(np.int32) if arrays else None,
        logprobs=(-rng.random(num_tokens - p).astype(np.float32)) if arrays else None,
        weight_versions=[WeightVersionSpan("v0", 0, num_tokens)], engine="crafted")


def split_payload(payload: bytes, version: int = FORMAT_VERSION,
                  schema: RoutingSchema | None = None) -> tuple[dict, list[bytes]]:
    """(meta, section data in body order) of a record payload (module doc); version 3
    needs the stream's ``schema``."""
    if version < 3:
        (mlen,) = struct.unpack("<I", payload[:4])
        meta = json.loads(payload[4:4 + mlen])
        body, parts, pos = payload[4 + mlen:], [], 0
        for sec in meta["sections"]:
            parts.append(body[pos:pos + sec[2]])
            pos += sec[2]
        return meta, parts
    buf = memoryview(payload)
    h = _meta.head_length(buf[:10], len(buf))
    m = _meta.decode_head(buf[:h], schema, len(buf))
    g = m.grid
    grid = _is_grid(buf)
    meta: dict = {"sample_id": m.sample_id, "num_tokens": m.num_tokens, "start": m.start,
                  "prompt_len": m.prompt_len,
                  "weight_versions": [[w.version, w.start, w.end] for w in m.weight_versions],
                  "recomputed": [list(x) for x in m.recomputed],
                  "prefix_cached": [list(x) for x in m.prefix_cached], "engine": m.engine,
                  "token_block": g.token_block if grid else None,
                  "layer_group": g.layer_group if grid else None,
                  "sections": []}
    ends = [0] + np.frombuffer(buf[h:h + g.table_len], dtype="<u4").tolist() \
        + [len(buf) - h - g.table_len]
    body = buf[h + g.table_len:]
    parts = []
    for i in range(g.n_sections):
        raw = bytes(body[ends[i]:ends[i + 1]])
        codec, data = CODECS_V3[raw[4]], raw[5:]
        if i < g.n_routing:
            meta["sections"].append(["routing", codec, len(data), *divmod(i, g.n_blocks)])
        else:
            name, n = g.arrays[i - g.n_routing]
            meta["sections"].append([name, codec, len(data), n])
        parts.append(data)
    return meta, parts


def _is_grid(buf: memoryview) -> bool:
    _, pos = read_varint(buf, 0)
    return bool(read_varint(buf, pos)[0] & _meta.F_GRID)


def join_payload(meta: dict, parts: list[bytes], version: int = FORMAT_VERSION) -> bytes:
    """Inverse of :func:`split_payload`; section lengths are set from ``parts``."""
    for sec, part in zip(meta["sections"], parts):
        sec[2] = len(part)
    if version < 3:
        js = json.dumps(meta).encode()
        return struct.pack("<I", len(js)) + js + b"".join(parts)
    arrays = {sec[0]: sec[3] for sec in meta["sections"] if sec[0] != "routing"}
    mb = _meta.encode_meta(
        meta["sample_id"], meta["num_tokens"], meta.get("token_block"), meta.get("layer_group"),
        start=meta.get("start", 0), prompt_len=meta.get("prompt_len"), arrays=arrays,
        weight_versions=meta.get("weight_versions", ()), engine=meta.get("engine", ""),
        recomputed=meta.get("recomputed", ()), prefix_cached=meta.get("prefix_cached", ()))
    secs = [(CODECS_V3.index(sec[1]) if sec[1] in CODECS_V3 else 255, bytes(part))
            for sec, part in zip(meta["sections"], parts)]
    out = _payload.assemble(mb, secs, meta.get("table"))
    if meta.get("bad_crc"):
        buf = bytearray(out)
        h = out.head_len
        table = meta.get("table") or np.cumsum([5 + len(d) for _, d in secs])[:-1].tolist()
        body_at = h + 4 * (len(secs) - 1)
        for i in meta["bad_crc"]:
            buf[body_at + ([0] + list(table))[i]] ^= 0xFF         # the CRC's first byte
        out2 = _payload.RecordPayload(bytes(buf))
        out2.head_len = h
        return out2
    return out


def reseal(payload: bytes, schema: RoutingSchema) -> bytes:
    """A version-3 payload whose bytes were edited, with its checksums made valid again
    where its head and table still say where they lie: the frame's CRC over the head
    (:func:`encode_frame` takes ``head_len``), and each section's CRC."""
    out = _payload.RecordPayload(payload)
    buf = memoryview(payload)
    try:
        h = _meta.head_length(buf[:10], len(buf))
    except Exception:  # noqa: BLE001 - a head that does not parse: nothing to reseal
        return out
    out.head_len = h
    try:
        g = _meta.decode_head(buf[:h], schema, len(buf)).grid
    except Exception:  # noqa: BLE001
        return out
    body = h + g.table_len
    ends = [0] + np.frombuffer(buf[h:body], dtype="<u4").tolist() + [len(buf) - body]
    fixed = bytearray(payload)
    for i in range(g.n_sections):
        a, b = body + ends[i], body + ends[i + 1]
        if b - a >= 5 and b <= len(buf):
            fixed[a:a + 4] = struct.pack("<I", _payload.section_crc(i, fixed[a + 4],
                                                                    bytes(fixed[a + 5:b])))
    out = _payload.RecordPayload(bytes(fixed))
    out.head_len = h
    return out


def stream(schema: RoutingSchema, payloads: list[bytes], version: int = FORMAT_VERSION) -> bytes:
    """A stream (no index) framing ``payloads`` with valid checksums."""
    head = encode_header(schema, codecs=CODECS_V3) if version >= 3 else v2_header(schema)
    return head + b"".join(encode_frame(KIND_RECORD, p) for p in payloads)


# --------------------------------------------------------------------------- version 2
V2_META_DEFAULTS = {"start": 0, "prompt_len": None, "weight_versions": [], "recomputed": [],
                    "prefix_cached": [], "engine": "", "sampling": None}


def v2_header(schema: RoutingSchema, codec: str = "ctx-zstd", layer_group: int = 4,
              column_order: str = "engine", extra: dict | None = None) -> bytes:
    """A version-2 stream header (docs/FORMAT.md "Header"), as routereplay 0.2 wrote it."""
    meta = {"schema": schema.to_dict(), "codec": codec, "column_order": column_order,
            "layer_group": layer_group, **({"extra": extra} if extra else {})}
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<8sHHI", MAGIC, 2, 0, len(js)) + js + struct.pack("<I", crc32(js))


def v2_payload(rec: RoutingRecord, schema: RoutingSchema, codec: str = "ctx-zstd",
               layer_group: int = 4, column_order: str = "engine") -> bytes:
    """A version-2 record payload as routereplay 0.2's writer encoded it: u32 meta_len, meta
    JSON without its defaults, sections ``[name, codec, length, a, b]`` back to back; a
    routing section beyond the expansion limit falls back to ``ctx-zstd``, ``raw-lm``."""
    ids = np.sort(rec.expert_ids, axis=-1) if column_order == "sorted" else rec.expert_ids
    sections, blobs = [], []
    nl = schema.num_moe_layers
    for l0 in range(0, nl, layer_group):
        part = ids[:, l0:min(l0 + layer_group, nl)]
        for c in (codec,) + tuple(f for f in FALLBACK if f != codec):
            blob = _codec.encode(part, c, schema.num_experts)
            if section_fits(c, part.nbytes, len(blob)):
                break
        blobs.append(blob)
        sections.append(["routing", c, len(blob), l0, l0 + part.shape[1]])
    if rec.token_ids is not None:
        tok = np.ascontiguousarray(rec.token_ids, dtype="<i4").tobytes()
        blob, c = zstandard.ZstdCompressor(level=3).compress(tok), "zstd"
        blob, c = (blob, c) if section_fits(c, len(tok), len(blob)) else (tok, "raw")
        blobs.append(blob)
        sections.append(["token_ids", c, len(blob), len(tok) // 4])
    if rec.logprobs is not None:
        blobs.append(np.ascontiguousarray(rec.logprobs, dtype="<f4").tobytes())
        sections.append(["logprobs", "raw", len(blobs[-1]), len(blobs[-1]) // 4])
    meta = {k: v for k, v in rec.meta().items() if V2_META_DEFAULTS.get(k, ...) != v}
    meta["sections"] = sections
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<I", len(js)) + js + b"".join(blobs)


def v2_stream(schema: RoutingSchema, records: list[RoutingRecord], *, closed: bool = True,
              **kw) -> bytes:
    """A version-2 stream of ``records`` (``kw``: :func:`v2_payload`'s codec, layer_group,
    column_order), with its JSON index and trailer unless ``closed`` is False."""
    out = [v2_header(schema, **kw)]
    pos, index = len(out[0]), []
    for rec in records:
        frame = encode_frame(KIND_RECORD, v2_payload(rec, schema, **kw))
        index.append([rec.sample_id, pos])
        out.append(frame)
        pos += len(frame)
    if closed:
        out += [encode_frame(KIND_INDEX, json.dumps({"records": index},
                                                    separators=(",", ":")).encode()),
                encode_trailer(pos)]
    return b"".join(out)


def forged(schema: RoutingSchema, rec: RoutingRecord, edit: Callable[[dict, list], None],
           codec: str | None = None, version: int = FORMAT_VERSION, **kw) -> bytes:
    """A one-record stream whose meta and sections ``edit(meta, parts)`` changed in place.
    ``kw``: more :func:`encode_record_payload` options (version 3: ``token_block``,
    ``layer_group``, ``one_section_bytes``)."""
    if version >= 3:
        kw["codecs"] = CODECS_V3
        payload = encode_record_payload(rec, schema, **({"codec": codec} if codec else {}), **kw)
    else:
        payload = v2_payload(rec, schema, **({"codec": codec} if codec else {}), **kw)
    meta, parts = split_payload(payload, version, schema)
    edit(meta, parts)
    return stream(schema, [join_payload(meta, parts, version)], version)


def zstd_bomb(nbytes: int, fill: bytes = b"\0") -> bytes:
    """One zstd frame holding ``nbytes`` bytes of ``fill`` (about 32 KiB per GiB)."""
    cobj = zstandard.ZstdCompressor(level=19).compressobj(size=nbytes)
    block, out, left = fill * MiB, [], nbytes
    while left:
        out.append(cobj.compress(block[:min(left, MiB)]))
        left -= min(left, MiB)
    return b"".join(out) + cobj.flush()


def _section(meta: dict, name: str) -> int:
    return next(i for i, s in enumerate(meta["sections"]) if s[0] == name)


def forged_count(schema: RoutingSchema, num_tokens: int = 1 << 24) -> bytes:
    """Issue 16 item 8: a record of 11 rows whose meta claims ``num_tokens``."""
    def edit(meta, parts):
        meta["num_tokens"] = num_tokens
    return forged(schema, record(schema, "count", 12, 1, arrays=False), edit)


def ctx_zstd_bomb(schema: RoutingSchema, num_tokens: int = 1 << 24) -> bytes:
    """Issue 16 item 8: a ctx-zstd section whose frame expands to its full size limit."""
    g, k = schema.num_moe_layers, schema.top_k
    nbits = -(-num_tokens * g // 8)
    bomb = zstd_bomb(nbits + num_tokens * g * k, b"\xff")

    def edit(meta, parts):
        meta["num_tokens"] = num_tokens
        parts[_section(meta, "routing")] = bomb
    return forged(schema, record(schema, "zb", 12, 2, arrays=False), edit)


def token_count_bomb(schema: RoutingSchema, count: int = 1 << 28) -> bytes:
    """Issue 16 item 7: 11 rows, a token_ids section claiming ``count`` ids (a zstd bomb)."""
    bomb = zstd_bomb(4 * count)

    def edit(meta, parts):
        i = _section(meta, "token_ids")
        meta["sections"][i][3] = count
        parts[i] = bomb
    return forged(schema, record(schema, "tok", 12, 3), edit)


def resync_junk(schema: RoutingSchema, nbytes: int = 32 * MiB) -> bytes:
    """Issue 16 item 8: a corrupt frame header, then ``nbytes`` of forged ``RRFM`` magics,
    then one good frame."""
    good = encode_frame(KIND_RECORD, encode_record_payload(record(schema, "g", 10, 4), schema))
    return encode_header(schema) + b"\0" * 24 + b"RRFM" * (nbytes // 4) + good


def many_tiny_records(schema: RoutingSchema, nbytes: int = 8 * MiB) -> bytes:
    """Valid records of one row each, ``nbytes`` of them (index memory per record)."""
    rec = record(schema, "x", 2, 5, arrays=False)
    meta, parts = split_payload(encode_record_payload(rec, schema, codecs=CODECS_V3),
                                schema=schema)
    frames, size, i = [], 0, 0
    while size < nbytes:
        meta["sample_id"] = f"t{i:08d}"
        f = encode_frame(KIND_RECORD, join_payload(meta, list(parts)))
        frames.append(f)
        size += len(f)
        i += 1
    return encode_header(schema, codecs=CODECS_V3) + b"".join(frames)


def many_corrupt_frames(schema: RoutingSchema, nbytes: int = 8 * MiB) -> bytes:
    """Frames whose headers are valid and whose payload checksums fail."""
    f = bytearray(encode_frame(KIND_RECORD, encode_record_payload(
        record(schema, "c", 2, 6, arrays=False), schema)))
    f[-1] ^= 0xFF
    return encode_header(schema) + bytes(f) * (nbytes // len(f))


def big_meta(schema: RoutingSchema, nbytes: int = 1 << 20) -> bytes:
    """A record meta of just under ``nbytes`` (the meta limit), mostly recomputed spans
    (two bytes each in version 3's binary meta)."""
    def edit(meta, parts):
        meta["recomputed"] = [[0, 1]] * ((nbytes - 4096) // 2)
    return forged(schema, record(schema, "m", 12, 7), edit)


# --------------------------------------------------------------------------- version 3


def _grid_record(schema: RoutingSchema, sample_id: str = "grid", num_tokens: int = 40,
                 seed: int = 9, arrays: bool = True) -> tuple[RoutingRecord, dict]:
    """A record and the writer options that make it a grid of 8-row x 1-layer sections."""
    return (record(schema, sample_id, num_tokens, seed, arrays),
            dict(token_block=8, layer_group=1, one_section_bytes=0, min_section_bytes=0))


def forged_table_entry(schema: RoutingSchema) -> bytes:
    """Version 3: a section-table entry moved into the next section (both sections' bytes
    change; a reader's CRC of each, which covers the section's index, refuses them)."""
    rec, kw = _grid_record(schema)

    def edit(meta, parts):
        ends = np.cumsum([5 + len(p) for p in parts])[:-1].tolist()
        ends[1] += 3
        meta["table"] = ends
    return forged(schema, rec, edit, **kw)


def swapped_table_entries(schema: RoutingSchema) -> bytes:
    """Version 3: sections 0 and 1 swapped in the body, the table following them: every
    byte is a valid section, at the wrong index (each CRC covers its index)."""
    rec, kw = _grid_record(schema)
    data = forged(schema, rec, lambda m, p: None, **kw)
    # NOTE: swap the two sections' stored bytes (CRC and codec byte included) in place
    buf = bytearray(data)
    head_at = _first_frame(schema, data) + 24
    h = _meta.head_length(buf[head_at:head_at + 10], len(buf) - head_at)
    m = _meta.decode_head(bytes(buf[head_at:head_at + h]), schema, len(buf) - head_at)
    g = m.grid
    table = np.frombuffer(bytes(buf[head_at + h:head_at + h + g.table_len]), "<u4").tolist()
    body = head_at + h + g.table_len
    s0, s1 = bytes(buf[body:body + table[0]]), bytes(buf[body + table[0]:body + table[1]])
    buf[body:body + table[1]] = s1 + s0
    buf[head_at + h:head_at + h + 4] = struct.pack("<I", len(s1))
    return bytes(buf)


def overlapping_sections(schema: RoutingSchema) -> bytes:
    """Version 3: table entries that go backwards (section 2 starts inside section 1)."""
    rec, kw = _grid_record(schema)

    def edit(meta, parts):
        ends = np.cumsum([5 + len(p) for p in parts])[:-1].tolist()
        ends[2] = ends[0] + 2
        meta["table"] = ends
    return forged(schema, rec, edit, **kw)


def section_crc_mismatch(schema: RoutingSchema) -> bytes:
    """Version 3: one routing section (MoE layer 1, rows [8, 16)) whose CRC fails; every
    other section reads."""
    rec, kw = _grid_record(schema)
    nb = -(-(rec.num_tokens) // kw["token_block"])

    def edit(meta, parts):
        meta["bad_crc"] = [1 * nb + 1]
    return forged(schema, rec, edit, **kw)


def grid_count_bomb(schema: RoutingSchema) -> bytes:
    """Version 3: a 40-token record whose meta claims 2^24 rows in blocks of one row
    (2^24 x L_moe sections): refused from the head, before any table entry is read."""
    rec, kw = _grid_record(schema, arrays=False)

    def edit(meta, parts):
        meta["num_tokens"] = 1 << 24
        meta["token_block"] = 1
    return forged(schema, rec, edit, **kw)


def _first_frame(schema: RoutingSchema, data: bytes) -> int:
    (jlen,) = struct.unpack("<I", data[12:16])
    return 20 + jlen


def largest_valid_record(schema: RoutingSchema, num_tokens: int = 1 << 20) -> bytes:
    """A valid, highly repetitive record written by the writer (its sections at or under the
    expansion limit; the writer falls back where its codec would exceed it)."""
    from routereplay.sidecar.writer import write_records
    rng = np.random.default_rng(8)
    t = num_tokens - 1
    fresh = rng.random(t) < 0.02
    fresh[0] = True
    rows = np.argsort(rng.random((int(fresh.sum()), schema.num_moe_layers, schema.num_experts)),
                      -1)[..., :schema.top_k]
    ids = rows[np.cumsum(fresh) - 1].astype(schema.id_dtype)
    return write_records(None, schema, [RoutingRecord("rep", ids)]).getvalue()


CASES: dict[str, Callable[[RoutingSchema], bytes]] = {
    "forged token count": forged_count,
    "ctx-zstd bomb": ctx_zstd_bomb,
    "token-id count bomb": token_count_bomb,
    "resync over forged magics": resync_junk,
    "many tiny records": many_tiny_records,
    "many corrupt frames": many_corrupt_frames,
    "meta JSON at its limit": big_meta,
    "largest valid record": largest_valid_record,
    "v3 forged table entry": forged_table_entry,
    "v3 swapped sections": swapped_table_entries,
    "v3 overlapping sections": overlapping_sections,
    "v3 section CRC mismatch": section_crc_mismatch,
    "v3 grid count bomb": grid_count_bomb,
}

__all__ = ["CASES", "CODECS_V3", "record", "forged", "split_payload", "join_payload", "reseal",
           "stream", "zstd_bomb", "v2_header", "v2_payload", "v2_stream"]


def slack_records(schema: RoutingSchema, num_records: int = 64, rows: int = 512,
                  mixed: bool = False) -> bytes:
    """Version 3: records of one-layer sections, each a ~30-byte ``xl-zstd`` section (mode 2:
    a zstd frame of the plain ids) of a valid
    row repeated ``rows`` times (checksums valid; every id valid). With an absolute slack per
    section (64 KiB) and per record, such a stream decoded to ~1800x its size.

    ``mixed``: the first section so coded, the others raw, so that the record as a whole is
    within the record-level limit and only the section limit can refuse it."""
    k, nl = schema.top_k, schema.num_moe_layers
    row = np.arange(k, dtype=schema.id_dtype)
    ids = np.tile(row, (rows, 1, 1))
    packed = b"\x02" + zstandard.ZstdCompressor(level=19).compress(ids.tobytes())
    cz, cr = CODECS_V3.index("xl-zstd"), CODECS_V3.index("raw-lm")
    payloads = []
    for n in range(num_records):
        meta = _meta.encode_meta(f"s{n}", rows, token_block=rows, layer_group=1)
        secs = [(cz, packed)] + [(cr if mixed else cz, ids.tobytes() if mixed else packed)
                                 for _ in range(nl - 1)]
        payloads.append(_payload.assemble(meta, secs))
    return stream(schema, payloads)

# NOTE: after CASES: the attacker review's stream (300 records of 48 tiny sections at the
# expansion limit; decoded to ~1800x its size while the slack was absolute)
CASES["tiny sections at the expansion limit"] = lambda schema: slack_records(schema, 300)
