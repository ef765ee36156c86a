"""Sidecar streams: an append-only, framed, checksummed file of routing records.

The byte layout is specified in docs/FORMAT.md; this module follows it exactly.

    stream  = header frame* [index-frame trailer]
    header  = magic(8) version(u16) flags(u16) json_len(u32) json crc32(json)(u32)
    frame   = b"RRFM" kind(u8) 0(3) payload_len(u64) crc32(payload)(u32) crc32(hdr[0:20])(u32) payload
    trailer = index_offset(u64) b"RRSCEND\\0"

Writers append one frame per record from a background thread (bounded queue, so a slow
destination pushes back on the producer instead of growing memory). Readers scan frames,
recover every complete frame before a torn tail, report corrupt frames by offset, and
decode only the sections they are asked for (one sample, a token range, some layers).

Metadata is JSON, validated on read. Nothing read from a stream is ever unpickled or
evaluated.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import struct
import threading
import zlib
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np
import zstandard

from routereplay import codec as _codec
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

MAGIC = b"\x89RRSC\r\n\x1a"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)                     # v1: dict sections, every meta key present
COLUMN_ORDERS = ("engine", "sorted")
FRAME_MAGIC = b"RRFM"
TRAILER_MAGIC = b"RRSCEND\x00"
KIND_RECORD = 1
KIND_INDEX = 2
_HEADER_FIXED = struct.Struct("<8sHHI")        # magic, version, flags, json_len
_FRAME_HDR = struct.Struct("<4sB3xQI")         # magic, kind, payload_len, payload crc32
FRAME_HEADER_SIZE = _FRAME_HDR.size + 4        # + crc32 of the 20 bytes above = 24
_TRAILER = struct.Struct("<Q8s")
MAX_JSON_BYTES = 64 << 20                      # header / meta JSON bound (bytes)
MAX_FRAME_BYTES = 1 << 32                      # payload bound (bytes), 4 GiB
DEFAULT_LAYER_GROUP = 4                        # MoE layers per routing section (partial-read unit)
MAX_TOKENS = 1 << 24                           # routing rows per record (format limit)


def _crc(b: bytes) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


# --------------------------------------------------------------------------- encoding


def encode_header(schema: RoutingSchema, codec: str = _codec.DEFAULT_CODEC,
                  extra: dict[str, Any] | None = None,
                  layer_group: int = DEFAULT_LAYER_GROUP, column_order: str = "engine") -> bytes:
    """Stream header bytes for ``schema`` (FORMAT.md "Header")."""
    meta = {"schema": schema.to_dict(), "codec": codec, "column_order": column_order,
            "layer_group": layer_group}
    if extra:
        meta["extra"] = extra
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return _HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(js)) + js + struct.pack("<I", _crc(js))


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One frame: 24-byte frame header + payload (FORMAT.md "Frame")."""
    hdr = _FRAME_HDR.pack(FRAME_MAGIC, kind, len(payload), _crc(payload))
    return hdr + struct.pack("<I", _crc(hdr)) + payload


_META_DEFAULTS: dict[str, Any] = {"start": 0, "prompt_len": None, "weight_versions": [],
                                  "recomputed": [], "prefix_cached": [], "engine": ""}


def encode_record_payload(record: RoutingRecord, schema: RoutingSchema,
                          codec: str = _codec.DEFAULT_CODEC,
                          layer_group: int = DEFAULT_LAYER_GROUP,
                          column_order: str = "engine") -> bytes:
    """Record frame payload: u32 meta_len, meta JSON, then the section blobs (FORMAT.md).

    Meta keys equal to their default are left out; sections are
    ``[name, codec, length, a, b]`` arrays laid back to back in list order.
    ``column_order="sorted"`` stores each row in ascending expert order.
    """
    sections: list[list[Any]] = []
    blobs: list[bytes] = []
    ids = np.sort(record.ids, axis=-1) if column_order == "sorted" else record.ids
    for l0 in range(0, schema.num_moe_layers, layer_group):
        l1 = min(l0 + layer_group, schema.num_moe_layers)
        blobs.append(_codec.encode(ids[:, l0:l1], codec, schema.num_experts))
        sections.append(["routing", codec, len(blobs[-1]), l0, l1])
    if record.token_ids is not None:
        tok = np.ascontiguousarray(record.token_ids, dtype="<i4")
        blobs.append(zstandard.ZstdCompressor(level=3).compress(tok.tobytes()))
        sections.append(["token_ids", "zstd", len(blobs[-1]), int(tok.shape[0])])
    if record.logprobs is not None:
        lp = np.ascontiguousarray(record.logprobs, dtype="<f4")
        blobs.append(lp.tobytes())
        sections.append(["logprobs", "raw", len(blobs[-1]), int(lp.shape[0])])
    meta = {k: v for k, v in record.meta().items() if _META_DEFAULTS.get(k, ...) != v}
    meta["sections"] = sections
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<I", len(js)) + js + b"".join(blobs)


