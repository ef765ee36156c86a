"""The stream's byte layout: header, frames, index and trailer (docs/FORMAT.md "Overall
layout", "Header", "Frame", "Index payload (kind 2) and trailer").

    stream  = header frame* [index_frame trailer]
    header  = magic(8) version(u16) flags(u16) json_len(u32) json crc32(json)(u32)
    frame   = b"RRFM" kind(u8) 0(3) payload_len(u64) crc(u32) crc32(hdr[0:20])(u32) payload
    trailer = index_offset(u64) b"RRSCEND\\0"

``crc`` is the CRC-32 of the whole payload, except in a version-3 record frame, where it
covers the record's head only (its sections carry their own CRCs: a reader checks exactly
the bytes it reads). The version-3 index is binary (varints), version 2's JSON (read only).
Frame kinds: 1 record, 2 index, 3 an ``xl-ans`` model of routereplay 0.2 (recognised by
scans, checksum checked, never parsed).

Every multi-byte integer is little-endian; CRC-32 is zlib's. This module only turns bytes
into validated numbers and back; it reads no file (see routereplay.sidecar.reader).
"""
from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

from routereplay.codec import DEFAULT_CODEC, removed_codec_error
from routereplay.errors import ConfigError, SidecarError
from routereplay.schema import RoutingSchema
from routereplay.varint import VarintError, read_varint, varint  # noqa: F401 - re-exported

MAGIC = b"\x89RRSC\r\n\x1a"
FORMAT_VERSION = 3                             # what writers write
READABLE_VERSIONS = (2, 3)                     # v2 (JSON meta) read only: sidecar.legacy
WRITABLE_VERSIONS = (3,)
COLUMN_ORDERS = ("engine", "sorted")
FRAME_MAGIC = b"RRFM"
TRAILER_MAGIC = b"RRSCEND\x00"
KIND_RECORD = 1
KIND_INDEX = 2
KIND_MODEL = 3              # a 0.2 xl-ans model: scanned and checked, never parsed
_HEADER_FIXED = struct.Struct("<8sHHI")        # magic, version, flags, json_len
HEADER_FIXED_SIZE = _HEADER_FIXED.size         # 16 bytes
_FRAME_HDR = struct.Struct("<4sB3xQI")         # magic, kind, payload_len, crc32
FRAME_HEADER_SIZE = _FRAME_HDR.size + 4        # + crc32 of the 20 bytes above = 24
_TRAILER = struct.Struct("<Q8s")
TRAILER_SIZE = _TRAILER.size                   # 16 bytes
# NOTE: reader limits (docs/FORMAT.md "Reader limits"); writers refuse what readers refuse.
MAX_JSON_BYTES = 1 << 20                       # header JSON / record meta bound (bytes)
MAX_FRAME_BYTES = 1 << 32                      # payload bound (bytes), 4 GiB
MAX_TOKENS = 1 << 24                           # routing rows, and start + rows, per record
# Writer defaults of the version-3 section grid (docs/FORMAT.md "Choosing the geometry",
# measured with benchmarks/scale.py on a DeepSeek-V3-shaped step).
DEFAULT_TOKEN_BLOCK = 512                      # rows per routing section (B)
DEFAULT_LAYER_GROUP = 1                        # MoE layers per routing section (G)
DEFAULT_ONE_SECTION_BYTES = 64 << 10           # records with at most this many id bytes: one section
DEFAULT_MIN_SECTION_BYTES = 1024               # coded bytes a routing section should reach
MAX_CODECS = 256                               # entries of a version-3 header's codec table


def crc32(b: bytes | memoryview) -> int:
    """CRC-32 (ISO-HDLC, zlib) of ``b`` as an unsigned 32-bit int."""
    return zlib.crc32(b) & 0xFFFFFFFF


