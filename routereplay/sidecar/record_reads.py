"""Reading a record: its head, its section table and only the sections asked for.

Version 3 records are read by ranges (docs/FORMAT.md "Reading a version-3 record"): the
head once (cached), the table entries around the sections needed, then one read per run
of adjacent needed sections, each checked against its CRC. Version 2 records are read whole
(one CRC covers the payload); only the layer groups asked for are decoded.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import numpy as np

from routereplay import codec as _codec
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord
from routereplay.sidecar.layout import FRAME_HEADER_SIZE, KIND_RECORD, crc32, parse_frame_header
from routereplay.sidecar.legacy import decode_payload_v2
from routereplay.sidecar.locking import serialized
from routereplay.sidecar.limits import SECTION_OVERHEAD
from routereplay.sidecar.payload import decode_array, open_section
from routereplay.sidecar.record_meta import (Grid, RecordMeta, decode_head, head_length,
                                             peek_sample_id)
from routereplay.source import Rows

HEAD_GUESS = 256               # bytes read at a frame for its header and head (one request)
TABLE_GAP = 1024               # section-table entries this close are read in one request


@dataclasses.dataclass(frozen=True)
class RecordBytes:
    """Where a record's bytes go (:meth:`SidecarReader.record_bytes`), in bytes: the whole
    ``frame`` (frame header, head, section table, sections), its ``routing`` sections (their
    CRC and codec byte included), each array section by name (``arrays``: "token_ids",
    "logprobs"); ``routing_sections`` counts the routing sections."""

    sample_id: str
    frame: int
    routing: int
    arrays: dict[str, int]
    routing_sections: int

    @property
    def routing_frame(self) -> int:
        """The frame without its array sections (a stream carrying routing only)."""
        return self.frame - sum(self.arrays.values())


@dataclasses.dataclass
class RecordHead:
    """A version-3 record's head, cached for the reader's life: frame ``offset``, validated
    ``meta`` (with its Grid), ``payload_len`` P, and ``prefix``, the payload bytes read with
    the head (at most HEAD_GUESS - 24), whose table entries and sections are not read again.
    """

    offset: int
    meta: RecordMeta
    payload_len: int
    prefix: bytes

    @property
    def grid(self) -> Grid:
        assert self.meta.grid is not None
        return self.meta.grid

    @property
    def body_at(self) -> int:
        """Payload offset of the body (after the head and the table)."""
        return self.grid.head_len + self.grid.table_len


def check_spans(meta: RecordMeta, offset: int | None = None) -> RecordMeta:
    """Return ``meta`` unless a weight-version, ``recomputed`` or ``prefix_cached`` span
    ``[a, b)`` breaks ``0 <= a <= b <= start + T + 1`` (the token positions its rows imply).

    NOTE: the one bound of :meth:`RoutingRecord.validate` the meta decoders leave out, so a
    record the writer would refuse is never returned. Work: O(spans).

    Raises:
        SidecarError: naming the sample, the span and the record's extent.
    """
    seq = meta.start + meta.num_tokens + 1
    named = [(f" of version {s.version[:40]!r}", "weight-version", s.start, s.end)
             for s in meta.weight_versions]
    named += [("", "recomputed", a, b) for a, b in meta.recomputed]
    named += [("", "prefix_cached", a, b) for a, b in meta.prefix_cached]
    for version, what, a, b in named:
        if not 0 <= a <= b <= seq:
            raise SidecarError(
                f"invalid record meta for sample {meta.sample_id!r}: {what} span [{a}, {b})"
                f"{version} runs beyond the record's {seq}-token sequence (start "
                f"{meta.start}, {meta.num_tokens} rows: spans lie within [0, {seq}]; "
                "writers refuse it)", offset=offset, sample_id=meta.sample_id)
    return meta


def table_ends(grid: Grid, table: memoryview, body_len: int) -> np.ndarray:
    """The whole section table -> section boundaries int64 [S + 1] (0, ends..., body_len),
    checked: every section at least 5 bytes, in order, inside the body.

    Raises:
        SidecarError: naming the first section whose table entry is out of place.
    """
    ends = np.empty(grid.n_sections + 1, dtype=np.int64)
    ends[0], ends[-1] = 0, body_len
    ends[1:-1] = np.frombuffer(table, dtype="<u4")
    bad = np.flatnonzero(np.diff(ends) < SECTION_OVERHEAD)
    if bad.size:
        i = int(bad[0])
        raise SidecarError(f"section table: {grid.describe(i)} spans [{int(ends[i])}, "
                           f"{int(ends[i + 1])}) of a {body_len}-byte body (forged or "
                           "overlapping table entries)")
    return ends


def clip_rows(meta: RecordMeta, runs: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """Row ranges ``(r0, r1)`` of absolute token ``runs`` clipped to the rows (None: all)."""
    t = meta.num_tokens
    if runs is None:
        return [(0, t)]
    rows = []
    for lo, hi in runs:
        a = min(max(lo - meta.start, 0), t)
        rows.append((a, min(max(hi - meta.start, a), t)))
    return rows


def _columns(want: list[int], section_of: Any) -> dict[Any, tuple[Any, Any]]:
    """{section key: (output columns, section columns)} of MoE layers ``want`` (slices when
    consecutive: one slice copy); ``section_of(layer)`` -> (key, its first layer)."""
    groups: dict[Any, tuple[list[int], list[int]]] = {}
    for pos, lyr in enumerate(want):
        key, first = section_of(lyr)
        c = groups.setdefault(key, ([], []))
        c[0].append(pos)
        c[1].append(lyr - first)
    return {key: (slice(p[0], p[0] + len(p)), slice(o[0], o[0] + len(o)))
            if p == list(range(p[0], p[0] + len(p))) and o == list(range(o[0], o[0] + len(o)))
            else (p, o) for key, (p, o) in groups.items()}


class RecordReads:
    """:class:`~routereplay.sidecar.reader.SidecarReader`'s reads of one record (a mixin
    using the reader's file, header and caches)."""

    @serialized
    def record_bytes(self, sample_id: str) -> RecordBytes:
        """Bytes one record takes, by part, from its stored section lengths (version 3
        reads only the head and the section table).

        Raises:
            UnknownSampleError (a KeyError): no such sample id.
            SidecarError: the frame is corrupt, or its section table is out of place.
        """
        off, got = self._frame_meta(sample_id)
        if self.version < 3:
            meta, _body = got
            fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
            routing = [s.length for s in meta.sections if s.name == "routing"]
            return RecordBytes(sample_id, FRAME_HEADER_SIZE + fh.payload_len, sum(routing), {
                s.name: s.length for s in meta.sections if s.name != "routing"}, len(routing))
        h, n = got, got.grid.n_routing
        sizes = np.diff(self._ends(h)).tolist()
        return RecordBytes(sample_id, FRAME_HEADER_SIZE + h.payload_len, sum(sizes[:n]),
                           {name: sizes[n + j] for j, (name, _) in enumerate(h.grid.arrays)}, n)

    @serialized
    def routing_codecs(self, sample_id: str) -> dict[str, int]:
        """How many of a record's routing sections each codec stores: {codec name: count}
        (e.g. ``{"xl-zstd": 3, "raw-lm": 1}``: a writer falls back per section), from the
        codec bytes (version 3: one read of the record's body) or the meta (version 2).

        Raises:
            UnknownSampleError (a KeyError): no such sample id.
            SidecarError: the frame is corrupt, its section table out of place, or a codec
                byte outside the header's table."""
        off, got = self._frame_meta(sample_id)
        out: dict[str, int] = {}
        if self.version >= 3:
            h, grid = got, got.grid
            ends, body = self._ends(h), self._payload(h, h.body_at, h.payload_len)
            for i in range(grid.n_routing):
                at = int(ends[i]) + 4
                cb = body[at] if at < len(body) else len(self._codecs)
                if cb >= len(self._codecs):
                    raise SidecarError(f"sample {sample_id!r}: {grid.describe(i)} has codec "
                                       f"byte {cb}, outside the header's table", offset=off,
                                       sample_id=sample_id)
                out[self._codecs[cb]] = out.get(self._codecs[cb], 0) + 1
            return out
        meta, _body = got
        for sec in meta.sections:
            if sec.name == "routing":
                out[sec.codec] = out.get(sec.codec, 0) + 1
        return out

    def _frame_meta(self, sample_id: str) -> tuple[int, Any]:
        """(frame offset, the cached RecordHead (version 3) or (meta, body) of the whole
        frame (version 2)). An index entry whose frame is missing, corrupt or another
        sample's makes the reader scan (checking the index) and look again."""
        fi = self._locate(sample_id)
        off = fi.offset
        try:
            if self.version >= 3:
                got: Any = self._head(off)
                meta = got.meta
            else:
                fh, payload = self._read_frame(off)
                if fh.kind != KIND_RECORD:
                    raise SidecarError(f"frame at offset {off} is not a record frame", offset=off)
                got = decode_payload_v2(payload, self.schema, off)
                meta = check_spans(got[0], off)
            if meta.sample_id != sample_id:
                raise SidecarError(f"frame at offset {off} holds sample {meta.sample_id!r}",
                                   offset=off)
        except SidecarError as e:
            if self._frames is None and self._index is not None:
                # NOTE: a stale or forged index entry
                self._by_id = {}
                self.scan()
                found = self._by_id.get(sample_id)
                if found is not None:
                    return self._frame_meta(sample_id)
                raise SidecarError(
                    f"sample {sample_id!r} is listed in the index of {self.name} (offset {off}) "
                    f"but its frame is missing or corrupt: {e}", offset=off,
                    sample_id=sample_id) from None
            if e.sample_id is not None:
                raise
            raise SidecarError(f"sample {sample_id!r}: {e}", offset=e.offset,
                               sample_id=sample_id) from None
        return off, got

    def _record_sections(self, sample_id: str, want: list[int], arrays: bool
                         ) -> tuple[RecordMeta, dict[Any, Any], int]:
        """Version 2: (meta, decoded sections by (l0, l1) layers or array name, offset)."""
        off, (meta, body) = self._frame_meta(sample_id)
        wanted = set(want)
        out: dict[Any, Any] = {}
        try:
            for sec in meta.sections:
                blob = body[sec.offset: sec.offset + sec.length]
                if sec.name == "routing":
                    if wanted.intersection(range(*sec.moe_layers)):
                        try:
                            out[sec.moe_layers] = _codec.decode(
                                bytes(blob), sec.codec, sec.shape, self.schema.id_dtype,
                                self.schema.num_experts)
                        except SidecarError as e:
                            l0, l1 = sec.moe_layers
                            raise SidecarError(f"routing section of MoE layers [{l0}, {l1}), "
                                               f"rows [0, {sec.shape[0]}): {e}") from None
                elif arrays and sec.name in ("token_ids", "logprobs"):
                    out[sec.name] = decode_array(blob, sec.name, sec.codec, sec.shape[0])
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r} (frame at offset {off}): {e}",
                               offset=off, sample_id=meta.sample_id) from None
        return meta, out, off

    def _load(self, sample_id: str, want: list[int], runs: list[tuple[int, int]] | None,
              arrays: bool) -> tuple[RecordMeta, list[Rows], dict[str, np.ndarray]]:
        """(meta, (ids [r1 - r0, len(want), K], first token position) per run, arrays by
        name) of ``sample_id``: MoE layers ``want`` of token ``runs`` (absolute positions,
        clipped to the record's rows; None: every row), and the arrays if asked for."""
        if self.version >= 3:
            return self._load_v3(sample_id, want, runs, arrays)
        meta, sections, off = self._record_sections(sample_id, want, arrays)
        rows = clip_rows(meta, runs)
        out = self._assemble(meta, sections, want, rows, off)
        return (meta, [(o, meta.start + r0) for o, (r0, _) in zip(out, rows)],
                {k: v for k, v in sections.items() if isinstance(k, str)})

    def _head(self, off: int) -> RecordHead:
        """The head of the version-3 record frame at ``off`` (cached): one read of up to
        HEAD_GUESS bytes (bounded by the next known frame), a second if the head is longer.

        Raises:
            SidecarError: a bad frame header, not a record frame, a head checksum
                mismatch, an invalid meta.
        """
        h = self._heads.get(off)
        if h is not None:
            return h
        j = bisect.bisect_right(self._offsets, off)
        end = self._offsets[j] if j < len(self._offsets) else self.size
        buf = self._read(off, max(FRAME_HEADER_SIZE, min(HEAD_GUESS, end - off)))
        fh = parse_frame_header(buf[:FRAME_HEADER_SIZE], off, self.size)
        if fh.kind != KIND_RECORD:
            raise SidecarError(f"frame at offset {off} is not a record frame", offset=off)
        prefix = buf[FRAME_HEADER_SIZE:FRAME_HEADER_SIZE + fh.payload_len]
        hl = head_length(prefix[:10] if len(prefix) >= min(10, fh.payload_len)
                         else self._read(off + FRAME_HEADER_SIZE, 10), fh.payload_len)
        head = prefix[:hl] if hl <= len(prefix) else \
            prefix + self._read(off + FRAME_HEADER_SIZE + len(prefix), hl - len(prefix))
        if len(head) != hl or crc32(head) != fh.payload_crc:
            raise SidecarError(f"corrupt frame at offset {off}: record head checksum mismatch",
                               offset=off, sample_id=peek_sample_id(head))
        meta = check_spans(decode_head(head, self.schema, fh.payload_len, off,
                                       floors=self._floors), off)
        h = self._heads[off] = RecordHead(off, meta, fh.payload_len, prefix)
        return h

    def _ends(self, h: RecordHead, whole: bytes | None = None) -> np.ndarray:
        """:func:`table_ends` of a version-3 record (its table from ``whole`` if given)."""
        return table_ends(h.grid, self._payload(h, h.grid.head_len, h.body_at, whole),
                          h.payload_len - h.body_at)

    def _payload(self, h: RecordHead, a: int, b: int, whole: bytes | None = None) -> memoryview:
        """Bytes [a, b) of a version-3 record's payload: from ``whole`` or the bytes read
        with the head when they hold them, else one read."""
        if whole is not None:
            return memoryview(whole)[a:b]
        if b <= len(h.prefix):
            return memoryview(h.prefix)[a:b]
        got = self._read(h.offset + FRAME_HEADER_SIZE + a, b - a)
        if len(got) != b - a:
            raise SidecarError(f"record frame at offset {h.offset} ends after "
                               f"{a + len(got)} of its {h.payload_len} payload bytes "
                               "(the stream shrank?)", offset=h.offset)
        return memoryview(got)

    def _sections_v3(self, h: RecordHead, needed: list[int], sink: Any) -> None:
        """Read, check and hand ``sink(i, codec, data)`` each section of ``needed`` (sorted
        indices): their table entries by ranges, then one read per run of adjacent sections
        (the whole payload at once when every section is needed).

        Raises:
            SidecarError: a table entry out of place (naming the section), a section
                failing its checks (open_section).
        """
        grid = h.grid
        n = grid.n_sections
        body_len = h.payload_len - h.body_at
        whole = None
        if len(needed) == n and len(h.prefix) < h.payload_len:
            whole = self._read(h.offset + FRAME_HEADER_SIZE, h.payload_len)
            if len(whole) != h.payload_len:
                raise SidecarError(f"record frame at offset {h.offset} is cut short",
                                   offset=h.offset)
        if len(needed) == n:
            ends = self._ends(h, whole)
            bounds = {i: (int(ends[i]), int(ends[i + 1])) for i in needed}
        else:
            entries = self._table_entries(h, needed, whole)
            bounds = {}
            for i in needed:
                a = entries[i - 1] if i else 0
                b = entries[i] if i < n - 1 else body_len
                if not (SECTION_OVERHEAD <= b - a and b <= body_len):
                    raise SidecarError(f"section table: {grid.describe(i)} spans [{a}, {b}) of "
                                       f"a {body_len}-byte body (forged or overlapping table "
                                       "entries)")
                bounds[i] = (a, b)
        j = 0
        while j < len(needed):                 # one read per run of adjacent sections
            e = j
            while e + 1 < len(needed) and bounds[needed[e + 1]][0] == bounds[needed[e]][1]:
                e += 1
            a0, b0 = bounds[needed[j]][0], bounds[needed[e]][1]
            buf = self._payload(h, h.body_at + a0, h.body_at + b0, whole)
            for i in needed[j:e + 1]:
                a, b = bounds[i]
                codec, data = open_section(grid, i, buf[a - a0:b - a0], self._codecs,
                                           self.schema)
                sink(i, codec, data)
            j = e + 1

    def _table_entries(self, h: RecordHead, needed: list[int], whole: bytes | None
                       ) -> dict[int, int]:
        """End offsets of sections ``needed`` and of those just before them (their starts),
        read in ranges (entries within TABLE_GAP of each other share one read)."""
        last = h.grid.n_sections - 1                  # its end is the body's: no entry
        want = sorted({i for x in needed for i in (x - 1, x) if 0 <= i < last})
        out: dict[int, int] = {}
        j = 0
        while j < len(want):
            e = j
            while e + 1 < len(want) and want[e + 1] - want[e] <= TABLE_GAP:
                e += 1
            i0, i1 = want[j], want[e]
            raw = self._payload(h, h.grid.head_len + 4 * i0, h.grid.head_len + 4 * (i1 + 1),
                                whole)
            out.update(zip(range(i0, i1 + 1), np.frombuffer(raw, dtype="<u4").tolist()))
            j = e + 1
        return out

    def _load_v3(self, sample_id: str, want: list[int], runs: list[tuple[int, int]] | None,
                 arrays: bool) -> tuple[RecordMeta, list[Rows], dict[str, np.ndarray]]:
        """:meth:`_load` of version 3, reading only the sections holding ``want`` x ``runs``.

        NOTE: each section is decoded, copied into the outputs and dropped (the reader holds
        the outputs, one read range and one decoded section). The outputs are allocated
        first: their size is within the expansion limit checked on the head."""
        off, h = self._frame_meta(sample_id)
        meta, grid, schema = h.meta, h.grid, self.schema
        k, rows = schema.top_k, clip_rows(meta, runs)
        out = [np.empty((r1 - r0, len(want), k), dtype=schema.id_dtype) for r0, r1 in rows]
        lg = grid.layer_group
        cols = _columns(want, lambda lyr: (lyr // lg, lyr // lg * lg))      # by layer group
        blocks = sorted({b for r0, r1 in rows if r1 > r0
                         for b in range(r0 // grid.token_block, (r1 - 1) // grid.token_block + 1)})
        needed = [g * grid.n_blocks + b for g in sorted(cols) for b in blocks]
        if arrays:
            needed += [i for i in (grid.array_index("token_ids"), grid.array_index("logprobs"))
                       if i is not None]
        got: dict[str, np.ndarray] = {}

        def sink(i: int, codec: str, data: memoryview) -> None:
            if i >= grid.n_routing:
                name, count = grid.arrays[i - grid.n_routing]
                try:
                    got[name] = decode_array(data, name, codec, count)
                except SidecarError as e:
                    raise SidecarError(f"{grid.describe(i)}: {e}") from None
                return
            g, b = divmod(i, grid.n_blocks)
            (l0, l1), (b0, b1) = grid.layers(g), grid.rows(b)
            try:
                ids = _codec.decode(bytes(data), codec, (b1 - b0, l1 - l0, k), schema.id_dtype,
                                    schema.num_experts)
            except SidecarError as e:
                raise SidecarError(f"{grid.describe(i)}: {e}") from None
            dst, src = cols[g]
            for o, (r0, r1) in zip(out, rows):
                a, e = max(r0, b0), min(r1, b1)
                if e > a:
                    o[a - r0:e - r0, dst] = ids[a - b0:e - b0][:, src]

        try:
            self._sections_v3(h, needed, sink)
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r} (frame at offset {off}): {e}",
                               offset=off, sample_id=meta.sample_id) from None
        self._check_ids(meta, out, rows, want, off)
        return meta, [(o, meta.start + r0) for o, (r0, _) in zip(out, rows)], got

    def _assemble(self, meta: RecordMeta, sections: dict[Any, Any], want: list[int],
                  rows: list[tuple[int, int]], offset: int) -> list[np.ndarray]:
        """ids [r1 - r0, len(want), K] for each row range, from the decoded sections.

        NOTE: allocated only after the sections decoded to their promised sizes, so the
        size is backed by real data (or is zero when no layer was asked for)."""
        schema = self.schema
        out = [np.empty((r1 - r0, len(want), schema.top_k), dtype=schema.id_dtype)
               for r0, r1 in rows]
        owner = {lyr: key for key in sections if isinstance(key, tuple) for lyr in range(*key)}
        for key, (dst, src) in _columns(want, lambda lyr: (owner[lyr], owner[lyr][0])).items():
            for o, (r0, r1) in zip(out, rows):
                o[:, dst] = sections[key][r0:r1][:, src]
        self._check_ids(meta, out, rows, want, offset)
        return out

    def _check_ids(self, meta: RecordMeta, out: list[np.ndarray], rows: list[tuple[int, int]],
                   want: list[int], offset: int) -> None:
        """Check decoded ids [r1 - r0, len(want), K] of each row range (in range, distinct
        in a row), naming the sample, token position and decoder layer.

        NOTE: the reader is the boundary that checks stored ids; consumers do not again."""
        layer_ids = [self.schema.moe_layer_ids[i] for i in want]
        for o, (r0, _) in zip(out, rows):
            try:
                RoutingRecord(meta.sample_id, o, start=meta.start + r0).validate_ids(
                    self.schema, layer_ids=layer_ids)
            except RecordError as e:
                raise SidecarError(f"frame at offset {offset}: {e}", offset=offset,
                                   sample_id=meta.sample_id) from None
