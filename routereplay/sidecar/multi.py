"""Several sidecar streams read as one (a folder, a glob, or a list of streams).

RL rollouts write several streams per step (one per API-server process or DP replica, one
per policy version); a trainer reads them as one :class:`routereplay.source.RoutingSource`.
Sample ids must be unique across the streams: an id in two streams is refused, naming both.

NOTE: a long run's streams reach the open-file limit (``ulimit -n``, often 1024): at most
``max_open`` are held open, the least recently used closed first; what a closed stream
holds (header, size, ids) is kept, so a record read reopens only its own stream.
"""
from __future__ import annotations

import collections
import functools
import glob as _glob
import itertools
import os
import stat
import threading
from typing import Any, BinaryIO, Iterator, Sequence, Union

from routereplay.errors import ConfigError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.locking import serialized
from routereplay.sidecar.reader import SidecarReader
from routereplay.sidecar.scan import FrameInfo
from routereplay.source import Rows

Stream = Union[str, os.PathLike, bytes, BinaryIO]
STREAM_SUFFIX = ".rrsc"          # what a folder source lists
MAX_OPEN = 64                    # streams (file descriptors) a multi reader holds open at once


def _default_max_open() -> int:
    """MAX_OPEN, or a quarter of the process's soft open-file limit where that is less (at
    least 1): other files the process opens keep room under ``ulimit -n``."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_OPEN
    return MAX_OPEN if soft == resource.RLIM_INFINITY else max(1, min(MAX_OPEN, soft // 4))


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[") and not os.path.exists(s)


def _local(spec: Any) -> bool:
    return isinstance(spec, (str, os.PathLike)) and "://" not in os.fspath(spec)


def _new_reader(spec: Stream, name: str, floors: bool = True) -> SidecarReader:
    """``SidecarReader(spec, floors=floors)``, with an OS error opening it (no such file, too
    many open files, permission) raised as a SidecarError naming the stream."""
    try:
        return SidecarReader(spec, floors=floors)
    except OSError as e:
        raise SidecarError(f"{name}: cannot open: {e.strerror or e}") from None


class _Stream:
    """One stream of a :class:`MultiSidecarReader` (an item of its ``readers``), with the
    :class:`SidecarReader` API.

    Its reader is opened on demand and held in the multi reader's LRU; while it is closed
    this keeps ``name``, the header fields (:attr:`_FIXED`), its sample ids, ``size``,
    ``complete``, ``torn_tail`` and ``errors``. Any other attribute or method is the open
    reader's (reopened first; a call holds the multi reader's lock, so no other thread
    closes it meanwhile). A path or URL is reopened by name and checked to be the same
    stream (same file and header, not shrunk, unchanged if its writer had closed it), else
    a SidecarError naming it. Bytes and file objects stay open.
    """

    _FIXED = ("header", "schema", "version", "codec", "column_order", "layer_group",
              "token_block")

    def __init__(self, multi: "MultiSidecarReader", spec: Stream, reader: SidecarReader):
        self._multi = multi
        self._spec = spec
        self._reopens = isinstance(spec, (str, os.PathLike))
        self.name = reader.name
        for a in self._FIXED:
            setattr(self, a, getattr(reader, a))
        self._reader: SidecarReader | None = reader
        self._pins = 0                       # records() iterations under way
        self._claimed = -1                   # sample ids registered with the multi reader
        self._ids: list[str] = []
        self._size, self._complete, self._torn = reader.size, reader.complete, reader.torn_tail
        # NOTE: the file itself (device, inode): a copy of the header and the size pasted
        # into another file at the path would pass the other checks
        self._ident = self._file_ident(reader)
        self._errors: list[str] = []         # from the times it was open before

    # -- what is kept while closed
    @property
    def size(self) -> int:
        return self._size if self._reader is None else self._reader.size

    @property
    def complete(self) -> bool:
        return self._complete if self._reader is None else self._reader.complete

    @property
    def torn_tail(self) -> int | None:
        return self._torn if self._reader is None else self._reader.torn_tail

    @property
    def errors(self) -> list[str]:
        if self._reader is None:
            return list(self._errors)
        return list(dict.fromkeys(self._errors + self._reader.errors))

    def sample_ids(self) -> list[str]:
        """:meth:`SidecarReader.sample_ids` while open; the ids last seen while closed."""
        with self._multi._lock:
            if self._reader is not None:
                self._ids = self._reader.sample_ids()
            return list(self._ids)

    def _grown(self) -> bool:
        """A closed live stream may have grown: a local file whose size differs from what
        was read (one stat; a removed one has not), a URL always."""
        if not _local(self._spec):
            return True
        try:
            return os.stat(self._spec).st_size != self._size
        except OSError:
            return False              # NOTE: a read of its records names it

    # -- open / close
    def _file_ident(self, r: SidecarReader) -> tuple[int, ...] | None:
        """A local stream's file: (device, inode), and for a closed (complete) stream also
        its status-change time, which no later write changes (an inode number freed by a
        delete can be reused at once by a new file)."""
        if r._ident is None:
            return None
        if not r.complete:
            return r._ident
        try:
            st = os.fstat(r._f.fileno())
        except (OSError, AttributeError, ValueError):
            return r._ident
        return (*r._ident, st.st_ctime_ns)

    def _same_file(self, now: tuple[int, ...] | None) -> bool:
        was = self._ident
        if was is None or now is None:
            return True
        return now[:2] == was[:2] and (len(now) < 3 or len(was) < 3 or now == was)

    def _attach(self, r: SidecarReader) -> None:
        why = ("it is another file now (replaced or renamed over)"
               if not self._same_file(self._file_ident(r)) else
               "its header changed (another stream at that path, or rewritten)"
               if r.header != self.header else
               f"it shrank from {self._size} to {r.size} bytes" if r.size < self._size else
               f"it changed after its writer closed it ({self._size} -> {r.size} bytes)"
               if self._complete and (r.size != self._size or not r.complete) else None)
        if why:
            raise SidecarError(f"{self.name}: {why} since it was first opened (a multi-stream "
                               "reader closes streams beyond its open-file bound and reopens "
                               "them by name); open the streams again")
        self._reader = r

    def _release(self) -> None:
        """Close the reader, keeping what it found (reopened on demand)."""
        r = self._reader
        if r is None:
            return
        self._errors = self.errors
        self._size, self._complete, self._torn = r.size, r.complete, r.torn_tail
        self._ident = self._file_ident(r)         # NOTE: a live stream may have closed since
        self._reader = None
        r.close()

    def close(self) -> None:
        """Close the stream's file (it is reopened when used again)."""
        with self._multi._lock:
            self._multi._lru.pop(self, None)
            self._release()

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """:meth:`SidecarReader.records`, the stream kept open until the iteration ends."""
        with self._multi._lock:
            r = self._multi._open(self)
            self._pins += 1
        try:
            yield from r.records(strict=strict, **kw)
        finally:
            with self._multi._lock:
                self._pins -= 1

    def __contains__(self, sample_id: object) -> bool:
        with self._multi._lock:
            return sample_id in self._multi._open(self)

    def __len__(self) -> int:
        return len(self.sample_ids())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        multi = self.__dict__["_multi"]
        with multi._lock:
            value = getattr(multi._open(self), name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*a: Any, **k: Any) -> Any:
            with multi._lock:
                return getattr(multi._open(self), name)(*a, **k)
        return call

    def __repr__(self) -> str:
        return f"<sidecar stream {self.name}{'' if self._reader else ' (closed)'}>"