# --------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class Header:
    """What a stream header says (FORMAT.md "Header").

    Attributes:
        version: format version (2 or 3).
        schema: the routing schema of every record.
        codec: the writer's default routing codec (each section names its own).
        column_order: "engine" or "sorted".
        layer_group: MoE layers per routing section the writer used (informational).
        token_block: version 3: rows per routing section the writer used (informational;
            each record states its own geometry), else None.
        codecs: version 3: the codec table a section's codec byte indexes, else ().
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
    token_block: Any = None
    codecs: tuple[str, ...] = ()


def encode_header(schema: RoutingSchema, codec: str | None = None,
                  extra: dict[str, Any] | None = None,
                  layer_group: int | None = None, column_order: str = "engine", *,
                  version: int = FORMAT_VERSION, token_block: int = DEFAULT_TOKEN_BLOCK,
                  one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                  codecs: tuple[str, ...] | None = None,
                  min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES,
                  stream_id: str | None = None) -> bytes:
    """Version-3 stream header bytes for ``schema`` (FORMAT.md "Header"); ``stream_id``: a
    random id (hex) that tells a stream from another written later under the same path.

    Args:
        codec: the writer's default routing codec (default: ``routereplay.codec``'s
            ``DEFAULT_CODEC``).
        layer_group, token_block, one_section_bytes, min_section_bytes: the writer's
            section grid (informational).
        version: 3 (format 2 and 1 writing was removed in 0.3.0).
        codecs: the codec table (default: :func:`codec_table` of ``codec``).

    Raises:
        ConfigError: a version other than 3.
    """
    check_writable(version)
    codec = codec or DEFAULT_CODEC
    meta: dict[str, Any] = {"schema": schema.to_dict(), "codec": codec,
                            "column_order": column_order,
                            "layer_group": layer_group or DEFAULT_LAYER_GROUP,
                            "token_block": token_block, "one_section_bytes": one_section_bytes,
                            "min_section_bytes": min_section_bytes,
                            "codecs": list(codecs if codecs is not None else codec_table(codec))}
    if extra:
        meta["extra"] = extra
    if stream_id is not None:
        meta["stream_id"] = stream_id
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return _HEADER_FIXED.pack(MAGIC, version, 0, len(js)) + js + struct.pack("<I", crc32(js))


def check_writable(version: Any) -> None:
    """Refuse a format version a writer does not write (only 3).

    Raises:
        ConfigError: naming the version and what to write instead.
    """
    if version == 1:
        raise ConfigError("format version 1 has not been written since before routereplay 0.2; "
                          "write format 3 (the default)")
    if version == 2:
        raise ConfigError("writing format version 2 was removed in routereplay 0.3.0: write "
                          "format 3 (the default), which routereplay 0.2.x also reads (this "
                          "release reads format 2 and writes format 3 only)")
    if version not in WRITABLE_VERSIONS:
        raise ConfigError(f"format_version must be one of {WRITABLE_VERSIONS}, got {version!r}")


def codec_table(codec: str) -> tuple[str, ...]:
    """The version-3 codec table a writer whose routing codec is ``codec`` declares: that
    codec, the fallbacks ``ctx-zstd`` and ``raw-lm``, and the array codecs ``zstd`` and
    ``raw``. A section's codec byte is an index into it."""
    return tuple(dict.fromkeys((codec, "ctx-zstd", "raw-lm", "zstd", "raw")))


def header_json_length(fixed: bytes, stream_size: int) -> tuple[int, int]:
    """(version, J) from the first 16 bytes of a stream.

    Raises:
        SidecarError: wrong magic, unsupported version, or J larger than the stream
            (or than 64 MiB).
    """
    if len(fixed) < HEADER_FIXED_SIZE and MAGIC.startswith(bytes(fixed[:8])):
        # NOTE: a live stream opened before its writer's first flush
        raise SidecarError(f"empty or partial stream header ({len(fixed)} bytes): its writer "
                           "has not written the header yet, or it was cut short", offset=0)
    if len(fixed) < HEADER_FIXED_SIZE or fixed[:8] != MAGIC:
        raise SidecarError("not a routereplay sidecar (wrong magic)", offset=0)
    _, version, _flags, jlen = _HEADER_FIXED.unpack(fixed[:HEADER_FIXED_SIZE])
    if version == 1:
        raise SidecarError(removed_codec_error("sidecar format version 1"), offset=0)
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
        codecs: tuple[str, ...] = ()
        if version >= 3:
            codecs = tuple(meta["codecs"])
            if not (1 <= len(codecs) <= MAX_CODECS and all(isinstance(c, str) for c in codecs)):
                raise ValueError("'codecs' must be a list of 1 to 256 codec names")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SidecarError(f"invalid sidecar header: {e!r}"[:500], offset=0) from None
    return Header(version=version, schema=schema, codec=codec, column_order=column_order,
                  layer_group=meta.get("layer_group"), meta=meta,
                  size=HEADER_FIXED_SIZE + len(js) + 4, token_block=meta.get("token_block"),
                  codecs=codecs)


