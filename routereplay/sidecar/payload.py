"""Version-3 record payloads (docs/FORMAT.md "Record payload (kind 1), version 3"), laid
out for ranged reads:

    payload = head table body
    head    = varint M, meta (M bytes, binary)        -- the frame header's CRC covers it
    table   = (S - 1) x u32: end offset of sections 0 .. S-2 in the body
    body    = section_0 .. section_{S-1}
    section = crc32(u32 index, codec byte, data) (u32), codec byte (u8), data

Routing sections form a grid of token blocks x MoE-layer groups (section ``g * n_blocks +
b``, :class:`~routereplay.sidecar.record_meta.Grid`); the arrays (token ids, log-probs)
follow. This module encodes a record (choosing its grid) and checks and decodes sections;
the head lives in routereplay.sidecar.record_meta.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np
import zstandard

from routereplay import codec as _codec
from routereplay.codec import REMOVED_CODECS, removed_codec_error
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (DEFAULT_LAYER_GROUP, DEFAULT_MIN_SECTION_BYTES,
                                        DEFAULT_ONE_SECTION_BYTES, DEFAULT_TOKEN_BLOCK,
                                        FORMAT_VERSION, MAX_JSON_BYTES, MAX_TOKENS,
                                        check_writable, codec_table)
from routereplay.sidecar.limits import (EXPANSION, EXPANSION_SLACK, SECTION_OVERHEAD,
                                        grid_fits, record_fits, section_fits)
# NOTE: Grid .. peek_sample_id re-exported for routereplay.sidecar.reader until it imports record_meta
from routereplay.sidecar.record_meta import (ARRAY_SECTIONS, Grid, RecordMeta,  # noqa: F401
                                             Section, decode_head, encode_meta, head_length,
                                             peek_sample_id)
from routereplay.varint import varint

ARRAY_CODECS = ("zstd", "raw")
FALLBACK = ("ctx-zstd", "raw-lm")      # routing codecs a writer falls back to, in order
_U32 = struct.Struct("<I")


class RecordPayload(bytes):
    """A version-3 record payload; ``head_len`` is the number of leading bytes the frame
    header's CRC covers (the head); ``geometry``: (token block B, layer group G, routing
    sections) as written."""

    head_len: int | None = None
    geometry: tuple[int, int, int] = (0, 0, 1)


def encode_record_payload(record: RoutingRecord, schema: RoutingSchema,
                          codec: str | None = None,
                          layer_group: int | None = None,
                          column_order: str = "engine", *, version: int = FORMAT_VERSION,
                          token_block: int = DEFAULT_TOKEN_BLOCK,
                          one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                          min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES,
                          codecs: tuple[str, ...] | None = None) -> RecordPayload:
    """Record frame payload (docs/FORMAT.md "Record payload"); frame it with
    ``encode_frame(KIND_RECORD, payload)`` (which takes ``payload.head_len``).

    ``codec`` None: ``xl-zstd``, as :class:`SidecarWriter`. ``version``: 3 only.
    A record whose ids take at most ``one_section_bytes`` bytes
    (``T x L_moe x top_k x itemsize``) is one routing section; a larger one is a grid of
    ``token_block`` rows x ``layer_group`` MoE layers; where its routing sections code to
    less than ``min_section_bytes`` on average (repetitive routing), the token block is
    multiplied by the smallest power of two that brings the mean to it (at most T rows).
    Token ids (one zstd section) and
    log-probs (one raw section) follow. ``codecs`` is the stream header's codec table
    (default: :func:`routereplay.sidecar.layout.codec_table` of ``codec``). A section that
    would expand beyond the reader's limit (:func:`section_fits`) is stored with the next
    codec of :data:`FALLBACK` that fits; a record beyond the record-level limit has its
    most expanding sections stored as ``raw-lm`` until it fits.
    ``column_order="sorted"`` stores each row in ascending expert order. The record must
    be valid (``RoutingRecord.validate``).

    Raises:
        RecordError: the meta exceeds the reader's limit (``MAX_JSON_BYTES``), or the body
            4 GiB.
        ConfigError: a version other than 3, an unknown or removed codec.
    """
    check_writable(version)
    codec = codec or _codec.DEFAULT_CODEC
    b_rows, g_layers = token_block, min(layer_group or DEFAULT_LAYER_GROUP, schema.num_moe_layers)
    while True:
        out = _encode_v3(record, schema, codec, g_layers, column_order, token_block=b_rows,
                         one_section_bytes=one_section_bytes,
                         min_section_bytes=min_section_bytes, codecs=codecs)
        grid_b, grid_g, n_routing = out.geometry
        if grid_fits(n_routing, len(out)):
            return out
        # NOTE: tiny sections (a small token_block and layer_group, or min_section_bytes=0)
        # fall under the reader's SECTION_FLOOR: longer token blocks, then wider layer
        # groups, until the record fits (one section always does)
        t = record.expert_ids.shape[0]
        if grid_b < t:
            b_rows = min(2 * grid_b, MAX_TOKENS)
        else:
            b_rows, g_layers = max(t, 1), min(2 * grid_g, schema.num_moe_layers)
        min_section_bytes = 0          # NOTE: the block is now set here, not by the trial


def _encode_v3(record: RoutingRecord, schema: RoutingSchema, codec: str, layer_group: int,
               column_order: str, *, token_block: int, one_section_bytes: int,
               min_section_bytes: int, codecs: tuple[str, ...] | None) -> "RecordPayload":
    """:func:`encode_record_payload` for version 3 at one geometry request; the payload's
    ``geometry`` is (B, G, routing sections) as written."""
    codecs = tuple(codecs) if codecs is not None else codec_table(codec)
    cid = {c: i for i, c in enumerate(codecs)}
    ids = np.sort(record.expert_ids, axis=-1) if column_order == "sorted" else record.expert_ids
    t, nl = ids.shape[0], schema.num_moe_layers
    grid, b_rows, g_layers, blobs = grid_sections(ids, codec, schema.num_experts, token_block,
                                                  layer_group or DEFAULT_LAYER_GROUP,
                                                  one_section_bytes, min_section_bytes)
    nb, ng = max(1, -(-t // b_rows)), -(-nl // g_layers)
    secs: list[tuple[str, bytes, int]] = []          # (codec, data, decoded bytes)
    for i, blob in enumerate(blobs):
        g, b = divmod(i, nb)
        part = ids[b * b_rows:(b + 1) * b_rows, g * g_layers:(g + 1) * g_layers]
        secs.append((codec, blob, part.nbytes) if section_fits(codec, part.nbytes, len(blob))
                    else _encode_routing(part, codec, schema.num_experts))
    arrays: list[tuple[str, int]] = []
    if record.token_ids is not None:
        tok = np.ascontiguousarray(record.token_ids, dtype="<i4").tobytes()
        blob, c = zstandard.ZstdCompressor(level=3).compress(tok), "zstd"
        if not section_fits(c, len(tok), len(blob)):
            blob, c = tok, "raw"
        secs.append((c, blob, len(tok)))
        arrays.append(("token_ids", len(tok) // 4))
    if record.logprobs is not None:
        lp = np.ascontiguousarray(record.logprobs, dtype="<f4").tobytes()
        secs.append(("raw", lp, len(lp)))
        arrays.append(("logprobs", len(lp) // 4))
    wv = [(str(x.version), int(x.start), int(x.end)) for x in record.weight_versions]
    meta = encode_meta(record.sample_id, t, b_rows if grid else None, g_layers if grid else None,
                       start=int(record.start), prompt_len=record.prompt_len,
                       arrays=dict(arrays), weight_versions=wv, engine=record.engine,
                       recomputed=record.recomputed, prefix_cached=record.prefix_cached,
                       sampling=record.sampling)
    if len(meta) > MAX_JSON_BYTES:
        raise RecordError(f"sample {str(record.sample_id)[:80]!r}: record meta of {len(meta)} "
                          f"bytes exceeds the reader's limit of {MAX_JSON_BYTES} bytes")
    _fit_record(secs, ng * nb, schema, ids, b_rows, g_layers, nb,
                len(varint(len(meta))) + len(meta) + 4 * (len(secs) - 1))
    body = sum(SECTION_OVERHEAD + len(d) for _, d, _ in secs)
    if body >= 1 << 32:
        raise RecordError(f"sample {str(record.sample_id)[:80]!r}: record body of {body} "
                          "bytes exceeds the format's 4 GiB")
    out = assemble(meta, [(cid[c], d) for c, d, _ in secs])
    out.geometry = (b_rows, g_layers, ng * nb)
    return out


def assemble(meta: bytes, sections: list[tuple[int, bytes]],
             table: list[int] | None = None) -> RecordPayload:
    """A version-3 payload from its meta bytes and its sections' (codec byte, data), in
    body order: head, table of end offsets (``table`` overrides it: crafted inputs), and
    each section behind its CRC and codec byte."""
    head = varint(len(meta)) + meta
    blobs = []
    for i, (cb, data) in enumerate(sections):
        blobs.append(_U32.pack(section_crc(i, cb, data)) + bytes([cb]) + data)
    if table is None:
        table = np.cumsum([len(b) for b in blobs], dtype=np.int64)[:-1].tolist()
    out = RecordPayload(head + np.asarray(table, dtype=np.int64).astype("<u4").tobytes()
                        + b"".join(blobs))
    out.head_len = len(head)
    return out


TRIAL_SHARE = 8              # 1/8 of a record's token blocks decide its grid's block size


def grid_sections(ids: np.ndarray, codec: str, num_experts: int,
                  token_block: int = DEFAULT_TOKEN_BLOCK, layer_group: int = DEFAULT_LAYER_GROUP,
                  one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                  min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES
                  ) -> tuple[bool, int, int, list[bytes]]:
    """The version-3 writer's geometry for ids [T, L_moe, K] and its routing sections coded
    with ``codec`` (before any expansion-limit fallback): (grid, B, G, section data, group-
    major). One section when the ids take at most ``one_section_bytes``; else
    ``token_block`` x ``layer_group``, the token block multiplied by the smallest power of
    two that brings the mean coded section to ``min_section_bytes`` where it is below (the
    mean over the record's first ``1 / TRIAL_SHARE`` token blocks, at least one).
    """
    t, nl = ids.shape[:2]
    if ids.nbytes <= one_section_bytes:
        b_rows, g_layers = max(t, 1), nl
        return False, b_rows, g_layers, _codec.encode_grid(ids, codec, num_experts, b_rows,
                                                           g_layers)
    b_rows, g_layers = token_block, layer_group
    if not min_section_bytes or t <= b_rows:
        return True, b_rows, g_layers, _codec.encode_grid(ids, codec, num_experts, b_rows,
                                                          g_layers)
    # NOTE: highly repetitive routing codes a 512-row section to a few hundred bytes, and a
    # section's fixed cost (zstd frame, Huffman table, CRC, table entry: 30-60 bytes) then
    # takes a large share (measured up to 1.5x zstd-19 on 4096-token records with 90 %
    # repeats). Longer blocks, to about min_section_bytes coded each, cost a rank reading a
    # few rows at most that many bytes more.
    # NOTE: the mean is taken over the record's first token blocks (1/TRIAL_SHARE of them,
    # at least one), coded without xl-zstd's zstd-19 pass, and the sections of the rest
    # coded only once the block is known: coding every section twice, the first time with
    # that pass (a 4K-token record of 32 layers x top-2: 256 sections of 1 KiB, each under
    # xl_zstd.CHECK_BYTES), held the writer to 9 MB/s there. Row slices are views: no copy.
    blocks = -(-t // b_rows)
    head_rows = max(1, blocks // TRIAL_SHARE) * b_rows
    head = _codec.encode_grid(ids[:head_rows], codec, num_experts, b_rows, g_layers,
                              check="never")
    mean = sum(map(len, head)) / len(head)
    if mean < min_section_bytes:
        m = 1 << int(np.ceil(np.log2(min_section_bytes / max(mean, 1.0))))
        b_rows = min(b_rows * m, t)
        return True, b_rows, g_layers, _codec.encode_grid(ids, codec, num_experts, b_rows,
                                                          g_layers)
    if codec == "xl-zstd":
        head = _codec.xl_zstd.check_grid(ids[:head_rows], head, b_rows, g_layers)
    if head_rows >= t:
        return True, b_rows, g_layers, head
    tail = _codec.encode_grid(ids[head_rows:], codec, num_experts, b_rows, g_layers)
    hb, tb = head_rows // b_rows, blocks - head_rows // b_rows       # blocks a group
    blobs = []
    for gi in range(len(head) // hb):                   # group-major: a group's blocks in order
        blobs += head[gi * hb:(gi + 1) * hb] + tail[gi * tb:(gi + 1) * tb]
    return True, b_rows, g_layers, blobs


def _encode_routing(part: np.ndarray, codec: str, num_experts: int) -> tuple[str, bytes, int]:
    """One routing section ids [rows, layers, K] -> (codec, data, decoded bytes), falling
    back (FALLBACK) where ``codec`` would exceed the reader's expansion limit."""
    for c in (codec,) + tuple(f for f in FALLBACK if f != codec):
        blob = _codec.encode(part, c, num_experts)
        if section_fits(c, part.nbytes, len(blob)):
            break
    return c, blob, part.nbytes


def _fit_record(secs: list, n_routing: int, schema: RoutingSchema, ids: np.ndarray, b_rows: int,
                g_layers: int, nb: int, fixed: int) -> None:
    """Store the most expanding routing sections as ``raw-lm`` until the record is within
    the record-level expansion limit (only ever needed for near-constant routing)."""
    decoded = sum(d for _, _, d in secs)

    def size() -> int:
        return fixed + sum(SECTION_OVERHEAD + len(b) for _, b, _ in secs)
    if record_fits(schema, decoded, size()):
        return
    order = sorted(range(n_routing), key=lambda i: -secs[i][2] / max(1, len(secs[i][1])))
    for i in order:
        if secs[i][0] == "raw-lm":
            continue
        g, b = divmod(i, nb)
        part = ids[b * b_rows:(b + 1) * b_rows, g * g_layers:(g + 1) * g_layers]
        secs[i] = ("raw-lm", _codec.encode(part, "raw-lm"), part.nbytes)
        if record_fits(schema, decoded, size()):
            return


def section_crc(index: int, codec_byte: int, data: bytes | memoryview) -> int:
    """CRC-32 of a version-3 section: over its u32 index, its codec byte and its data."""
    return zlib.crc32(data, zlib.crc32(_U32.pack(index) + bytes([codec_byte]))) & 0xFFFFFFFF


def open_section(grid: Grid, i: int, raw: memoryview, codecs: tuple[str, ...],
                 schema: RoutingSchema) -> tuple[str, memoryview]:
    """Check section ``i`` (its stored bytes ``raw``) -> (codec name, data): its CRC, its
    codec byte, and its codec's expansion limit for the shape it holds.

    Raises:
        SidecarError: a CRC mismatch, a codec byte outside the header's table, an array
            codec other than zstd/raw, an unknown routing codec, a routing codec removed in 0.3.0
            (:func:`routereplay.codec.removed_codec_error`), or a section beyond the
            expansion limit (naming the section).
    """
    if len(raw) < SECTION_OVERHEAD:
        raise SidecarError(f"{grid.describe(i)} is shorter than its checksum and codec byte")
    cb = raw[4]
    if _U32.unpack(raw[:4])[0] != section_crc(i, cb, raw[5:]):
        raise SidecarError(f"{grid.describe(i)}: checksum mismatch")
    if cb >= len(codecs):
        raise SidecarError(f"{grid.describe(i)}: codec byte {cb} outside the header's table of "
                           f"{len(codecs)} codecs")
    codec = codecs[cb]
    data = raw[SECTION_OVERHEAD:]
    if i >= grid.n_routing:
        name, n = grid.arrays[i - grid.n_routing]
        if codec not in ARRAY_CODECS:
            raise SidecarError(f"{grid.describe(i)}: codec {codec!r} is not an array codec "
                               f"{ARRAY_CODECS}")
        decoded = n * ARRAY_SECTIONS[name].itemsize
    else:
        if codec in REMOVED_CODECS:
            raise SidecarError(f"{grid.describe(i)}: "
                               + removed_codec_error(f"routing codec {codec!r}"))
        if codec not in _codec.CODECS:
            raise SidecarError(f"{grid.describe(i)}: unknown routing codec {codec!r} (this "
                               f"release reads {_codec.CODECS})")
        g, b = divmod(i, grid.n_blocks)
        (l0, l1), (r0, r1) = grid.layers(g), grid.rows(b)
        decoded = (r1 - r0) * (l1 - l0) * schema.top_k * schema.id_dtype.itemsize
    if not section_fits(codec, decoded, len(data)):
        raise SidecarError(f"{grid.describe(i)} ({codec}) declares {decoded} bytes from {len(data)} "
                           f"stored bytes: beyond the reader's limit of {EXPANSION[codec]} x "
                           f"+ min({EXPANSION_SLACK}, {EXPANSION[codec]} x) bytes")
    return codec, data


def decode_array(blob: bytes | memoryview, name: str, codec: str, count: int) -> np.ndarray:
    """A ``token_ids`` (int32 [N]) or ``logprobs`` (float32 [G]) section, native byte order.

    Raises:
        SidecarError: the bytes do not hold exactly ``count`` values.
    """
    dtype = ARRAY_SECTIONS[name]
    n = count * dtype.itemsize
    if codec == "zstd":
        blob = _codec.bounded_zstd_decompress(bytes(blob), n)
    if len(blob) != n:
        raise SidecarError(f"section {name!r} holds {len(blob)} bytes, expected {n}")
    return np.frombuffer(blob, dtype=dtype).astype(dtype.newbyteorder("="))
