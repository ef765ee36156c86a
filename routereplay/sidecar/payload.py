"""Record payloads (docs/FORMAT.md "Record payload (kind 1)"): version 3, and what every
version shares (limits, the validated :class:`RecordMeta`, array sections).

A version-3 payload is laid out for ranged reads:

    payload = head table body
    head    = varint M, meta (M bytes, binary)        -- the frame header's CRC covers it
    table   = (S - 1) x u32: end offset of sections 0 .. S-2 in the body
    body    = section_0 .. section_{S-1}
    section = crc32(u32 index, codec byte, data) (u32), codec byte (u8), data

Routing sections form a grid of token blocks x MoE-layer groups (:class:`Grid`), section
``g * n_blocks + b``; the arrays (token ids, log-probs) follow. A reader that needs some
layers and some token runs reads the head, the table entries around its sections and its
sections, and checks exactly what it read. Versions 1-2 (JSON meta, one CRC per payload)
are read by routereplay.sidecar.payload_v2.
"""
from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Any

import numpy as np
import zstandard

from routereplay import codec as _codec
from routereplay.errors import RecordError, SidecarError
from routereplay.record import (MAX_SAMPLING_PROCESSORS, RoutingRecord, SamplingInfo,
                              WeightVersionSpan)
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (DEFAULT_LAYER_GROUP, DEFAULT_MIN_SECTION_BYTES,
                                        DEFAULT_ONE_SECTION_BYTES,
                                        DEFAULT_TOKEN_BLOCK, FORMAT_VERSION, MAX_JSON_BYTES,
                                        MAX_TOKENS, V2_LAYER_GROUP, VarintError, codec_table,
                                        read_varint, varint)

ARRAY_SECTIONS = {"token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4")}
ARRAY_CODECS = ("zstd", "raw")

# NOTE: reader limit (docs/FORMAT.md "Reader limits"): a section of a known codec may
# decode to at most EXPANSION[codec] x its stored bytes + min(EXPANSION_SLACK,
# EXPANSION[codec] x its stored bytes), so that the work and memory a stream costs are
# bounded by its size on disk (a 359-byte section claiming 2^24 rows, or a zstd bomb, is
# refused before anything is decompressed). The slack is proportional to the stored bytes:
# an absolute slack per section (or per record) was granted again for every section of
# every record, so a stream of many tiny forged sections decoded to 1800x its size (11 s
# of CPU per MiB). Real routing expands 1.4-5x (ctx-zstd up to ~15x with long repeat
# runs); the writer stores a section that would exceed the limit with the next codec that
# fits (FALLBACK), so it never writes what readers refuse: only near-constant routing
# (over 128x) is stored raw. The ANS codecs get the lowest factors: ctx-ans decodes at
# 5-90 MB/s of ids, xl-ans at 12-90 with numba and xl-ans-rows at 120-215 (2-25 with
# constriction: E entries a symbol, 1 + A a row), ctx-zstd at 60-2000 MB/s.
EXPANSION = {"ctx-ans": 16, "ctx-ans-sorted": 16, "xl-ans": 8, "xl-ans-rows": 8, "ctx-zstd": 64,
             "xl-zstd": 64,
             "zstd-lm": 64,
             "raw-lm": 1, "zstd": 64, "raw": 1}
EXPANSION_SLACK = 64 << 10             # the most slack bytes a section gets
# NOTE: version 3 adds a record-level limit: the whole record (ids, token ids, log-probs)
# decodes to at most 2 x RECORD_EXPANSION x its payload, so that largest_record_bytes()
# holds for every version.
RECORD_EXPANSION = max(EXPANSION.values())
FALLBACK = ("ctx-zstd", "raw-lm")      # routing codecs a writer falls back to, in order
SECTION_OVERHEAD = 5                   # bytes of a version-3 section before its data
# NOTE: reader limit (docs/FORMAT.md "Reader limits", issue 27): every routing section of a
# version-3 record costs a fixed amount of reading (its table entry, CRC, codec byte, a
# decoder call, numpy calls: about 10-50 us) whatever its size, so a grid of one token x one
# layer (17-33 bytes a section) read at 1.2-5 s of CPU per MiB. A record's payload must hold
# at least SECTION_FLOOR bytes per routing section beyond its first (checked from the head,
# before any section is read; one-section records are exempt): about 1 s per MiB at the
# floor. The writer doubles a record's token block (then its layer group) until it fits;
# default geometry (512-row sections of hundreds of bytes or more) is far above it.
SECTION_FLOOR = 96
# NOTE: streams of earlier writers (before these floors) given tiny grids, and their ctx-ans
# records of a few rows, hold sections below them: readable with floors=False (trusted
# streams), so that nothing written before is lost
LEGACY_HINT = ("; a stream of an earlier writer (before the reader floors: tiny grids, "
               "ctx-ans records of a few rows) reads with SidecarReader(..., floors=False) or "
               "`routereplay convert --from sidecar --no-floors` (trusted streams only: its "
               "CPU per MiB is then unbounded)")

