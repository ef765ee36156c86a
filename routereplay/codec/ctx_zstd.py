"""``ctx-zstd``: repeat bitmap and per-layer id bytes, then zstd (docs/FORMAT.md "ctx-zstd").

Per section (ids ``[T, G, K]``), rows in layer-major order:

1. Repeats: one bit per row, 0 when the row equals the previous token's row of the same
   layer (such rows are not stored), 1 for a stored row.
2. Fresh rows as bytes, row-major: one byte per id (E <= 256), or two byte planes, low
   then high (E > 256); for E <= 16, two ids share a byte (four for E <= 4), so that the
   Huffman stage codes them jointly and learns for free that a row never repeats an
   expert.
3. One zstd frame; a block ends after the bitmap and after each layer's bytes, so that
   each layer gets its own Huffman table (its popular experts) and zstd's match finder
   sees one layer at a time.

NOTE: the decoder is zstd plus a handful of whole-array numpy operations per section (a
cumulative sum, a row gather, a transpose; a table lookup for packed ids), which is what
makes it fast: no per-symbol work in Python, no adaptive model. ``ctx-ans``
(routereplay.codec.context) is 2-5 % smaller on most traces (14 % with long repeat runs)
at a tenth of the speed or less (benchmarks/README.md).
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard

from routereplay.errors import SidecarError

LEVEL = 3                       # zstd level (measured: higher levels gain < 1 % here)
SMALL_SECTION = 4096            # bytes: below this the encoder also tries a single block
STORE_ALL_BELOW = 16            # store every row when fewer than 1/16 of the rows repeat
ONE_SHOT_LIMIT = 64 << 20       # bytes: a larger declared content is decompressed in steps
_LUTS: dict = {}
_LOCAL = threading.local()       # NOTE: zstandard (de)compressor objects are not thread-safe


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_LOCAL, "dctx"):
        _LOCAL.dctx = zstandard.ZstdDecompressor()
    return _LOCAL.dctx


def pack_width(num_experts: int) -> int:
    """Ids per stored byte: 4 (E <= 4), 2 (E <= 16), 1 (E <= 256); 0 for E > 256 (two bytes)."""
    return 4 if num_experts <= 4 else 2 if num_experts <= 16 else 1 if num_experts <= 256 else 0


def row_bytes(num_experts: int, top_k: int) -> int:
    """Bytes of one stored row."""
    n = pack_width(num_experts)
    return 2 * top_k if n == 0 else -(-top_k // n)


def _row_view(x: np.ndarray) -> np.ndarray:
    """[..., W] rows -> [...] one scalar per row (for row compares and gathers)."""
    return np.ascontiguousarray(x).view(_row_dtype(x.shape[-1] * x.itemsize)).reshape(x.shape[:-1])


def _pack(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """Fresh rows [N, K] (E <= 256) -> stored bytes uint8 [N, row_bytes]: ``pack_width`` ids
    per byte, first id most significant; a short last byte is padded with id 0."""
    n, k = rows.shape
    per = pack_width(num_experts)
    rows = rows.astype(np.uint8, copy=False)
    if per == 1:
        return rows
    nb = -(-k // per)
    padded = np.zeros((n, nb * per), dtype=np.uint8)
    padded[:, :k] = rows
    out = np.zeros((n, nb), dtype=np.uint8)
    for j in range(per):
        out = out * num_experts + padded[:, j::per]
    return out


def _unpack_table(num_experts: int, per: int) -> np.ndarray:
    """[256] of uint16 (per 2) or uint32 (per 4): each packed byte value's ``per`` ids as
    bytes in memory order, first id first.

    Byte values past E^per - 1 map to ids 255 (>= E), which the range check refuses.
    """
    key = (num_experts, per)
    if key not in _LUTS:
        v = np.arange(256)
        ids = np.empty((256, per), dtype=np.uint8)
        for j in reversed(range(per)):
            v, ids[:, j] = np.divmod(v, num_experts)
        ids[num_experts ** per:] = 255
        _LUTS[key] = ids.view(np.uint16 if per == 2 else np.uint32).ravel()
    return _LUTS[key]


def encode(ids: np.ndarray, num_experts: int, level: int = LEVEL) -> bytes:
    """ids: uint8|uint16 [T, G, top_k] -> one zstd frame (a ``ctx-zstd`` section).

    Rows are stored as given (any column order; a row may even repeat an expert).

    Raises:
        ValueError: an id out of [0, num_experts), or ids not uint8 (E <= 256) / uint16
            (E > 256), the schema's id_dtype.
    """
    t, g, k = ids.shape
    e = num_experts
    if ids.dtype != (np.uint8 if e <= 256 else np.uint16):
        raise ValueError(f"ctx-zstd codes {e} experts from {'uint8' if e <= 256 else 'uint16'} "
                         f"ids, got {ids.dtype}")
    if ids.size and int(ids.max()) >= e:
        raise ValueError(f"expert id out of range [0, {e})")
    rows = _row_view(ids).T                                   # [G, T] one scalar per row
    fresh = np.ones((g, t), dtype=bool)
    fresh[:, 1:] = rows[:, 1:] != rows[:, :-1]
    nfresh = fresh.sum(axis=1)
    if (g * t - nfresh.sum()) * STORE_ALL_BELOW < g * t:
        # NOTE: with few repeats, storing them costs about what the bitmap's bits do, and
        # an all-ones bitmap lets the decoder skip the row gather (faster by a third).
        fresh[:] = True
        nfresh[:] = t
    stored = rows[fresh].view(ids.dtype).reshape(-1, k)                     # layer-major
    if pack_width(e) == 0:
        planes = [(stored & 0xFF).astype(np.uint8), (stored >> 8).astype(np.uint8)]
    else:
        planes = [_pack(stored, e)]
    parts = [np.packbits(fresh.ravel()).tobytes()]
    bounds = np.concatenate(([0], np.cumsum(nfresh)))
    for layer in range(g):
        parts += [p[bounds[layer]:bounds[layer + 1]].tobytes() for p in planes]
    cctx = zstandard.ZstdCompressor(level=level)
    cobj = cctx.compressobj(size=sum(map(len, parts)))
    out = b"".join([cobj.compress(p) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
                    for p in parts[:-1]] + [cobj.compress(parts[-1]) + cobj.flush()])
    if len(out) < SMALL_SECTION:
        # NOTE: on a short section a Huffman table per layer can cost more than it saves;
        # try one block too and keep the smaller (readers do not depend on blocks).
        one = cctx.compress(b"".join(parts))
        out = one if len(one) < len(out) else out
    return out


def _content(data: bytes, cap: int) -> bytes:
    """The section's zstd frame -> its content, never more than ``cap`` bytes.

    NOTE: a frame that declares its size (ours always do) is checked against ``cap`` before
    one-shot decompression; otherwise memory grows with what the frame really holds.
    """
    try:
        declared = zstandard.frame_content_size(data)
        if 0 <= declared <= min(cap, ONE_SHOT_LIMIT):
            out = _decompressor().decompress(data)
            if len(out) != declared:
                raise SidecarError(f"ctx-zstd frame holds {len(out)} bytes, declares {declared}")
            return out
        if declared > cap:
            raise SidecarError(f"ctx-zstd frame declares {declared} bytes, the shape allows {cap}")
        buf = bytearray()
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False)
        while len(buf) <= cap:
            piece = reader.read(min(1 << 20, cap + 1 - len(buf)))
            if not piece:
                break
            buf += piece
    except zstandard.ZstdError as exc:
        raise SidecarError(f"ctx-zstd section is not a valid zstd frame: {exc}") from None
    if len(buf) > cap:
        raise SidecarError(f"ctx-zstd section holds more than the {cap} bytes its shape allows")
    return bytes(buf)


def _row_dtype(width: int) -> np.dtype:
    """One scalar per row of ``width`` bytes (a plain unsigned int where one fits)."""
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width, f"V{width}"))


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> np.ndarray:
    """``ctx-zstd`` section bytes -> ids [T, G, top_k] of ``dtype``.

    Raises:
        SidecarError: not a zstd frame, or content that does not decode to exactly
            ``shape``: a repeat flag on a layer's first row, content of the wrong length
            for the stored rows the bitmap implies, ids >= num_experts.
    """
    # NOTE: written for few numpy calls: at 4 layers x 4096 tokens a call's fixed cost
    # (microseconds) is a large part of the whole decode.
    t, g, k = shape
    e = num_experts
    dtype = np.dtype(dtype)
    if dtype != (np.uint8 if e <= 256 else np.uint16):
        raise SidecarError(f"ctx-zstd stores {e} experts as "
                           f"{'uint8' if e <= 256 else 'uint16'}, not {dtype.name}")
    total, rb, per = g * t, row_bytes(e, k), pack_width(e)
    nbits = -(-total // 8)
    content = np.frombuffer(_content(data, nbits + total * rb), dtype=np.uint8)
    if content.size < nbits:
        raise SidecarError("ctx-zstd content ends inside its repeat bitmap")
    fresh = np.unpackbits(content[:nbits], count=total)              # 1: a stored row
    if t and not fresh[::t].all():
        raise SidecarError(f"ctx-zstd marks the first row of layer {int(np.argmin(fresh[::t]))} "
                           "of the section as a repeat")
    if content.size == nbits + total * rb:
        if total and not fresh.all():
            raise SidecarError("ctx-zstd content holds every row but its bitmap marks repeats")
        n, src = total, None                                         # every row stored
    else:
        src = np.cumsum(fresh, dtype=np.intp)
        n = int(src[-1]) if total else 0
    if content.size != nbits + n * rb:
        raise SidecarError(f"ctx-zstd content of {content.size} bytes does not match its "
                           f"{n} stored rows of a {g} x {t} x {k} section")
    if n == 0:
        return np.zeros(shape, dtype)
    stored = content[nbits:]
    if per == 1:
        if e < 256 and int(stored.max()) >= e:
            raise SidecarError(f"ctx-zstd section holds an expert id >= {e}")
        rows = stored.view(_row_dtype(k))
    elif per == 0:
        rows = _wide_rows(stored, fresh.reshape(g, t).sum(axis=1), k, e)
    else:
        if int(stored.max()) >= e ** per:
            raise SidecarError(f"ctx-zstd section holds a packed byte >= {e ** per}")
        rows = np.take(_unpack_table(e, per), stored)
        if rb * per != k:                                            # a short last byte
            rows = np.ascontiguousarray(rows.view(np.uint8).reshape(n, -1)[:, :k])
        rows = rows.view(_row_dtype(k)).reshape(n)
    if src is None:
        flat = rows
    elif rows.dtype.kind == "V":
        # NOTE: rows of 3, 5, 6, 7 bytes: numpy copies them one by one, so gather once in
        # token-major order rather than gather + transpose.
        src -= 1
        return np.take(rows, np.ascontiguousarray(src.reshape(g, t).T)).view(dtype).reshape(t, g, k)
    else:
        src -= 1
        flat = rows[src]                                             # [G * T] layer-major
    out = np.empty((t, g), dtype=flat.dtype)
    for layer in range(g):              # NOTE: column copies transpose 3x faster than numpy's
        out[:, layer] = flat[layer * t:(layer + 1) * t]
    return out.view(dtype).reshape(t, g, k)


def _wide_rows(stored: np.ndarray, nfresh: np.ndarray, k: int, num_experts: int) -> np.ndarray:
    """E > 256: per layer a low-byte plane then a high-byte plane -> one scalar per row
    (K uint16 ids).

    Raises:
        SidecarError: an id >= num_experts.
    """
    rows = np.empty((int(nfresh.sum()), k), dtype="<u2")
    start = 0
    for m in nfresh.tolist():
        plane = stored[2 * k * start:2 * k * (start + m)].reshape(2, m, k)
        rows[start:start + m] = plane[0] | (plane[1].astype(np.uint16) << 8)
        start += m
    if rows.size and int(rows.max()) >= num_experts:
        raise SidecarError(f"ctx-zstd section holds an expert id >= {num_experts}")
    return rows.astype(np.uint16, copy=False).view(_row_dtype(2 * k)).reshape(-1)
