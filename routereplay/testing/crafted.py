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
any codec, a bogus one included.
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
from routereplay.sidecar.layout import (FORMAT_VERSION, KIND_RECORD, encode_frame,
                                        encode_header, read_varint)
from routereplay.sidecar.payload import encode_record_payload

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
    h = _payload.head_length(buf[:10], len(buf))
    m = _payload.decode_head(buf[:h], schema, len(buf))
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
    return bool(read_varint(buf, pos)[0] & _payload.F_GRID)


def join_payload(meta: dict, parts: list[bytes], version: int = FORMAT_VERSION) -> bytes:
    """Inverse of :func:`split_payload`; section lengths are set from ``parts``."""
    for sec, part in zip(meta["sections"], parts):
        sec[2] = len(part)
    if version < 3:
        js = json.dumps(meta).encode()
        return struct.pack("<I", len(js)) + js + b"".join(parts)
    arrays = {sec[0]: sec[3] for sec in meta["sections"] if sec[0] != "routing"}
    mb = _payload.encode_meta(
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
        h = _payload.head_length(buf[:10], len(buf))
    except Exception:  # noqa: BLE001 - a head that does not parse: nothing to reseal
        return out
    out.head_len = h
    try:
        g = _payload.decode_head(buf[:h], schema, len(buf)).grid
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
    return encode_header(schema, version=version, codecs=CODECS_V3 if version >= 3 else None) \
        + b"".join(encode_frame(KIND_RECORD, p) for p in payloads)


def forged(schema: RoutingSchema, rec: RoutingRecord, edit: Callable[[dict, list], None],
           codec: str | None = None, version: int = FORMAT_VERSION, **kw) -> bytes:
    """A one-record stream whose meta and sections ``edit(meta, parts)`` changed in place.
    ``kw``: more :func:`encode_record_payload` options (version 3: ``token_block``,
    ``layer_group``, ``one_section_bytes``)."""
    if version >= 3:
        kw["codecs"] = CODECS_V3
    meta, parts = split_payload(encode_record_payload(
        rec, schema, **({"codec": codec} if codec else {}), version=version, **kw), version,
        schema)
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


def ctx_ans_forged_count(schema: RoutingSchema, num_tokens: int = 1 << 24) -> bytes:
    """Issue 16 item 8: a ctx-ans record of 11 rows whose meta claims ``num_tokens``."""
    def edit(meta, parts):
        meta["num_tokens"] = num_tokens
    return forged(schema, record(schema, "ans", 12, 1, arrays=False), edit, codec="ctx-ans")


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
    h = _payload.head_length(buf[head_at:head_at + 10], len(buf) - head_at)
    m = _payload.decode_head(bytes(buf[head_at:head_at + h]), schema, len(buf) - head_at)
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


def largest_valid_ctx_ans(schema: RoutingSchema, num_tokens: int = 1 << 20) -> bytes:
    """A valid, highly repetitive record written by the writer (its sections at or under the
    expansion limit; the writer falls back where ctx-ans would exceed it)."""
    from routereplay.sidecar.writer import write_records
    rng = np.random.default_rng(8)
    t = num_tokens - 1
    fresh = rng.random(t) < 0.02
    fresh[0] = True
    rows = np.argsort(rng.random((int(fresh.sum()), schema.num_moe_layers, schema.num_experts)),
                      -1)[..., :schema.top_k]
    ids = rows[np.cumsum(fresh) - 1].astype(schema.id_dtype)
    return write_records(None, schema, [RoutingRecord("rep", ids)], codec="ctx-ans").getvalue()


CASES: dict[str, Callable[[RoutingSchema], bytes]] = {
    "ctx-ans forged token count": ctx_ans_forged_count,
    "ctx-zstd bomb": ctx_zstd_bomb,
    "token-id count bomb": token_count_bomb,
    "resync over forged magics": resync_junk,
    "many tiny records": many_tiny_records,
    "many corrupt frames": many_corrupt_frames,
    "meta JSON at its limit": big_meta,
    "largest valid ctx-ans record": largest_valid_ctx_ans,
    "v3 forged table entry": forged_table_entry,
    "v3 swapped sections": swapped_table_entries,
    "v3 overlapping sections": overlapping_sections,
    "v3 section CRC mismatch": section_crc_mismatch,
    "v3 grid count bomb": grid_count_bomb,
}

__all__ = ["CASES", "CODECS_V3", "record", "forged", "split_payload", "join_payload", "reseal",
           "stream", "zstd_bomb"]


def slack_records(schema: RoutingSchema, num_records: int = 64, rows: int = 512,
                  mixed: bool = False) -> bytes:
    """Version 3: records of one-layer sections, each a ~30-byte zstd-lm frame of a valid
    row repeated ``rows`` times (checksums valid; every id valid). With an absolute slack per
    section (64 KiB) and per record, such a stream decoded to ~1800x its size.

    ``mixed``: the first section so coded, the others raw, so that the record as a whole is
    within the record-level limit and only the section limit can refuse it."""
    k, nl = schema.top_k, schema.num_moe_layers
    row = np.arange(k, dtype=schema.id_dtype)
    ids = np.tile(row, (rows, 1, 1))
    packed = zstandard.ZstdCompressor(level=19).compress(ids.transpose(1, 0, 2).tobytes())
    cz, cr = CODECS_V3.index("zstd-lm"), CODECS_V3.index("raw-lm")
    payloads = []
    for n in range(num_records):
        meta = _payload.encode_meta(f"s{n}", rows, token_block=rows, layer_group=1)
        secs = [(cz, packed)] + [(cr if mixed else cz, ids.tobytes() if mixed else packed)
                                 for _ in range(nl - 1)]
        payloads.append(_payload.assemble(meta, secs))
    return stream(schema, payloads)

# NOTE: after CASES: the attacker review's stream (300 records of 48 tiny sections at the
# expansion limit; decoded to ~1800x its size while the slack was absolute)
CASES["tiny sections at the expansion limit"] = lambda schema: slack_records(schema, 300)


# --------------------------------------------------------------------------- xl-ans


XL_ANS_CODECS = ("xl-ans", "xl-zstd", "ctx-zstd", "raw-lm", "zstd", "raw")


def xl_ans_model_thrash(schema: RoutingSchema, nbytes: int = MiB, num_layers: int = 64,
                        num_models: int = 9, num_experts: int = 64, seed: int = 18) -> bytes:
    """xl-ans (issue 18 attacker review): model frames named in turn by one-layer sections.

    A stream of ``num_layers`` MoE layers, top-1 of E=64: ``num_models`` identical model
    frames at different offsets (payload just above the reader's floor of ceil(n / 16)
    bytes, n = 2 x L x (6 + E + E^2 + C x E) bytes of tables), then records of one-layer
    sections (a grid of G = 1), each a valid ``xl-ans`` section of a few rows at the
    reader's floor (32 bytes per coder call: 64 bytes), section j of record i naming model
    ``(i x L + j) % num_models``. While readers kept the last 8 models (keyed by offset),
    every section read re-read, re-checked and re-decompressed a whole model (58 s of CPU
    per MiB at L = 256, when payloads needed only 1/128 of their tables). Now a reader
    parses each of at most 16 model frames once; what is left is the per-section fixed
    cost at the floor. Every record reads back exactly as encoded; with ``num_models`` > 16
    the 17th model frame is refused.

    ``schema`` is ignored (xl-ans models at most 64 experts)."""
    from routereplay.codec import xl_ans
    from routereplay.sidecar.layout import KIND_MODEL, varint
    k, e, nl = 1, num_experts, num_layers
    sch = RoutingSchema(nl, tuple(range(nl)), k, e)
    rng = np.random.default_rng(seed)
    least, _ = xl_ans.payload_limits(nl, e, k)
    m = xl_ans.XlModel.empty(nl, e, k)
    m.flags[:] = rng.integers(0, 4, m.flags.shape)
    m.pop[:] = rng.integers(1, 16, m.pop.shape)
    cells = 64
    flat = m.pair.reshape(-1)                # pair tables: unused by one-layer sections
    while True:                              # random counts until the payload reaches the floor
        flat[:cells] = rng.integers(0, 1 << 16, cells)
        payload = m.to_bytes()
        if len(payload) >= least:
            break
        cells = min(2 * cells, flat.size)
    model = xl_ans.XlModel.from_bytes(payload, nl, e, k)
    head = encode_header(sch, "xl-ans", codecs=XL_ANS_CODECS, stream_id="00" * 8)
    out, offs, pos = [head], [], len(head)
    frame = encode_frame(KIND_MODEL, payload)
    for _ in range(num_models):
        offs.append(pos)
        out.append(frame)
        pos += len(frame)
    floor = xl_ans.least_bytes(1, k)
    t = 2
    while True:                              # the fewest rows whose every layer reaches the floor
        ids = np.argsort(rng.random((t, nl, e)), axis=-1)[..., :k].astype(np.uint8)
        ids[1:] = np.where((ids[1:] == ids[:-1]).all(-1, keepdims=True), (ids[:-1] + 1) % e,
                           ids[1:])
        words = [xl_ans.encode(np.ascontiguousarray(ids[:, j:j + 1]), model, j)
                 for j in range(nl)]
        if min(map(len, words)) >= floor:
            break
        t += 2
    i = n = 0
    while pos < nbytes:
        secs = [(0, varint(offs[(n + j) % num_models]) + words[j]) for j in range(nl)]
        n += nl
        meta = _payload.encode_meta(f"x{i:07d}", t, t, 1)
        f = encode_frame(KIND_RECORD, _payload.assemble(meta, secs))
        out.append(f)
        pos += len(f)
        i += 1
    return b"".join(out)


CASES["xl-ans model cache thrash"] = xl_ans_model_thrash


def _repeat_record(out: list[bytes], pos: int, nbytes: int, prefix: str, rows: int,
                   sections: list, at_least_one: bool = False) -> bytes:
    """The stream ``out`` (its bytes end at offset ``pos``) with records of ``rows`` rows
    holding the same ``sections`` ((codec index, bytes) pairs), sample ids ``<prefix>0000000``,
    ``<prefix>0000001``, ..., appended until it reaches ``nbytes`` bytes (at least one
    record with ``at_least_one``), joined."""
    i = 0
    while pos < nbytes or (at_least_one and i == 0):
        frame = encode_frame(KIND_RECORD, _payload.assemble(
            _payload.encode_meta(f"{prefix}{i:07d}", rows), sections))
        out.append(frame)
        pos += len(frame)
        i += 1
    return b"".join(out)


def xl_ans_dense_rows(schema: RoutingSchema, nbytes: int = MiB, rows: int = 16384,
                      num_experts: int = 64, seed: int = 18, num_layers: int = 2) -> bytes:
    """xl-ans (issue 18 attacker review): the most row work per stored byte that the
    expansion limit allows. A stream of two MoE layers, top-1 of E=64, one model frame, then
    records of ``rows`` rows, one valid ``xl-ans`` section each: every row fresh at both
    layers, layer 0 one of two experts (1 bit a row), layer 1 determined by layer 0 (~0
    bits): 0.5 bit per row-layer, i.e. 16 decoded ids per stored byte (the limit,
    8 x S + min(65536, 8 x S)). Each fresh row costs the reader an E-wide weight row
    (numpy, int64 and float64) and a 64-entry per-symbol model in constriction. Every
    record reads back exactly as encoded.

    ``num_layers=1``: layer 0 only (1 bit a row, 8 ids per stored byte): the limit for
    sections of more than 8 KiB (whose slack is capped at 64 KiB), where one section of
    many rows costs the most memory. ``schema`` is ignored (xl-ans models at most 64
    experts)."""
    from routereplay.codec import xl_ans
    from routereplay.sidecar.layout import KIND_MODEL, varint
    e, k, nl = num_experts, 1, num_layers
    sch = RoutingSchema(nl, tuple(range(nl)), k, e)
    rng = np.random.default_rng(seed)
    m = xl_ans.XlModel.empty(nl, e, k)
    m.flags[:, :, 0] = 0xFFFF                    # "fresh" almost certain
    m.pop[0, :2] = 0xFFFF                        # layer 0: expert 0 or 1, one bit
    for u in (0, 1) if nl > 1 else ():           # layer 1: expert u + 2 after u
        m.pair[1, u, u + 2] = 0xFFFF
        m.joint[1, u, u + 2] = 0xFFFF
    least, _ = xl_ans.payload_limits(nl, e, k)
    cells = 64
    while len(m.to_bytes()) < least:             # unused layer-0 pair table: padding
        m.pair[0].reshape(-1)[:cells] = rng.integers(0, 1 << 16, cells)
        cells = min(2 * cells, e * e)
    payload = m.to_bytes()
    head = encode_header(sch, "xl-ans", codecs=XL_ANS_CODECS, stream_id="00" * 8)
    off = len(head)
    model = xl_ans.XlModel.from_bytes(payload, nl, e, k)
    out = [head, encode_frame(KIND_MODEL, payload)]
    pos = off + len(out[1])
    l0 = np.arange(rows) % 2                     # never a repeat; i.i.d. to the model
    ids = np.stack([l0, l0 + 2][:nl], axis=1)[:, :, None].astype(np.uint8)
    sec = varint(off) + xl_ans.encode(ids, model, 0)
    assert _payload.section_fits("xl-ans", ids.nbytes, len(sec))
    return _repeat_record(out, pos, nbytes, "d", rows, [(0, sec)], at_least_one=True)


CASES["xl-ans dense rows at the expansion limit"] = xl_ans_dense_rows
# NOTE: one record of one MoE layer and 2^19 rows (~64 KiB): its one section is decoded at
# once, with [T, E] int64 and float64 weight tables (~12 KiB of memory per stored byte)
CASES["xl-ans one long section"] = lambda schema: xl_ans_dense_rows(
    schema, nbytes=0, rows=1 << 19, num_layers=1)
# NOTE: more model frames than a reader parses (16), named in turn: refused at the 17th
CASES["xl-ans more model frames than the reader's limit"] = lambda schema: xl_ans_model_thrash(
    schema, num_models=17)


def xl_ans_calls_at_floor(schema: RoutingSchema, nbytes: int = MiB, num_layers: int = 64,
                          num_experts: int = 64, top_k: int = 8) -> bytes:
    """xl-ans (issue 18, second attacker review): the most coder calls per stored byte.
    One model frame, then records of one section (no grid: G = L_moe layers) whose words
    sit at the reader's floor (32 bytes per coder call, G x (1 + K) calls), every row fresh
    with ids the model finds improbable. Every record reads back exactly as encoded; what
    it measures is a coder call's fixed cost. ``schema`` is ignored (xl-ans models at most
    64 experts)."""
    from routereplay.codec import xl_ans
    from routereplay.sidecar.layout import KIND_MODEL, varint
    e, k, nl = num_experts, top_k, num_layers
    sch = RoutingSchema(nl, tuple(range(nl)), k, e)
    rng = np.random.default_rng(2)
    m = xl_ans.XlModel.empty(nl, e, k)
    m.flags[:, :, 0] = 0xFFFF
    m.pop[:, :k] = 0xFFFF                        # experts 0..K-1 likely: the ids avoid them
    m.pair[:, :, :k] = 0xFFFF
    least, _ = xl_ans.payload_limits(nl, e, k)
    flat = (m.joint if m.joint.shape[1] else m.pair).reshape(-1)
    cells = 16
    while len(m.to_bytes()) < least:             # random counts up to the payload floor
        flat[-cells:] = rng.integers(0, 1 << 16, cells)
        cells = min(2 * cells, flat.size)
    payload = m.to_bytes()
    model = xl_ans.XlModel.from_bytes(payload, nl, e, k)
    head = encode_header(sch, "xl-ans", codecs=XL_ANS_CODECS, stream_id="00" * 8)
    out = [head, encode_frame(KIND_MODEL, payload)]
    off, pos = len(head), len(head) + len(out[1])
    t = 1
    while True:                                  # the fewest rows that reach the floor
        ids = (k + np.argsort(rng.random((t, nl, e - k)), axis=-1)[..., :k]).astype(np.uint8)
        words = xl_ans.encode(ids, model, 0)
        if len(words) >= xl_ans.least_bytes(nl, k):
            break
        t += 1
    sec = varint(off) + words
    return _repeat_record(out, pos, nbytes, "c", t, [(0, sec)])


CASES["xl-ans coder calls at the floor"] = xl_ans_calls_at_floor


def xl_ans_rows_at_work_limit(schema: RoutingSchema, nbytes: int = MiB, rows: int = 16384,
                              seed: int = 18, num_experts: int = 8, top_k: int = 2) -> bytes:
    """xl-ans-rows (issue 18, the row layout): the most row work per stored byte its
    reader allows (256 units a byte, a row's 1 + A: 57 at E=8 top-2, 65 at E=64 top-1).
    One MoE layer: rows repeat the row before with the largest probability (in steps of
    0.05) whose section still fits the work limit, fresh rows are random (top-2: pairs of 4
    experts), and the model is counted from the rows themselves. Records of ``rows`` rows,
    one valid ``xl-ans-rows`` section each; each row costs the constriction path 1 + A
    parameters and a per-symbol model of 1 + A entries. Every record reads back exactly as
    encoded. ``schema`` is ignored.

    ``nbytes=0, rows=4_000_000, num_experts=64, top_k=1``: one section of 4M rows (about
    1 MiB), where the constriction path once built all of a layer's parameters at once
    (the attacker review: 2 GiB of memory, 3.8 s of CPU per MiB)."""
    from routereplay.codec import xl_ans, xl_ans_rows
    from routereplay.sidecar.layout import KIND_MODEL, varint
    e, k, nl = num_experts, top_k, 1
    sch = RoutingSchema(nl, tuple(range(nl)), k, e)
    codecs = ("xl-ans", "xl-ans-rows", "xl-zstd", "ctx-zstd", "raw-lm", "zstd", "raw")
    head = encode_header(sch, "xl-ans", codecs=codecs, stream_id="00" * 8)
    off = len(head)
    for p in np.arange(0.9, 0.0, -0.05):              # the most repeats that fit the limit
        rng = np.random.default_rng(seed)
        fresh = np.argsort(rng.random((rows, 4 if k == 2 else e)), axis=-1)[:, :k]
        rep = rng.random(rows) < p
        rep[0] = False
        src = np.maximum.accumulate(np.where(rep, 0, np.arange(rows)))
        ids = fresh[src].astype(np.uint8).reshape(rows, nl, k)
        m = xl_ans.XlModel.empty(nl, e, k)
        m.count(ids)
        m = m.stored()
        least, _ = xl_ans.payload_limits(nl, e, k)
        while len(m.to_bytes()) < least:             # the unused pair table: padding
            m.pair[0] = rng.integers(0, 1 << 16, m.pair[0].shape)
        payload = m.to_bytes()
        model = xl_ans.XlModel.from_bytes(payload, nl, e, k)
        words = xl_ans_rows.encode(ids, model, 0)
        if xl_ans_rows.section_work(ids.shape, e) <= xl_ans_rows.WORK_PER_BYTE * len(words):
            break
    sec = varint(off) + words
    assert _payload.section_fits("xl-ans-rows", ids.nbytes, len(sec))
    out = [head, encode_frame(KIND_MODEL, payload)]
    pos = off + len(out[1])
    return _repeat_record(out, pos, nbytes, "w", rows, [(1, sec)], at_least_one=True)


CASES["xl-ans-rows rows at the work limit"] = xl_ans_rows_at_work_limit
CASES["xl-ans-rows one long section"] = lambda schema: xl_ans_rows_at_work_limit(
    schema, nbytes=0, rows=4_000_000, num_experts=64, top_k=1)


def xl_ans_rows_model_thrash(schema: RoutingSchema, num_models: int = 16,
                             seed: int = 5) -> bytes:
    """xl-ans-rows (issue 18, the row layout's attacker review): the most row-table building
    per stored byte. E=8 top-2 at the most MoE layers xl-ans-rows codes (its tables at most
    4 MiB a model: 106 layers), ``num_models`` model frames at the smallest payload a
    reader takes (1/16 of the u16 tables), then one record per model whose first layer is
    an ``xl-ans-rows`` section naming it (the other layers ``raw-lm``). A reader builds
    each model's coder tables and row tables once (at most 16 models a stream). Every
    record reads back exactly as encoded. ``schema`` is ignored."""
    from routereplay.codec import layer_major, xl_ans, xl_ans_rows
    from routereplay.sidecar.layout import KIND_MODEL, varint
    e, k = 8, 2
    nl = 1
    while xl_ans_rows.applies(nl + 1, e, k):
        nl += 1
    sch = RoutingSchema(nl, tuple(range(nl)), k, e)
    codecs = ("xl-ans", "xl-ans-rows", "xl-zstd", "ctx-zstd", "raw-lm", "zstd", "raw")
    head = encode_header(sch, "xl-ans", codecs=codecs, stream_id="00" * 8)
    rng = np.random.default_rng(seed)
    out, pos, models = [head], len(head), []
    least, _ = xl_ans.payload_limits(nl, e, k)
    for _ in range(num_models):
        m = xl_ans.XlModel.empty(nl, e, k)
        m.flags[:] = rng.integers(0, 1 << 16, m.flags.shape)
        m.pop[:] = rng.integers(1, 1 << 16, m.pop.shape)
        flat, cells = m.pair.reshape(-1), 64
        while len(m.to_bytes()) < least:              # the pair tables: padding
            flat[:cells] = rng.integers(0, 1 << 16, cells)
            cells = min(2 * cells, flat.size)
        payload = m.to_bytes()
        models.append((pos, xl_ans.XlModel.from_bytes(payload, nl, e, k)))
        frame = encode_frame(KIND_MODEL, payload)
        out.append(frame)
        pos += len(frame)
    for i, (off, model) in enumerate(models):
        t = 8
        while True:                                    # the fewest rows over the floor
            ids = np.argsort(rng.random((t, nl, e)), axis=-1)[..., :k].astype(np.uint8)
            words = xl_ans_rows.encode(np.ascontiguousarray(ids[:, :1]), model, 0)
            if len(words) >= xl_ans_rows.least_bytes(1):
                break
            t += 8
        secs = [(1, varint(off) + words)] + [
            (4, layer_major.encode(np.ascontiguousarray(ids[:, lyr:lyr + 1]), "raw-lm"))
            for lyr in range(1, nl)]
        frame = encode_frame(KIND_RECORD, _payload.assemble(
            _payload.encode_meta(f"m{i:07d}", t, t, 1), secs))
        out.append(frame)
        pos += len(frame)
    return b"".join(out)


CASES["xl-ans-rows model tables per stored byte"] = xl_ans_rows_model_thrash