# --------------------------------------------------------------------------- writer


def writer_codec(codec: str | None, column_order: str = "engine") -> str:
    """The routing codec a writer uses for ``codec`` (None: the default) and ``column_order``.

    None -> ``ctx-zstd`` (engine order) or ``ctx-ans-sorted`` (sorted); ``ctx-ans`` with
    sorted rows -> ``ctx-ans-sorted``.

    Raises:
        ValueError: unknown codec or column order, or ``ctx-ans-sorted`` for engine order.
    """
    if column_order not in COLUMN_ORDERS:
        raise ValueError(f"column_order must be one of {COLUMN_ORDERS}")
    if codec is None:
        return "ctx-ans-sorted" if column_order == "sorted" else _codec.DEFAULT_CODEC
    if column_order == "sorted" and codec == "ctx-ans":
        return "ctx-ans-sorted"
    if codec not in _codec.CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(_codec.CODECS)}")
    if codec == "ctx-ans-sorted" and column_order != "sorted":
        raise ValueError("codec 'ctx-ans-sorted' needs column_order='sorted'")
    return codec


class SidecarWriter:
    """Append routing records to a sidecar stream, off the caller's thread.

    Args:
        dest: a local path, an fsspec URL (``"memory://x"``, ``"s3://..."``), a writable
            binary file object, or None for an in-memory stream (read it with
            :meth:`getvalue` after :meth:`close`, e.g. to put it in a Ray object store).
        schema: routing schema of every record.
        layer_group: MoE layers per routing section; a reader decompresses whole sections,
            so this is the unit of partial reads by layer (e.g. one pipeline stage).
        background: encode and write on a background thread (default). The queue holds
            at most ``max_queue`` records; :meth:`write` blocks when it is full.
        fsync: "close" (default) fsyncs local files on close; "frame" after every frame;
            "never" leaves it to the OS.
        codec: routing codec (routereplay.codec.CODECS); None (default) picks ``ctx-zstd``
            (fast), or ``ctx-ans-sorted`` for sorted streams; ``ctx-ans`` is 2-5 % smaller
            than ``ctx-zstd`` on most routing and 10-50x slower.
        column_order: "engine" (default: top-k columns exactly as the engine returned
            them) or "sorted" (canonical: each row in ascending expert id; declared in the
            header; ``ctx-ans-sorted`` codes it smaller by about log2(top_k!) bits a row).

    Every frame is flushed to the OS as soon as it is written, so a killed writer loses at
    most the frame in flight (a torn tail, which readers detect and skip).
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema, *,
                 codec: str | None = None, background: bool = True, max_queue: int = 64,
                 fsync: str = "close", extra_header: dict[str, Any] | None = None,
                 layer_group: int = DEFAULT_LAYER_GROUP, column_order: str = "engine"):
        codec = writer_codec(codec, column_order)
        if fsync not in ("close", "frame", "never"):
            raise ValueError("fsync must be 'close', 'frame' or 'never'")
        if layer_group < 1:
            raise ValueError("layer_group must be >= 1")
        self.schema, self.codec, self._fsync = schema, codec, fsync
        self.layer_group, self.column_order = layer_group, column_order
        self._own = True
        self._fsspec_file = None
        if dest is None:
            self._f: BinaryIO = io.BytesIO()
        elif isinstance(dest, (str, os.PathLike)) and "://" not in os.fspath(dest):
            self._f = open(dest, "wb")
        elif isinstance(dest, (str, os.PathLike)):
            import fsspec  # lazy: only for URLs
            self._fsspec_file = fsspec.open(os.fspath(dest), "wb")
            self._f = self._fsspec_file.open()
        else:
            self._f, self._own = dest, False
        self._index: list[tuple[str, int]] = []
        self._ids: set[str] = set()
        self._pos = 0
        self._closed = False
        self._error: BaseException | None = None
        self._bytes_written = 0
        self._emit(encode_header(schema, codec, extra_header, layer_group, column_order))
        self._q: queue.Queue | None = None
        if background:
            self._q = queue.Queue(maxsize=max_queue)
            self._thread = threading.Thread(target=self._run, name="routereplay-sidecar-writer",
                                            daemon=True)
            self._thread.start()

    # -- public
    def write(self, record: RoutingRecord) -> None:
        """Validate ``record`` against the schema and append it.

        Raises:
            RecordError: invalid record or a sample id already in this stream (nothing written).
            SidecarError: the background writer failed earlier.
        """
        self._check_open()
        record.validate(self.schema)
        if record.num_tokens > MAX_TOKENS:
            raise RecordError(f"sample {record.sample_id!r}: {record.num_tokens} routing rows, "
                              f"above the sidecar format's limit of {MAX_TOKENS}")
        if record.sample_id in self._ids:
            raise RecordError(f"sample {record.sample_id!r} already written to this stream")
        self._ids.add(record.sample_id)
        if self._q is None:
            self._write_now(record)
        else:
            self._q.put(record)

    def flush(self) -> None:
        """Block until every queued record is written and flushed to the OS."""
        if self._q is not None:
            self._q.join()
        self._raise_bg()
        self._f.flush()

    def close(self) -> None:
        """Flush, append the index frame and trailer, fsync (local files), close."""
        if self._closed:
            return
        if self._q is not None:
            self._q.put(None)
            self._thread.join()
        self._closed = True
        try:
            self._finish()
        except Exception:
            if self._error is None:
                raise                # else: the background error below says what went wrong
        finally:
            if self._own and not isinstance(self._f, io.BytesIO):
                self._f.close()
                if self._fsspec_file is not None:
                    self._fsspec_file.close()
        self._raise_bg()

    def _finish(self) -> None:
        """Index frame and trailer over the frames written so far (also after a background
        write error: the frames before it stay indexed)."""
        idx = json.dumps({"records": [[s, o] for s, o in self._index]},
                         separators=(",", ":")).encode()
        index_offset = self._pos
        self._emit(encode_frame(KIND_INDEX, idx))
        self._emit(_TRAILER.pack(index_offset, TRAILER_MAGIC))
        self._f.flush()
        if self._fsync != "never":
            self._do_fsync()

    def getvalue(self) -> bytes:
        """The whole stream, for an in-memory writer (dest=None)."""
        if not isinstance(self._f, io.BytesIO):
            raise SidecarError("getvalue() is only for in-memory sidecars (dest=None)")
        return self._f.getvalue()

    @property
    def bytes_written(self) -> int:
        """Bytes appended so far (header and frames)."""
        return self._bytes_written

    def __enter__(self) -> "SidecarWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals
    def _check_open(self) -> None:
        if self._closed:
            raise SidecarError("sidecar writer is closed")
        self._raise_bg()

    def _raise_bg(self) -> None:
        if self._error is not None:
            raise SidecarError(f"background sidecar writer failed: {self._error!r}") from self._error

    def _emit(self, b: bytes) -> None:
        self._f.write(b)
        self._pos += len(b)
        self._bytes_written += len(b)

    def _write_now(self, record: RoutingRecord) -> None:
        payload = encode_record_payload(record, self.schema, self.codec, self.layer_group,
                                        self.column_order)
        offset = self._pos
        self._emit(encode_frame(KIND_RECORD, payload))
        self._index.append((record.sample_id, offset))
        self._f.flush()
        if self._fsync == "frame":
            self._do_fsync()

    def _do_fsync(self) -> None:
        try:
            os.fsync(self._f.fileno())
        except (AttributeError, OSError, io.UnsupportedOperation):
            pass  # not a local file

    def _run(self) -> None:
        assert self._q is not None
        while True:
            rec = self._q.get()
            try:
                if rec is None:
                    return
                if self._error is None:
                    self._write_now(rec)
            except BaseException as e:  # reported on the next write/flush/close
                self._error = e
            finally:
                self._q.task_done()


# --------------------------------------------------------------------------- reader


@dataclasses.dataclass
class FrameInfo:
    """Where one record frame lies and what its metadata says.

    ``offset`` is the byte offset of the frame header; ``meta`` is the validated record
    metadata, or None if the frame is corrupt (then ``error`` says why).
    """

    offset: int
    kind: int
    payload_len: int
    meta: dict[str, Any] | None = None
    error: str | None = None

    @property
    def sample_id(self) -> str | None:
        return None if self.meta is None else self.meta["sample_id"]


class SidecarReader:
    """Read a sidecar stream lazily.

    Args:
        source: a local path, an fsspec URL, bytes, or a seekable binary file object.

    Opening reads only the header and (if present) the index; frames are located by the
    index or by scanning (:meth:`scan`), and record sections are decoded on demand.

    Attributes:
        schema: the stream's RoutingSchema.
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
        self._frames: list[FrameInfo] | None = None
        self._by_id: dict[str, FrameInfo] = {}
        self._read_header()
        self._load_index()

    # -- header / index
    def _read(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(n)

    def _read_header(self) -> None:
        fixed = self._read(0, _HEADER_FIXED.size)
        if len(fixed) < _HEADER_FIXED.size or fixed[:8] != MAGIC:
            raise SidecarError("not a routereplay sidecar (wrong magic)", offset=0)
        _, version, _flags, jlen = _HEADER_FIXED.unpack(fixed)
        if version not in READABLE_VERSIONS:
            raise SidecarError(f"unsupported sidecar format version {version} "
                               f"(this reader supports {READABLE_VERSIONS})", offset=0)
        self.version = version
        if jlen > min(MAX_JSON_BYTES, self.size):
            raise SidecarError(f"header length {jlen} exceeds the stream", offset=0)
        js = self._read(_HEADER_FIXED.size, jlen)
        crc = self._read(_HEADER_FIXED.size + jlen, 4)
        if len(js) != jlen or len(crc) != 4 or struct.unpack("<I", crc)[0] != _crc(js):
            raise SidecarError("sidecar header is truncated or its checksum does not match",
                               offset=0)
        try:
            self.header = json.loads(js)
            self.schema = RoutingSchema.from_dict(self.header["schema"])
            self.codec = str(self.header["codec"])
            self.column_order = self.header.get("column_order", "engine")
            if self.column_order not in COLUMN_ORDERS:
                raise ValueError(f"column_order {self.column_order!r}")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise SidecarError(f"invalid sidecar header: {e!r}"[:500], offset=0) from None
        self._data_start = _HEADER_FIXED.size + jlen + 4

    def _load_index(self) -> None:
        """Use the index frame named by the trailer, if the stream was closed cleanly."""
        if self.size < self._data_start + _TRAILER.size:
            return
        off, magic = _TRAILER.unpack(self._read(self.size - _TRAILER.size, _TRAILER.size))
        if magic != TRAILER_MAGIC or not (self._data_start <= off < self.size - _TRAILER.size):
            return
        try:
            kind, payload = self._read_frame(off)
            if kind != KIND_INDEX:
                return
            entries = json.loads(payload)["records"]
            frames = []
            for sid, o in entries:
                # NOTE: offsets must point into the frame area; _decode also checks that
                # the frame found there holds this sample id (a stale or forged index).
                if not isinstance(sid, str) or isinstance(o, bool) or not isinstance(o, int) \
                        or not (self._data_start <= o < off):
                    return
                frames.append(FrameInfo(offset=o, kind=KIND_RECORD, payload_len=-1,
                                        meta={"sample_id": sid}))
        except (SidecarError, ValueError, KeyError, TypeError, RecursionError):
            return  # fall back to scanning
        self._frames_index = frames
        self._by_id = {fi.meta["sample_id"]: fi for fi in frames}
        self._index_end = off

    def _read_frame(self, off: int) -> tuple[int, bytes]:
        hdr = self._read(off, FRAME_HEADER_SIZE)
        if len(hdr) < FRAME_HEADER_SIZE:
            raise SidecarError(f"torn frame header at offset {off}", offset=off)
        magic, kind, plen, pcrc = _FRAME_HDR.unpack(hdr[:20])
        if magic != FRAME_MAGIC or struct.unpack("<I", hdr[20:24])[0] != _crc(hdr[:20]):
            raise SidecarError(f"corrupt frame header at offset {off}", offset=off)
        if plen > MAX_FRAME_BYTES or off + FRAME_HEADER_SIZE + plen > self.size:
            raise SidecarError(f"torn frame at offset {off}: payload of {plen} bytes runs past "
                               f"the end of the stream ({self.size} bytes)", offset=off)
        payload = self._read(off + FRAME_HEADER_SIZE, plen)
        if _crc(payload) != pcrc:
            raise SidecarError(f"corrupt frame at offset {off}: payload checksum mismatch",
                               offset=off)
        return kind, payload

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
            if self.size - off == _TRAILER.size and \
                    self._read(off + 8, 8) == TRAILER_MAGIC:
                break
            hdr = self._read(off, FRAME_HEADER_SIZE)
            if len(hdr) < FRAME_HEADER_SIZE:
                self._torn(off, "incomplete frame header")
                break
            magic, kind, plen, pcrc = _FRAME_HDR.unpack(hdr[:20])
            if magic != FRAME_MAGIC or struct.unpack("<I", hdr[20:24])[0] != _crc(hdr[:20]):
                nxt = self._resync(off + 1)
                self.errors.append(f"corrupt frame header at offset {off}; "
                                   + (f"resynchronised at offset {nxt}" if nxt is not None
                                      else "no later frame found"))
                frames.append(FrameInfo(off, -1, -1, error="corrupt frame header"))
                if nxt is None:
                    break
                off = nxt
                continue
            end = off + FRAME_HEADER_SIZE + plen
            if end > self.size or plen > MAX_FRAME_BYTES:
                self._torn(off, f"payload of {plen} bytes runs past the end ({self.size} bytes)")
                break
            if kind == KIND_RECORD:
                fi = FrameInfo(off, kind, plen)
                payload = self._read(off + FRAME_HEADER_SIZE, plen)
                if _crc(payload) != pcrc:
                    fi.error = "payload checksum mismatch"
                    sid = _peek_sample_id(payload)
                    self.errors.append(f"corrupt frame at offset {off}"
                                       + (f" (sample {sid!r})" if sid else "")
                                       + ": payload checksum mismatch")
                else:
                    try:
                        fi.meta = _parse_meta(payload, self.schema)[0]
                    except SidecarError as e:
                        fi.error = str(e)
                        self.errors.append(f"corrupt frame at offset {off}: {e}")
                if fi.meta is not None and fi.sample_id in seen:
                    # NOTE: writers refuse duplicate ids, so this stream was spliced or forged;
                    # keep the first, report the rest
                    fi.error = f"duplicate sample id {fi.sample_id!r} (first at offset {seen[fi.sample_id]})"
                    self.errors.append(f"corrupt frame at offset {off}: {fi.error}")
                    fi.meta = None
                elif fi.meta is not None:
                    seen[fi.sample_id] = off
                frames.append(fi)
            off = end
        self._frames = frames
        self._by_id = {fi.sample_id: fi for fi in frames if fi.meta is not None}
        return frames

    def _torn(self, off: int, why: str) -> None:
        self.torn_tail = off
        self.errors.append(f"torn tail at offset {off} ({why}); "
                           f"{self.size - off} trailing bytes skipped")

    def _resync(self, start: int) -> int | None:
        """Next offset >= start holding a frame header whose own checksum is valid."""
        pos = start
        while True:
            chunk = self._read(pos, 1 << 20)
            if len(chunk) < FRAME_HEADER_SIZE:
                return None
            i = chunk.find(FRAME_MAGIC)
            while i != -1:
                hdr = self._read(pos + i, FRAME_HEADER_SIZE)
                if len(hdr) == FRAME_HEADER_SIZE and \
                        struct.unpack("<I", hdr[20:24])[0] == _crc(hdr[:20]):
                    return pos + i
                i = chunk.find(FRAME_MAGIC, i + 1)
            pos += len(chunk) - 3

    # -- access
    def sample_ids(self) -> list[str]:
        """Sample ids of readable records, in stream order (index if present, else scan)."""
        if self._frames is None and getattr(self, "_frames_index", None) is not None:
            return [fi.meta["sample_id"] for fi in self._frames_index]
        return [fi.sample_id for fi in self.scan() if fi.meta is not None]

    def __len__(self) -> int:
        return len(self.sample_ids())

    def read(self, sample_id: str, *, layers: Sequence[int] | None = None,
             tokens: tuple[int, int] | None = None, arrays: bool = True) -> RoutingRecord:
        """Decode one record.

        Args:
            sample_id: the record's id.
            layers: positions on the MoE layer axis to decode (e.g. one pipeline stage's
                layers); other layer groups are not decompressed. Default: all.
            tokens: (start, end) token positions to keep (absolute positions, clipped to the
                record's rows). Default: all rows.
            arrays: also decode token_ids and logprobs if stored.
        Returns:
            a RoutingRecord whose ids are [T', len(layers), top_k].
        Raises:
            KeyError: no such sample id.
            SidecarError: the frame is corrupt (names the offset and the sample id).
        """
        if sample_id not in self._by_id:
            self.scan()
        fi = self._by_id.get(sample_id)
        if fi is None:
            raise KeyError(f"sample {sample_id!r} not in sidecar")
        try:
            rec = self._decode(fi.offset, layers=layers, tokens=tokens, arrays=arrays)
            if rec.sample_id != sample_id:
                if self._frames is None:          # index disagrees with the frames: rescan
                    self._by_id = {}
                    self.scan()
                    return self.read(sample_id, layers=layers, tokens=tokens, arrays=arrays)
                raise SidecarError(f"frame at offset {fi.offset} holds sample "
                                   f"{rec.sample_id!r}, not {sample_id!r}", offset=fi.offset)
            return rec
        except SidecarError as e:
            if e.sample_id is not None:
                raise
            raise SidecarError(f"sample {sample_id!r}: {e}", offset=e.offset,
                               sample_id=sample_id) from None

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
                yield self._decode(fi.offset, **kw)

    def _decode(self, off: int, *, layers: Sequence[int] | None = None,
                tokens: tuple[int, int] | None = None, arrays: bool = True) -> RoutingRecord:
        kind, payload = self._read_frame(off)
        if kind != KIND_RECORD:
            raise SidecarError(f"frame at offset {off} is not a record frame", offset=off)
        meta, body = _parse_meta(payload, self.schema, offset=off)
        sid = meta["sample_id"]
        schema = self.schema
        t = meta["num_tokens"]
        want = list(range(schema.num_moe_layers)) if layers is None else [int(x) for x in layers]
        for lyr in want:
            if not 0 <= lyr < schema.num_moe_layers:
                raise IndexError(f"MoE layer position {lyr} out of range [0, {schema.num_moe_layers})")
        if len(set(want)) != len(want):
            raise ValueError(f"layers {want} repeat a MoE layer position")
        start = meta["start"]
        r0, r1 = 0, t
        if tokens is not None:
            r0 = min(max(tokens[0] - start, 0), t)
            r1 = min(max(tokens[1] - start, r0), t)
        pos = {lyr: i for i, lyr in enumerate(want)}
        extra: dict[str, np.ndarray] = {}
        parts: list[tuple[list[int], int, np.ndarray]] = []
        try:
            for sec in meta["sections"]:
                blob = body[sec["offset"]: sec["offset"] + sec["length"]]
                if sec["name"] == "routing":
                    l0, l1 = sec["layers"]
                    hit = [lyr for lyr in range(l0, l1) if lyr in pos]
                    if hit:
                        ids = _codec.decode(blob, sec["codec"], tuple(sec["shape"]),
                                            schema.id_dtype, schema.num_experts)
                        parts.append((hit, l0, ids))
                elif arrays and sec["name"] in ("token_ids", "logprobs"):
                    extra[sec["name"]] = _decode_array(blob, sec)
        except SidecarError as e:
            raise SidecarError(f"sample {sid!r} (frame at offset {off}): {e}", offset=off,
                               sample_id=sid) from None
        # NOTE: allocated only after the sections decoded to their promised sizes, so the
        # size is backed by real data (or is zero when no layer was asked for).
        out = np.empty((r1 - r0, len(want), schema.top_k), dtype=schema.id_dtype)
        for hit, l0, ids in parts:
            for lyr in hit:
                out[:, pos[lyr]] = ids[r0:r1, lyr - l0]
        rec = RoutingRecord(
            sample_id=sid, ids=out, start=start + r0, prompt_len=meta["prompt_len"],
            token_ids=extra.get("token_ids"), logprobs=extra.get("logprobs"),
            weight_versions=RoutingRecord.spans_from_meta(meta),
            recomputed=[tuple(s) for s in meta["recomputed"]],
            prefix_cached=[tuple(s) for s in meta["prefix_cached"]],
            engine=meta["engine"])
        try:
            rec.validate_ids(schema, layer_ids=[schema.moe_layer_ids[i] for i in want])
        except RecordError as e:
            raise SidecarError(f"frame at offset {off}: {e}", offset=off, sample_id=sid) from None
        return rec

    def close(self) -> None:
        if self._own:
            self._f.close()

    def __enter__(self) -> "SidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- helpers


def _parse_meta(payload: bytes, schema: RoutingSchema,
                offset: int | None = None) -> tuple[dict[str, Any], bytes]:
    """Split a record payload into validated meta and the section body."""
    if len(payload) < 4:
        raise SidecarError("record payload shorter than its meta length", offset=offset)
    (mlen,) = struct.unpack("<I", payload[:4])
    if mlen > len(payload) - 4:
        raise SidecarError(f"meta length {mlen} exceeds the payload", offset=offset)
    try:
        meta = json.loads(payload[4:4 + mlen])
    except (ValueError, RecursionError) as e:
        raise SidecarError(f"record meta is not JSON: {e!r}"[:300], offset=offset) from None
    body = payload[4 + mlen:]
    meta = _expand_meta(meta, schema, offset)
    _validate_meta(meta, schema, len(body), offset)
    return meta, body


def _expand_meta(meta: Any, schema: RoutingSchema, offset: int | None) -> Any:
    """Fill the defaults a v2 writer leaves out and turn ``[name, codec, length, a, b]``
    sections into v1-style dicts with offsets and shapes; v1 meta passes through."""
    if not isinstance(meta, dict):
        return meta
    meta = {**{k: (list(v) if isinstance(v, list) else v) for k, v in _META_DEFAULTS.items()},
            **meta}
    secs = meta.get("sections")
    if not isinstance(secs, list) or not all(isinstance(x, list) for x in secs):
        return meta                                   # v1 dicts, or invalid: validated next
    out, pos = [], 0
    for sec in secs:
        if not (4 <= len(sec) <= 5 and isinstance(sec[0], str) and isinstance(sec[1], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in sec[2:])):
            sid = meta.get("sample_id")
            raise SidecarError("invalid record meta" + (f" for sample {sid!r}" if isinstance(sid, str) else "")
                               + f": bad section {str(sec)[:80]}", offset=offset,
                               sample_id=sid if isinstance(sid, str) else None)
        name, codec, length = sec[0], sec[1], sec[2]
        d: dict[str, Any] = {"name": name, "codec": codec, "offset": pos, "length": length}
        if name == "routing" and len(sec) == 5:
            d["layers"] = [sec[3], sec[4]]
            d["shape"] = [meta.get("num_tokens"), sec[4] - sec[3], schema.top_k]
        else:
            d["shape"] = list(sec[3:])
        out.append(d)
        pos += max(length, 0)
    meta["sections"] = out
    return meta


def _validate_meta(meta: Any, schema: RoutingSchema, body_len: int, offset: int | None) -> None:
    def bad(why: str) -> SidecarError:
        sid = meta.get("sample_id") if isinstance(meta, dict) else None
        return SidecarError(f"invalid record meta" + (f" for sample {sid!r}" if sid else "")
                            + f": {why}", offset=offset, sample_id=sid)

    if not isinstance(meta, dict):
        raise bad("not an object")
    types = {"sample_id": str, "num_tokens": int, "start": int, "weight_versions": list,
             "recomputed": list, "prefix_cached": list, "engine": str, "sections": list}
    for k, ty in types.items():
        if not isinstance(meta.get(k), ty) or isinstance(meta.get(k), bool):
            raise bad(f"field {k!r} missing or not {ty.__name__}")
    if meta["num_tokens"] < 0 or meta["start"] < 0:
        raise bad("negative num_tokens or start")
    if meta["num_tokens"] > MAX_TOKENS:
        raise bad(f"num_tokens {meta['num_tokens']} above the format's limit {MAX_TOKENS}")
    pl = meta.get("prompt_len")
    if pl is not None and (not isinstance(pl, int) or isinstance(pl, bool) or pl < 0):
        raise bad("prompt_len not a non-negative integer")
    for span in meta["weight_versions"]:
        if not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
                and all(isinstance(x, int) for x in span[1:]) and 0 <= span[1] <= span[2]):
            raise bad(f"bad weight-version span {span!r}")
    for key in ("recomputed", "prefix_cached"):
        for span in meta[key]:
            if not (isinstance(span, list) and len(span) == 2
                    and all(isinstance(x, int) for x in span) and 0 <= span[0] <= span[1]):
                raise bad(f"bad {key} span {span!r}")
    covered = []
    for sec in meta["sections"]:
        if not isinstance(sec, dict) or not isinstance(sec.get("name"), str):
            raise bad("section without a name")
        o, n = sec.get("offset"), sec.get("length")
        if not (isinstance(o, int) and isinstance(n, int) and 0 <= o and 0 <= n and o + n <= body_len):
            raise bad(f"section {sec.get('name')!r} lies outside the payload")
        shape = sec.get("shape")
        if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
            raise bad(f"section {sec['name']!r} has a bad shape")
        if sec["name"] == "routing":
            ly = sec.get("layers")
            if not (isinstance(ly, list) and len(ly) == 2 and all(isinstance(x, int) for x in ly)
                    and 0 <= ly[0] < ly[1] <= schema.num_moe_layers):
                raise bad(f"routing section has bad layers {ly!r}")
            if shape != [meta["num_tokens"], ly[1] - ly[0], schema.top_k]:
                raise bad(f"routing section shape {shape} does not match num_tokens/top_k")
            if not isinstance(sec.get("codec"), str):
                raise bad("routing section without codec")
            covered.extend(range(ly[0], ly[1]))
        elif sec["name"] in ("token_ids", "logprobs"):
            if len(shape) != 1 or sec.get("codec") not in ("zstd", "raw"):
                raise bad(f"section {sec['name']!r} has a bad shape or codec")
    if sorted(covered) != list(range(schema.num_moe_layers)):
        raise bad(f"routing sections cover MoE layers {sorted(covered)}, "
                  f"expected 0..{schema.num_moe_layers - 1} once each")


