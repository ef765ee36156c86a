"""Layer-major codecs ``raw-lm`` and ``zstd-lm`` (docs/FORMAT.md "Routing codecs").

Transpose ``ids [T, L_g, top_k]`` to layer-major ``[L_g, T, top_k]`` (so each layer's
token-to-token repetition sits together) and store it raw or as one zstd frame. Kept as the
fast general-purpose fallback and to read streams written with them; ``ctx-ans``
(routereplay.codec.ctx_ans) is smaller.
"""
from __future__ import annotations

import numpy as np
import zstandard

from routereplay.errors import SidecarError

ZSTD_LEVEL = 3


def encode(ids: np.ndarray, codec: str, level: int = ZSTD_LEVEL) -> bytes:
    """ids: uint8|uint16 [T, L_g, top_k] -> section bytes (``raw-lm`` or ``zstd-lm``)."""
    lm = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(ids.dtype.newbyteorder("<"), copy=False)
    if codec == "raw-lm":
        return lm.tobytes()
    return zstandard.ZstdCompressor(level=level).compress(lm.tobytes())


def bounded_zstd_decompress(data: bytes, nbytes: int, chunk: int = 1 << 20, *,
                            exact: bool = True) -> bytes:
    """Decompress one zstd frame that must hold exactly ``nbytes`` bytes (at most
    ``nbytes`` with ``exact=False``).

    NOTE: memory grows with the bytes actually produced (read in ``chunk``-sized steps),
    never with a size claimed by metadata or by the frame header, so forged sizes cannot
    cause a huge allocation.

    Raises:
        SidecarError: not a valid zstd frame, or its content is not ``nbytes`` long
            (longer than ``nbytes`` with ``exact=False``).
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
    if len(out) > nbytes or (exact and len(out) != nbytes):
        raise SidecarError(f"zstd section holds {'more than ' if len(out) > nbytes else ''}"
                           f"{len(out)} bytes, metadata says {'at most ' if not exact else ''}"
                           f"{nbytes}")
    return bytes(out)


def decode(data: bytes, codec: str, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
    """Section bytes -> ids [T, L_g, top_k] of ``dtype``.

    Raises:
        SidecarError: the decoded size does not match ``shape``.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    t, lg, k = shape
    nbytes = t * lg * k * dtype.itemsize
    raw = data if codec == "raw-lm" else bounded_zstd_decompress(data, nbytes)
    if len(raw) != nbytes:
        raise SidecarError(f"routing section decodes to {len(raw)} bytes, metadata says "
                           f"{nbytes} ({t}x{lg}x{k} {dtype.name})")
    lm = np.frombuffer(raw, dtype=dtype).reshape(lg, t, k)
    return np.ascontiguousarray(lm.transpose(1, 0, 2)).astype(dtype.newbyteorder("="), copy=False)
