"""``xl-zstd``: the better of a layer-major and a token-major model, never much larger than
zstd-19 (docs/FORMAT.md "xl-zstd").

A section (ids ``[T, G, K]``) is one mode byte and a payload:

- mode 0, layer-major: a ``ctx-zstd`` section (routereplay.codec.ctx_zstd): per layer,
  time repeats and the expert popularity of that layer. Best where layers are independent
  or where rows repeat the previous token's row (the synthetic traces of routing_trace).
- mode 1, token-major: one zstd frame of the ids in token-major order ``[T, G, K]``,
  packed ``ctx_zstd.pack_width(E)`` ids a byte (E <= 256; two bytes an id, little-endian,
  for E > 256). A token's rows of consecutive MoE layers lie side by side, so zstd's match
  finder copies a token's path through the layers from an earlier token that took the
  same path (a repeated word or phrase, or routing that follows from the layer before),
  and pairs of ids share a byte (the Huffman stage learns that a row never repeats an
  expert). Best on routing of trained models (issue 18).
- mode 2, plain: one zstd frame of the unpacked token-major array, the same bytes
  ``zstandard.ZstdCompressor(level=19).compress(ids.tobytes())`` takes: the fallback that
  bounds a section by zstd-19 plus one byte.

Encoder (:func:`encode`): mode 0, and (sections of more than one MoE layer) mode 1 at a
fast setting (zstd lazy2, minimum match 4); where mode 1 comes within ``LZ_REGIME`` of mode
0, also mode 1 with a near-optimal parser of small search depth (zstd btultra; within about
1 % of zstd-19 on packed ids at several times its speed). The smallest is kept. Then mode
2 (zstd-19 on the plain array, 10x slower than the rest together) where ``check`` asks for
it:

- ``"auto"`` (default): for sections of at most ``CHECK_BYTES`` bytes as plain uint8, where
  the models' fixed costs (zstd block headers, Huffman tables) can make them lose to
  zstd-19 (measured up to 17 % on 64-token top-1 sections) and where the pass costs
  little time. Larger sections were measured at most 0.63 % (266 bytes on 4096 tokens)
  above zstd-19 without it, 24 of 2112 traces above at all, all near-uniform routing
  (benchmarks/codec.py --grid: 352 traces x 6 lengths of 64-4096 tokens), so it is
  skipped there to keep the encoder fast.
- ``"always"``: every section; then, for any input, a section is at most zstd-19's frame
  of the token-major array plus one byte (the mode byte). Encodes at zstd-19's speed.

NOTE: the decoder is one zstd call plus a few whole-array numpy operations (mode 0: those
of ctx-zstd; modes 1-2: an unpack table lookup), whatever the mode.
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard

from routereplay.codec import ctx_zstd
from routereplay.codec.layer_major import bounded_zstd_decompress
from routereplay.errors import ConfigError, SidecarError

MODE_LAYER, MODE_TOKEN, MODE_PLAIN = 0, 1, 2
LZ_REGIME = 1.03        # try the slow token-major parser when fast token-major <= 1.03 x mode 0
CHECK_BYTES = 2048      # "auto" runs the zstd-19 pass on sections of at most this many plain bytes
PLAIN_LEVEL = 19
_LOCAL = threading.local()


def _compressors() -> dict[str, zstandard.ZstdCompressor]:
    """Thread-local zstd compressors: fast and opt token-major, plain zstd-19.

    NOTE: measured on routing of a briefly trained tiny MoE (benchmarks/trained_routing.py):
    lazy2 with matches of >= 4 bytes runs at 150-200 MB/s on packed ids and lands 5-6 %
    above zstd-19; btultra with search depth 4 and target length 16 lands within 1 % of
    zstd-19 on packed ids at 30-60 MB/s (zstd-19: 2-7 MB/s). Window 2^17: sections of
    records of a few thousand tokens fit; larger ones lose only far matches.
    """
    c = getattr(_LOCAL, "c", None)
    if c is None:
        p = zstandard.ZstdCompressionParameters
        c = _LOCAL.c = {
            "fast": zstandard.ZstdCompressor(compression_params=p.from_level(9, min_match=4)),
            "opt": zstandard.ZstdCompressor(compression_params=p(
                window_log=17, chain_log=16, hash_log=16, search_log=2, min_match=3,
                target_length=16, strategy=zstandard.STRATEGY_BTULTRA)),
            "plain": zstandard.ZstdCompressor(level=PLAIN_LEVEL),
        }
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    if not hasattr(_LOCAL, "d"):
        _LOCAL.d = zstandard.ZstdDecompressor()
    return _LOCAL.d


def _plain(ids: np.ndarray) -> bytes:
    """ids [T, G, K] -> token-major bytes, uint8 or uint16 little-endian."""
    return np.ascontiguousarray(ids).astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()


def _token_major(ids: np.ndarray, num_experts: int) -> bytes:
    """ids [T, G, K] -> mode 1 content: token-major ids, packed as ctx-zstd packs a layer."""
    if ctx_zstd.pack_width(num_experts) > 1:
        return ctx_zstd._pack(np.ascontiguousarray(ids).reshape(-1), num_experts).tobytes()
    return _plain(ids)


def encode(ids: np.ndarray, num_experts: int, check: str = "auto") -> bytes:
    """ids: uint8|uint16 [T, G, top_k] -> an ``xl-zstd`` section (mode byte + payload).

    ``check``: ``"auto"`` (the zstd-19 pass on sections of at most ``CHECK_BYTES`` plain
    bytes) or ``"always"`` (every section: then the section is at most zstd-19 of the
    token-major array plus one byte, for any input; encodes at zstd-19's speed).

    Raises:
        ValueError: an id out of [0, num_experts), ids not uint8 (E <= 256) / uint16
            (E > 256).
        ConfigError (a ValueError): an unknown ``check``.
    """
    if check not in ("auto", "always"):
        raise ConfigError(f"check must be 'auto' or 'always', got {check!r}")
    return _choose(ids, num_experts, check, ctx_zstd.encode(ids, num_experts))


def _choose(ids: np.ndarray, num_experts: int, check: str, mode0: bytes) -> bytes:
    """The smallest section of the modes tried, given mode 0's payload ``mode0``.

    NOTE: a one-layer section's token-major order is its layer-major order: mode 1 would
    hold mode 0's ids without its repeat bitmap, and was never smaller (mode 0 chosen for
    every 512-token one-layer section of the cross-layer and independent sources of
    benchmarks/codec.py), so it is not tried there; mode 2 (the bound) still is."""
    best = bytes([MODE_LAYER]) + mode0
    comp = _compressors()
    if ids.shape[1] == 1:
        return _plain_check(ids, check, best, comp)
    tm = _token_major(ids, num_experts)
    fast = comp["fast"].compress(tm)
    if len(fast) + 1 < len(best):
        best = bytes([MODE_TOKEN]) + fast
    if len(fast) <= LZ_REGIME * len(best):
        opt = comp["opt"].compress(tm)
        if len(opt) + 1 < len(best):
            best = bytes([MODE_TOKEN]) + opt
    return _plain_check(ids, check, best, comp)


def _plain_check(ids: np.ndarray, check: str, best: bytes, comp: dict) -> bytes:
    """``best``, or mode 2 where it is tried (``check``) and smaller."""
    if check == "never":
        return best
    raw = _plain(ids)
    if check == "always" or len(raw) <= CHECK_BYTES:
        plain = comp["plain"].compress(raw)
        if len(plain) + 1 < len(best):
            best = bytes([MODE_PLAIN]) + plain
    return best


def encode_grid(ids: np.ndarray, num_experts: int, token_block: int, layer_group: int,
                check: str = "auto") -> list[bytes]:
    """ids [T, L, top_k] -> the ``xl-zstd`` sections of a version-3 grid, group-major; each
    exactly :func:`encode` of its slice (one-layer groups take their mode-0 payloads from
    :func:`routereplay.codec.ctx_zstd.encode_grid`, one pass over the record).

    ``check``: as :func:`encode`, or ``"never"`` (no zstd-19 pass: the writer's trial of a
    geometry, whose sections it may throw away; :func:`check_grid` adds the pass to
    sections it keeps)."""
    if check not in ("auto", "always", "never"):
        raise ConfigError(f"check must be 'auto', 'always' or 'never', got {check!r}")
    t, nl, _ = ids.shape
    mode0 = ctx_zstd.encode_grid(ids, num_experts, token_block, layer_group)
    out, i = [], 0
    for l0 in range(0, nl, layer_group):
        for r0 in range(0, max(t, 1), token_block):
            part = ids[r0:r0 + token_block, l0:l0 + layer_group]
            out.append(_choose(np.ascontiguousarray(part), num_experts, check, mode0[i]))
            i += 1
    return out


def check_grid(ids: np.ndarray, sections: list[bytes], token_block: int,
               layer_group: int) -> list[bytes]:
    """Sections of :func:`encode_grid` with ``check="never"`` -> those of ``check="auto"``
    (the zstd-19 pass where a section is at most ``CHECK_BYTES`` plain bytes), byte for
    byte."""
    t, nl, _ = ids.shape
    comp = _compressors()
    out, i = [], 0
    for l0 in range(0, nl, layer_group):
        for r0 in range(0, max(t, 1), token_block):
            part = np.ascontiguousarray(ids[r0:r0 + token_block, l0:l0 + layer_group])
            out.append(_plain_check(part, "auto", sections[i], comp))
            i += 1
    return out


def _content(data: bytes, nbytes: int, where: str) -> bytes:
    """A zstd frame that must hold exactly ``nbytes`` bytes -> its content.

    NOTE: a frame that declares its size is checked against ``nbytes`` before anything is
    allocated; one that does not is decompressed with memory bounded by ``nbytes``.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise SidecarError(f"xl-zstd {where} is not a valid zstd frame: {exc}") from None
    if declared >= 0:
        if declared != nbytes:
            raise SidecarError(f"xl-zstd {where} declares {declared} bytes, the shape needs {nbytes}")
        try:
            out = _dctx().decompress(data)
        except zstandard.ZstdError as exc:
            raise SidecarError(f"xl-zstd {where} does not decode: {exc}") from None
        if len(out) != nbytes:
            raise SidecarError(f"xl-zstd {where} holds {len(out)} bytes, declares {nbytes}")
        return out
    return bounded_zstd_decompress(data, nbytes)


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> np.ndarray:
    """``xl-zstd`` section bytes -> ids [T, G, top_k] of ``dtype``.

    Raises:
        SidecarError: an empty section, an unknown mode, ``dtype`` not uint8 (E <= 256) /
            uint16 (E > 256), a payload that does not decode to exactly ``shape``, an id
            >= num_experts (or a packed byte >= E^p).
    """
    t, g, k = shape
    e = num_experts
    dtype = np.dtype(dtype)
    if dtype != (np.uint8 if e <= 256 else np.uint16):
        raise SidecarError(f"xl-zstd stores {e} experts as native "
                           f"{'uint8' if e <= 256 else 'uint16'}, not {dtype.str}")
    if not data:
        raise SidecarError("xl-zstd section is empty (no mode byte)")
    mode, body = data[0], data[1:]
    if mode == MODE_LAYER:
        return ctx_zstd.decode(body, shape, dtype, e)
    n = t * g * k
    per = ctx_zstd.pack_width(e)
    if mode == MODE_TOKEN and per > 1:
        packed = np.frombuffer(_content(body, -(-n // per), "token-major frame"), dtype=np.uint8)
        if packed.size and int(packed.max()) >= e ** per:
            raise SidecarError(f"xl-zstd section holds a packed byte >= {e ** per}")
        return np.take(ctx_zstd._unpack_table(e, per), packed).view(np.uint8)[:n].reshape(shape)
    if mode not in (MODE_TOKEN, MODE_PLAIN):
        raise SidecarError(f"xl-zstd section has unknown mode {mode}")
    raw = _content(body, n * dtype.itemsize, "token-major frame" if mode == MODE_TOKEN
                   else "plain frame")
    ids = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)      # a writable copy
    if ids.size and (e < 256 or dtype.itemsize == 2) and int(ids.max()) >= e:
        raise SidecarError(f"xl-zstd section holds an expert id >= {e}")
    return ids.reshape(shape)
