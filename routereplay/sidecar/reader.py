"""Sidecar reader: lazy, recovering, partial (docs/FORMAT.md "Reading rules").

Opening reads the header and, for a cleanly closed stream, the index; frames are found by
the index or by scanning. A scan recovers every complete frame before a torn tail and
reports corrupt frames by offset (it reads and checks every byte of every frame).

Records are decoded on demand. Version 3 records are read by ranges: the frame header and
head (once per record, cached), the section-table entries around the sections needed, and
the needed sections (one read per contiguous run), each checked against its own CRC; only
the (token block, layer group) sections holding the asked rows and MoE layers are read and
decoded. Version 1-2 records are read whole (their CRC covers the whole payload) and only
the layer groups asked for are decoded. The reader is a
:class:`routereplay.source.RoutingSource`.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import io
import os
import stat
import threading
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from routereplay import codec as _codec
from routereplay.codec import xl_ans
from routereplay.errors import ConfigError, RecordError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.sidecar.layout import (FRAME_HEADER_SIZE, HEADER_FIXED_SIZE,
                                        KIND_INDEX, KIND_MODEL, KIND_RECORD, TRAILER_MAGIC, TRAILER_SIZE,
                                        FrameHeader, crc32, decode_header, decode_index,
                                        header_json_length,
                                        parse_frame_header, parse_trailer)
from routereplay.sidecar.payload import (SECTION_OVERHEAD, Grid, RecordMeta, decode_array,
                                         decode_head, decode_record_payload, head_length,
                                         open_section, peek_sample_id)
from routereplay.source import Rows, check_fetch_args

_RESYNC_CHUNK = 1 << 20
MAX_STREAM_MODELS = 16         # xl-ans model frames a reader parses (and keeps) per stream
MAX_REPORTED = 1000            # error messages (and corrupt-frame entries) kept; the rest counted
_CRC_TABLE: np.ndarray | None = None
# NOTE: version 3 ranged reads (docs/FORMAT.md "Reading a version-3 record").
HEAD_GUESS = 256               # bytes read at a frame for its header and head (one request)
TABLE_GAP = 1024               # section-table entries this close are read in one request


@dataclasses.dataclass(frozen=True)
class RecordBytes:
    """Where a record's bytes go (:meth:`SidecarReader.record_bytes`), in bytes.

    Attributes:
        sample_id: the record's id.
        frame: the whole frame: frame header, head (meta), section table, sections.
        routing: the routing sections (their per-section CRC and codec byte included).
        arrays: bytes of each array section by name ("token_ids", "logprobs").
        routing_sections: how many routing sections the record has.
    """

    sample_id: str
    frame: int
    routing: int
    arrays: dict[str, int]
    routing_sections: int

    @property
    def routing_frame(self) -> int:
        """The frame without its array sections: what the record would take in a stream
        carrying routing only (as the engines' formats do)."""
        return self.frame - sum(self.arrays.values())


@dataclasses.dataclass
class _Head:
    """A version-3 record's head, read once and cached for the reader's life.

    Attributes:
        offset: the frame's offset.
        meta: the validated meta (with its Grid).
        payload_len: P.
        prefix: the payload bytes read with the head (the first HEAD_GUESS - 24 bytes or
            fewer): table entries and sections inside it are not read again.
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


@dataclasses.dataclass
class FrameInfo:
    """Where one record frame lies and what its metadata says.

    Attributes:
        offset: byte offset of the frame header.
        kind: frame kind (1 = record; -1 when the frame header itself is corrupt).
        payload_len: P, payload bytes (-1 when not known: index entry, corrupt header).
        sample_id: the record's id (from the meta, or from the index before a scan; for a
            corrupt frame, what its meta still says, if anything).
        meta: the validated record metadata, or None (not scanned yet, or corrupt).
        error: why the frame is corrupt, else None.
    """

    offset: int
    kind: int
    payload_len: int
    sample_id: str | None = None
    meta: RecordMeta | None = None
    error: str | None = None


def _crc_table() -> np.ndarray:
    global _CRC_TABLE
    if _CRC_TABLE is None:
        t = np.arange(256, dtype=np.uint32)
        for _ in range(8):
            t = np.where(t & 1, (t >> 1) ^ np.uint32(0xEDB88320), t >> 1).astype(np.uint32)
        _CRC_TABLE = t
    return _CRC_TABLE


def valid_frame_headers(chunk: bytes) -> np.ndarray:
    """Offsets o in ``chunk`` where a whole frame header lies whose own CRC matches
    (FORMAT.md's resynchronisation test), ascending.

    NOTE: vectorised over every ``RRFM`` candidate at once (a table-driven CRC-32 over the
    20 header bytes of all candidates in 20 numpy steps): a region packed with forged
    ``RRFM`` costs about 20 ns a byte instead of a Python call per candidate.
    """
    a = np.frombuffer(chunk, dtype=np.uint8)
    n = a.size - FRAME_HEADER_SIZE + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    cand = np.flatnonzero((a[:n] == 0x52) & (a[1:n + 1] == 0x52) & (a[2:n + 2] == 0x46)
                          & (a[3:n + 3] == 0x4D))
    if cand.size == 0:
        return cand
    table = _crc_table()
    crc = np.full(cand.size, 0xFFFFFFFF, dtype=np.uint32)
    for i in range(20):
        crc = table[(crc ^ a[cand + i]) & 0xFF] ^ (crc >> 8)
    crc ^= np.uint32(0xFFFFFFFF)
    stored = (a[cand + 20].astype(np.uint32) | (a[cand + 21].astype(np.uint32) << 8)
              | (a[cand + 22].astype(np.uint32) << 16) | (a[cand + 23].astype(np.uint32) << 24))
    return cand[crc == stored]


def check_spans(meta: RecordMeta, offset: int | None = None) -> RecordMeta:
    """Refuse a meta read from a frame whose spans :meth:`RoutingRecord.validate` refuses:
    every weight-version, ``recomputed`` and ``prefix_cached`` span ``[a, b)`` must have
    ``0 <= a <= b <= start + T + 1``, token positions of the sequence the record's rows
    imply. Returns ``meta``.

    NOTE: the meta decoders already check each span's order and every count validate()
    checks (payload.check_counts); this is the one bound of validate() they leave out, so a
    record the writer would refuse is never returned (docs/FORMAT.md "Version 3 meta").
    Work: O(spans), within the meta's size.

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


def _serialized(fn):
    """A SidecarReader method run under the reader's lock (one seek-and-read file position,
    scan state and caches shared by every caller)."""
    @functools.wraps(fn)
    def wrapper(self, *a, **k):
        with self._lock:
            return fn(self, *a, **k)
    return wrapper


class SidecarReader:
    """Read a sidecar stream lazily.

    Args:
        source: a local path (a regular file), an fsspec URL (opened without a read-ahead
            cache: one ranged request per read), bytes, or a seekable binary file object.
        floors: enforce the section floors of docs/FORMAT.md "Reader limits" (default),
            which bound a read's CPU per stored byte. False reads streams of earlier
            writers whose tiny grids or short ``ctx-ans`` records sit below them; only for
            streams you trust (their CPU per MiB is then unbounded).

    Attributes:
        name: the path or URL read ("<bytes>" / "<stream>" otherwise), for messages.
        schema: the stream's RoutingSchema.
        header: the header JSON object (FORMAT.md "Header").
        version, codec, column_order, layer_group: from the header.
        size: stream bytes seen so far (grows as :meth:`refresh` finds more).
        complete: the stream ends with a valid index frame and trailer (its writer closed
            it); False for a live stream, a killed writer or a stream cut short.
        errors: messages about corrupt frames, index/frame disagreements and a torn tail
            (the first :data:`MAX_REPORTED`, then a count), filled by :meth:`scan`.
        torn_tail: byte offset where an incomplete trailing frame starts, else None.

    A stream still being written (live) is read as far as it is complete; :meth:`refresh`
    (called on every lookup of an id not seen yet) scans only the bytes appended since,
    from the last complete frame on: nothing already scanned is scanned again.

    Thread-safe: one lock serializes its methods (they share a file position, the scan
    state and the caches), so a trainer's prefetch thread and its caller may share a reader;
    reads from several threads take turns.

    Raises:
        SidecarError: not a regular file (a FIFO would block), wrong magic, unsupported
            format version, corrupt header (the message names the stream).
    """

    def __init__(self, source: str | os.PathLike | bytes | BinaryIO, *, floors: bool = True):
        self._lock = threading.RLock()
        self._floors = bool(floors)
        self._own = True
        self._path: str | None = None
        self._ident: tuple[int, int] | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.name = "<bytes>"
            self._f: BinaryIO = io.BytesIO(bytes(source))
        elif isinstance(source, (str, os.PathLike)) and "://" not in os.fspath(source):
            self.name = self._path = os.fspath(source)
            try:
                st = os.stat(self._path)
            except OSError as e:
                raise SidecarError(f"{self.name}: cannot open: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode):
                # NOTE: opening a FIFO blocks until a writer appears; a reader needs to seek
                raise SidecarError(f"{self.name}: not a regular file (a sidecar reader needs a "
                                   "seekable file, not a FIFO, device or folder)")
            try:
                self._f = open(self._path, "rb")
            except OSError as e:         # NOTE: e.g. EMFILE: too many open files
                raise SidecarError(f"{self.name}: cannot open: {e.strerror or e}") from None
            fst = os.fstat(self._f.fileno())
            self._ident = (fst.st_dev, fst.st_ino)
        elif isinstance(source, (str, os.PathLike)):
            import fsspec
            self.name = os.fspath(source)
            # NOTE: no read-ahead cache: fsspec's default fetches whole blocks (5 MiB in
            # its base class) for every ranged read, which swallows version 3's partial
            # reads (docs/scale.md); each read is then one ranged request of its bytes.
            self._f = fsspec.open(self.name, "rb", cache_type="none").open()
        elif all(hasattr(source, m) for m in ("read", "seek", "tell")):
            self.name = getattr(source, "name", None) or "<stream>"
            self.name = self.name if isinstance(self.name, str) else "<stream>"
            self._f, self._own = source, False
        else:
            raise ConfigError(f"a sidecar source is a path, an fsspec URL, bytes or a seekable "
                              f"binary file object, not {type(source).__name__}")
        self.size = self._current_size()
        self._errors: list[str] = []
        self._num_errors = 0
        self._torn_msg: str | None = None
        self.torn_tail: int | None = None
        self.complete = False
        self._frames: list[FrameInfo] | None = None          # after scan()
        self._scan_pos = 0                                    # where the next scan starts
        self._resync_from: int | None = None                  # a scan stopped resynchronising
        self._index: list[FrameInfo] | None = None           # from the index frame
        self._index_offset: int | None = None
        self._by_id: dict[str, FrameInfo] = {}
        self._corrupt: dict[str, FrameInfo] = {}              # sample id -> its corrupt frame
        self._num_corrupt = 0
        self._missing: dict[str, str] = {}                    # listed in the index, not found
        self._seen: dict[str, int] = {}
        try:
            version, jlen = header_json_length(self._read(0, HEADER_FIXED_SIZE), self.size)
            hdr = decode_header(version, self._read(HEADER_FIXED_SIZE, jlen),
                                self._read(HEADER_FIXED_SIZE + jlen, 4))
        except SidecarError as e:
            self.close()
            raise SidecarError(f"{self.name}: {e}", offset=e.offset) from None
        except Exception:
            self.close()
            raise
        self.header: dict[str, Any] = hdr.meta
        self.schema = hdr.schema
        self.version = hdr.version
        self.codec = hdr.codec
        self.column_order = hdr.column_order
        self.layer_group = hdr.layer_group
        self.token_block = hdr.token_block
        self._codecs = hdr.codecs
        self._heads: dict[int, _Head] = {}                   # version 3: frame offset -> head
        self._offsets: list[int] = []                         # known frame offsets, sorted
        self._data_start = hdr.size
        self._header_bytes = self._read(0, hdr.size)
        self._scan_pos = hdr.size
        self._models: dict[int, Any] = {}                     # xl-ans: frame offset -> model
        self._model_frames: dict[int, int] = {}               # found by scans: offset -> bytes
        self._load_index()

    # -- header / index
    def _read(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(n)

    def _current_size(self) -> int:
        if self._path is not None:
            return os.fstat(self._f.fileno()).st_size
        self._f.seek(0, os.SEEK_END)
        return self._f.tell()

    @property
    def errors(self) -> list[str]:
        """Messages about corrupt frames, index disagreements and a torn tail."""
        out = list(self._errors)
        if self._num_errors > len(self._errors):
            out.append(f"... {self._num_errors - len(self._errors)} more errors")
        if self._torn_msg:
            out.append(self._torn_msg)
        return out

    @property
    def num_corrupt(self) -> int:
        """Corrupt frames the scans found so far: all of them, where :attr:`errors` lists
        the first :data:`MAX_REPORTED` and then a count."""
        return self._num_corrupt

    def _error(self, msg: str) -> None:
        self._num_errors += 1
        if len(self._errors) < MAX_REPORTED:
            self._errors.append(msg)

    def _load_index(self) -> None:
        """Use the index frame named by the trailer, if the stream was closed cleanly."""
        if self.size < self._data_start + TRAILER_SIZE:
            return
        off = parse_trailer(self._read(self.size - TRAILER_SIZE, TRAILER_SIZE))
        if off is None or not (self._data_start <= off < self.size - TRAILER_SIZE):
            return
        self.complete = True          # NOTE: a trailer ends the frame area either way
        self._index_offset = off
        try:
            fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
            # NOTE: an index lists at most one entry per frame, and each entry is not
            # longer than its frame's meta: a bigger index frame is forged (JSON parsing
            # costs ~10x its bytes in memory), so the reader scans instead.
            if fh.kind != KIND_INDEX or fh.payload_len > off - self._data_start + 4096:
                raise SidecarError("not an index frame of a plausible size", offset=off)
            fh, payload = self._read_frame(off)
        except SidecarError as e:
            self._error(f"index frame at offset {off} is unreadable ({e}); records are found "
                        "by scanning")
            return
        entries = decode_index(payload, self._data_start, off, self.version)
        if entries is None:
            self._error(f"index frame at offset {off} is not a valid index; records are found "
                        "by scanning")
            return
        if len({sid for sid, _ in entries}) != len(entries):
            # NOTE: writers refuse duplicate ids; an index listing one twice is forged or
            # corrupt. Scanning finds every frame and reports the duplicate, so every reader
            # of the stream serves the same (first) frame for an id.
            self._error(f"index frame at offset {off} lists a sample id twice; records are "
                        "found by scanning")
            return
        # NOTE: offsets must point into the frame area; read() also checks that the frame
        # found there holds this sample id (a stale or forged index).
        self._index = [FrameInfo(offset=o, kind=KIND_RECORD, payload_len=-1, sample_id=sid)
                       for sid, o in entries]
        self._by_id = {fi.sample_id: fi for fi in self._index}
        self._offsets = sorted({o for _, o in entries} | {off})

    def _read_frame(self, off: int) -> tuple[FrameHeader, bytes]:
        fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
        payload = self._read(off + FRAME_HEADER_SIZE, fh.payload_len)
        if crc32(payload) != fh.payload_crc:
            raise SidecarError(f"corrupt frame at offset {off}: payload checksum mismatch",
                               offset=off)
        return fh, payload

    @property
    def model_frames(self) -> dict[int, int]:
        """``xl-ans`` model frames found by :meth:`scan` so far: frame offset -> its size in
        bytes (frame header included). Empty until :meth:`scan` has run (reads through the index
        do not scan, unless a model frame they name is not reached by walking the frame
        headers from the records the index lists: :meth:`_check_model_frame`; ``inspect``
        scans). Routing data shared by the records after it; a
        corrupt one is reported in :attr:`errors` and makes the sections that name it
        unreadable."""
        return dict(self._model_frames)

    @_serialized
    def xl_ans_model(self) -> "xl_ans.XlModel | None":
        """The ``xl-ans`` model of the stream's last model frame, to seed a later stream's
        writer (``SidecarWriter(..., codec="xl-ans", xl_ans_seed=)``); None where the
        stream has none. Scans the stream (reads every frame not scanned yet). Its counts
        are u16 (each table scaled so no count exceeds 65535, then rounded) and learned from
        the records before that frame only: where the stream's writer is at hand, its
        ``learned_model()`` holds them all, and :meth:`xl_ans_counts` counts them all
        again from the stream.

        Raises:
            SidecarError: that model frame is corrupt."""
        self.scan()
        if not self._model_frames:
            return None
        return self._model_at(max(self._model_frames))

    @_serialized
    def xl_ans_counts(self) -> "xl_ans.XlModel":
        """An ``xl-ans`` model counted from every record of the stream (each one read and
        decoded), int64 counts as the stream's writer's ``learned_model()`` holds them
        (without that writer's own seed): the seed of a later stream's writer
        (``SidecarWriter(..., codec="xl-ans", xl_ans_seed=)``) with all of this stream's
        routing, where :meth:`xl_ans_model` gives its last model frame's counts, learned
        from the records before that frame only (in a short stream, often the first one or
        two). Any codec's stream can seed: its routing is what is counted.

        Raises:
            SidecarError: a record that does not read (named);
            RecordError (a ValueError): a schema xl-ans cannot model (E outside 2-64)."""
        s = self.schema
        m = xl_ans.XlModel.empty(s.num_moe_layers, s.num_experts, s.top_k)
        for sid in self.sample_ids():
            m.count(self.read(sid).expert_ids)
        return m

    def _model_at(self, off: int, before: int | None = None) -> Any:
        """The xl-ans model of the model frame at ``off`` (read, checked, cached: every
        model frame of the stream, at most MAX_STREAM_MODELS); ``before``: the offset of the
        record naming it (a model frame precedes the records coded with it).

        Raises:
            SidecarError: ``off`` outside the frame area or not before ``before``, a stream
                before version 3, more than MAX_STREAM_MODELS model frames named, not a
                model frame (kind 3), not a model frame of the stream's frame sequence
                (:meth:`_check_model_frame`: nested in another frame's bytes, or running
                into the record), a payload beyond the reader's limit for the stream's
                model shape, a checksum mismatch, or a payload that does not parse
                (routereplay.codec.xl_ans).
        """
        m = self._models.get(off)
        if m is not None and (before is None or off < before):
            if isinstance(m, SidecarError):
                raise m                     # NOTE: refused once, not read again per section
            return m
        s = self.schema
        end = self._index_offset if self.complete and self._index_offset is not None \
            else self.size
        if not self._data_start <= off <= end - FRAME_HEADER_SIZE \
                or (before is not None and off >= before):
            raise SidecarError(f"xl-ans model offset {off} is outside the stream's frames "
                               "before the record naming it", offset=off)
        if self.version < 3:
            raise SidecarError(f"xl-ans model frames are version-3 frames; this stream is "
                               f"version {self.version}", offset=off)
        if len(self._models) >= MAX_STREAM_MODELS:
            # NOTE: each model is parsed once and kept: a stream naming many model frames in
            # turn would otherwise cost a whole model's tables per section read
            raise SidecarError(f"xl-ans model frame at offset {off}: the stream names more "
                               f"than {MAX_STREAM_MODELS} model frames (the reader's limit; "
                               f"writers write at most {MAX_STREAM_MODELS - 4})", offset=off)
        try:
            fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
        except SidecarError as e:
            self._models[off] = SidecarError(f"xl-ans model offset {off}: {e}", offset=off)
            raise self._models[off] from None
        if fh.kind != KIND_MODEL:
            raise SidecarError(f"frame at offset {off} is not an xl-ans model frame (kind "
                               f"{fh.kind})", offset=off)
        self._check_model_frame(off, fh.end, end if before is None else before)
        lo, hi = xl_ans.payload_limits(s.num_moe_layers, s.num_experts, s.top_k)
        if not lo <= fh.payload_len <= hi:
            raise SidecarError(f"xl-ans model frame at offset {off} holds {fh.payload_len} "
                               f"bytes, outside the reader's limits [{lo}, {hi}] for its tables",
                               offset=off)
        try:
            _, payload = self._read_frame(off)
            m = xl_ans.XlModel.from_bytes(payload, s.num_moe_layers, s.num_experts, s.top_k)
        except SidecarError as e:
            msg = str(e).replace(f"corrupt frame at offset {off}: ", "")
            err = SidecarError(f"xl-ans model frame at offset {off}: {msg} (the sections "
                               "that name it are unreadable)", offset=off)
            self._models[off] = err
            raise err from None
        self._models[off] = m
        return m

    def _check_model_frame(self, off: int, frame_end: int, end: int) -> None:
        """Refuse a model frame offset that is not the start of a frame a scan walks to, or
        whose frame (its header says it ends at ``frame_end``) runs past ``end`` (the record
        naming it, or the frame area's end).

        NOTE: the rule (docs/FORMAT.md "xl-ans"): a model frame is one a scan finds (frame
        after frame from the header, resynchronising past corrupt headers), so a frame
        nested in another frame's bytes, which no scan sees (nor ``inspect``, nor a check of
        its bytes), never serves a record. Index frames do not list model frames: a read
        through the index walks the frame headers from the nearest frame start it knows
        before ``off`` (a record the index lists, a model frame already checked, the
        header's end): a stream's writer puts a model frame right after a record, so one
        read of 24 bytes. Where that walk does not land on ``off`` (a corrupt header on the
        way, a frame there that covers ``off``) or the frame runs into the next one the
        index lists, the reader scans and the scan decides. Work: one set lookup after a
        scan; else the frame headers between (a scan at worst, once).

        Raises:
            SidecarError: naming the offset (the caller names the sample).
        """
        if off not in self._model_frames and self._frames is None and self._index is not None:
            j = bisect.bisect_right(self._offsets, off)
            pos = max([self._data_start, *self._offsets[j - 1:j]]
                      + [o for o, m in self._models.items()
                         if o <= off and not isinstance(m, SidecarError)])
            bound = min(end, self._offsets[j] if j < len(self._offsets) else end)
            try:
                while pos < off:
                    pos = parse_frame_header(self._read(pos, FRAME_HEADER_SIZE), pos,
                                             self.size).end
                if pos == off and frame_end <= bound:
                    return
            except SidecarError:
                pass
        if off not in self._model_frames:
            self.scan()
        size = self._model_frames.get(off)
        if size is None:
            raise SidecarError(f"xl-ans model offset {off} is not the start of a model frame "
                               "of the stream (no scan finds a frame there: it lies inside "
                               "another frame's bytes, or in corrupt bytes)", offset=off)
        if off + size > end:
            raise SidecarError(f"xl-ans model frame at offset {off} runs past the record naming "
                               f"it (it ends at offset {off + size}, the record starts at "
                               f"{end})", offset=off)

    # -- scanning
    @_serialized
    def scan(self) -> list[FrameInfo]:
        """Walk the frames not scanned yet (all of them on the first call; on a live stream,
        those appended since); fills :attr:`errors` and :attr:`torn_tail`. On a complete
        stream, checks the index against the frames found: every listed record missing,
        corrupt or elsewhere, and every frame the index does not list, is an error.

        Returns:
            one FrameInfo per record frame, corrupt ones included (with ``error`` set; the
            first :data:`MAX_REPORTED` of those).
        """
        if self._frames is None:
            self._frames = []
        elif self._scan_pos >= (self._index_offset if self.complete else self.size) \
                and self._resync_from is None:
            return self._frames
        frames = self._frames
        off = self._scan_pos
        if self._resync_from is not None:
            nxt = self._resync(self._resync_from)
            if nxt is None:
                self._resync_from = max(self._resync_from, self.size - FRAME_HEADER_SIZE + 1)
                return frames
            self._resync_from = None
            off = nxt
        self.torn_tail, self._torn_msg = None, None
        end = self._index_offset if self.complete else self.size
        while off < end:
            if not self.complete and self.size - off == TRAILER_SIZE \
                    and self._read(off + 8, 8) == TRAILER_MAGIC:
                break
            try:
                fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
            except SidecarError as e:
                if e.torn:
                    self._torn(off, str(e))
                    break
                nxt = self._resync(off + 1, end)
                self._error(f"corrupt frame header at offset {off}; "
                            + (f"resynchronised at offset {nxt}" if nxt is not None
                               else "no later frame found"))
                self._keep(FrameInfo(off, -1, -1, error="corrupt frame header"))
                if nxt is None:
                    if not self.complete:      # a live stream may append frames later
                        self._resync_from = max(off + 1, self.size - FRAME_HEADER_SIZE + 1)
                    off = end
                    break
                off = nxt
                continue
            if fh.kind == KIND_RECORD:
                fi = self._scan_record(fh)
                if fi.meta is not None:
                    frames.append(fi)
                    self._by_id.setdefault(fi.meta.sample_id, fi)
                    if self._index is not None and self._by_id[fi.meta.sample_id] is not fi:
                        self._by_id[fi.meta.sample_id] = fi          # index entry -> scanned
                else:
                    self._keep(fi)
            elif fh.kind == KIND_MODEL and self.version >= 3:
                self._model_frames[off] = FRAME_HEADER_SIZE + fh.payload_len
                try:
                    self._model_at(off)
                except SidecarError as e:
                    self._error(str(e))
            off = fh.end
        self._scan_pos = off
        if self.complete:
            self._cross_check()
        return frames

    def _keep(self, fi: FrameInfo) -> None:
        """Record a corrupt frame (the first MAX_REPORTED are listed, the rest counted in
        :attr:`errors`)."""
        assert self._frames is not None
        self._num_corrupt += 1
        if self._num_corrupt <= MAX_REPORTED:
            self._frames.append(fi)
            if fi.sample_id is not None:
                self._corrupt.setdefault(fi.sample_id, fi)

    def _scan_record(self, fh: FrameHeader) -> FrameInfo:
        off = fh.offset
        fi = FrameInfo(off, fh.kind, fh.payload_len)
        payload = self._read(off + FRAME_HEADER_SIZE, fh.payload_len)
        try:
            if self.version >= 3:
                meta = self._check_record_v3(fh, memoryview(payload))
            else:
                if crc32(payload) != fh.payload_crc:
                    raise SidecarError("payload checksum mismatch", offset=off)
                meta = decode_record_payload(payload, self.schema, self.version, off,
                                             floors=self._floors)[0]
            check_spans(meta, off)
        except SidecarError as e:
            fi.error = str(e)
            fi.sample_id = e.sample_id or peek_sample_id(payload, self.version)
            self._error(f"corrupt frame at offset {off}"
                        + (f" (sample {fi.sample_id!r})" if fi.sample_id and e.sample_id is None
                           else "") + f": {e}")
            return fi
        sid = meta.sample_id
        if sid in self._seen:
            # NOTE: writers refuse duplicate ids, so this stream was spliced or forged; keep
            # the first, report the rest
            fi.error = f"duplicate sample id {sid!r} (first at offset {self._seen[sid]})"
            self._error(f"corrupt frame at offset {off}: {fi.error}")
            return fi
        self._seen[sid] = off
        fi.sample_id = sid
        if self.version >= 3:
            fi.meta = meta
            self._heads[off] = _Head(off, meta, fh.payload_len,
                                     payload[:max(0, HEAD_GUESS - FRAME_HEADER_SIZE)])
        else:
            # NOTE: the section list is dropped: read() decodes the meta again from the
            # frame, and a scan of many small records should cost little memory per record.
            fi.meta = dataclasses.replace(meta, sections=())
        return fi

    def _check_record_v3(self, fh: FrameHeader, payload: memoryview) -> RecordMeta:
        """Every check of a version-3 record (a scan's): the head's CRC and meta, the whole
        section table, and each section's CRC, codec byte and expansion limit (nothing is
        decoded). Returns the meta.

        Raises:
            SidecarError: the first problem, naming the sample where the meta gives it.
        """
        off = fh.offset
        h = head_length(payload[:10], fh.payload_len)
        if crc32(payload[:h]) != fh.payload_crc:
            raise SidecarError("record head checksum mismatch", offset=off)
        meta = decode_head(payload[:h], self.schema, fh.payload_len, off, floors=self._floors)
        grid = meta.grid
        assert grid is not None
        try:
            ends = self._table_ends(grid, payload[h:h + grid.table_len],
                                    fh.payload_len - h - grid.table_len)
            body = payload[h + grid.table_len:]
            for i in range(grid.n_sections):
                open_section(grid, i, body[int(ends[i]):int(ends[i + 1])], self._codecs,
                             self.schema, floors=self._floors)
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r}: {e}", offset=off,
                               sample_id=meta.sample_id) from None
        return meta

    @staticmethod
    def _table_ends(grid: Grid, table: memoryview, body_len: int) -> np.ndarray:
        """The whole section table -> section boundaries int64 [S + 1] (0, ends...,
        body_len), checked: every section at least 5 bytes, in order, inside the body.

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

    def _cross_check(self) -> None:
        """Index entries against the frames scanned (FORMAT.md "Index payload")."""
        if self._index is None or self._frames is None:
            return
        at = {fi.offset: fi for fi in self._frames}
        listed = set()
        for sid in [k for k, v in self._by_id.items() if v.meta is None]:
            del self._by_id[sid]                  # index entries: only scanned frames stay
        for entry in self._index:
            fi = at.get(entry.offset)
            listed.add(entry.offset)
            if fi is not None and fi.meta is not None and fi.meta.sample_id == entry.sample_id:
                continue
            found = self._by_id.get(entry.sample_id)
            found = found if found is not None and found.meta is not None else None
            floor = fi is not None and fi.error is not None and "reader's floor" in fi.error
            why = ("its frame there is below the reader's floors (readable with floors=False, "
                   "`--no-floors`: an earlier writer's stream)" if floor else
                   "its frame there is corrupt" if fi is not None and fi.error else
                   f"the frame there holds sample {fi.meta.sample_id!r}" if fi is not None else
                   "no record frame starts there")
            msg = (f"sample {entry.sample_id!r} is listed in the index at offset "
                   f"{entry.offset} but {why}"
                   + (f"; found at offset {found.offset}" if found is not None
                      else "" if floor else "; the record is missing from the stream"))
            self._error(msg)
            if found is None and entry.sample_id not in self._corrupt:
                self._missing[entry.sample_id] = msg
        for fi in self._frames:
            if fi.meta is not None and fi.offset not in listed:
                self._error(f"frame at offset {fi.offset} (sample {fi.meta.sample_id!r}) is "
                            "not listed in the stream's index")

    def _torn(self, off: int, why: str) -> None:
        self.torn_tail = off
        self._torn_msg = (f"torn tail at offset {off} ({why}); {self.size - off} trailing "
                          "bytes skipped")

    def _resync(self, start: int, end: int | None = None) -> int | None:
        """Next offset in ``[start, end)`` holding a frame header whose own checksum is
        valid (work: about 20 ns a byte, whatever the bytes)."""
        end = self.size if end is None else end
        pos = start
        while pos < end:
            chunk = self._read(pos, min(_RESYNC_CHUNK, end - pos) + FRAME_HEADER_SIZE - 1)
            hits = valid_frame_headers(chunk)
            if hits.size:
                return pos + int(hits[0])
            if len(chunk) < FRAME_HEADER_SIZE:
                return None
            pos += len(chunk) - FRAME_HEADER_SIZE + 1
        return None

    @_serialized
    def check(self, *, torn_ok: bool = True) -> None:
        """Raise unless every frame scanned so far is readable: for a consumer that lists
        :meth:`sample_ids` (readable records only) and must not skip a corrupt one.

        Args:
            torn_ok: a torn tail (a killed writer, or a frame being written) is not a
                problem: every whole frame before it is read.
        Raises:
            SidecarError: the first corrupt frame, duplicate id, or index entry without its
                frame (and the torn tail unless ``torn_ok``), naming the stream.
        """
        self.scan()
        problems = list(self._errors) + ([] if torn_ok or not self._torn_msg
                                         else [self._torn_msg])
        if problems:
            more = self._num_errors - 1 + (0 if torn_ok or not self._torn_msg else 1)
            raise SidecarError(f"{self.name}: {problems[0]}"
                               + (f" (and {more} more problems)" if more > 0 else ""))

    # -- live streams
    def _check_unchanged(self, path: bool = True) -> int:
        """The stream's current size, after checking it is still the stream this reader
        opened: not shrunk, same header, and (``path``) still the file at its path.

        Raises:
            SidecarError: replaced, shrunk or rewritten in place, naming the stream.
        """
        if path and self._path is not None:
            try:
                st = os.stat(self._path)
            except OSError:
                st = None             # NOTE: removed or renamed: the open file still reads
            if st is not None and (st.st_dev, st.st_ino) != self._ident:
                raise SidecarError(f"{self.name}: the stream was replaced since this reader "
                                   "opened it (rotated or rewritten under the same path); "
                                   "open the new stream")
        size = self._current_size()
        if size < self.size:
            raise SidecarError(f"{self.name}: the stream shrank from {self.size} to {size} "
                               "bytes since this reader opened it (truncated or rewritten)")
        if self._read(0, self._data_start) != self._header_bytes:
            # NOTE: writers put a random stream_id in the header, so a stream rewritten in
            # place (same inode, same schema) has a different header
            raise SidecarError(f"{self.name}: the stream's header changed since this reader "
                               "opened it (rewritten in place)")
        return size

    @_serialized
    def refresh(self) -> bool:
        """Pick up what a writer appended since the last scan (a live stream), scanning only
        the new bytes. Returns True when the stream grew.

        Raises:
            SidecarError: the stream was replaced under its path (rotated, rewritten), shrank,
                or changed after it was closed; naming the stream. Reopen it.
        """
        size = self._check_unchanged()
        if size == self.size:
            return False
        if self.complete:
            raise SidecarError(f"{self.name}: the stream grew after its writer closed it "
                               f"({self.size} -> {size} bytes): it was rewritten")
        self.size = size
        self._load_index()
        if self._frames is not None or self._index is None:
            self.scan()
        return True

    # -- access
    @_serialized
    def sample_ids(self) -> list[str]:
        """Sample ids of readable records, in stream order (the index of a complete stream;
        otherwise a scan, which on a live stream picks up records appended since)."""
        if self._frames is None and self._index is not None:
            return [fi.sample_id for fi in self._index]
        if not self.complete:
            self.refresh()
        return [fi.sample_id for fi in self.scan() if fi.meta is not None]

    @_serialized
    def __len__(self) -> int:
        return len(self.sample_ids())

    @_serialized
    def __contains__(self, sample_id: object) -> bool:
        try:
            self._locate(sample_id)       # type: ignore[arg-type]
        except UnknownSampleError:
            return False
        except SidecarError:
            return True                   # NOTE: present but corrupt: read() says why
        return True

    def _locate(self, sample_id: str) -> FrameInfo:
        fi = self._by_id.get(sample_id)
        if fi is not None:
            if not self.complete and self._path is not None:
                # NOTE: a live stream may be rewritten in place under a reader that already
                # knows the id: one small read of the header before serving it (a stream
                # replaced by another file at its path still reads from the open file)
                self._check_unchanged(path=False)
            return fi
        if self._frames is None and not (self.complete and self._index is not None):
            self.scan()
        elif not self.complete:
            self.refresh()
        fi = self._by_id.get(sample_id)
        if fi is not None:
            return fi
        if sample_id in self._missing:
            raise SidecarError(f"{self.name}: {self._missing[sample_id]}", sample_id=sample_id)
        bad = self._corrupt.get(sample_id)
        if bad is not None:
            raise SidecarError(f"sample {sample_id!r}: its frame at offset {bad.offset} is "
                               f"corrupt ({bad.error})", offset=bad.offset, sample_id=sample_id)
        raise UnknownSampleError(f"sample {sample_id!r} not in sidecar {self.name}", sample_id)

    @_serialized
    def read(self, sample_id: str, *, moe_layers: Sequence[int] | None = None,
             tokens: tuple[int, int] | None = None, arrays: bool = True,
             layers: Sequence[int] | None = None) -> RoutingRecord:
        """Decode one record.

        Args:
            sample_id: the record's id.
            moe_layers: positions on the MoE layer axis to decode (e.g. one pipeline
                stage's layers); other layer groups are not decompressed. Default: all.
                ``layers`` is an alias kept for one release.
            tokens: (start, end) token positions to keep (absolute positions, clipped to the
                record's rows). Default: all rows.
            arrays: also decode token_ids and logprobs if stored.
        Returns:
            a RoutingRecord whose expert_ids are [T', len(moe_layers), K].
        Raises:
            UnknownSampleError (a KeyError): no such sample id.
            SidecarError: the frame is corrupt, or listed in the index but missing (names
                the offset and the sample id).
            ConfigError (a ValueError): a MoE layer position out of range or repeated.
        """
        if layers is not None:
            moe_layers = layers
        want = self._moe_layers(moe_layers)
        if tokens is not None:
            check_fetch_args([], [tokens], 0)
        if self.version >= 3:
            meta, got, arrs = self._load_v3(sample_id, want, None if tokens is None else
                                            check_fetch_args([], [tokens], 0)[1], arrays)
            (out, first), = got
            return RoutingRecord(
                sample_id=meta.sample_id, expert_ids=out, start=first,
                prompt_len=meta.prompt_len, token_ids=arrs.get("token_ids"),
                logprobs=arrs.get("logprobs"), weight_versions=list(meta.weight_versions),
                recomputed=list(meta.recomputed), prefix_cached=list(meta.prefix_cached),
                engine=meta.engine, sampling=meta.sampling)
        meta, sections, off = self._record_sections(sample_id, want, arrays)
        r0, r1 = 0, meta.num_tokens
        if tokens is not None:
            lo, hi = check_fetch_args([], [tokens], 0)[1][0]
            r0 = min(max(lo - meta.start, 0), meta.num_tokens)
            r1 = min(max(hi - meta.start, r0), meta.num_tokens)
        out = self._assemble(meta, sections, want, [(r0, r1)], off)[0]
        return RoutingRecord(
            sample_id=meta.sample_id, expert_ids=out, start=meta.start + r0,
            prompt_len=meta.prompt_len, token_ids=sections.get("token_ids"),
            logprobs=sections.get("logprobs"), weight_versions=list(meta.weight_versions),
            recomputed=list(meta.recomputed), prefix_cached=list(meta.prefix_cached),
            engine=meta.engine, sampling=meta.sampling)

    @_serialized
    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """:meth:`routereplay.source.RoutingSource.fetch`.

        Version 3: reads (by ranges) and decodes only the sections holding these MoE
        layers and runs; with no MoE layer it reads no section (only the record's head,
        once). Versions 1-2: every run from one read of the frame, each needed layer-group
        section decompressed once."""
        want, runs = check_fetch_args(moe_layers, runs, self.schema.num_moe_layers)
        if self.version >= 3:
            return self._load_v3(sample_id, want, runs, arrays=False)[1]
        meta, sections, off = self._record_sections(sample_id, want, arrays=False)
        rows = []
        for lo, hi in runs:
            a = min(max(lo - meta.start, 0), meta.num_tokens)
            rows.append((a, min(max(int(hi) - meta.start, a), meta.num_tokens)))
        return [(ids, meta.start + a) for ids, (a, _) in
                zip(self._assemble(meta, sections, want, rows, off), rows)]

    @_serialized
    def record_bytes(self, sample_id: str) -> RecordBytes:
        """Bytes one record takes in the stream, by part, from its stored section lengths
        (nothing is decompressed; version 3 reads the head and the section table only).

        Raises:
            UnknownSampleError (a KeyError): no such sample id.
            SidecarError: the frame is corrupt, or its section table is out of place.
        """
        off, got = self._frame_meta(sample_id)
        if self.version >= 3:
            h: _Head = got
            grid = h.grid
            body_len = h.payload_len - h.body_at
            ends = self._table_ends(grid, self._payload(h, grid.head_len, h.body_at),
                                    body_len)
            sizes = np.diff(ends)
            routing = int(sizes[:grid.n_routing].sum())
            arrays = {name: int(sizes[grid.n_routing + j])
                      for j, (name, _) in enumerate(grid.arrays)}
            return RecordBytes(sample_id, FRAME_HEADER_SIZE + h.payload_len, routing, arrays,
                               grid.n_routing)
        meta, _body = got
        fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
        routing = sum(s.length for s in meta.sections if s.name == "routing")
        arrays = {s.name: s.length for s in meta.sections if s.name != "routing"}
        return RecordBytes(sample_id, FRAME_HEADER_SIZE + fh.payload_len, routing, arrays,
                           sum(1 for s in meta.sections if s.name == "routing"))

    @_serialized
    def routing_codecs(self, sample_id: str) -> dict[str, int]:
        """How many of a record's routing sections each codec stores: {codec name: count}
        (e.g. ``{"xl-ans-rows": 1}``; a writer of ``xl-ans`` picks per section among
        ``xl-ans-rows``, ``xl-ans`` and ``xl-zstd``). Version 3 reads each section's codec
        byte (one read of the record's body); versions 1-2 the meta.

        Raises:
            UnknownSampleError (a KeyError): no such sample id.
            SidecarError: the frame is corrupt, its section table out of place, or a codec
                byte outside the header's table."""
        off, got = self._frame_meta(sample_id)
        out: dict[str, int] = {}
        if self.version >= 3:
            h: _Head = got
            grid = h.grid
            ends = self._table_ends(grid, self._payload(h, grid.head_len, h.body_at),
                                    h.payload_len - h.body_at)
            body = self._payload(h, h.body_at, h.payload_len)
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

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """Iterate over all records in stream order.

        strict=True raises SidecarError at the first problem (a corrupt frame, a torn tail,
        an index entry without its frame, a record whose sections do not decode); with
        strict=False every record that decodes is returned and the others are reported in
        :attr:`errors`.
        """
        frames = self.scan()
        if strict and self.errors:
            raise SidecarError(f"{self.name}: {self.errors[0]}", offset=next(
                (f.offset for f in frames if f.error), self.torn_tail))
        for fi in list(frames):
            if fi.meta is None:
                continue
            try:
                rec = self.read(fi.meta.sample_id, **kw)
            except SidecarError as e:
                if strict:
                    raise
                self._error(str(e))
                continue
            yield rec

    # -- decoding
    def _moe_layers(self, moe_layers: Sequence[int] | None) -> list[int]:
        n = self.schema.num_moe_layers
        if moe_layers is None:
            return list(range(n))
        return check_fetch_args(moe_layers, [], n)[0]

    def _frame_meta(self, sample_id: str) -> tuple[int, Any]:
        """(frame offset, what its record's head says): version 3 the cached
        :class:`_Head`; versions 1-2 (meta, body) from the whole frame. A record located
        by the index whose frame is missing, corrupt or holds another sample makes the
        reader scan (which checks the index against the frames) and look again."""
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
                got = decode_record_payload(payload, self.schema, self.version, off,
                                            floors=self._floors)
                meta = check_spans(got[0], off)
            if meta.sample_id != sample_id:
                raise SidecarError(f"frame at offset {off} holds sample {meta.sample_id!r}",
                                   offset=off)
        except SidecarError as e:
            if self._frames is None and self._index is not None:
                # NOTE: located by the index: scan, which checks the index against the
                # frames, and look again (a stale index; a frame missing or corrupt)
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
        """Versions 1-2: meta and decoded sections of ``sample_id``: routing sections
        holding a wanted layer under their (l0, l1) key, and the arrays if asked for; the
        frame's offset."""
        off, (meta, body) = self._frame_meta(sample_id)
        wanted = set(want)
        out: dict[Any, Any] = {}
        try:
            for sec in meta.sections:
                blob = body[sec.offset: sec.offset + sec.length]
                if sec.name == "routing":
                    if wanted.intersection(range(*sec.moe_layers)):
                        out[sec.moe_layers] = _codec.decode(
                            bytes(blob), sec.codec, sec.shape, self.schema.id_dtype,
                            self.schema.num_experts)
                elif arrays and sec.name in ("token_ids", "logprobs"):
                    out[sec.name] = decode_array(blob, sec.name, sec.codec, sec.shape[0])
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r} (frame at offset {off}): {e}",
                               offset=off, sample_id=meta.sample_id) from None
        return meta, out, off

    # -- version 3: ranged reads
    def _head(self, off: int) -> _Head:
        """The head of the version-3 record frame at ``off`` (cached): one read of up to
        HEAD_GUESS bytes (the frame header, the head and what follows; bounded by the next
        known frame), a second only if the head is longer.

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
                               offset=off, sample_id=peek_sample_id(head, 3))
        meta = check_spans(decode_head(head, self.schema, fh.payload_len, off,
                                       floors=self._floors), off)
        h = self._heads[off] = _Head(off, meta, fh.payload_len, prefix)
        return h

    def _payload(self, h: _Head, a: int, b: int, whole: bytes | None = None) -> memoryview:
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

    def _sections_v3(self, h: _Head, needed: list[int], sink: Any) -> None:
        """Read, check and hand ``sink(i, codec, data)`` each section of ``needed``
        (sorted section indices): the table entries around them in ranges, then one read
        per contiguous run of sections (the whole payload in one read when every section
        is needed).

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
            ends = self._table_ends(grid, self._payload(h, grid.head_len, h.body_at, whole),
                                    body_len)
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
                                           self.schema, floors=self._floors)
                sink(i, codec, data)
            j = e + 1

    def _table_entries(self, h: _Head, needed: list[int], whole: bytes | None) -> dict[int, int]:
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
        """Version 3: (meta, rows per run, arrays) of ``sample_id``, reading and decoding
        only the sections holding MoE layers ``want`` x ``runs`` (absolute token positions,
        clipped to the record's rows; None: every row), and the arrays if asked for.

        NOTE: each section is decoded, its rows copied into the outputs and dropped, so the
        reader holds the outputs plus one read range and one decoded section. The outputs
        are allocated before any section is read: their size is within the record-level
        expansion limit, checked on the head."""
        off, h = self._frame_meta(sample_id)
        meta, grid, schema = h.meta, h.grid, self.schema
        t, k = meta.num_tokens, schema.top_k
        if runs is None:
            rows = [(0, t)]
        else:
            rows = []
            for lo, hi in runs:
                a = min(max(lo - meta.start, 0), t)
                rows.append((a, min(max(int(hi) - meta.start, a), t)))
        out = [np.empty((r1 - r0, len(want), k), dtype=schema.id_dtype) for r0, r1 in rows]
        cols: dict[int, tuple[list[int], list[int]]] = {}       # group -> (out cols, section cols)
        for pos, lyr in enumerate(want):
            g = lyr // grid.layer_group
            c = cols.setdefault(g, ([], []))
            c[0].append(pos)
            c[1].append(lyr - g * grid.layer_group)
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
                got[name] = decode_array(data, name, codec, count)
                return
            g, b = divmod(i, grid.n_blocks)
            (l0, l1), (b0, b1) = grid.layers(g), grid.rows(b)
            ids = _codec.decode(bytes(data), codec, (b1 - b0, l1 - l0, k), schema.id_dtype,
                                schema.num_experts, moe_layer0=l0,
                                models=lambda o: self._model_at(o, before=off))
            pos, offs = cols[g]
            run = pos == list(range(pos[0], pos[0] + len(pos))) \
                and offs == list(range(offs[0], offs[0] + len(offs)))
            for o, (r0, r1) in zip(out, rows):
                a, e = max(r0, b0), min(r1, b1)
                if e <= a:
                    continue
                if run:
                    o[a - r0:e - r0, pos[0]:pos[0] + len(pos)] = \
                        ids[a - b0:e - b0, offs[0]:offs[0] + len(offs)]
                else:
                    o[a - r0:e - r0, pos] = ids[a - b0:e - b0][:, offs]

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
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for i, lyr in enumerate(want):
            key = owner[lyr]
            pos, offs = groups.setdefault(key, ([], []))
            pos.append(i)
            offs.append(lyr - key[0])
        for key, (pos, offs) in groups.items():
            ids = sections[key]
            # NOTE: one copy per section (a slice when its layers are wanted in order)
            run = pos == list(range(pos[0], pos[0] + len(pos))) \
                and offs == list(range(offs[0], offs[0] + len(offs)))
            for o, (r0, r1) in zip(out, rows):
                if run:
                    o[:, pos[0]:pos[0] + len(pos)] = ids[r0:r1, offs[0]:offs[0] + len(offs)]
                else:
                    o[:, pos] = ids[r0:r1][:, offs]
        self._check_ids(meta, out, rows, want, offset)
        return out

    def _check_ids(self, meta: RecordMeta, out: list[np.ndarray], rows: list[tuple[int, int]],
                   want: list[int], offset: int) -> None:
        """Check decoded ids [r1 - r0, len(want), K] of each row range (range, distinct in
        a row), naming the sample, token position and decoder layer.

        NOTE: the reader is the boundary that checks stored ids; consumers (alignment,
        replay) do not check them again."""
        layer_ids = [self.schema.moe_layer_ids[i] for i in want]
        for o, (r0, _) in zip(out, rows):
            try:
                RoutingRecord(meta.sample_id, o, start=meta.start + r0).validate_ids(
                    self.schema, layer_ids=layer_ids)
            except RecordError as e:
                raise SidecarError(f"frame at offset {offset}: {e}", offset=offset,
                                   sample_id=meta.sample_id) from None

    @_serialized
    def close(self) -> None:
        """Close the underlying file (when the reader opened it)."""
        if self._own:
            self._f.close()

    def __enter__(self) -> "SidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
