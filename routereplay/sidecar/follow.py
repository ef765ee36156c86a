"""Following a live sidecar stream: picking up what its writer appends, and refusing a
stream replaced, shrunk or rewritten under the reader."""
from __future__ import annotations

import os

from routereplay.errors import SidecarError
from routereplay.sidecar.locking import serialized


class LiveFollow:
    """:class:`~routereplay.sidecar.reader.SidecarReader`'s following of a live stream (a
    mixin: it uses the reader's file, header bytes and scan)."""

    def _current_size(self) -> int:
        if self._path is not None:
            return os.fstat(self._f.fileno()).st_size
        self._f.seek(0, os.SEEK_END)
        return self._f.tell()

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

    @serialized
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

