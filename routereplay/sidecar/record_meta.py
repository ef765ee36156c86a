"""What a record's head says (docs/FORMAT.md "Record payload (kind 1)", "Version 3 meta"):
the validated :class:`RecordMeta` with its sections (version 2: :class:`Section`; version
3: :class:`Grid`), the writer's rules on counts, and version 3's binary head (varint M,
meta) encoded and decoded. Shared by the version-3 payload and routereplay.sidecar.legacy.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from routereplay.errors import RecordError, SidecarError
from routereplay.record import MAX_SAMPLING_PROCESSORS, SamplingInfo, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import MAX_JSON_BYTES, MAX_TOKENS
from routereplay.sidecar.limits import (LEGACY_HINT, RECORD_EXPANSION, SECTION_FLOOR,
                                        SECTION_OVERHEAD, grid_fits, record_fits)
from routereplay.varint import VarintError, read_varint, varint

ARRAY_SECTIONS = {"token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4")}

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


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of a version-2 record body.

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

    ``sections``: the section list of a version-2 record; ``grid``: where the sections
    of a version-3 record lie (None for version 2).
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


def peek_sample_id(payload: bytes | memoryview) -> str | None:
    """Best-effort sample id from a version-3 payload whose checksum failed (for error
    messages; version 2: routereplay.sidecar.legacy.peek_sample_id_v2)."""
    try:
        buf = memoryview(payload)
        cur = _Cursor(buf, 0)
        cur.uint("meta length")
        cur.uint("flags")
        return cur.text("sample id")
    except Exception:  # noqa: BLE001 - corrupt bytes: nothing to report
        return None
