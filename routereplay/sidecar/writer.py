"""Sidecar writer: append records to a stream off the caller's thread (docs/FORMAT.md).

A bounded queue feeds one background thread that encodes and appends frames, so a slow
destination pushes back on the producer instead of growing memory.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import stat
import queue
import threading
from typing import Any, BinaryIO, Sequence

from routereplay import codec as _codec
from routereplay.errors import ConfigError, RecordError, SidecarError, StreamExistsError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (COLUMN_ORDERS, DEFAULT_LAYER_GROUP,
                                        DEFAULT_MIN_SECTION_BYTES, DEFAULT_ONE_SECTION_BYTES,
                                        DEFAULT_TOKEN_BLOCK, FORMAT_VERSION, KIND_INDEX,
                                        KIND_RECORD, MAX_JSON_BYTES, MAX_TOKENS, check_writable,
                                        codec_table, encode_frame, encode_header, encode_index,
                                        encode_trailer)
from routereplay.sidecar.payload import encode_record_payload

FSYNC_MODES = ("close", "frame", "never")
def writer_codec(codec: str | None, column_order: str = "engine",
                 format_version: int = FORMAT_VERSION, schema: RoutingSchema | None = None) -> str:
    """The routing codec a writer uses for ``codec`` (None: ``xl-zstd``, in either column
    order); ``schema`` is accepted for callers and not needed.

    Raises:
        ConfigError (a ValueError): unknown column order or codec, a codec removed in 0.3.0
            or a format version other than 3 (both with
            :func:`routereplay.codec.removed_codec_error`'s text).
    """
    if column_order not in COLUMN_ORDERS:
        raise ConfigError(f"column_order must be one of {COLUMN_ORDERS}")
    check_writable(format_version)
    if codec is None:
        return _codec.DEFAULT_CODEC
    if codec in _codec.REMOVED_CODECS:
        raise ConfigError(_codec.removed_codec_error(f"codec {codec!r}"))
    if codec not in _codec.WRITER_CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(_codec.WRITER_CODECS)}")
    return codec


class SidecarWriter:
    """Append routing records to a sidecar stream, off the caller's thread.

    Args:
        dest: a local path, an fsspec URL (``"memory://x"``, ``"s3://..."``), a writable
            binary file object, or None for an in-memory stream (read it with
            :meth:`getvalue` after :meth:`close`, e.g. to put it in a Ray object store).
            A path or URL must not exist yet: the writer creates it exclusively (local
            paths with ``O_CREAT | O_EXCL``, atomic also across hosts on one NFS folder;
            fsspec URLs by an existence check, which is not atomic), so that a second
            writer, or a restarted process that reuses a name, can never truncate a stream
            holding acknowledged records (docs/FORMAT.md "Stream lifecycle").
        replace: replace an existing stream at ``dest`` on purpose (a path or URL). Local
            paths: the new stream is written to a new sibling ``<dest>.<random>.partial``
            and renamed over ``dest`` by :meth:`close` (atomic: readers of ``dest`` see the
            old stream until then; a writer killed before close, whose writer thread
            failed, or whose ``with`` block raised leaves ``dest`` as it was and its
            records in the ``.partial`` file, which readers recover). An existing ``dest``
            that is not a regular file (a folder, symbolic link, FIFO, device, socket) is
            refused even then. URLs: the same, ``fs.mv`` on close (on object stores a copy
            and a delete: not atomic, but ``dest`` is never half-written).
        schema: routing schema of every record.
        token_block, layer_group: the version-3 section grid: routing sections of
            ``token_block`` rows (B, default 512) x ``layer_group`` MoE layers (G, default
            1). A reader reads and decodes whole sections, so this is the unit of partial
            reads (a rank's token runs, one pipeline stage's layers); the defaults were
            chosen by measurement (docs/FORMAT.md "Choosing the geometry").
        one_section_bytes: version 3: a record whose ids take at most this many bytes
            (``T x L_moe x top_k x itemsize``, default 64 KiB) is written as one section:
            short records pay one section's framing, and a codec sees all their layers.
        min_section_bytes: version 3: where a record's routing sections code to less than
            this on average (default 1024; repetitive routing), its token block is multiplied
            by the smallest power of two that reaches it (0: never).
        format_version: 3 (the only one written: writing 2 was removed in 0.3.0).
        background: encode and write on a background thread (default). The queue holds
            at most ``max_queue`` records; :meth:`write` blocks when it is full.
        fsync: "close" (default) fsyncs local files on close; "frame" after every frame;
            "never" leaves it to the OS.
        codec: routing codec, one of routereplay.codec.WRITER_CODECS: ``xl-zstd`` (None,
            the default, in either column order), ``ctx-zstd``, ``raw-lm``
            (docs/FORMAT.md "Routing codecs": each one's measured reason).
        column_order: "engine" (default: top-k columns exactly as the engine returned
            them) or "sorted" (canonical: each row in ascending expert id; declared in the
            header).

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
        ConfigError: a bad or removed codec, column order, fsync mode, format version
            other than 3, token block, layer group, one_section_bytes or max_queue
            (checked before ``dest`` is opened).
        StreamExistsError: ``dest`` exists (without ``replace``; also a ``FileExistsError``),
            or (with ``replace``) is not a regular file or is a live stream (its writer
            holds its lock; checked again by :meth:`close` before the rename, which then
            keeps the new stream in its ``.partial``). Nothing at ``dest`` is touched.
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema, *,
                 codec: str | None = None, background: bool = True, max_queue: int = 64,
                 fsync: str = "close", extra_header: dict[str, Any] | None = None,
                 layer_group: int | None = None, column_order: str = "engine",
                 token_block: int = DEFAULT_TOKEN_BLOCK,
                 one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                 min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES,
                 format_version: int = FORMAT_VERSION, replace: bool = False):
        if not isinstance(schema, RoutingSchema):
            raise ConfigError(f"schema must be a RoutingSchema, got {type(schema).__name__}")
        if dest is not None and not isinstance(dest, (str, os.PathLike)) \
                and not hasattr(dest, "write"):
            raise ConfigError(f"a sidecar destination is a path, an fsspec URL, a writable "
                              f"binary file object or None, not {type(dest).__name__}")
        codec = writer_codec(codec, column_order, format_version)
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        if layer_group is None:
            layer_group = DEFAULT_LAYER_GROUP
        for name, v, lo in (("layer_group", layer_group, 1), ("token_block", token_block, 1),
                            ("one_section_bytes", one_section_bytes, 0),
                            ("min_section_bytes", min_section_bytes, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if token_block > MAX_TOKENS:
            raise ConfigError(f"token_block must be at most {MAX_TOKENS}, got {token_block}")
        layer_group = min(layer_group, schema.num_moe_layers)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            # NOTE: queue.Queue(0) would be unbounded: no back-pressure, unbounded loss
            raise ConfigError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.format_version = format_version
        self.token_block, self.one_section_bytes = token_block, one_section_bytes
        self.min_section_bytes = min_section_bytes
        self._codecs = codec_table(codec)
        try:
            header = encode_header(schema, codec, extra_header, layer_group, column_order,
                                   version=format_version, token_block=token_block,
                                   one_section_bytes=one_section_bytes, codecs=self._codecs,
                                   min_section_bytes=min_section_bytes,
                                   stream_id=secrets.token_hex(8))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"extra_header is not JSON-serialisable: {e}") from None
        if len(header) - 20 > MAX_JSON_BYTES:
            raise ConfigError(f"the stream header's JSON is {len(header) - 20} bytes (schema "
                              f"and extra_header), above the reader's limit of "
                              f"{MAX_JSON_BYTES} bytes")
        self.schema, self.codec, self._fsync = schema, codec, fsync
        self.layer_group, self.column_order = layer_group, column_order
        self._owns_file = True
        self._fsspec_file = None
        self._partial: tuple[str, str] | None = None       # (partial path, dest): replace=True
        self._abandon = False                               # keep the .partial name on close
        if dest is None:
            self._f: BinaryIO = io.BytesIO()
        elif isinstance(dest, (str, os.PathLike)) and "://" not in os.fspath(dest):
            self._f = self._create(os.fspath(dest), replace)
        elif isinstance(dest, (str, os.PathLike)):
            import fsspec  # lazy: only for URLs
            url = os.fspath(dest)
            fs, fs_path = fsspec.core.url_to_fs(url)
            # NOTE: object stores have no exclusive create that fsspec exposes everywhere:
            # the check and the open are two calls (docs/FORMAT.md "Stream lifecycle")
            if not replace and fs.exists(fs_path):
                raise StreamExistsError(f"sidecar destination {url} exists: a writer never "
                                        "overwrites a stream (write a new name, or pass "
                                        "replace=True to replace it on purpose)", path=url)
            target = url
            if replace:
                # NOTE: as for local paths, written beside it and moved over it on close
                # (fs.mv: a copy and a delete on object stores, never a half-written dest)
                target = f"{url}.{secrets.token_hex(6)}.partial"
                self._partial = (target, url)
            self._fsspec_file = fsspec.open(target, "wb")
            self._f = self._fsspec_file.open()
        else:
            self._f, self._owns_file = dest, False
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

    def _create(self, path: str, replace: bool) -> BinaryIO:
        """Open a new local file for the stream: ``path`` itself, created exclusively, or
        (``replace``) a new ``.partial`` sibling that :meth:`close` renames over it."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            # NOTE: a symbolic link too: renamed over, the link would become a file and
            # its target stay as it was (the CLI refuses links for the same reason)
            kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                    "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise StreamExistsError(f"sidecar destination {path} exists and is {kind}: a "
                                    "writer never replaces it, even with replace=True (give "
                                    "a new path)", path=path)
        if replace:
            if st is not None:
                _check_unlocked(path)
            partial = f"{path}.{secrets.token_hex(6)}.partial"
            f = open(partial, "xb")
            self._partial = (partial, path)
            return f
        try:
            f = open(path, "xb")
        except FileExistsError:
            raise StreamExistsError(
                f"sidecar destination {path} exists: a writer never overwrites a stream "
                "(another writer's, or an earlier run's); write a new name, or pass "
                "replace=True to replace it on purpose", path=path) from None
        # NOTE: held for the writer's life (released when its file closes): a writer with
        # replace=True refuses a stream whose writer is still running (attacker review)
        _lock(f)
        return f

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
        # (the version-3 binary meta is smaller than this JSON)
        meta_len = len(json.dumps(record.meta(), separators=(",", ":")).encode())
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
            if self._owns_file and not isinstance(self._f, io.BytesIO):
                self._f.close()
                if self._fsspec_file is not None:
                    self._fsspec_file.close()
        if self._partial is not None and self._error is None and not self._abandon:
            # NOTE: only a closed (indexed) stream replaces the old one, in one rename; after
            # a background error, or an exception in the caller's `with` block, the old
            # stream stays and the new one keeps its .partial name
            partial, path = self._partial
            if self._fsspec_file is not None:
                import fsspec
                fs, src = fsspec.core.url_to_fs(partial)
                fs.mv(src, fsspec.core.url_to_fs(path)[1])
            else:
                # NOTE: checked again: a writer may have opened, or a folder or FIFO been
                # put at, the destination since this writer started
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    st = None
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise StreamExistsError(f"sidecar destination {path} is no longer a "
                                            f"regular file: not replaced; the new stream is "
                                            f"{partial}", path=path)
                if st is not None:
                    _check_unlocked(path, partial)
                try:
                    os.replace(partial, path)
                except OSError as e:
                    raise SidecarError(f"{path}: cannot replace it with {partial}: "
                                       f"{e.strerror or e}") from None
                if self._fsync != "never":
                    _fsync_dir(os.path.dirname(os.path.abspath(path)))
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

    def __exit__(self, exc_type, *exc) -> None:
        # NOTE: a `with` block left by an exception closes the stream (every record written
        # stays readable) but, with replace=True, does not put it in place of the old one
        self._abandon = exc_type is not None
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
                                        self.column_order, token_block=self.token_block,
                                        one_section_bytes=self.one_section_bytes,
                                        min_section_bytes=self.min_section_bytes,
                                        codecs=self._codecs)
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


def _lock(f: BinaryIO) -> None:
    """An advisory exclusive lock (``flock``) on a writer's file, held until it is closed;
    a no-op where the file system refuses locks (some network file systems)."""
    try:
        import fcntl
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        pass


def _check_unlocked(path: str, partial: str | None = None) -> None:
    """Refuse to replace ``path`` while a writer holds its lock (:func:`_lock`): a live
    stream whose later records would go to an unlinked file.

    Raises:
        StreamExistsError: naming the path (and where the new stream stays).
    """
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StreamExistsError(
            f"sidecar destination {path} is a live stream (its writer is still running): "
            "not replaced" + (f"; the new stream is {partial}" if partial else ""),
            path=path) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """fsync a folder (a rename in it durable); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_records(dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema,
                  records: Sequence[RoutingRecord], **kw: Any) -> SidecarWriter:
    """Write ``records`` to ``dest`` and close; returns the (closed) writer."""
    w = SidecarWriter(dest, schema, **kw)
    for r in records:
        w.write(r)
    w.close()
    return w
