"""Sidecar streams: an append-only, framed, checksummed file of routing records.

The byte layout is specified in docs/FORMAT.md; the modules follow its headings:

- :mod:`~routereplay.sidecar.layout`: header, frames, index and trailer ("Overall layout",
  "Header", "Frame", "Index payload (kind 2) and trailer");
- :mod:`~routereplay.sidecar.record_meta`, :mod:`~routereplay.sidecar.limits`,
  :mod:`~routereplay.sidecar.payload`: record payloads ("Record payload (kind 1)"): the
  meta, grid and head; the reader limits; sections; version 2 (read only) in
  :mod:`~routereplay.sidecar.legacy`;
- :mod:`~routereplay.sidecar.writer`: :class:`SidecarWriter` (background thread, bounded
  queue, local files, fsspec URLs, file objects, in-memory bytes);
- :mod:`~routereplay.sidecar.reader`: :class:`SidecarReader` (opening, header, index; a
  RoutingSource), with :mod:`~routereplay.sidecar.scan` (scan, torn-tail recovery, index
  check), :mod:`~routereplay.sidecar.record_reads` (ranged reads of only the sections asked
  for) and :mod:`~routereplay.sidecar.follow` (live streams);
- :mod:`~routereplay.sidecar.multi`: :class:`MultiSidecarReader` (a folder, glob or list
  of streams read as one) and :func:`open_sidecar`.

Metadata is binary (version 3: varints and length-prefixed strings) or JSON (header,
version 2), validated on read. Nothing read from a stream is ever unpickled or evaluated.
"""
from routereplay.sidecar.layout import (COLUMN_ORDERS, DEFAULT_LAYER_GROUP,
                                        DEFAULT_ONE_SECTION_BYTES, DEFAULT_TOKEN_BLOCK,
                                        FORMAT_VERSION, FRAME_HEADER_SIZE, FRAME_MAGIC, KIND_INDEX,
                                        KIND_MODEL, KIND_RECORD, MAGIC, MAX_FRAME_BYTES,
                                        MAX_JSON_BYTES, MAX_TOKENS, READABLE_VERSIONS,
                                        TRAILER_MAGIC, WRITABLE_VERSIONS, crc32, encode_frame,
                                        encode_header)
from routereplay.sidecar.payload import encode_record_payload
from routereplay.sidecar.record_meta import RecordMeta, Section
from routereplay.sidecar.multi import MultiSidecarReader, open_sidecar
from routereplay.sidecar.reader import FrameInfo, RecordBytes, SidecarReader
from routereplay.sidecar.writer import SidecarWriter, write_records, writer_codec

_crc = crc32          # NOTE: pre-0.2 private name, still used by external test helpers

__all__ = ["SidecarWriter", "SidecarReader", "MultiSidecarReader", "open_sidecar", "FrameInfo",
           "RecordBytes", "RecordMeta", "Section", "write_records", "writer_codec",
           "encode_header", "encode_frame", "encode_record_payload", "crc32", "MAGIC",
           "FORMAT_VERSION", "READABLE_VERSIONS", "COLUMN_ORDERS", "FRAME_MAGIC", "TRAILER_MAGIC",
           "KIND_RECORD", "KIND_INDEX", "KIND_MODEL", "FRAME_HEADER_SIZE", "MAX_JSON_BYTES",
           "MAX_FRAME_BYTES", "DEFAULT_LAYER_GROUP", "DEFAULT_TOKEN_BLOCK",
           "DEFAULT_ONE_SECTION_BYTES", "WRITABLE_VERSIONS", "MAX_TOKENS"]