def _decode_array(blob: bytes, sec: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype("<i4") if sec["name"] == "token_ids" else np.dtype("<f4")
    n = sec["shape"][0] * dtype.itemsize
    if sec["codec"] == "zstd":
        blob = _codec.bounded_zstd_decompress(blob, n)
    if len(blob) != n:
        raise SidecarError(f"section {sec['name']!r} holds {len(blob)} bytes, expected {n}")
    return np.frombuffer(blob, dtype=dtype).astype(dtype.newbyteorder("="))


def _peek_sample_id(payload: bytes) -> str | None:
    """Best-effort sample id from a payload whose checksum failed (for error messages)."""
    try:
        (mlen,) = struct.unpack("<I", payload[:4])
        meta = json.loads(payload[4:4 + min(mlen, MAX_JSON_BYTES)])
        sid = meta.get("sample_id")
        return sid if isinstance(sid, str) else None
    except Exception:  # noqa: BLE001 - corrupt bytes (also RecursionError): nothing to report
        return None


def write_records(dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema,
                  records: Sequence[RoutingRecord], **kw: Any) -> SidecarWriter:
    """Write ``records`` to ``dest`` and close; returns the (closed) writer."""
    w = SidecarWriter(dest, schema, **kw)
    for r in records:
        w.write(r)
    w.close()
    return w
