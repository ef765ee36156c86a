"""Several sidecar streams read as one (a folder, a glob, or a list of streams).

RL rollouts write several streams per step (one per API-server process or DP replica, one
per policy version); a trainer reads them as one :class:`routereplay.source.RoutingSource`.
Sample ids must be unique across the streams: an id in two streams is refused, naming
both, never resolved by picking one.
"""
from __future__ import annotations

import glob as _glob
import os
import threading
from typing import Any, BinaryIO, Iterator, Sequence, Union

from routereplay.errors import ConfigError, SidecarError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.reader import FrameInfo, SidecarReader, _serialized
from routereplay.source import Rows

Stream = Union[str, os.PathLike, bytes, BinaryIO]
STREAM_SUFFIX = ".rrsc"          # what a folder source lists


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[") and not os.path.exists(s)


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

    Attributes:
        readers: the open :class:`SidecarReader` of each stream, in order.
        schema: the routing schema every stream shares.
        pending: paths of empty streams not opened yet.

    Raises:
        ConfigError: no stream given (an empty folder, a glob matching nothing).
        SchemaError: a stream whose schema differs from the first's (names the stream).
        SidecarError: a stream that cannot be read (names it), or a sample id present in two
            streams (names both).
    """

    def __init__(self, sources: Stream | Sequence[Stream]):
        self._lock = threading.RLock()
        if isinstance(sources, (str, os.PathLike, bytes, bytearray, memoryview)) \
                or hasattr(sources, "read"):
            sources = [sources]                                       # type: ignore[list-item]
        if not isinstance(sources, (list, tuple)):
            raise ConfigError(f"sidecar streams are a path, folder, glob, bytes, file object or "
                              f"a list of them, not {type(sources).__name__}")
        self._specs = list(sources)
        self.readers: list[SidecarReader] = []
        self.pending: list[str] = []
        self._opened: set[str] = set()
        self._owner: dict[str, SidecarReader] = {}
        self._claimed: dict[int, int] = {}             # id(reader) -> sample ids claimed
        self.schema: RoutingSchema | None = None                      # type: ignore[assignment]
        try:
            self._open_new()
            if not self.readers:
                raise ConfigError("no sidecar streams in " + ", ".join(
                    str(s) if isinstance(s, (str, os.PathLike)) else type(s).__name__
                    for s in self._specs) + (f" ({len(self.pending)} empty)" if self.pending
                                             else ""))
        except Exception:
            self.close()
            raise

    # -- streams
    def _expand(self) -> list[Stream]:
        out: list[Stream] = []
        for spec in self._specs:
            if isinstance(spec, (str, os.PathLike)) and "://" not in os.fspath(spec):
                path = os.fspath(spec)
                if os.path.isdir(path):
                    out += sorted(os.path.join(path, n) for n in os.listdir(path)
                                  if n.endswith(STREAM_SUFFIX))
                    continue
                if _is_glob(path):
                    out += sorted(_glob.glob(path))
                    continue
            elif not isinstance(spec, (bytes, bytearray, memoryview)) \
                    and not hasattr(spec, "read"):
                raise ConfigError(f"not a sidecar stream: {type(spec).__name__}")
            out.append(spec)
        return out

    def _open_new(self) -> None:
        for spec in self._expand():
            key = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else f"<{id(spec)}>"
            if key in self._opened:
                continue
            if isinstance(spec, (str, os.PathLike)) and "://" not in key \
                    and os.path.isfile(key) and os.path.getsize(key) == 0:
                if key not in self.pending:
                    self.pending.append(key)
                continue
            r = SidecarReader(spec)
            self._opened.add(key)
            if key in self.pending:
                self.pending.remove(key)
            try:
                if self.schema is None:
                    self.schema = r.schema
                elif r.schema != self.schema:
                    self.schema.check_same(r.schema, what=f"sidecar {r.name}")
                self._claim(r)
            except Exception:
                r.close()
                raise
            self.readers.append(r)

    def _claim(self, r: SidecarReader) -> None:
        """Register ``r``'s sample ids, refusing one that another stream holds."""
        ids = r.sample_ids()
        if self._claimed.get(id(r)) == len(ids):
            return
        self._claimed[id(r)] = len(ids)
        for sid in ids:
            other = self._owner.get(sid)
            if other is None:
                self._owner[sid] = r
            elif other is not r:
                raise SidecarError(f"sample {sid!r} is in two streams: {other.name} and "
                                   f"{r.name} (sample ids must be unique across the streams "
                                   "read as one)", sample_id=sid)

    @_serialized
    def refresh(self) -> bool:
        """Pick up records appended to live streams (each scanned incrementally) and
        streams that appeared in a folder or glob. Returns True when anything was added.

        Raises:
            SidecarError: a stream replaced or truncated under a reader, or a sample id that
                is now in two streams (names both).
        """
        before = (len(self.readers), len(self._owner))
        for r in self.readers:
            if not r.complete:
                r.refresh()
                self._claim(r)
        self._open_new()
        return (len(self.readers), len(self._owner)) != before

    @_serialized
    def stream_of(self, sample_id: str) -> str:
        """The name (path or URL) of the stream holding ``sample_id``.

        Raises:
            UnknownSampleError: no stream holds it.
        """
        return self._reader(sample_id).name

    def _reader(self, sample_id: str) -> SidecarReader:
        r = self._owner.get(sample_id)
        if r is None:
            self.refresh()
            r = self._owner.get(sample_id)
        if r is None:
            for rd in self.readers:           # corrupt or listed-but-missing: its own error
                if sample_id in rd:
                    return rd
            raise UnknownSampleError(f"sample {sample_id!r} is in none of the "
                                     f"{len(self.readers)} sidecar streams", sample_id)
        return r

    # -- the reader's API
    @_serialized
    def sample_ids(self) -> list[str]:
        """Sample ids of every stream, stream by stream in order."""
        for r in self.readers:
            if not r.complete:
                self.refresh()
                break
        return [sid for r in self.readers for sid in r.sample_ids()]

    @_serialized
    def __len__(self) -> int:
        return len(self.sample_ids())

    @_serialized
    def __contains__(self, sample_id: object) -> bool:
        try:
            self._reader(sample_id)           # type: ignore[arg-type]
        except UnknownSampleError:
            return False
        return True

    @_serialized
    def read(self, sample_id: str, **kw: Any) -> RoutingRecord:
        """:meth:`SidecarReader.read` on the stream holding ``sample_id``."""
        return self._reader(sample_id).read(sample_id, **kw)

    @_serialized
    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """:meth:`routereplay.source.RoutingSource.fetch` on the stream holding the sample."""
        return self._reader(sample_id).fetch(sample_id, moe_layers, runs)

    def records(self, *, strict: bool = True, **kw: Any) -> Iterator[RoutingRecord]:
        """Every record of every stream, in order (see :meth:`SidecarReader.records`)."""
        for r in self.readers:
            yield from r.records(strict=strict, **kw)

    @_serialized
    def scan(self) -> list[tuple[SidecarReader, FrameInfo]]:
        """(stream, frame) for every record frame of every stream (see
        :meth:`SidecarReader.scan`)."""
        return [(r, fi) for r in self.readers for fi in r.scan()]

    @_serialized
    def check(self, *, torn_ok: bool = True) -> None:
        """:meth:`SidecarReader.check` on every stream; an empty stream still pending is a
        problem unless ``torn_ok``."""
        for r in self.readers:
            r.check(torn_ok=torn_ok)
        if self.pending and not torn_ok:
            raise SidecarError(f"{self.pending[0]}: empty stream (its writer has not written "
                               "its header yet)")

    @property
    def errors(self) -> list[str]:
        """Every stream's errors, each prefixed with the stream's name."""
        return [f"{r.name}: {e}" for r in self.readers for e in r.errors]

    @property
    def complete(self) -> bool:
        """Every stream is complete (closed by its writer) and none is pending."""
        return not self.pending and all(r.complete for r in self.readers)

    @property
    def size(self) -> int:
        """Bytes of all streams."""
        return sum(r.size for r in self.readers)

    @_serialized
    def xl_ans_model(self) -> Any:
        """The ``xl-ans`` model of the last stream that has one (its last model frame; see
        :meth:`SidecarReader.xl_ans_model`), to seed a later stream; None where none has.

        Raises:
            SidecarError: that model frame is corrupt."""
        for r in reversed(self.readers):
            m = r.xl_ans_model()
            if m is not None:
                return m
        return None

    def xl_ans_counts(self) -> Any:
        """An ``xl-ans`` model counted from every record of every stream
        (:meth:`SidecarReader.xl_ans_counts`, summed), to seed a later stream's writer.

        Raises:
            SidecarError: a record that does not read (named);
            RecordError (a ValueError): a schema xl-ans cannot model (E outside 2-64)."""
        total = None
        for r in self.readers:
            m = r.xl_ans_counts()
            if total is None:
                total = m
            else:
                for name in ("flags", "pop", "pair", "joint"):
                    getattr(total, name)[...] += getattr(m, name)
        return total

    @_serialized
    def close(self) -> None:
        """Close every stream."""
        for r in self.readers:
            r.close()

    def __enter__(self) -> "MultiSidecarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sidecar(spec: Stream | Sequence[Stream]) -> SidecarReader | MultiSidecarReader:
    """A reader for ``spec``: a :class:`SidecarReader` for one stream (a file, URL, bytes
    or file object), a :class:`MultiSidecarReader` for a folder, a glob or a list of more
    than one stream.

    Raises:
        see :class:`SidecarReader` and :class:`MultiSidecarReader`.
    """
    if isinstance(spec, (list, tuple)):
        return SidecarReader(spec[0]) if len(spec) == 1 and not (
            isinstance(spec[0], (str, os.PathLike)) and (os.path.isdir(spec[0])
                                                         or _is_glob(os.fspath(spec[0])))
        ) else MultiSidecarReader(spec)
    if isinstance(spec, (str, os.PathLike)) and "://" not in os.fspath(spec) and (
            os.path.isdir(spec) or _is_glob(os.fspath(spec))):
        return MultiSidecarReader(spec)
    return SidecarReader(spec)                                        # type: ignore[arg-type]


__all__ = ["MultiSidecarReader", "open_sidecar", "STREAM_SUFFIX"]