# version-3 meta flags (docs/FORMAT.md "Version 3 meta")
F_GRID, F_START, F_PROMPT_LEN, F_TOKEN_IDS, F_LOGPROBS = 1, 2, 4, 8, 16
F_WEIGHT_VERSIONS, F_ENGINE, F_RECOMPUTED, F_PREFIX_CACHED = 32, 64, 128, 256
F_SAMPLING = 512         # NOTE: a format-3 addition: readers before it refuse such records
_KNOWN_FLAGS = 1023
_F64 = struct.Struct("<d")
# NOTE: strings (sample ids, versions, engine) are UTF-8, lone surrogates included as their
# 3-byte forms (Python's "surrogatepass"): a str that version 2's JSON meta could carry
# (as a \ud800 escape) stays writable.
UTF8 = ("utf-8", "surrogatepass")
_U32 = struct.Struct("<I")


def largest_record_bytes(schema: RoutingSchema, stream_bytes: int) -> int:
    """Decoded bytes (ids, token ids, log-probs) of the largest record that the reader
    limits let a stream of ``stream_bytes`` bytes hold: the bound that a reader's work and
    memory on any input are measured against (docs/FORMAT.md "Reader limits").

    min(format limit, expansion limit): the format allows ``MAX_TOKENS`` rows of
    ``L_moe x top_k`` ids plus ``MAX_TOKENS + 1`` token ids and log-probs; the expansion
    limit allows at most ``2 x max(EXPANSION)`` times the stored bytes (section limit with
    its proportional slack; version 3 also the record-level limit).
    """
    fmt = MAX_TOKENS * schema.num_moe_layers * schema.top_k * schema.id_dtype.itemsize \
        + 8 * (MAX_TOKENS + 1)
    return min(fmt, 2 * RECORD_EXPANSION * stream_bytes)


def section_fits(codec: str, decoded: int, stored: int) -> bool:
    """Whether a section of ``stored`` bytes declaring ``decoded`` bytes is within the
    reader's expansion limit (:data:`EXPANSION`); True for codecs without a limit here
    (a reader refuses those by name when asked to decode them)."""
    r = EXPANSION.get(codec)
    return r is None or decoded <= r * stored + min(EXPANSION_SLACK, r * stored)


def record_fits(schema: RoutingSchema, decoded: int, payload_len: int) -> bool:
    """Whether a version-3 record of ``payload_len`` bytes that decodes to ``decoded``
    bytes is within the reader's record-level expansion limit (:data:`RECORD_EXPANSION`)."""
    return decoded <= 2 * RECORD_EXPANSION * payload_len


def grid_fits(n_routing: int, payload_len: int) -> bool:
    """Whether a version-3 record of ``n_routing`` routing sections and a payload of
    ``payload_len`` bytes is at or above the reader's floor (:data:`SECTION_FLOOR` bytes a
    routing section beyond the first)."""
    return payload_len >= SECTION_FLOOR * (n_routing - 1)


def section_floor(codec: str, shape: tuple[int, int, int], num_experts: int) -> int:
    """The reader's floor for a routing section of ``codec`` holding ids ``shape``
    [T, L_g, K] (bytes of its data; 0 for codecs without one here): ``ctx-ans`` and
    ``ctx-ans-sorted``: routereplay.codec.ctx_ans.least_bytes. (``xl-ans`` and
    ``xl-ans-rows`` check theirs when decoding, before their model is resolved.)"""
    if codec in ("ctx-ans", "ctx-ans-sorted"):
        return _codec.ctx_ans.least_bytes(shape[0], shape[1], num_experts)
    return 0