# --------------------------------------------------------------------------- frames


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    """The 24-byte header of a frame at ``offset`` (FORMAT.md "Frame").

    Attributes:
        offset: byte offset of the frame in the stream.
        kind: 1 = record, 2 = index, 3 = a 0.2 xl-ans model (others are skipped).
        payload_len: P, payload bytes.
        payload_crc: CRC-32 of the payload (of the head, in a version-3 record frame).
    """

    offset: int
    kind: int
    payload_len: int
    payload_crc: int

    @property
    def end(self) -> int:
        """Offset just past the payload."""
        return self.offset + FRAME_HEADER_SIZE + self.payload_len


def encode_frame(kind: int, payload: bytes, head_len: int | None = None) -> bytes:
    """One frame: 24-byte frame header + payload (FORMAT.md "Frame").

    The header's CRC field covers ``payload[:head_len]``: the head of a version-3 record
    (``head_len`` defaults to the ``head_len`` attribute of a
    :class:`routereplay.sidecar.payload.RecordPayload`), else the whole payload.
    """
    if head_len is None:
        head_len = getattr(payload, "head_len", None)
    covered = payload if head_len is None else memoryview(payload)[:head_len]
    hdr = _FRAME_HDR.pack(FRAME_MAGIC, kind, len(payload), crc32(covered))
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


def _torn(msg: str, offset: int) -> SidecarError:
    return SidecarError(msg, offset=offset, torn=True)


# --------------------------------------------------------------------------- index, trailer


def encode_index(entries: list[tuple[str, int]]) -> bytes:
    """Version-3 index payload: ``varint count``, then per record ``varint len, sample id
    (UTF-8), varint delta`` with the frame offset = previous offset (0 for the first) +
    delta."""
    out = [varint(len(entries))]
    prev = 0
    for sid, off in entries:
        b = sid.encode("utf-8", "surrogatepass")
        out += [varint(len(b)), b, varint(off - prev)]
        prev = off
    return b"".join(out)


def decode_index(payload: bytes, data_start: int, index_offset: int,
                 version: int = 2) -> list[tuple[str, int]] | None:
    """Entries of an index payload, or None when it is not a valid index (then readers
    scan instead). Every offset must lie in the frame area ``[data_start, index_offset)``
    (version 3 offsets, delta-coded, never decrease; version 2: ``{"records": [[sample_id,
    frame_offset], ...]}``)."""
    if version >= 3:
        return _decode_index_v3(memoryview(payload), data_start, index_offset)
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


def _decode_index_v3(buf: memoryview, data_start: int, index_offset: int
                     ) -> list[tuple[str, int]] | None:
    try:
        n, pos = read_varint(buf, 0)
        # NOTE: every entry takes at least 2 bytes: a forged count costs nothing
        if n > len(buf) // 2:
            return None
        out, off = [], 0
        for _ in range(n):
            ln, pos = read_varint(buf, pos)
            if pos + ln > len(buf):
                return None
            sid = bytes(buf[pos:pos + ln]).decode("utf-8", "surrogatepass")
            delta, pos = read_varint(buf, pos + ln)
            off += delta
            if not data_start <= off < index_offset:
                return None
            out.append((sid, off))
        return out if pos == len(buf) else None
    except (VarintError, UnicodeDecodeError):
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
