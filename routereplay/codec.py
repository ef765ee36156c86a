"""Routing codecs: turn one layer group of a record's ids into bytes and back.

A codec works on ``ids: uint8|uint16 [T, L_g, top_k]`` (one group of MoE layers) and is
named by a short string stored in each section's metadata (see docs/FORMAT.md):

- ``"zstd-lm"``: transpose to layer-major ``[L_g, T, top_k]``, little-endian id dtype,
  zstd-compressed. Layer-major puts each layer's token-to-token repetition next to itself,
  which zstd's match finder exploits; top-k column order is preserved exactly.

Decoders check sizes before allocating: a forged size can never cause a huge allocation.
"""
from __future__ import annotations

import numpy as np
import zstandard

from routereplay.errors import SidecarError

DEFAULT_CODEC = "zstd-lm"
CODECS = ("zstd-lm", "raw-lm")
_ZSTD_LEVEL = 3


def encode(ids: np.ndarray, codec: str = DEFAULT_CODEC, level: int = _ZSTD_LEVEL) -> bytes:
    """Encode ids [T, L_g, top_k] (uint8 or uint16) with ``codec``.

    Returns:
        the section bytes.
    Raises:
        ValueError: unknown codec or wrong dtype.
    """
    if ids.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"ids must be uint8 or uint16, got {ids.dtype}")
    lm = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(ids.dtype.newbyteorder("<"), copy=False)
    if codec == "raw-lm":
        return lm.tobytes()
    if codec == "zstd-lm":
        return zstandard.ZstdCompressor(level=level).compress(lm.tobytes())
    raise ValueError(f"unknown codec {codec!r}; known: {CODECS}")


def bounded_zstd_decompress(data: bytes, nbytes: int, chunk: int = 1 << 20) -> bytes:
    """Decompress one zstd frame that must hold exactly ``nbytes`` bytes.

    NOTE: memory grows with the bytes actually produced (read in ``chunk``-sized steps),
    never with a size claimed by metadata or by the frame header, so forged sizes cannot
    cause a huge allocation.

    Raises:
        SidecarError: not a valid zstd frame, or its content is not ``nbytes`` long.
    """
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False)
        while len(out) <= nbytes:
            piece = reader.read(min(chunk, nbytes + 1 - len(out)))
            if not piece:
                break
            out += piece
    except zstandard.ZstdError as e:
        raise SidecarError(f"zstd section does not decode: {e}") from None
    if len(out) != nbytes:
        raise SidecarError(f"zstd section holds {'more than ' if len(out) > nbytes else ''}"
                           f"{len(out)} bytes, metadata says {nbytes}")
    return bytes(out)


def decode(data: bytes, codec: str, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
    """Decode a section back to ids [T, L_g, top_k] of ``dtype``.

    ``shape`` is (T, L_g, top_k) from the frame metadata.

    Raises:
        SidecarError: unknown codec, or the decoded size does not match ``shape``.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    t, lg, k = shape
    nbytes = t * lg * k * dtype.itemsize
    if codec == "raw-lm":
        raw = data
    elif codec == "zstd-lm":
        raw = bounded_zstd_decompress(data, nbytes)
    else:
        raise SidecarError(f"unknown routing codec {codec!r}; known: {CODECS}")
    if len(raw) != nbytes:
        raise SidecarError(f"routing section decodes to {len(raw)} bytes, metadata says "
                           f"{nbytes} ({t}x{lg}x{k} {dtype.name})")
    lm = np.frombuffer(raw, dtype=dtype).reshape(lg, t, k)
    return np.ascontiguousarray(lm.transpose(1, 0, 2)).astype(dtype.newbyteorder("="), copy=False)
