"""The stream's byte layout: header, frames, index and trailer (docs/FORMAT.md "Overall
layout", "Header", "Frame", "Index payload (kind 2) and trailer").

    stream  = header frame* [index_frame trailer]
    header  = magic(8) version(u16) flags(u16) json_len(u32) json crc32(json)(u32)
    frame   = b"RRFM" kind(u8) 0(3) payload_len(u64) crc32(payload)(u32) crc32(hdr[0:20])(u32) payload
    trailer = index_offset(u64) b"RRSCEND\\0"

Every multi-byte integer is little-endian; CRC-32 is zlib's. This module only turns bytes
into validated numbers and back; it reads no file (see routereplay.sidecar.reader).
"""
from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

from routereplay.errors import SidecarError
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
HEADER_FIXED_SIZE = _HEADER_FIXED.size         # 16 bytes
_FRAME_HDR = struct.Struct("<4sB3xQI")         # magic, kind, payload_len, payload crc32
FRAME_HEADER_SIZE = _FRAME_HDR.size + 4        # + crc32 of the 20 bytes above = 24
_TRAILER = struct.Struct("<Q8s")
TRAILER_SIZE = _TRAILER.size                   # 16 bytes
# NOTE: reader limits (docs/FORMAT.md "Reader limits"); writers refuse what readers refuse.
MAX_JSON_BYTES = 1 << 20                       # header / meta JSON bound (bytes)
MAX_FRAME_BYTES = 1 << 32                      # payload bound (bytes), 4 GiB
DEFAULT_LAYER_GROUP = 4                        # MoE layers per routing section (partial-read unit)
MAX_TOKENS = 1 << 24                           # routing rows, and start + rows, per record


def crc32(b: bytes | memoryview) -> int:
    """CRC-32 (ISO-HDLC, zlib) of ``b`` as an unsigned 32-bit int."""
    return zlib.crc32(b) & 0xFFFFFFFF


# --------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class Header:
    """What a stream header says (FORMAT.md "Header").

    Attributes:
        version: format version (1 or 2).
        schema: the routing schema of every record.
        codec: the writer's default routing codec (each section names its own).
        column_order: "engine" or "sorted".
        layer_group: MoE layers per routing section the writer used (informational).
        meta: the whole header JSON object.
        size: header bytes (16 + J + 4): the offset of the first frame.
    """

    version: int
    schema: RoutingSchema
    codec: str
    column_order: str
    layer_group: Any
    meta: dict[str, Any]
    size: int


def encode_header(schema: RoutingSchema, codec: str = "ctx-zstd", extra: dict[str, Any] | None = None,
                  layer_group: int = DEFAULT_LAYER_GROUP, column_order: str = "engine") -> bytes:
    """Stream header bytes for ``schema`` (FORMAT.md "Header")."""
    meta = {"schema": schema.to_dict(), "codec": codec, "column_order": column_order,
            "layer_group": layer_group}
    if extra:
        meta["extra"] = extra
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return _HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(js)) + js + struct.pack("<I", crc32(js))


def header_json_length(fixed: bytes, stream_size: int) -> tuple[int, int]:
    """(version, J) from the first 16 bytes of a stream.

    Raises:
        SidecarError: wrong magic, unsupported version, or J larger than the stream
            (or than 64 MiB).
    """
    if len(fixed) < HEADER_FIXED_SIZE or fixed[:8] != MAGIC:
        raise SidecarError("not a routereplay sidecar (wrong magic)", offset=0)
    _, version, _flags, jlen = _HEADER_FIXED.unpack(fixed[:HEADER_FIXED_SIZE])
    if version not in READABLE_VERSIONS:
        raise SidecarError(f"unsupported sidecar format version {version} "
                           f"(this reader supports {READABLE_VERSIONS})", offset=0)
    if jlen > min(MAX_JSON_BYTES, stream_size):
        raise SidecarError(f"header JSON length {jlen} exceeds the stream ({stream_size} bytes) "
                           f"or the reader's limit of {MAX_JSON_BYTES} bytes", offset=0)
    return version, jlen


