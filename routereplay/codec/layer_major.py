"""The layer-major codec ``raw-lm`` (docs/FORMAT.md "Routing codecs"), and the bounded zstd
decompression every zstd section uses.

``raw-lm`` stores ``ids [T, L_g, top_k]`` transposed to layer-major ``[L_g, T, top_k]``,
uncompressed: the writers' fallback for near-constant routing, and for debugging.
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard

from routereplay.errors import SidecarError


def encode(ids: np.ndarray) -> bytes:
    """ids: uint8|uint16 [T, L_g, top_k] -> ``raw-lm`` bytes (T x L_g x top_k x itemsize)."""
    lm = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(ids.dtype.newbyteorder("<"), copy=False)
    return lm.tobytes()


_TLS = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """A decompressor per thread (zstandard's are not thread-safe; making one per section
    is a large share of a tiny section's read)."""
    d = getattr(_TLS, "dctx", None)
    if d is None:
        d = _TLS.dctx = zstandard.ZstdDecompressor()
    return d


def bounded_zstd_decompress(data: bytes, nbytes: int, *, exact: bool = True) -> bytes:
    """Decompress one whole zstd frame that must hold exactly ``nbytes`` bytes (at most
    ``nbytes`` with ``exact=False``); bytes after the frame are ignored.

    docs/FORMAT.md "Conventions": a frame is whole when the decoder reaches its end (its
    last block, and its checksum where the frame header announces one); a declared content
    size must equal what the frame holds. A truncated frame is refused even where the
    blocks before the cut hold ``nbytes`` bytes (issue 27: the same rule in every section).

    NOTE: a declared size is checked against ``nbytes`` before anything is decompressed,
    and an undeclared one is bounded by ``nbytes + 1`` bytes of output: memory never
    follows a size claimed by the frame, only ``nbytes``, which callers bound by the
    reader's expansion limit (routereplay.sidecar.payload.section_fits) first.

    Raises:
        SidecarError: not a zstd frame (a skippable frame included), a truncated frame, or
            content that is not ``nbytes`` long (longer than ``nbytes`` with ``exact=False``).
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise SidecarError(f"zstd section is not a zstd frame: {e}") from None
    if declared > nbytes or (exact and declared >= 0 and declared != nbytes):
        raise SidecarError(f"zstd section declares {declared} bytes, metadata says "
                           f"{'at most ' if not exact else ''}{nbytes}")
    try:
        out = _dctx().decompress(data, max_output_size=nbytes + 1)
    except zstandard.ZstdError as e:
        raise SidecarError(f"zstd section is truncated or holds more than {nbytes} bytes (not "
                           f"a whole frame of {'at most ' if not exact else ''}{nbytes} bytes): "
                           f"{e}") from None
    if len(out) > nbytes or (exact and len(out) != nbytes) or (declared >= 0 and len(out) != declared):
        raise SidecarError(f"zstd section holds {len(out)} bytes, metadata says "
                           f"{'at most ' if not exact else ''}{nbytes}")
    return out


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
    """``raw-lm`` section bytes -> ids [T, L_g, top_k] of ``dtype``.

    Raises:
        SidecarError: the decoded size does not match ``shape``.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    t, lg, k = shape
    nbytes = t * lg * k * dtype.itemsize
    raw = data
    if len(raw) != nbytes:
        raise SidecarError(f"routing section decodes to {len(raw)} bytes, metadata says "
                           f"{nbytes} ({t}x{lg}x{k} {dtype.name})")
    lm = np.frombuffer(raw, dtype=dtype).reshape(lg, t, k)
    return np.ascontiguousarray(lm.transpose(1, 0, 2)).astype(dtype.newbyteorder("="), copy=False)