def routing_fits(codec: str, part: np.ndarray, num_experts: int, stored: int) -> bool:
    """Whether a routing section of ``codec`` holding ``part`` [T, L_g, K] in ``stored``
    bytes is within the reader's limits: its expansion limit (:func:`section_fits`) and
    its codec's floor (:func:`section_floor`)."""
    return section_fits(codec, part.nbytes, stored) and \
        stored >= section_floor(codec, part.shape, num_experts)


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of a version-1/2 record body.

    Attributes:
        name: "routing", "token_ids", "logprobs" (others are skipped by readers).
        codec: routing codec name, or "zstd"/"raw" for arrays.
        offset: byte offset in the body.
        length: bytes.
        shape: routing: (T, l1 - l0, top_k); arrays: (N,) or (G,).
        moe_layers: routing only: MoE-axis positions [l0, l1).
    """

    name: str
    codec: str
    offset: int
    length: int
    shape: tuple[int, ...]
    moe_layers: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where a version-3 record's sections lie (docs/FORMAT.md "Sections").

    Routing section ``i = g * n_blocks + b`` holds rows ``[b*B, min(T, (b+1)*B))`` of MoE
    layers ``[g*G, min(L_moe, (g+1)*G))``; the arrays follow in ``arrays`` order. A record
    written as one section has ``B = max(T, 1)`` and ``G = L_moe``.

    Attributes:
        num_tokens: T, routing rows.
        num_layers: L_moe.
        token_block: B, rows per routing section (>= 1).
        layer_group: G, MoE layers per routing section (1 .. L_moe).
        arrays: (name, count) of the array sections, in body order.
        head_len: H, bytes of the head (varint M + meta): where the table starts.
    """

    num_tokens: int
    num_layers: int
    token_block: int
    layer_group: int
    arrays: tuple[tuple[str, int], ...]
    head_len: int

    @property
    def n_blocks(self) -> int:
        return max(1, -(-self.num_tokens // self.token_block))

    @property
    def n_groups(self) -> int:
        return -(-self.num_layers // self.layer_group)

    @property
    def n_routing(self) -> int:
        return self.n_blocks * self.n_groups

    @property
    def n_sections(self) -> int:
        return self.n_routing + len(self.arrays)

    @property
    def table_len(self) -> int:
        """Bytes of the section table (S - 1 u32 end offsets)."""
        return 4 * (self.n_sections - 1)

    def rows(self, b: int) -> tuple[int, int]:
        """Rows [r0, r1) of token block ``b``."""
        return b * self.token_block, min(self.num_tokens, (b + 1) * self.token_block)

    def layers(self, g: int) -> tuple[int, int]:
        """MoE-axis positions [l0, l1) of layer group ``g``."""
        return g * self.layer_group, min(self.num_layers, (g + 1) * self.layer_group)

    def array_index(self, name: str) -> int | None:
        """Section index of the array ``name``, or None when the record has none."""
        for j, (n, _) in enumerate(self.arrays):
            if n == name:
                return self.n_routing + j
        return None

    def describe(self, i: int) -> str:
        """Section ``i`` in words, for error messages."""
        if i >= self.n_routing:
            return f"section {i} ({self.arrays[i - self.n_routing][0]})"
        g, b = divmod(i, self.n_blocks)
        (l0, l1), (r0, r1) = self.layers(g), self.rows(b)
        return f"section {i} (MoE layers [{l0}, {l1}), rows [{r0}, {r1}))"


@dataclasses.dataclass(frozen=True)
class RecordMeta:
    """Validated record metadata (everything but the arrays), as read from a frame.

    ``sections``: the section list of a version-1/2 record; ``grid``: where the sections
    of a version-3 record lie (None for versions 1-2).
    """

    sample_id: str
    num_tokens: int
    start: int = 0
    prompt_len: int | None = None
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    recomputed: tuple[tuple[int, int], ...] = ()
    prefix_cached: tuple[tuple[int, int], ...] = ()
    engine: str = ""
    sections: tuple[Section, ...] = ()
    grid: Grid | None = None
    sampling: SamplingInfo | None = None

    def versions(self) -> list[str]:
        """Distinct weight versions, in order of first appearance."""
        return list(dict.fromkeys(s.version for s in self.weight_versions))


class MetaError(Exception):
    """Why a record meta is invalid (the decoders wrap it into a SidecarError naming the
    frame offset)."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_spans(meta: dict[str, Any]) -> tuple[list[WeightVersionSpan],
                                               dict[str, tuple[tuple[int, int], ...]]]:
    """Version-1/2 JSON span lists -> weight-version spans and the flag spans."""
    spans = []
    for span in meta["weight_versions"]:
        if not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
                and all(is_int(x) for x in span[1:]) and 0 <= span[1] <= span[2]):
            raise MetaError(f"bad weight-version span {span!r}")
        spans.append(WeightVersionSpan(span[0], span[1], span[2]))
    flags: dict[str, tuple[tuple[int, int], ...]] = {}
    for key in ("recomputed", "prefix_cached"):
        for span in meta[key]:
            if not (isinstance(span, list) and len(span) == 2
                    and all(is_int(x) for x in span) and 0 <= span[0] <= span[1]):
                raise MetaError(f"bad {key} span {span!r}")
        flags[key] = tuple((a, b) for a, b in meta[key])
    return spans, flags


def check_counts(t: int, start: int, prompt_len: int | None, n: int | None,
                 g: int | None) -> None:
    """The writer's rules (RoutingRecord.validate and SidecarWriter.write) on counts:
    positions ``start + T <= MAX_TOKENS``; with token ids, N = start + T + 1, prompt_len in
    [1, N] and G = N - prompt_len log-probs; without, prompt_len and G at most start + T + 1.

    NOTE: checked before any section is decompressed, so a forged count (2^28 token ids for
    11 rows) costs nothing, and a record the writer would refuse is never returned.
    """
    seq = start + t + 1                       # tokens of the sequence the rows imply
    if start + t > MAX_TOKENS:
        raise MetaError(f"start {start} + {t} rows above the format's limit {MAX_TOKENS}")
    if n is not None:
        if n != seq:
            raise MetaError(f"{n} token ids for {t} routing rows from position {start}: "
                            f"expected start + T + 1 = {seq}")
        if prompt_len is not None and not 0 < prompt_len <= n:
            raise MetaError(f"prompt_len {prompt_len} outside [1, {n}]")
        if g is not None and prompt_len is not None and g != n - prompt_len:
            raise MetaError(f"{g} log-probs for {n - prompt_len} generated tokens")
    if prompt_len is not None and prompt_len > seq:
        raise MetaError(f"prompt_len {prompt_len} above the {seq} tokens the rows imply")
    if g is not None and g > seq - (prompt_len or 0):
        raise MetaError(f"{g} log-probs, more than the {seq - (prompt_len or 0)} generated "
                        "tokens the rows imply")


# --------------------------------------------------------------------------- encoding


class RecordPayload(bytes):
    """A record payload; ``head_len`` is the number of leading bytes the frame header's
    CRC covers (version 3: the head), None for version 1-2 (the whole payload).
    ``geometry`` (version 3): (token block B, layer group G, routing sections) as written.
    ``floor_margin`` (``xl-ans`` writers): the words of the record's ``xl-ans`` and
    ``xl-ans-rows`` sections over the reader's floors for them (summed over those
    sections: a short last token block does not decide), None where it has none."""

    head_len: int | None = None
    floor_margin: float | None = None
    geometry: tuple[int, int, int] = (0, 0, 1)


def encode_record_payload(record: RoutingRecord, schema: RoutingSchema,
                          codec: str | None = None,
                          layer_group: int | None = None,
                          column_order: str = "engine", *, version: int = FORMAT_VERSION,
                          token_block: int = DEFAULT_TOKEN_BLOCK,
                          one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                          min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES,
                          codecs: tuple[str, ...] | None = None,
                          model: tuple[int, Any] | None = None) -> RecordPayload:
    """Record frame payload (docs/FORMAT.md "Record payload"); frame it with
    ``encode_frame(KIND_RECORD, payload)`` (which takes ``payload.head_len``).

    ``codec`` None: ``xl-zstd`` (version 2: ``ctx-zstd``), as :class:`SidecarWriter`.
    Version 3 (default): a record whose ids take at most ``one_section_bytes`` bytes
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
    ``xl-ans``: the geometry and sections of ``xl-zstd``, each replaced by its ``xl-ans``
    coding under ``model`` (model frame offset, routereplay.codec.xl_ans.XlModel) where
    that is smaller and within the limit; without a model, ``xl-zstd`` throughout.
    Version 2: routereplay.sidecar.payload_v2 (``layer_group`` default 4).
    ``column_order="sorted"`` stores each row in ascending expert order. The record must
    be valid (``RoutingRecord.validate``).

    Raises:
        RecordError: the meta exceeds the reader's limit (``MAX_JSON_BYTES``), or the body
            4 GiB.
    """
    if codec is None:
        codec = _codec.DEFAULT_CODEC if version >= 3 else _codec.V2_DEFAULT_CODEC
    if version < 3:
        return _encode_v2(record, schema, codec, layer_group or V2_LAYER_GROUP, column_order)
    b_rows, g_layers = token_block, min(layer_group or DEFAULT_LAYER_GROUP, schema.num_moe_layers)
    if codec in ("ctx-ans", "ctx-ans-sorted"):
        # NOTE: sections under ctx-ans's floor are stored as ctx-zstd: longer token blocks
        # (as for repetitive routing) keep more of them ctx-ans
        min_section_bytes = max(min_section_bytes, _codec.ctx_ans.least_bytes(
            token_block, g_layers, schema.num_experts))
    while True:
        out = _encode_v3(record, schema, codec, g_layers, column_order, token_block=b_rows,
                         one_section_bytes=one_section_bytes,
                         min_section_bytes=min_section_bytes, codecs=codecs, model=model)
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


def _encode_v2(record: RoutingRecord, schema: RoutingSchema, codec: str, layer_group: int,
               column_order: str) -> "RecordPayload":
    """A version-2 payload (routereplay.sidecar.payload_v2); for ``ctx-ans`` codecs, the
    whole record in ``ctx-zstd`` where a ctx-ans section would fall under the reader's
    floor (:func:`section_floor`; version-2 sections span every row, so only short
    records)."""
    from routereplay.sidecar.payload_v2 import encode_payload_v2
    out = encode_payload_v2(record, schema, codec, layer_group, column_order)
    if codec in ("ctx-ans", "ctx-ans-sorted"):
        import json
        (mlen,) = _U32.unpack(out[:4])
        t = record.expert_ids.shape[0]
        for sec in json.loads(out[4:4 + mlen])["sections"]:
            if sec[0] == "routing" and sec[1] == codec and sec[2] < section_floor(
                    codec, (t, sec[4] - sec[3], schema.top_k), schema.num_experts):
                out = encode_payload_v2(record, schema, "ctx-zstd", layer_group, column_order)
                break
    return RecordPayload(out)


def _encode_v3(record: RoutingRecord, schema: RoutingSchema, codec: str, layer_group: int,
               column_order: str, *, token_block: int, one_section_bytes: int,
               min_section_bytes: int, codecs: tuple[str, ...] | None,
               model: tuple[int, Any] | None) -> "RecordPayload":
    """:func:`encode_record_payload` for version 3 at one geometry request; the payload's
    ``geometry`` is (B, G, routing sections) as written."""
    codecs = tuple(codecs) if codecs is not None else codec_table(codec)
    cid = {c: i for i, c in enumerate(codecs)}
    ids = np.sort(record.expert_ids, axis=-1) if column_order == "sorted" else record.expert_ids
    t, nl = ids.shape[0], schema.num_moe_layers
    base = "xl-zstd" if codec == "xl-ans" else codec
    rows = codec == "xl-ans" and model is not None and "xl-ans-rows" in cid and \
        _codec.xl_ans_rows.applies(nl, schema.num_experts, schema.top_k)
    grid, b_rows, g_layers, blobs = grid_sections(ids, base, schema.num_experts, token_block,
                                                  layer_group or DEFAULT_LAYER_GROUP,
                                                  one_section_bytes, min_section_bytes)
    nb, ng = max(1, -(-t // b_rows)), -(-nl // g_layers)
    secs: list[tuple[str, bytes, int]] = []          # (codec, data, decoded bytes)
    layers: list[int] = []                           # MoE layers of each routing section
    for i, blob in enumerate(blobs):
        g, b = divmod(i, nb)
        part = ids[b * b_rows:(b + 1) * b_rows, g * g_layers:(g + 1) * g_layers]
        sec = (base, blob, part.nbytes) if routing_fits(base, part, schema.num_experts, len(blob)) \
            else _encode_routing(part, base, schema.num_experts)
        if codec == "xl-ans" and model is not None:
            sec = _xl_ans_section(part, g * g_layers, schema, model, sec, rows)
        secs.append(sec)
        layers.append(part.shape[1])
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
    if model is not None:
        ref = len(varint(model[0]))
        xl = [(len(d) - ref, _codec.xl_ans_rows.least_bytes(g) if c == "xl-ans-rows"
               else _codec.xl_ans.least_bytes(g, schema.top_k))
              for (c, d, _), g in zip(secs, layers)
              if c in ("xl-ans", "xl-ans-rows")]
        out.floor_margin = sum(w for w, _ in xl) / sum(f for _, f in xl) if xl else None
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
    back (FALLBACK) where ``codec`` would exceed the reader's expansion limit or fall
    under its floor (:func:`routing_fits`)."""
    for c in (codec,) + tuple(f for f in FALLBACK if f != codec):
        blob = _codec.encode(part, c, num_experts)
        if routing_fits(c, part, num_experts, len(blob)):
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


def encode_meta(sample_id: str, num_tokens: int, token_block: int | None = None,
                layer_group: int | None = None, *, start: int = 0,
                prompt_len: int | None = None, arrays: dict[str, int] | None = None,
                weight_versions: Any = (), engine: str = "", recomputed: Any = (),
                prefix_cached: Any = (), sampling: SamplingInfo | None = None) -> bytes:
    """Version-3 binary meta (docs/FORMAT.md "Version 3 meta"): flags, sample id, T, then
    the fields the flags announce. ``token_block`` and ``layer_group`` (both or neither):
    the record's section grid (None: one routing section). ``arrays``: {"token_ids": N,
    "logprobs": G} of the array sections present. Spans: (version, start, end) and
    (start, end) with non-negative positions. ``sampling``: a validated SamplingInfo (the
    SAMPLING field, flag bit 9), or None."""
    arrays = arrays or {}
    flags = 0
    tail: list[bytes] = []
    if token_block is not None:
        flags |= F_GRID
        tail += [varint(token_block), varint(layer_group or 0)]
    if start:
        flags |= F_START
        tail.append(varint(start))
    if prompt_len is not None:
        flags |= F_PROMPT_LEN
        tail.append(varint(int(prompt_len)))
    for flag, name in ((F_TOKEN_IDS, "token_ids"), (F_LOGPROBS, "logprobs")):
        if name in arrays:
            flags |= flag
            tail.append(varint(arrays[name]))
    if weight_versions:
        flags |= F_WEIGHT_VERSIONS
        tail.append(varint(len(weight_versions)))
        for v, a, b in weight_versions:
            vb = str(v).encode(*UTF8)
            tail += [varint(len(vb)), vb, varint(int(a)), varint(int(b) - int(a))]
    if engine:
        flags |= F_ENGINE
        e = engine.encode(*UTF8)
        tail += [varint(len(e)), e]
    for flag, spans in ((F_RECOMPUTED, recomputed), (F_PREFIX_CACHED, prefix_cached)):
        if spans:
            flags |= flag
            tail.append(varint(len(spans)))
            for a, b in spans:
                tail += [varint(int(a)), varint(int(b) - int(a))]
    if sampling is not None:
        flags |= F_SAMPLING
        mode = sampling.logprobs_mode.encode(*UTF8)
        tail += [varint(len(mode)), mode, _F64.pack(sampling.temperature),
                 _F64.pack(sampling.top_p), varint(sampling.top_k), _F64.pack(sampling.min_p),
                 varint(len(sampling.processors))]
        for name in sampling.processors:
            nb = name.encode(*UTF8)
            tail += [varint(len(nb)), nb]
    sid = sample_id.encode(*UTF8)
    return b"".join([varint(flags), varint(len(sid)), sid, varint(num_tokens)] + tail)


# --------------------------------------------------------------------------- decoding


def head_length(prefix: bytes | memoryview, payload_len: int) -> int:
    """H, the head's length in bytes, from the first bytes of a version-3 payload (at
    least 10, or the whole payload).

    Raises:
        SidecarError: the meta length's varint is bad, or M exceeds the payload or the
            reader's limit (``MAX_JSON_BYTES``).
    """
    try:
        m, pos = read_varint(prefix, 0)
    except VarintError as e:
        raise SidecarError(f"record head: {e}") from None
    if m > MAX_JSON_BYTES or pos + m > payload_len:
        raise SidecarError(f"meta length {m} exceeds the payload ({payload_len} bytes) or "
                           f"the reader's limit of {MAX_JSON_BYTES} bytes")
    return pos + m


class _Cursor:
    """Reads varints and strings from a meta, raising MetaError past its end."""

    def __init__(self, buf: memoryview, pos: int):
        self.buf, self.pos = buf, pos

    def uint(self, what: str) -> int:
        try:
            v, self.pos = read_varint(self.buf, self.pos)
        except VarintError as e:
            raise MetaError(f"{what}: {e}") from None
        return v

    def text(self, what: str) -> str:
        n = self.uint(what + " length")
        if self.pos + n > len(self.buf):
            raise MetaError(f"{what} runs past the meta")
        try:
            s = bytes(self.buf[self.pos:self.pos + n]).decode(*UTF8)
        except UnicodeDecodeError:
            raise MetaError(f"{what} is not UTF-8") from None
        self.pos += n
        return s

    def f64(self, what: str) -> float:
        if self.pos + 8 > len(self.buf):
            raise MetaError(f"{what} runs past the meta")
        (v,) = _F64.unpack(self.buf[self.pos:self.pos + 8])
        self.pos += 8
        return v

    def sampling(self) -> SamplingInfo:
        """The SAMPLING field (docs/FORMAT.md "Version 3 meta"), validated."""
        mode = self.text("sampling mode")
        temperature, top_p = self.f64("sampling temperature"), self.f64("sampling top_p")
        top_k, min_p = self.uint("sampling top_k"), self.f64("sampling min_p")
        n = self.uint("sampling processors count")
        if n > MAX_SAMPLING_PROCESSORS:
            raise MetaError(f"sampling processors count {n} above {MAX_SAMPLING_PROCESSORS}")
        procs = tuple(self.text("sampling processor") for _ in range(n))
        try:
            return SamplingInfo(mode, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, processors=procs)
        except RecordError as e:
            raise MetaError(str(e)) from None

    def spans(self, what: str) -> list[tuple[int, int]]:
        n = self.uint(what + " count")
        if n > len(self.buf) - self.pos:            # NOTE: 2+ bytes each: a forged count is refused
            raise MetaError(f"{what} count {n} runs past the meta")
        out = []
        for _ in range(n):
            a = self.uint(what)
            out.append((a, a + self.uint(what)))
        return out


def decode_head(head: bytes | memoryview, schema: RoutingSchema, payload_len: int,
                offset: int | None = None, *, floors: bool = True) -> RecordMeta:
    """A version-3 record's head (the H bytes :func:`head_length` gives; its CRC already
    checked) -> validated meta with its :class:`Grid`.

    Checks the writer's rules on counts, the geometry, that the section table and S
    sections of at least 5 bytes fit the payload, the section floor (``floors``:
    :data:`SECTION_FLOOR`; False only for trusted streams of earlier writers) and the
    record-level expansion limit, all before anything else is read.

    Raises:
        SidecarError: naming the offset (and the sample id when the meta gives one).
    """
    head = memoryview(head)
    sid = None
    try:
        cur = _Cursor(head, 0)
        mlen = cur.uint("meta length")
        if cur.pos + mlen != len(head):
            raise MetaError("meta length does not match the head")
        flags = cur.uint("flags")
        sid = cur.text("sample id")
        if flags & ~_KNOWN_FLAGS:
            raise MetaError(f"unknown flags {flags & ~_KNOWN_FLAGS:#x} (a newer writer?)")
        t = cur.uint("num_tokens")
        if t > MAX_TOKENS:
            raise MetaError(f"num_tokens {t} above the format's limit {MAX_TOKENS}")
        nl = schema.num_moe_layers
        if flags & F_GRID:
            b_rows, g_layers = cur.uint("token_block"), cur.uint("layer_group")
            if not (1 <= b_rows <= MAX_TOKENS and 1 <= g_layers <= nl):
                raise MetaError(f"token_block {b_rows} or layer_group {g_layers} outside "
                                f"[1, {MAX_TOKENS}] / [1, {nl}]")
        else:
            b_rows, g_layers = max(t, 1), nl
        start = cur.uint("start") if flags & F_START else 0
        prompt_len = cur.uint("prompt_len") if flags & F_PROMPT_LEN else None
        n_tok = cur.uint("token_ids count") if flags & F_TOKEN_IDS else None
        n_lp = cur.uint("logprobs count") if flags & F_LOGPROBS else None
        spans: list[WeightVersionSpan] = []
        if flags & F_WEIGHT_VERSIONS:
            n = cur.uint("weight_versions count")
            if n > len(head) - cur.pos:
                raise MetaError(f"weight_versions count {n} runs past the meta")
            for _ in range(n):
                v = cur.text("weight version")
                a = cur.uint("weight-version span")
                spans.append(WeightVersionSpan(v, a, a + cur.uint("weight-version span")))
        engine = cur.text("engine") if flags & F_ENGINE else ""
        recomputed = cur.spans("recomputed") if flags & F_RECOMPUTED else []
        prefix_cached = cur.spans("prefix_cached") if flags & F_PREFIX_CACHED else []
        sampling = cur.sampling() if flags & F_SAMPLING else None
        if cur.pos != len(head):
            raise MetaError(f"{len(head) - cur.pos} bytes after the meta's last field")
        check_counts(t, start, prompt_len, n_tok, n_lp)
        arrays = tuple((name, n) for name, n in (("token_ids", n_tok), ("logprobs", n_lp))
                       if n is not None)
        grid = Grid(t, nl, b_rows, g_layers, arrays, len(head))
        s = grid.n_sections
        if len(head) + grid.table_len + SECTION_OVERHEAD * s > payload_len:
            raise MetaError(f"{s} sections (token_block {b_rows}, layer_group {g_layers}) do "
                            f"not fit a payload of {payload_len} bytes")
        if floors and not grid_fits(grid.n_routing, payload_len):
            raise MetaError(f"{grid.n_routing} routing sections (token_block {b_rows}, "
                            f"layer_group {g_layers}) in a payload of {payload_len} bytes: "
                            f"below the reader's floor of {SECTION_FLOOR} bytes a section "
                            f"beyond the first{LEGACY_HINT}")
        decoded = t * nl * schema.top_k * schema.id_dtype.itemsize + 4 * sum(n for _, n in arrays)
        if not record_fits(schema, decoded, payload_len):
            raise MetaError(f"record declares {decoded} decoded bytes from a payload of "
                            f"{payload_len} bytes: beyond the reader's limit of "
                            f"{2 * RECORD_EXPANSION} x")
    except MetaError as e:
        raise SidecarError("invalid record meta" + (f" for sample {sid!r}" if sid else "")
                           + f": {e}", offset=offset, sample_id=sid) from None
    return RecordMeta(sample_id=sid, num_tokens=t, start=start, prompt_len=prompt_len,
                      weight_versions=tuple(spans), recomputed=tuple(recomputed),
                      prefix_cached=tuple(prefix_cached), engine=engine, grid=grid,
                      sampling=sampling)


def section_crc(index: int, codec_byte: int, data: bytes | memoryview) -> int:
    """CRC-32 of a version-3 section: over its u32 index, its codec byte and its data."""
    return zlib.crc32(data, zlib.crc32(_U32.pack(index) + bytes([codec_byte]))) & 0xFFFFFFFF


def _xl_ans_section(part: np.ndarray, l0: int, schema: RoutingSchema,
                    model: tuple[int, Any], fallback: tuple[str, bytes, int],
                    rows: bool) -> tuple[str, bytes, int]:
    """The section (codec, data, decoded bytes) of ids ``part`` [T, G, K] (MoE layers from
    ``l0``) under an ``xl-ans`` model (frame offset, XlModel): ``xl-ans-rows`` where
    ``rows`` and it fits the reader's floor and work limit, else ``xl-ans`` where that
    fits them, kept only where smaller than ``fallback`` (the ``xl-zstd`` section: its
    bound by zstd-19 carries over) and within the expansion limit.

    NOTE: both layouts code the same model (sizes within 0.1 %); rows decode 2-3x faster
    but cost 1 + A work units a row, so repetitive routing (under about 1.8 bits a row at
    E=8 top-2) takes ``xl-ans``, whose repeats cost 2. Where rows fit but are not smaller
    than ``fallback``, neither would be: ``xl-ans`` is not coded as well."""
    e, ref = schema.num_experts, len(varint(model[0]))
    part = np.ascontiguousarray(part)
    if rows and len(fallback[1]) > ref + _codec.xl_ans_rows.least_bytes(part.shape[1]):
        xa = _codec.encode(part, "xl-ans-rows", e, model=model, moe_layer0=l0)
        words = len(xa) - ref
        if words >= _codec.xl_ans_rows.least_bytes(part.shape[1]) and \
                _codec.xl_ans_rows.section_work(part.shape, e) <= \
                _codec.xl_ans_rows.WORK_PER_BYTE * words:
            if len(xa) < len(fallback[1]) and section_fits("xl-ans-rows", part.nbytes, len(xa)):
                return "xl-ans-rows", xa, part.nbytes
            return fallback
    xa = _codec.encode(part, "xl-ans", e, model=model, moe_layer0=l0)
    words = len(xa) - ref
    if len(xa) < len(fallback[1]) and section_fits("xl-ans", part.nbytes, len(xa)) \
            and words >= _codec.xl_ans.least_bytes(part.shape[1], part.shape[2]) \
            and _codec.xl_ans.section_work(part, e) <= _codec.xl_ans.WORK_PER_BYTE * words:
        return "xl-ans", xa, part.nbytes
    return fallback


def open_section(grid: Grid, i: int, raw: memoryview, codecs: tuple[str, ...],
                 schema: RoutingSchema, *, floors: bool = True) -> tuple[str, memoryview]:
    """Check section ``i`` (its stored bytes ``raw``) -> (codec name, data): its CRC, its
    codec byte, its codec's expansion limit for the shape it holds and (``floors``) its
    codec's floor (:func:`section_floor`).

    Raises:
        SidecarError: a CRC mismatch, a codec byte outside the header's table, an array
            codec other than zstd/raw, or a section beyond the expansion limit or under its
            floor (naming the section).
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
        g, b = divmod(i, grid.n_blocks)
        (l0, l1), (r0, r1) = grid.layers(g), grid.rows(b)
        decoded = (r1 - r0) * (l1 - l0) * schema.top_k * schema.id_dtype.itemsize
    if not section_fits(codec, decoded, len(data)):
        raise SidecarError(f"{grid.describe(i)} ({codec}) declares {decoded} bytes from {len(data)} "
                           f"stored bytes: beyond the reader's limit of {EXPANSION[codec]} x "
                           f"+ min({EXPANSION_SLACK}, {EXPANSION[codec]} x) bytes")
    if floors and i < grid.n_routing:
        least = section_floor(codec, (r1 - r0, l1 - l0, schema.top_k), schema.num_experts)
        if len(data) < least:
            raise SidecarError(f"{grid.describe(i)} ({codec}) of {len(data)} bytes is below the "
                               f"reader's floor of {least} bytes for its shape{LEGACY_HINT}")
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


def decode_record_payload(payload: bytes | memoryview, schema: RoutingSchema, version: int,
                          offset: int | None = None, *, floors: bool = True
                          ) -> tuple[RecordMeta, memoryview]:
    """Split a version-1/2 record payload into validated meta and the body
    (routereplay.sidecar.payload_v2; version-3 heads: :func:`decode_head`), its routing
    sections checked against their codec's floor (:func:`section_floor`).

    Raises:
        SidecarError: naming the offset (and the sample id), a section under its floor by
            its MoE layers."""
    from routereplay.sidecar.payload_v2 import decode_payload_v2
    meta, body = decode_payload_v2(payload, schema, version, offset)
    for sec in meta.sections if floors else ():
        if sec.name == "routing" and sec.length < section_floor(sec.codec, sec.shape,
                                                                 schema.num_experts):
            raise SidecarError(f"invalid record meta for sample {meta.sample_id!r}: routing "
                               f"section of MoE layers {list(sec.moe_layers)} ({sec.codec}) "
                               f"of {sec.length} bytes is below the reader's floor of "
                               f"{section_floor(sec.codec, sec.shape, schema.num_experts)} "
                               f"bytes for its shape{LEGACY_HINT}", offset=offset,
                               sample_id=meta.sample_id)
    return meta, body


def peek_sample_id(payload: bytes | memoryview, version: int = 2) -> str | None:
    """Best-effort sample id from a payload whose checksum failed (for error messages)."""
    if version < 3:
        from routereplay.sidecar.payload_v2 import peek_sample_id_v2
        return peek_sample_id_v2(payload)
    try:
        buf = memoryview(payload)
        cur = _Cursor(buf, 0)
        cur.uint("meta length")
        cur.uint("flags")
        return cur.text("sample id")
    except Exception:  # noqa: BLE001 - corrupt bytes: nothing to report
        return None
