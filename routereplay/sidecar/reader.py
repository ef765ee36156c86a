"""Sidecar reader: lazy, recovering, partial (docs/FORMAT.md "Reading rules").

Opening reads the header and, for a cleanly closed stream, the index; frames are found by
the index or by scanning. A scan recovers every complete frame before a torn tail and
reports corrupt frames by offset; record sections are decoded on demand, only the layer
groups asked for. The reader is a :class:`routereplay.source.RoutingSource`.
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from routereplay import codec as _codec
from routereplay.errors import ConfigError, RecordError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.sidecar.layout import (FRAME_HEADER_SIZE, FRAME_MAGIC, HEADER_FIXED_SIZE,
                                        KIND_INDEX, KIND_RECORD, TRAILER_MAGIC, TRAILER_SIZE,
                                        FrameHeader, crc32, decode_header, decode_index,
                                        frame_header_valid, header_json_length,
                                        parse_frame_header, parse_trailer)
from routereplay.sidecar.payload import (RecordMeta, decode_array,
                                         decode_record_payload, peek_sample_id)
from routereplay.source import Rows

_RESYNC_CHUNK = 1 << 20


@dataclasses.dataclass
class FrameInfo:
    """Where one record frame lies and what its metadata says.

    Attributes:
        offset: byte offset of the frame header.
        kind: frame kind (1 = record; -1 when the frame header itself is corrupt).
        payload_len: P, payload bytes (-1 when not known: index entry, corrupt header).
        sample_id: the record's id (from the meta, or from the index before a scan).
        meta: the validated record metadata, or None (not scanned yet, or corrupt).
        error: why the frame is corrupt, else None.
    """

    offset: int
    kind: int
    payload_len: int
    sample_id: str | None = None
    meta: RecordMeta | None = None
    error: str | None = None


class SidecarReader:
    """Read a sidecar stream lazily.

    Args:
        source: a local path, an fsspec URL, bytes, or a seekable binary file object.

    Attributes:
        schema: the stream's RoutingSchema.
        header: the header JSON object (FORMAT.md "Header").
        version, codec, column_order, layer_group: from the header.
        size: stream bytes when opened.
        errors: messages about corrupt frames and a torn tail, filled by :meth:`scan`.
        torn_tail: byte offset where an incomplete trailing frame starts, else None.

    Raises:
        SidecarError: wrong magic, unsupported format version, corrupt header.
    """

    def __init__(self, source: str | os.PathLike | bytes | BinaryIO):
        self._own = True
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._f: BinaryIO = io.BytesIO(bytes(source))
        elif isinstance(source, (str, os.PathLike)) and "://" not in os.fspath(source):
            self._f = open(source, "rb")
        elif isinstance(source, (str, os.PathLike)):
            import fsspec
            self._f = fsspec.open(os.fspath(source), "rb").open()
        else:
            self._f, self._own = source, False
        self._f.seek(0, os.SEEK_END)
        self.size = self._f.tell()
        self.errors: list[str] = []
        self.torn_tail: int | None = None
        self._frames: list[FrameInfo] | None = None          # after scan()
        self._index: list[FrameInfo] | None = None           # from the index frame
        self._by_id: dict[str, FrameInfo] = {}
        try:
            version, jlen = header_json_length(self._read(0, HEADER_FIXED_SIZE), self.size)
            hdr = decode_header(version, self._read(HEADER_FIXED_SIZE, jlen),
                                self._read(HEADER_FIXED_SIZE + jlen, 4))
        except Exception:
            self.close()
            raise
        self.header: dict[str, Any] = hdr.meta
        self.schema = hdr.schema
        self.version = hdr.version
        self.codec = hdr.codec
        self.column_order = hdr.column_order
        self.layer_group = hdr.layer_group
        self._data_start = hdr.size
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
        try:
            fh, payload = self._read_frame(off)
        except SidecarError:
            return                                        # fall back to scanning
        entries = decode_index(payload, self._data_start, off) if fh.kind == KIND_INDEX else None
        if entries is None:
            return
        # NOTE: offsets must point into the frame area; read() also checks that the frame
        # found there holds this sample id (a stale or forged index).
        self._index = [FrameInfo(offset=o, kind=KIND_RECORD, payload_len=-1, sample_id=sid)
                       for sid, o in entries]
        self._by_id = {fi.sample_id: fi for fi in self._index}

    def _read_frame(self, off: int) -> tuple[FrameHeader, bytes]:
        fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
        payload = self._read(off + FRAME_HEADER_SIZE, fh.payload_len)
        if crc32(payload) != fh.payload_crc:
            raise SidecarError(f"corrupt frame at offset {off}: payload checksum mismatch",
                               offset=off)
        return fh, payload

    # -- scanning
    def scan(self) -> list[FrameInfo]:
        """Walk every frame from the header on; fills :attr:`errors` and :attr:`torn_tail`.

        Returns:
            one FrameInfo per record frame, corrupt ones included (with ``error`` set).
        """
        if self._frames is not None:
            return self._frames
        frames: list[FrameInfo] = []
        seen: dict[str, int] = {}
        off = self._data_start
        while off < self.size:
            if self.size - off == TRAILER_SIZE and self._read(off + 8, 8) == TRAILER_MAGIC:
                break
            try:
                fh = parse_frame_header(self._read(off, FRAME_HEADER_SIZE), off, self.size)
            except SidecarError as e:
                if e.torn:
                    self._torn(off, str(e))
                    break
                nxt = self._resync(off + 1)
                self.errors.append(f"corrupt frame header at offset {off}; "
                                   + (f"resynchronised at offset {nxt}" if nxt is not None
                                      else "no later frame found"))
                frames.append(FrameInfo(off, -1, -1, error="corrupt frame header"))
                if nxt is None:
                    break
                off = nxt
                continue
            if fh.kind == KIND_RECORD:
                frames.append(self._scan_record(fh, seen))
            off = fh.end
        self._frames = frames
        self._by_id = {fi.sample_id: fi for fi in frames if fi.meta is not None}
        return frames

    def _scan_record(self, fh: FrameHeader, seen: dict[str, int]) -> FrameInfo:
        off = fh.offset
        fi = FrameInfo(off, fh.kind, fh.payload_len)
        payload = self._read(off + FRAME_HEADER_SIZE, fh.payload_len)
        if crc32(payload) != fh.payload_crc:
            fi.error = "payload checksum mismatch"
            sid = peek_sample_id(payload)
            self.errors.append(f"corrupt frame at offset {off}"
                               + (f" (sample {sid!r})" if sid else "")
                               + ": payload checksum mismatch")
            return fi
        try:
            fi.meta = decode_record_payload(payload, self.schema, self.version, off)[0]
        except SidecarError as e:
            fi.error = str(e)
            self.errors.append(f"corrupt frame at offset {off}: {e}")
            return fi
        sid = fi.meta.sample_id
        if sid in seen:
            # NOTE: writers refuse duplicate ids, so this stream was spliced or forged; keep
            # the first, report the rest
            fi.error = f"duplicate sample id {sid!r} (first at offset {seen[sid]})"
            self.errors.append(f"corrupt frame at offset {off}: {fi.error}")
            fi.meta = None
            return fi
        seen[sid] = off
        fi.sample_id = sid
        return fi

    def _torn(self, off: int, why: str) -> None:
        self.torn_tail = off
        self.errors.append(f"torn tail at offset {off} ({why}); "
                           f"{self.size - off} trailing bytes skipped")

    def _resync(self, start: int) -> int | None:
        """Next offset >= start holding a frame header whose own checksum is valid."""
        pos = start
        while True:
            chunk = self._read(pos, _RESYNC_CHUNK)
            if len(chunk) < FRAME_HEADER_SIZE:
                return None
            i = chunk.find(FRAME_MAGIC)
            while i != -1:
                hdr = chunk[i:i + FRAME_HEADER_SIZE]
                if len(hdr) < FRAME_HEADER_SIZE:
                    hdr = self._read(pos + i, FRAME_HEADER_SIZE)
                if frame_header_valid(hdr):
                    return pos + i
                i = chunk.find(FRAME_MAGIC, i + 1)
            pos += len(chunk) - 3

    # -- access
    def sample_ids(self) -> list[str]:
        """Sample ids of readable records, in stream order (index if present, else scan)."""
        if self._frames is None and self._index is not None:
            return [fi.sample_id for fi in self._index]
        return [fi.sample_id for fi in self.scan() if fi.meta is not None]

    def __len__(self) -> int:
        return len(self.sample_ids())

    def __contains__(self, sample_id: object) -> bool:
        if sample_id not in self._by_id and self._frames is None:
            self.scan()
        return sample_id in self._by_id

    def _locate(self, sample_id: str) -> FrameInfo:
        if sample_id not in self._by_id and self._frames is None:
            self.scan()
        fi = self._by_id.get(sample_id)
        if fi is None:
            raise UnknownSampleError(f"sample {sample_id!r} not in sidecar", sample_id)
        return fi

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
            SidecarError: the frame is corrupt (names the offset and the sample id).
            ConfigError (a ValueError): a MoE layer position out of range or repeated.
        """
        if layers is not None:
            moe_layers = layers
        want = self._moe_layers(moe_layers)
        meta, sections, off = self._record_sections(sample_id, want, arrays)
        r0, r1 = 0, meta.num_tokens
        if tokens is not None:
            r0 = min(max(tokens[0] - meta.start, 0), meta.num_tokens)
            r1 = min(max(tokens[1] - meta.start, r0), meta.num_tokens)
        out = self._assemble(meta, sections, want, [(r0, r1)], off)[0]
        return RoutingRecord(
            sample_id=meta.sample_id, expert_ids=out, start=meta.start + r0,
            prompt_len=meta.prompt_len, token_ids=sections.get("token_ids"),
            logprobs=sections.get("logprobs"), weight_versions=list(meta.weight_versions),
            recomputed=list(meta.recomputed), prefix_cached=list(meta.prefix_cached),
            engine=meta.engine)

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """:meth:`routereplay.source.RoutingSource.fetch`: every run from one read of the
        frame, each needed layer-group section decompressed once."""
        want = self._moe_layers(moe_layers)
        meta, sections, off = self._record_sections(sample_id, want, arrays=False)
        rows = []
        for lo, hi in runs:
            a = min(max(int(lo) - meta.start, 0), meta.num_tokens)
            rows.append((a, min(max(int(hi) - meta.start, a), meta.num_tokens)))
        return [(ids, meta.start + a) for ids, (a, _) in
                zip(self._assemble(meta, sections, want, rows, off), rows)]

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """Iterate over all records in stream order.

        strict=True raises SidecarError at the first corrupt frame or torn tail; with
        strict=False they are skipped (see :attr:`errors`).
        """
        frames = self.scan()
        if strict and self.errors:
            raise SidecarError(self.errors[0], offset=next(
                (f.offset for f in frames if f.error), self.torn_tail))
        for fi in frames:
            if fi.meta is not None:
                yield self.read(fi.meta.sample_id, **kw)

    # -- decoding
    def _moe_layers(self, moe_layers: Sequence[int] | None) -> list[int]:
        n = self.schema.num_moe_layers
        want = list(range(n)) if moe_layers is None else [int(x) for x in moe_layers]
        for lyr in want:
            if not 0 <= lyr < n:
                raise ConfigError(f"MoE layer position {lyr} out of range [0, {n})")
        if len(set(want)) != len(want):
            raise ConfigError(f"moe_layers {want} repeat a MoE layer position")
        return want

    def _record_sections(self, sample_id: str, want: list[int], arrays: bool
                         ) -> tuple[RecordMeta, dict[Any, Any], int]:
        """Meta and decoded sections of ``sample_id``: routing sections holding a wanted
        layer under their (l0, l1) key, and the arrays if asked for; the frame's offset."""
        fi = self._locate(sample_id)
        off = fi.offset
        try:
            fh, payload = self._read_frame(off)
            if fh.kind != KIND_RECORD:
                raise SidecarError(f"frame at offset {off} is not a record frame", offset=off)
            meta, body = decode_record_payload(payload, self.schema, self.version, off)
        except SidecarError as e:
            if e.sample_id is not None:
                raise
            raise SidecarError(f"sample {sample_id!r}: {e}", offset=e.offset,
                               sample_id=sample_id) from None
        if meta.sample_id != sample_id:
            if self._frames is None:          # index disagrees with the frames: rescan
                self._by_id = {}
                self.scan()
                return self._record_sections(sample_id, want, arrays)
            raise SidecarError(f"frame at offset {off} holds sample {meta.sample_id!r}, not "
                               f"{sample_id!r}", offset=off, sample_id=sample_id)
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
                    out[sec.name] = decode_array(blob, sec)
        except SidecarError as e:
            raise SidecarError(f"sample {meta.sample_id!r} (frame at offset {off}): {e}",
                               offset=off, sample_id=meta.sample_id) from None
        return meta, out, off

    def _assemble(self, meta: RecordMeta, sections: dict[Any, Any], want: list[int],
                  rows: list[tuple[int, int]], offset: int) -> list[np.ndarray]:
        """ids [r1 - r0, len(want), K] for each row range, from the decoded sections.

        NOTE: allocated only after the sections decoded to their promised sizes, so the
        size is backed by real data (or is zero when no layer was asked for)."""
        schema = self.schema
        out = [np.empty((r1 - r0, len(want), schema.top_k), dtype=schema.id_dtype)
               for r0, r1 in rows]
        for i, lyr in enumerate(want):
            (l0, _), ids = next((key, v) for key, v in sections.items()
                                if isinstance(key, tuple) and key[0] <= lyr < key[1])
            for o, (r0, r1) in zip(out, rows):
                o[:, i] = ids[r0:r1, lyr - l0]
        # NOTE: the reader is the boundary that checks stored ids (range, distinct in a
        # row); consumers (alignment, replay) do not check them again.
        layer_ids = [schema.moe_layer_ids[i] for i in want]
        for o, (r0, _) in zip(out, rows):
            try:
                RoutingRecord(meta.sample_id, o, start=meta.start + r0).validate_ids(
                    schema, layer_ids=layer_ids)
            except RecordError as e:
                raise SidecarError(f"frame at offset {offset}: {e}", offset=offset,
                                   sample_id=meta.sample_id) from None
        return out

    def close(self) -> None:
        """Close the underlying file (when the reader opened it)."""
        if self._own:
            self._f.close()

    def __enter__(self) -> "SidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
