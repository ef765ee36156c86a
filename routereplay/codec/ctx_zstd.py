"""``ctx-zstd``: repeat bitmap and per-layer id bytes, then zstd (docs/FORMAT.md "ctx-zstd").

Per section (ids ``[T, G, K]``), rows in layer-major order:

1. Repeats: one bit per row, 0 when the row equals the previous token's row of the same
   layer (such rows are not stored), 1 for a stored row.
   A section where that saves less than the bitmap costs (chance repeats) stores every
   row instead (:func:`_store_every_row`).
2. Stored rows as bytes, per layer, row-major: one byte per id (E <= 256), or two byte
   planes, low then high (E > 256). For E <= 11 and E = 16 a layer's ids share bytes,
   two a byte (four for E <= 4), across row boundaries: the Huffman stage then codes pairs (with
   K = 2, whole rows: it learns that a row never repeats an expert), and top-1 routing
   over few experts is not left with 2-3 bit symbols, where zstd's match finder takes
   chance matches. (Not for 12-15 experts: their near-uniform pairs have so little
   Huffman gain over 8 raw bits that zstd stores them raw, 4 bits an id; 16 experts fill
   the byte exactly.)
3. One zstd frame (level 9, or 3 for E > 256 where level 9 is slow on the near-constant
   high bytes); a block ends after the bitmap and after each layer's bytes (each plane),
   so that each layer gets its own Huffman table (its popular experts). Frames under
   32 KiB are also tried with all layers in one block (one table); the smaller is kept.

NOTE: the decoder is zstd plus a handful of whole-array numpy operations per section (a
cumulative sum, a row gather, a transpose; a table lookup for packed ids), which is what
makes it fast: no per-symbol work in Python, no adaptive model.
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard

from routereplay.codec.layer_major import bounded_zstd_decompress
from routereplay.errors import RecordError, SidecarError

LEVEL = 9                       # zstd level (E <= 256)
WIDE_LEVEL = 3                  # zstd level for E > 256: 9 encodes at 20-40 MB/s there
MIN_MATCH = 7                   # bytes; see _compressor
SMALL_SECTION = 32768           # bytes: below this the encoder also tries one block for all layers
ONE_SHOT_LIMIT = 64 << 20       # bytes: a larger declared content is decompressed in steps
_LUTS: dict = {}
_LOCAL = threading.local()       # NOTE: zstandard (de)compressor objects are not thread-safe


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """zstd at ``level`` with matches of at least ``MIN_MATCH`` bytes.

    NOTE: measured on routing traces: zstd's default parameters for a small input (what
    ``compress`` picks from the pledged size) and short minimum matches make the match
    finder take chance 4-byte matches between unrelated rows, which cost more than the
    literals they replace: up to 6 % larger sections (E=32 top-4, 1024 tokens) than
    these fixed parameters, at the same speed.
    """
    cache = _LOCAL.__dict__.setdefault("cctx", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(level, min_match=MIN_MATCH)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_LOCAL, "dctx"):
        _LOCAL.dctx = zstandard.ZstdDecompressor()
    return _LOCAL.dctx


def pack_width(num_experts: int) -> int:
    """Ids per stored byte: 4 (E <= 4), 2 (E <= 11 or E = 16), 1 (E <= 256); 0 for E > 256
    (two bytes)."""
    e = num_experts
    return 4 if e <= 4 else 2 if e <= 11 or e == 16 else 1 if e <= 256 else 0


def layer_bytes(num_stored: np.ndarray | int, num_experts: int, top_k: int) -> np.ndarray | int:
    """Bytes of a layer's part for ``num_stored`` stored rows (int, or int64 array per layer)."""
    per = pack_width(num_experts)
    if per == 0:
        return 2 * top_k * num_stored
    return -(-(num_stored * top_k) // per)


def _row_view(x: np.ndarray) -> np.ndarray:
    """[..., W] rows -> [...] one scalar per row (for row compares and gathers)."""
    return np.ascontiguousarray(x).view(_row_dtype(x.shape[-1] * x.itemsize)).reshape(x.shape[:-1])


def _pack(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """One layer's stored ids, flat uint8 [N_g * K] (E <= 256) -> its bytes: ``pack_width``
    ids per byte, first id most significant, the last byte padded with id 0."""
    per = pack_width(num_experts)
    if per == 1:
        return ids
    padded = np.zeros(-(-ids.size // per) * per, dtype=np.uint8)
    padded[:ids.size] = ids
    padded = padded.reshape(-1, per)
    out = padded[:, 0].copy()
    for j in range(1, per):
        out = out * num_experts + padded[:, j]
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


def _store_every_row(repeat_fraction: float, num_experts: int, top_k: int) -> bool:
    """Whether a section stores every row (an all-ones bitmap) instead of skipping repeats.

    NOTE: the bitmap costs about H2(f) bits a row (f = fraction of rows that repeat) and
    saves f rows of at most top_k * log2(E) bits, fewer with skewed routing (hence the
    factor 3/4, measured on Zipf traces). Repeats that happen by chance (uniform top-1
    over few experts: f = 1/E) save less than the bitmap costs: measured 19 % larger
    sections at E=5, top-1, without this rule. An all-ones bitmap also lets the decoder
    skip the row gather, so near the break-even point storing every row is preferred.
    """
    f = repeat_fraction
    if f <= 0.0:
        return True
    if f >= 1.0:
        return False
    h2 = -(f * np.log2(f) + (1.0 - f) * np.log2(1.0 - f))
    return h2 >= 0.75 * f * top_k * np.log2(max(num_experts, 2))


def _check_input(ids: np.ndarray, e: int) -> None:
    """ids must be the schema's id dtype (uint8 for E <= 256, else uint16), all < E."""
    if ids.dtype != (np.uint8 if e <= 256 else np.uint16):
        raise RecordError(f"ctx-zstd codes {e} experts from {'uint8' if e <= 256 else 'uint16'} "
                          f"ids, got {ids.dtype}")
    if ids.size and int(ids.max()) >= e:
        raise RecordError(f"expert id out of range [0, {e})")


def encode(ids: np.ndarray, num_experts: int, level: int | None = None) -> bytes:
    """ids: uint8|uint16 [T, G, top_k] -> one zstd frame (a ``ctx-zstd`` section).

    Rows are stored as given (any column order; a row may even repeat an expert).

    Raises:
        RecordError (a ValueError): an id out of [0, num_experts), or ids not uint8 (E <= 256) / uint16
            (E > 256), the schema's id_dtype.
    """
    t, g, k = ids.shape
    e = num_experts
    _check_input(ids, e)
    rows = _row_view(ids).T                                   # [G, T] one scalar per row
    fresh = np.ones((g, t), dtype=bool)
    fresh[:, 1:] = rows[:, 1:] != rows[:, :-1]
    nfresh = fresh.sum(axis=1)
    if _store_every_row(1.0 - nfresh.sum() / max(g * t, 1), e, k):
        fresh[:] = True
        nfresh[:] = t
    stored = rows[fresh].view(ids.dtype)                      # [N * K] layer-major ids
    parts = [np.packbits(fresh.ravel()).tobytes()]
    bounds = k * np.concatenate(([0], np.cumsum(nfresh)))
    for layer in range(g):
        ids_g = stored[bounds[layer]:bounds[layer + 1]]
        if e > 256:
            parts += [(ids_g & 0xFF).astype(np.uint8).tobytes(), (ids_g >> 8).astype(np.uint8).tobytes()]
        else:
            parts.append(_pack(ids_g, e).tobytes())
    cctx = _compressor(level if level is not None else LEVEL if e <= 256 else WIDE_LEVEL)
    return _compress(cctx, parts)


def _compress(cctx: zstandard.ZstdCompressor, parts: list[bytes]) -> bytes:
    """The section's frame from its content parts (bitmap, then each layer's part or
    planes): a block per part, and for a frame under SMALL_SECTION the smaller of that and
    two blocks (the bitmap, then all layers), which is the same frame with one layer."""
    out = _frame(cctx, parts)
    if len(out) < SMALL_SECTION and len(parts) > 2:
        # NOTE: on a short section, or routing without per-layer preferences, a Huffman
        # table per layer can cost more than it saves (measured 1.5 % at 16 experts, top-1,
        # 2048 tokens); try the layers as one block too and keep the smaller (readers do not
        # depend on blocks). The bitmap keeps a block of its own: mixed into the ids' block
        # it costs more (its bytes enter their Huffman table).
        one = _frame(cctx, [parts[0], b"".join(parts[1:])])
        out = one if len(one) < len(out) else out
    return out


def encode_grid(ids: np.ndarray, num_experts: int, token_block: int, layer_group: int,
                level: int | None = None) -> list[bytes]:
    """ids: uint8|uint16 [T, L, top_k] -> the ``ctx-zstd`` sections of a version-3 grid
    (docs/FORMAT.md "Sections"): layer groups of ``layer_group`` x token blocks of
    ``token_block`` rows, group-major. Each is exactly :func:`encode` of its slice; the
    row compares, repeat counts and packing run once over the record instead of once per
    section (NOTE: a section of 512 rows x 1 layer costs tens of microseconds of fixed
    numpy and zstd work; measured 55 -> 96 MB/s on a DeepSeek-V3-shaped record).

    Raises:
        RecordError: as :func:`encode`.
    """
    t, nl, k = ids.shape
    e = num_experts
    _check_input(ids, e)
    rows = _row_view(ids)                                     # [T, L] one scalar per row
    fresh_all = np.ones((t, nl), dtype=bool)
    fresh_all[1:] = rows[1:] != rows[:-1]
    fresh_all[::token_block] = True                           # a block's first row is fresh
    starts = np.arange(0, max(t, 1), token_block)
    counts = np.add.reduceat(fresh_all, starts, axis=0) if t else np.zeros((1, nl), np.int64)
    cctx = _compressor(level if level is not None else LEVEL if e <= 256 else WIDE_LEVEL)
    per = pack_width(e)
    out = []
    for l0 in range(0, nl, layer_group):
        l1 = min(nl, l0 + layer_group)
        g = l1 - l0
        for b, r0 in enumerate(starts.tolist()):
            r1 = min(t, r0 + token_block)
            n = r1 - r0
            nfresh = counts[b, l0:l1]
            fresh = fresh_all[r0:r1, l0:l1].T                 # [G, n] layer-major
            if _store_every_row(1.0 - int(nfresh.sum()) / max(g * n, 1), e, k):
                bitmap = np.packbits(np.ones(g * n, dtype=bool)).tobytes()
                stored = np.ascontiguousarray(rows[r0:r1, l0:l1].T).reshape(-1)
                nfresh = np.full(g, n)
            else:
                bitmap = np.packbits(fresh).tobytes()
                stored = rows[r0:r1, l0:l1].T[fresh]
            stored = stored.view(ids.dtype)                   # [N * K] layer-major ids
            parts = [bitmap]
            if g == 1 and per == 1:
                parts.append(stored.tobytes())
            else:
                bounds = k * np.concatenate(([0], np.cumsum(nfresh)))
                for layer in range(g):
                    ids_g = stored[bounds[layer]:bounds[layer + 1]]
                    if e > 256:
                        parts += [(ids_g & 0xFF).astype(np.uint8).tobytes(),
                                  (ids_g >> 8).astype(np.uint8).tobytes()]
                    else:
                        parts.append(_pack(ids_g, e).tobytes())
            out.append(_compress(cctx, parts))
    return out


def _frame(cctx: zstandard.ZstdCompressor, parts: list[bytes]) -> bytes:
    """One zstd frame of ``parts`` (declared content size), a block boundary after each."""
    cobj = cctx.compressobj(size=sum(map(len, parts)))
    return b"".join([cobj.compress(p) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
                     for p in parts[:-1]] + [cobj.compress(parts[-1]) + cobj.flush()])


def _content(data: bytes, cap: int) -> bytes:
    """The section's zstd frame -> its content, never more than ``cap`` bytes.

    NOTE: a frame that declares its size (ours always do) is checked against ``cap`` and
    decompressed in one call; otherwise memory grows with what the frame really holds
    (routereplay.codec.layer_major.bounded_zstd_decompress).
    """
    try:
        declared = zstandard.frame_content_size(data)
        if declared > cap:
            raise SidecarError(f"ctx-zstd frame declares {declared} bytes, the shape allows {cap}")
        if 0 <= declared <= ONE_SHOT_LIMIT:
            out = _decompressor().decompress(data)
            if len(out) != declared:
                raise SidecarError(f"ctx-zstd frame holds {len(out)} bytes, declares {declared}")
            return out
    except zstandard.ZstdError as exc:
        raise SidecarError(f"ctx-zstd section is not a valid zstd frame: {exc}") from None
    return bounded_zstd_decompress(data, cap, exact=False)


def _row_dtype(width: int) -> np.dtype:
    """One scalar per row of ``width`` bytes (a plain unsigned int where one fits)."""
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width, f"V{width}"))


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> np.ndarray:
    """``ctx-zstd`` section bytes -> ids [T, G, top_k] of ``dtype``.

    Raises:
        SidecarError: ``dtype`` is not uint8 (E <= 256) / uint16 (E > 256); not a zstd
            frame; or content that does not decode to exactly ``shape``: a repeat flag on
            a layer's first row, content of the wrong length for the stored rows the
            bitmap implies, ids >= num_experts.
    """
    # NOTE: written for few numpy calls: at 4 layers x 4096 tokens a call's fixed cost
    # (microseconds) is a large part of the whole decode.
    t, g, k = shape
    e = num_experts
    dtype = np.dtype(dtype)
    if dtype != (np.uint8 if e <= 256 else np.uint16):
        raise SidecarError(f"ctx-zstd stores {e} experts as native "
                           f"{'uint8' if e <= 256 else 'uint16'}, not {dtype.str}")
    total, per = g * t, pack_width(e)
    nbits = -(-total // 8)
    full = nbits + g * layer_bytes(t, e, k)                          # every row stored
    content = np.frombuffer(_content(data, full), dtype=np.uint8)
    if content.size < nbits:
        raise SidecarError("ctx-zstd content ends inside its repeat bitmap")
    fresh = np.unpackbits(content[:nbits], count=total)              # 1: a stored row
    if t and not fresh[::t].all():
        raise SidecarError(f"ctx-zstd marks the first row of layer {int(np.argmin(fresh[::t]))} "
                           "of the section as a repeat")
    # NOTE: per-layer stored-row counts matter only for byte planes and for packed ids
    # with padding at each layer's end; otherwise totals suffice (fewer numpy calls).
    per_layer = per == 0 or (per > 1 and k % per != 0)
    if content.size == full and fresh.all():                          # every row stored
        src, n = None, total
        nstored = np.full(g, t, dtype=np.int64) if per_layer else None
    else:
        src = np.cumsum(fresh, dtype=np.intp)
        n = int(src[-1]) if total else 0
        nstored = fresh.reshape(g, t).sum(axis=1, dtype=np.int64) if per_layer else None
    size = nbits + (int(layer_bytes(nstored, e, k).sum()) if per_layer else layer_bytes(n, e, k))
    if content.size != size:
        raise SidecarError(f"ctx-zstd content of {content.size} bytes does not match its "
                           f"{n} stored rows of a {g} x {t} x {k} section")
    if n == 0:
        return np.zeros(shape, dtype)
    stored = content[nbits:]
    if per == 0:
        rows = _wide_rows(stored, nstored, k, e)
    elif per == 1:
        if e < 256 and int(stored.max()) >= e:
            raise SidecarError(f"ctx-zstd section holds an expert id >= {e}")
        rows = stored.view(_row_dtype(k))
    else:
        rows = _unpack(stored, e, per, nstored * k if per_layer else None).view(_row_dtype(k))
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


def _unpack(stored: np.ndarray, num_experts: int, per: int,
            counts: np.ndarray | None) -> np.ndarray:
    """Packed bytes of all layers -> their ids, flat uint8. ``counts``: ids per layer
    (int64 [G]) when layers end in padding, which is dropped; None when none does.

    Raises:
        SidecarError: a byte >= E^per.
    """
    if int(stored.max()) >= num_experts ** per:
        raise SidecarError(f"ctx-zstd section holds a packed byte >= {num_experts ** per}")
    ids = np.take(_unpack_table(num_experts, per), stored).view(np.uint8)
    if counts is None:
        return ids
    starts = per * np.concatenate(([0], np.cumsum(-(-counts // per))[:-1]))
    return np.concatenate([ids[s:s + c] for s, c in zip(starts.tolist(), counts.tolist())])


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