def decode_header(version: int, js: bytes, crc: bytes) -> Header:
    """Validate the header JSON ``js`` and its CRC bytes (after :func:`header_json_length`).

    Raises:
        SidecarError: truncated header, CRC mismatch, invalid JSON or schema.
    """
    if len(crc) != 4 or struct.unpack("<I", crc)[0] != crc32(js):
        raise SidecarError("sidecar header is truncated or its checksum does not match",
                           offset=0)
    try:
        meta = json.loads(js)
        schema = RoutingSchema.from_dict(meta["schema"])
        codec = str(meta["codec"])
        column_order = meta.get("column_order", "engine")
        if column_order not in COLUMN_ORDERS:
            raise ValueError(f"column_order {column_order!r}")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SidecarError(f"invalid sidecar header: {e!r}"[:500], offset=0) from None
    return Header(version=version, schema=schema, codec=codec, column_order=column_order,
                  layer_group=meta.get("layer_group"), meta=meta,
                  size=HEADER_FIXED_SIZE + len(js) + 4)


# --------------------------------------------------------------------------- frames


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    """The 24-byte header of a frame at ``offset`` (FORMAT.md "Frame").

    Attributes:
        offset: byte offset of the frame in the stream.
        kind: 1 = record, 2 = index (others are skipped by readers).
        payload_len: P, payload bytes.
        payload_crc: CRC-32 of the payload.
    """

    offset: int
    kind: int
    payload_len: int
    payload_crc: int

    @property
    def end(self) -> int:
        """Offset just past the payload."""
        return self.offset + FRAME_HEADER_SIZE + self.payload_len


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One frame: 24-byte frame header + payload (FORMAT.md "Frame")."""
    hdr = _FRAME_HDR.pack(FRAME_MAGIC, kind, len(payload), crc32(payload))
    return hdr + struct.pack("<I", crc32(hdr)) + payload


def parse_frame_header(hdr: bytes, offset: int, stream_size: int) -> FrameHeader:
    """The one parser of frame headers (reads, scans and resynchronisation all use it).

    Raises:
        SidecarError: fewer than 24 bytes (``torn=True``), a wrong magic or header CRC
            (``torn=False``: the length cannot be trusted), or a payload running past the
            end of the stream or above 4 GiB (``torn=True``). ``offset`` names the frame.
    """
    if len(hdr) < FRAME_HEADER_SIZE:
        raise _torn(f"torn frame header at offset {offset}", offset)
    magic, kind, plen, pcrc = _FRAME_HDR.unpack(hdr[:20])
    if magic != FRAME_MAGIC or struct.unpack("<I", hdr[20:24])[0] != crc32(hdr[:20]):
        raise SidecarError(f"corrupt frame header at offset {offset}", offset=offset)
    if plen > MAX_FRAME_BYTES or offset + FRAME_HEADER_SIZE + plen > stream_size:
        raise _torn(f"torn frame at offset {offset}: payload of {plen} bytes runs past the "
                    f"end of the stream ({stream_size} bytes)", offset)
    return FrameHeader(offset=offset, kind=kind, payload_len=plen, payload_crc=pcrc)


def frame_header_valid(hdr: bytes) -> bool:
    """True when ``hdr`` (24 bytes) starts with the frame magic and its own CRC matches
    (the resynchronisation test of FORMAT.md)."""
    return (len(hdr) >= FRAME_HEADER_SIZE and hdr[:4] == FRAME_MAGIC
            and struct.unpack("<I", hdr[20:24])[0] == crc32(hdr[:20]))


def _torn(msg: str, offset: int) -> SidecarError:
    return SidecarError(msg, offset=offset, torn=True)


# --------------------------------------------------------------------------- index, trailer


def encode_index(entries: list[tuple[str, int]]) -> bytes:
    """Index payload: ``{"records": [[sample_id, frame_offset], ...]}``."""
    return json.dumps({"records": [[s, o] for s, o in entries]}, separators=(",", ":")).encode()


def decode_index(payload: bytes, data_start: int, index_offset: int) -> list[tuple[str, int]] | None:
    """Entries of an index payload, or None when it is not a valid index (then readers
    scan instead). Every offset must lie in the frame area ``[data_start, index_offset)``."""
    try:
        entries = json.loads(payload)["records"]
        out = []
        for sid, o in entries:
            if not isinstance(sid, str) or isinstance(o, bool) or not isinstance(o, int) \
                    or not (data_start <= o < index_offset):
                return None
            out.append((sid, o))
        return out
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def encode_trailer(index_offset: int) -> bytes:
    """The 16-byte trailer naming the index frame's offset."""
    return _TRAILER.pack(index_offset, TRAILER_MAGIC)


def parse_trailer(tail: bytes) -> int | None:
    """Index offset named by the last 16 bytes of a stream, or None (no trailer)."""
    if len(tail) != TRAILER_SIZE:
        return None
    off, magic = _TRAILER.unpack(tail)
    return off if magic == TRAILER_MAGIC else None
