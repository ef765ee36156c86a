"""Sidecar writer: append records to a stream off the caller's thread (docs/FORMAT.md).

A bounded queue feeds one background thread that encodes and appends frames, so a slow
destination pushes back on the producer instead of growing memory.
"""
from __future__ import annotations

import io
import json
import os
import queue
import threading
from typing import Any, BinaryIO, Sequence

from routereplay import codec as _codec
from routereplay.errors import ConfigError, RecordError, SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (COLUMN_ORDERS, DEFAULT_LAYER_GROUP, KIND_INDEX,
                                        KIND_RECORD, MAX_JSON_BYTES, MAX_TOKENS, encode_frame,
                                        encode_header, encode_index, encode_trailer)
from routereplay.sidecar.payload import encode_record_payload

FSYNC_MODES = ("close", "frame", "never")


def writer_codec(codec: str | None, column_order: str = "engine") -> str:
    """The routing codec a writer uses for ``codec`` (None: the default) and ``column_order``.

    None -> ``ctx-zstd`` (engine order) or ``ctx-ans-sorted`` (sorted); ``ctx-ans`` with
    sorted rows -> ``ctx-ans-sorted``.

    Raises:
        ConfigError (a ValueError): unknown codec or column order, or ``ctx-ans-sorted``
            for engine order.
    """
    if column_order not in COLUMN_ORDERS:
        raise ConfigError(f"column_order must be one of {COLUMN_ORDERS}")
    if codec is None:
        return "ctx-ans-sorted" if column_order == "sorted" else _codec.DEFAULT_CODEC
    if column_order == "sorted" and codec == "ctx-ans":
        return "ctx-ans-sorted"
    if codec not in _codec.CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(_codec.CODECS)}")
    if codec == "ctx-ans-sorted" and column_order != "sorted":
        raise ConfigError("codec 'ctx-ans-sorted' needs column_order='sorted'")
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

    Durability contract (what survives the writer's process being killed):

    - :meth:`write` returning means the record was validated, its sample id reserved, and
      (``background=True``) queued: it is not in the stream yet. A process killed then
      loses the records still queued or being encoded: at most ``max_queue + 1`` records
      whose :meth:`write` had returned (the default ``max_queue=64`` can lose 65).
    - ``write(record, wait=True)`` (or ``background=False``) returns only once the record's
      frame is written and flushed to the OS: a killed process no longer loses it.
    - :meth:`flush` returning: every record whose :meth:`write` returned before is written
      and flushed to the OS.
    - :meth:`close`: flush, then the index frame and trailer, then fsync (local files,
      ``fsync="close"`` or ``"frame"``). Only a closed stream is complete; a reader of an
      unclosed one recovers every whole frame and reports the stream as not complete.
    - Against power loss (not only a killed process) a frame is durable once fsynced:
      ``fsync="frame"`` fsyncs each frame as it is written.

    Bounded loss, for users who need it: ``max_queue=N`` bounds what a kill can lose to
    N + 1 records whose write() returned; ``wait=True`` per record, or
    ``background=False`` for all, to none. A frame being written when the process dies is
    a torn tail, which readers detect and skip.

    Raises:
        ConfigError: a bad codec, column order, fsync mode, layer group or max_queue.
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema, *,
                 codec: str | None = None, background: bool = True, max_queue: int = 64,
                 fsync: str = "close", extra_header: dict[str, Any] | None = None,
                 layer_group: int = DEFAULT_LAYER_GROUP, column_order: str = "engine"):
        if not isinstance(schema, RoutingSchema):
            raise ConfigError(f"schema must be a RoutingSchema, got {type(schema).__name__}")
        if dest is not None and not isinstance(dest, (str, os.PathLike)) \
                and not hasattr(dest, "write"):
            raise ConfigError(f"a sidecar destination is a path, an fsspec URL, a writable "
                              f"binary file object or None, not {type(dest).__name__}")
        codec = writer_codec(codec, column_order)
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        if isinstance(layer_group, bool) or not isinstance(layer_group, int) or layer_group < 1:
            raise ConfigError(f"layer_group must be an integer >= 1, got {layer_group!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            # NOTE: queue.Queue(0) would be unbounded: no back-pressure, unbounded loss
            raise ConfigError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        try:
            header = encode_header(schema, codec, extra_header, layer_group, column_order)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"extra_header is not JSON-serialisable: {e}") from None
        if len(header) - 20 > MAX_JSON_BYTES:
            raise ConfigError(f"extra_header makes a header JSON of {len(header) - 20} bytes, "
                              f"above the reader's limit of {MAX_JSON_BYTES} bytes")
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
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._emit(header)
        if background:
            self._q = queue.Queue(maxsize=max_queue)
            self._thread = threading.Thread(target=self._run, name="routereplay-sidecar-writer",
                                            daemon=True)
            self._thread.start()

    # -- public
    def write(self, record: RoutingRecord, *, wait: bool = False) -> None:
        """Validate ``record`` against the schema and append it.

        Args:
            wait: return only once the record's frame is written and flushed to the OS
                (see the durability contract in the class doc); otherwise return once it is
                queued (``background=True``).
        Raises:
            RecordError: invalid record or a sample id already in this stream (nothing written).
            SidecarError: the background writer failed (earlier, or with ``wait``, on this
                record).
        """
        self._check_open()
        if not isinstance(record, RoutingRecord):
            raise RecordError(f"expected a RoutingRecord, got {type(record).__name__}")
        record.validate(self.schema)
        if record.start + record.num_tokens > MAX_TOKENS:
            raise RecordError(f"sample {record.sample_id!r}: {record.num_tokens} routing rows from "
                              f"position {record.start}, above the sidecar format's limit of "
                              f"{MAX_TOKENS} token positions")
        # NOTE: the meta's size is checked here, not on the writer thread, so that an
        # oversized record fails its own write() and the stream stays usable.
        sections = -(-self.schema.num_moe_layers // self.layer_group) + 2
        meta_len = len(json.dumps(record.meta(), separators=(",", ":")).encode()) + 48 * sections
        if meta_len > MAX_JSON_BYTES:
            raise RecordError(f"sample {str(record.sample_id)[:80]!r}: record meta of about "
                              f"{meta_len} bytes exceeds the reader's limit of {MAX_JSON_BYTES} "
                              "bytes (sample id or span lists too long)")
        if record.sample_id in self._ids:
            raise RecordError(f"sample {record.sample_id!r} already written to this stream")
        self._ids.add(record.sample_id)
        if self._q is None:
            self._write_now(record)
        elif wait:
            done = threading.Event()
            self._q.put((record, done))
            done.wait()
            self._raise_bg()
        else:
            self._q.put((record, None))

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
        if self._q is not None and self._thread is not None:
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
    def _finish(self) -> None:
        """Index frame and trailer over the frames written so far (also after a background
        write error: the frames before it stay indexed)."""
        index_offset = self._pos
        self._emit(encode_frame(KIND_INDEX, encode_index(self._index)))
        self._emit(encode_trailer(index_offset))
        self._f.flush()
        if self._fsync != "never":
            self._do_fsync()

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
            item = self._q.get()
            done = None
            try:
                if item is None:
                    return
                rec, done = item
                if self._error is None:
                    self._write_now(rec)
            except BaseException as e:  # reported on the next write/flush/close
                self._error = e
            finally:
                if done is not None:
                    done.set()
                self._q.task_done()


def write_records(dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema,
                  records: Sequence[RoutingRecord], **kw: Any) -> SidecarWriter:
    """Write ``records`` to ``dest`` and close; returns the (closed) writer."""
    w = SidecarWriter(dest, schema, **kw)
    for r in records:
        w.write(r)
    w.close()
    return w