class MultiSidecarReader:
    """Sidecar streams read as one, with the reader's API (``sample_ids``, ``read``,
    ``records``, ``fetch``, ``in``) and usable wherever a :class:`SidecarReader` is (it is a
    :class:`routereplay.source.RoutingSource`).

    Args:
        sources: a folder (every ``*.rrsc`` in it, by name), a glob pattern, or a list of
            streams (paths, fsspec URLs, bytes, file objects; folders and globs in the list
            are expanded). Folders and globs are listed again by :meth:`refresh`, so
            streams that appear later (rotation: one stream per policy version) are picked
            up; an empty file (a writer that has not flushed its header yet) is listed in
            :attr:`pending` and opened once it has bytes.
        max_open: streams held open at once (default: :data:`MAX_OPEN`, or a quarter of
            the soft open-file limit where that is less); the least recently used beyond
            it are closed. Reopening one reads its header and index again (a live one: a
            scan); one removed or replaced while closed is a SidecarError naming it.
        floors: :class:`SidecarReader`'s (False: trusted streams of earlier writers).
        weight_version: read only the streams whose ``header["extra"]["weight_version"]``
            is this (the vLLM plugin writes one stream per version; a sample id may recur
            under another version); the others are listed in :attr:`other_versions`.

    Attributes:
        readers: each stream, in order, with the :class:`SidecarReader` API (opened on
            demand).
        schema: the routing schema every stream shares.
        pending: paths of empty streams not opened yet.
        other_versions: (``weight_version``) the streams of other (or no) weight versions,
            by name, with the version their header names (None: none).

    Raises:
        ConfigError: no stream given (an empty folder, a glob matching nothing), or
            ``max_open`` under 1.
        SchemaError: a stream whose schema differs from the first's (names the stream).
        SidecarError: a stream that cannot be opened or read, an OS error included (names
            it), or a sample id present in two streams (names both).
    """

    def __init__(self, sources: Stream | Sequence[Stream], *, max_open: int | None = None,
                 floors: bool = True, weight_version: str | None = None):
        self._lock = threading.RLock()
        self._floors = floors
        if weight_version is not None and not isinstance(weight_version, str):
            raise ConfigError(f"weight_version is a str, not {type(weight_version).__name__}")
        self._version = weight_version
        self.other_versions: list[tuple[str, str | None]] = []
        if isinstance(sources, (str, os.PathLike, bytes, bytearray, memoryview)) \
                or hasattr(sources, "read"):
            sources = [sources]                                       # type: ignore[list-item]
        if not isinstance(sources, (list, tuple)):
            raise ConfigError(f"sidecar streams are a path, folder, glob, bytes, file object or "
                              f"a list of them, not {type(sources).__name__}")
        if max_open is None:
            max_open = _default_max_open()
        if isinstance(max_open, bool) or not isinstance(max_open, int) or max_open < 1:
            raise ConfigError(f"max_open is a count of streams (1 or more), not {max_open!r}")
        self._specs = list(sources)
        self._max_open = max_open
        self.readers: list[_Stream] = []
        self.pending: list[str] = []
        self._opened: set[str] = set()
        self._owner: dict[str, _Stream] = {}
        self._lru: collections.OrderedDict[_Stream, None] = collections.OrderedDict()
        self._closed = False
        self.schema: RoutingSchema | None = None                      # type: ignore[assignment]
        try:
            self._open_new()
            if not self.readers:
                raise ConfigError("no sidecar streams in " + ", ".join(
                    str(s) if isinstance(s, (str, os.PathLike)) else type(s).__name__
                    for s in self._specs) + (f" ({len(self.pending)} empty)" if self.pending
                                             else "") + (
                    f" of weight version {self._version!r} ({len(self.other_versions)} of "
                    f"others: {sorted({str(v) for _, v in self.other_versions})[:8]})"
                    if self._version is not None else ""))
        except Exception:
            self.close()
            raise

    # -- streams
    def _expand(self) -> list[Stream]:
        out: list[Stream] = []
        for spec in self._specs:
            if _local(spec):
                path = os.fspath(spec)
                if os.path.isdir(path):
                    try:
                        names = os.listdir(path)
                    except OSError as e:
                        raise SidecarError(f"{path}: cannot list: {e.strerror or e}") from None
                    out += sorted(os.path.join(path, n) for n in names
                                  if n.endswith(STREAM_SUFFIX))
                    continue
                if _is_glob(path):
                    out += sorted(_glob.glob(path))
                    continue
            elif not isinstance(spec, (str, os.PathLike, bytes, bytearray, memoryview)) \
                    and not hasattr(spec, "read"):
                raise ConfigError(f"not a sidecar stream: {type(spec).__name__}")
            out.append(spec)
        return out

    def _open_new(self) -> None:
        for spec in self._expand():
            key = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else f"<{id(spec)}>"
            if key in self._opened:
                continue
            if _local(spec):
                try:
                    st = os.stat(key)
                except OSError:
                    st = None                     # NOTE: the reader names it
                if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    if key not in self.pending:
                        self.pending.append(key)
                    continue
            r = _new_reader(spec, key if isinstance(spec, (str, os.PathLike))
                            else type(spec).__name__, self._floors)
            if self._version is not None:
                extra = r.header.get("extra")
                found = extra.get("weight_version") if isinstance(extra, dict) else None
                if found != self._version:
                    r.close()
                    self._opened.add(key)
                    self.other_versions.append((r.name, found))
                    continue
            s = _Stream(self, spec, r)
            try:
                if self.schema is None:
                    self.schema = r.schema
                elif r.schema != self.schema:
                    self.schema.check_same(r.schema, what=f"sidecar {r.name}")
                self._claim(s)
            except Exception:
                r.close()
                raise
            self._opened.add(key)
            if key in self.pending:
                self.pending.remove(key)
            self.readers.append(s)
            self._keep_open(s)

    def _open(self, s: _Stream) -> SidecarReader:
        """The open reader of ``s`` (reopened and checked when closed), now the most
        recently used; streams beyond ``max_open`` are closed."""
        if s._reader is None:
            if self._closed:
                raise SidecarError(f"{s.name}: the multi-stream reader was closed")
            r = _new_reader(s._spec, s.name, self._floors)
            try:
                s._attach(r)
            except Exception:
                r.close()
                raise
        self._keep_open(s)
        return s._reader                                              # type: ignore[return-value]

    def _keep_open(self, s: _Stream) -> None:
        if not s._reopens:
            return                    # NOTE: bytes and file objects: nothing to reopen from
        self._lru[s] = None
        self._lru.move_to_end(s)
        over = len(self._lru) - self._max_open
        if over > 0:
            # NOTE: a stream iterated by records() is not closed under its iterator
            for old in list(itertools.islice(
                    (o for o in self._lru if o._pins == 0 and o is not s), over)):
                del self._lru[old]
                old._release()

    def _claim(self, s: _Stream) -> None:
        """Register ``s``'s sample ids, refusing one that another stream holds.

        NOTE: all or none: a refused stream registers no id (a reopen would read it)."""
        ids = s.sample_ids()
        if s._claimed == len(ids):
            return
        for sid in ids:
            other = self._owner.get(sid)
            if other is not None and other is not s:
                raise SidecarError(f"sample {sid!r} is in two streams: {other.name} and "
                                   f"{s.name} (sample ids must be unique across the streams "
                                   "read as one)", sample_id=sid)
        for sid in ids:
            self._owner.setdefault(sid, s)
        s._claimed = len(ids)

    @serialized
    def refresh(self) -> bool:
        """Pick up records appended to live streams (each scanned incrementally; a closed
        one is reopened only when its size changed) and streams that appeared in a folder
        or glob. Returns True when anything was added.

        Raises:
            SidecarError: a stream replaced or truncated under a reader, or a sample id that
                is now in two streams (names both).
        """
        before = (len(self.readers), len(self._owner))
        for s in self.readers:
            if not s.complete and (s._reader is not None or s._grown()):
                self._open(s).refresh()
                self._claim(s)
        self._open_new()
        return (len(self.readers), len(self._owner)) != before

    @serialized
    def stream_of(self, sample_id: str) -> str:
        """The name (path or URL) of the stream holding ``sample_id``.

        Raises:
            UnknownSampleError: no stream holds it.
        """
        return self._reader(sample_id).name

    def _reader(self, sample_id: str) -> _Stream:
        s = self._owner.get(sample_id)
        if s is None:
            self.refresh()
            s = self._owner.get(sample_id)
        if s is None:
            for rd in self.readers:           # corrupt or listed-but-missing: its own error
                if rd.errors and sample_id in rd:
                    return rd
            raise UnknownSampleError(f"sample {sample_id!r} is in none of the "
                                     f"{len(self.readers)} sidecar streams", sample_id)
        return s

    # -- the reader's API
    @serialized
    def sample_ids(self) -> list[str]:
        """Sample ids of every stream, stream by stream in order."""
        for s in self.readers:
            if not s.complete:
                self.refresh()
                break
        return [sid for s in self.readers for sid in s.sample_ids()]

    @serialized
    def __len__(self) -> int:
        return len(self.sample_ids())

    @serialized
    def __contains__(self, sample_id: object) -> bool:
        try:
            self._reader(sample_id)           # type: ignore[arg-type]
        except UnknownSampleError:
            return False
        return True

    @serialized
    def read(self, sample_id: str, **kw: Any) -> RoutingRecord:
        """:meth:`SidecarReader.read` on the stream holding ``sample_id``."""
        return self._open(self._reader(sample_id)).read(sample_id, **kw)

    @serialized
    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """:meth:`routereplay.source.RoutingSource.fetch` on the stream holding the sample."""
        return self._open(self._reader(sample_id)).fetch(sample_id, moe_layers, runs)

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """Every record of every stream, in order (see :meth:`SidecarReader.records`)."""
        for s in self.readers:
            yield from s.records(strict=strict, **kw)

    @serialized
    def scan(self) -> list[tuple[_Stream, FrameInfo]]:
        """(stream, frame) for every record frame of every stream (see
        :meth:`SidecarReader.scan`)."""
        return [(s, fi) for s in self.readers for fi in s.scan()]

    @serialized
    def check(self, *, torn_ok: bool = True) -> None:
        """:meth:`SidecarReader.check` on every stream; an empty stream still pending is a
        problem unless ``torn_ok``."""
        for s in self.readers:
            s.check(torn_ok=torn_ok)
        if self.pending and not torn_ok:
            raise SidecarError(f"{self.pending[0]}: empty stream (its writer has not written "
                               "its header yet)")

    @property
    def errors(self) -> list[str]:
        """Every stream's errors, each prefixed with the stream's name."""
        return [f"{s.name}: {e}" for s in self.readers for e in s.errors]

    @property
    def complete(self) -> bool:
        """Every stream is complete (closed by its writer) and none is pending."""
        return not self.pending and all(s.complete for s in self.readers)

    @property
    def size(self) -> int:
        """Bytes of all streams."""
        return sum(s.size for s in self.readers)

    @serialized
    def close(self) -> None:
        """Close every stream (a closed multi reader reads nothing more)."""
        self._closed = True
        self._lru.clear()
        for s in self.readers:
            s._release()

    def __enter__(self) -> "MultiSidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sidecar(spec: Stream | Sequence[Stream], *, floors: bool = True,
                 weight_version: str | None = None, max_open: int | None = None
                 ) -> SidecarReader | MultiSidecarReader:
    """A reader for ``spec``: a :class:`SidecarReader` for one stream (a file, URL, bytes
    or file object), a :class:`MultiSidecarReader` for a folder, a glob or a list of more
    than one stream. ``floors``: :class:`SidecarReader`'s; ``weight_version`` and
    ``max_open``: :class:`MultiSidecarReader`'s (a ``weight_version`` always gives one).

    Raises:
        SidecarError: an OS error opening a stream (names it); see :class:`SidecarReader`
            and :class:`MultiSidecarReader`.
    """
    if isinstance(spec, (list, tuple)) and len(spec) == 1 and not (
            _local(spec[0]) and (os.path.isdir(spec[0]) or _is_glob(os.fspath(spec[0])))):
        spec = spec[0]
    if isinstance(spec, (list, tuple)) or weight_version is not None or _local(spec) and (
            os.path.isdir(spec) or _is_glob(os.fspath(spec))):          # type: ignore[arg-type]
        return MultiSidecarReader(spec, floors=floors, weight_version=weight_version,
                                  max_open=max_open)
    if isinstance(spec, (str, os.PathLike)):
        return _new_reader(spec, os.fspath(spec), floors)
    return SidecarReader(spec, floors=floors)                         # type: ignore[arg-type]


__all__ = ["MultiSidecarReader", "open_sidecar", "STREAM_SUFFIX", "MAX_OPEN"]
