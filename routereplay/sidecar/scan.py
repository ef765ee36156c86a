"""Scanning a sidecar stream's frames (docs/FORMAT.md "Reading rules").

A scan reads and checks every byte of every frame: it recovers every complete frame before
a torn tail, reports corrupt frames by offset (resynchronising at the next valid frame
header), and checks a closed stream's index against the frames it finds. On a live stream
each scan starts where the last one stopped.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from routereplay.errors import SidecarError
from routereplay.sidecar.layout import (FRAME_HEADER_SIZE, KIND_MODEL, KIND_RECORD,
                                        TRAILER_MAGIC, TRAILER_SIZE, FrameHeader, crc32,
                                        parse_frame_header)
from routereplay.sidecar.legacy import decode_payload_v2, peek_sample_id_v2
from routereplay.sidecar.locking import serialized
from routereplay.sidecar.payload import open_section
from routereplay.sidecar.record_meta import RecordMeta, decode_head, head_length, peek_sample_id
from routereplay.sidecar.record_reads import HEAD_GUESS, RecordHead, check_spans, table_ends

_RESYNC_CHUNK = 1 << 20
MAX_REPORTED = 1000            # error messages (and corrupt-frame entries) kept; the rest counted
_CRC_TABLE: np.ndarray | None = None

@dataclasses.dataclass
class FrameInfo:
    """Where one record frame lies and what its metadata says.

    Attributes:
        offset: byte offset of the frame header.
        kind: frame kind (1 = record; -1: the frame header itself is corrupt).
        payload_len: P, payload bytes (-1 when not known: index entry, corrupt header).
        sample_id: the record's id (from the meta, or the index before a scan; for a
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
    """Offsets in ``chunk`` (int64, ascending) where a whole frame header lies whose own
    CRC matches (FORMAT.md's resynchronisation test).

    NOTE: a table-driven CRC-32 over all ``RRFM`` candidates at once (20 numpy steps): a
    region packed with forged ``RRFM`` costs about 20 ns a byte.
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


class StreamScan:
    """:class:`~routereplay.sidecar.reader.SidecarReader`'s scan and its findings (a mixin
    using the reader's file and frame state)."""

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
        """Corrupt frames the scans found so far (:attr:`errors` lists the first
        :data:`MAX_REPORTED`)."""
        return self._num_corrupt

    def _error(self, msg: str) -> None:
        self._num_errors += 1
        if len(self._errors) < MAX_REPORTED:
            self._errors.append(msg)

    @property
    def model_frames(self) -> dict[int, int]:
        """Model frames (kind 3: routereplay 0.2's ``xl-ans``) found by :meth:`scan` so far:
        frame offset -> bytes (frame header included). Their checksum is checked (a corrupt
        one is in :attr:`errors`), their content never parsed (a removed codec's)."""
        return dict(self._model_frames)

    @serialized
    def scan(self) -> list[FrameInfo]:
        """Walk the frames not scanned yet (all on the first call; on a live stream, those
        appended since), filling :attr:`errors` and :attr:`torn_tail`. On a complete
        stream, every index entry missing, corrupt or elsewhere, and every frame the index
        does not list, is an error.

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
                    self._read_frame(off)
                except SidecarError as e:
                    why = str(e).replace(f"corrupt frame at offset {off}: ", "")
                    self._error(f"xl-ans model frame at offset {off}: {why}")
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
                meta = decode_payload_v2(payload, self.schema, off)[0]
            check_spans(meta, off)
        except SidecarError as e:
            fi.error = str(e)
            fi.sample_id = e.sample_id or (peek_sample_id(payload) if self.version >= 3
                                           else peek_sample_id_v2(payload))
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
            self._heads[off] = RecordHead(off, meta, fh.payload_len,
                                          payload[:max(0, HEAD_GUESS - FRAME_HEADER_SIZE)])
        else:
            # NOTE: read() decodes the meta again; a scan keeps little memory per record
            fi.meta = dataclasses.replace(meta, sections=())
        return fi

    def _check_record_v3(self, fh: FrameHeader, payload: memoryview) -> RecordMeta:
        """A scan's checks of a version-3 record: the head's CRC and meta, the section
        table, each section's CRC, codec byte and expansion limit (nothing decoded).
        Returns the meta.

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
            ends = table_ends(grid, payload[h:h + grid.table_len],
                              fh.payload_len - h - grid.table_len)
            body = payload[h + grid.table_len:]
            for i in range(grid.n_sections):
                open_section(grid, i, body[int(ends[i]):int(ends[i + 1])], self._codecs,
                             self.schema)
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r}: {e}", offset=off,
                               sample_id=meta.sample_id) from None
        return meta

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
            err = fi.error if fi is not None and fi.error is not None else ""
            floor, removed = "reader's floor" in err, "removed in routereplay" in err
            why = ("its frame there is below the reader's floors (readable with floors=False, "
                   "`--no-floors`: an earlier writer's stream)" if floor else
                   "its frame there holds a section of a removed codec (routereplay 0.2.x "
                   "converts it)" if removed else
                   "its frame there is corrupt" if fi is not None and fi.error else
                   f"the frame there holds sample {fi.meta.sample_id!r}" if fi is not None else
                   "no record frame starts there")
            msg = (f"sample {entry.sample_id!r} is listed in the index at offset "
                   f"{entry.offset} but {why}"
                   + (f"; found at offset {found.offset}" if found is not None
                      else "" if floor or removed else "; the record is missing from the stream"))
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

    @serialized
    def check(self, *, torn_ok: bool = True) -> None:
        """Raise unless every frame scanned so far is readable (:meth:`sample_ids` lists
        readable records only: for a consumer that must not skip a corrupt one).

        Args:
            torn_ok: a torn tail (a killed writer, a frame being written) is no problem.
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
