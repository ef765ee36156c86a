"""Sidecar reader: lazy, recovering, partial (docs/FORMAT.md "Reading rules").

Opening reads the header and, for a cleanly closed stream, the index; frames are found by
the index or by a scan (:mod:`~routereplay.sidecar.scan`); records are decoded on demand,
reading only the sections asked for (:mod:`~routereplay.sidecar.record_reads`); a live
stream is followed as it grows (:mod:`~routereplay.sidecar.follow`).
"""
from __future__ import annotations

import io
import os
import stat
import threading
from typing import Any, BinaryIO, Iterator, Sequence

from routereplay.errors import ConfigError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.sidecar.follow import LiveFollow
from routereplay.sidecar.layout import (FRAME_HEADER_SIZE, HEADER_FIXED_SIZE, KIND_INDEX,
                                        KIND_RECORD, TRAILER_SIZE, FrameHeader, crc32,
                                        decode_header, decode_index, header_json_length,
                                        parse_frame_header, parse_trailer)
from routereplay.sidecar.locking import serialized
from routereplay.sidecar.record_reads import RecordBytes, RecordHead, RecordReads, check_spans
from routereplay.sidecar.scan import MAX_REPORTED, FrameInfo, StreamScan, valid_frame_headers
from routereplay.source import Rows, check_fetch_args

__all__ = ["SidecarReader", "FrameInfo", "RecordBytes", "MAX_REPORTED", "check_spans",
           "valid_frame_headers"]


class SidecarReader(StreamScan, RecordReads, LiveFollow):
    """Read a sidecar stream lazily.

    Args:
        source: a local path (a regular file), an fsspec URL (opened without a read-ahead
            cache: one ranged request per read), bytes, or a seekable binary file object.
        floors: enforce the section floors of docs/FORMAT.md "Reader limits" (default),
            which bound a read's CPU per stored byte. False reads earlier writers' streams
            whose tiny grids sit below them: only for trusted streams.

    Attributes:
        name: the path or URL read ("<bytes>" / "<stream>" otherwise), for messages.
        schema: the stream's RoutingSchema.
        header: the header JSON object (FORMAT.md "Header").
        version, codec, column_order, layer_group, token_block: from the header.
        size: stream bytes seen so far (grows as :meth:`refresh` finds more).
        complete: the stream ends with a valid index frame and trailer (its writer closed
            it); False for a live stream, a killed writer or a stream cut short.
        errors: messages about corrupt frames, index/frame disagreements and a torn tail
            (the first :data:`MAX_REPORTED`, then a count), filled by :meth:`scan`.
        torn_tail: byte offset where an incomplete trailing frame starts, else None.

    A live stream is read as far as it is complete; :meth:`refresh` (called on every
    lookup of an id not seen yet) scans only the bytes appended since. Thread-safe: one
    lock serializes the methods (:mod:`~routereplay.sidecar.locking`).

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
            # NOTE: no read-ahead cache: fsspec's default fetches whole blocks (5 MiB) for
            # every ranged read, which swallows version 3's partial reads (docs/scale.md)
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
        self._heads: dict[int, RecordHead] = {}              # version 3: frame offset -> head
        self._offsets: list[int] = []                         # known frame offsets, sorted
        self._data_start = hdr.size
        self._header_bytes = self._read(0, hdr.size)
        self._scan_pos = hdr.size
        self._model_frames: dict[int, int] = {}               # found by scans: offset -> bytes
        self._load_index()

    # -- header / index
    def _read(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(n)

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
            # NOTE: an index lists at most one entry per frame, none longer than its
            # frame's meta: a bigger index is forged (JSON costs ~10x its bytes in memory)
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
            # NOTE: writers refuse duplicate ids; a scan reports the duplicate and serves
            # the first frame, as every reader of the stream does
            self._error(f"index frame at offset {off} lists a sample id twice; records are "
                        "found by scanning")
            return
        # NOTE: read() checks that the frame at an offset holds its sample id
        self._index = [FrameInfo(offset=o, kind=KIND_RECORD, payload_len=-1, sample_id=sid)
                       for sid, o in entries]
        # NOTE: a follower that scanned frames of the live stream keeps them: the scan's
        # cross-check keeps only scanned frames, and resumes past these
        scanned = {sid: fi for sid, fi in self._by_id.items() if fi.meta is not None}
        self._by_id = {fi.sample_id: fi for fi in self._index}
        self._by_id.update(scanned)
        self._offsets = sorted({o for _, o in entries} | {off})

    def _read_frame(self, off: int) -> tuple[FrameHeader, bytes]:
        fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
        payload = self._read(off + FRAME_HEADER_SIZE, fh.payload_len)
        if crc32(payload) != fh.payload_crc:
            raise SidecarError(f"corrupt frame at offset {off}: payload checksum mismatch",
                               offset=off)
        return fh, payload

    # -- access
    @serialized
    def sample_ids(self) -> list[str]:
        """Sample ids of readable records, in stream order (the index of a complete stream;
        otherwise a scan, which on a live stream picks up records appended since)."""
        if self._frames is None and self._index is not None:
            return [fi.sample_id for fi in self._index]
        if not self.complete:
            self.refresh()
        return [fi.sample_id for fi in self.scan() if fi.meta is not None]

    @serialized
    def __len__(self) -> int:
        return len(self.sample_ids())

    @serialized
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
                # NOTE: a live stream may be rewritten in place under a reader that knows
                # the id: one small read of the header before serving it
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

    @serialized
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
        n = self.schema.num_moe_layers
        want = list(range(n)) if moe_layers is None else check_fetch_args(moe_layers, [], n)[0]
        runs = None if tokens is None else check_fetch_args([], [tokens], 0)[1]
        meta, ((out, first),), arrs = self._load(sample_id, want, runs, arrays)
        return RoutingRecord(
            sample_id=meta.sample_id, expert_ids=out, start=first,
            prompt_len=meta.prompt_len, token_ids=arrs.get("token_ids"),
            logprobs=arrs.get("logprobs"), weight_versions=list(meta.weight_versions),
            recomputed=list(meta.recomputed), prefix_cached=list(meta.prefix_cached),
            engine=meta.engine, sampling=meta.sampling)

    @serialized
    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """:meth:`routereplay.source.RoutingSource.fetch`: version 3 reads (by ranges) and
        decodes only the sections holding these MoE layers and runs (no MoE layer: only the
        record's head, once); version 2 reads the frame once, decoding each needed layer
        group once."""
        want, runs = check_fetch_args(moe_layers, runs, self.schema.num_moe_layers)
        return self._load(sample_id, want, runs, arrays=False)[1]

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """Iterate over all records in stream order (``kw``: :meth:`read`'s).

        strict=True raises SidecarError at the first problem (a corrupt frame, a torn tail,
        an index entry without its frame, a record that does not decode); strict=False
        yields every record that decodes and reports the others in :attr:`errors`.
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

    @serialized
    def close(self) -> None:
        """Close the underlying file (when the reader opened it)."""
        if self._own:
            self._f.close()

    def __enter__(self) -> "SidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
