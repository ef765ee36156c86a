"""Routing codecs: one layer group of a record's ids to bytes and back.

A codec works on ``ids: uint8|uint16 [T, L_g, top_k]`` (one group of MoE layers) and is
named by a short string stored in each routing section's metadata (docs/FORMAT.md
"Routing codecs", where each one's measured reason is given):

- ``xl-zstd`` (default, also for sorted column order): per section the smaller of
  ``ctx-zstd`` (layer-major) and a token-major zstd frame of packed ids (zstd copies a
  token's path through the layers from an earlier token), with zstd-19 on the plain array
  as the fallback that bounds it (routereplay.codec.xl_zstd);
- ``ctx-zstd``: per-layer repeat bitmap and id bytes, then zstd with a Huffman table per
  layer (routereplay.codec.ctx_zstd); the writers' fallback, and format 2's default;
- ``raw-lm``: layer-major bytes, uncompressed (routereplay.codec.layer_major): the
  fallback of near-constant routing, and for debugging.

The codecs of routereplay 0.2 that 0.3.0 removed (:data:`REMOVED_CODECS`) are refused by
name: ConfigError from a writer, SidecarError from a reader, with :func:`removed_codec_error`.
Decoders never allocate more than the section's shape allows (its metadata, itself capped
by the reader), and where a frame does not declare its size, memory grows with the data.
"""
from __future__ import annotations

import numpy as np

from routereplay.codec import ctx_zstd, layer_major, xl_zstd
from routereplay.codec.layer_major import bounded_zstd_decompress
from routereplay.errors import ConfigError, RecordError, SidecarError

DEFAULT_CODEC = "xl-zstd"
CODECS = ("xl-zstd", "ctx-zstd", "raw-lm")
WRITER_CODECS = CODECS
REMOVED_CODECS = ("xl-ans", "xl-ans-rows", "ctx-ans", "ctx-ans-sorted", "zstd-lm")

__all__ = ["CODECS", "WRITER_CODECS", "DEFAULT_CODEC", "REMOVED_CODECS", "removed_codec_error",
           "encode", "encode_grid", "decode", "bounded_zstd_decompress"]


def removed_codec_error(what: str) -> str:
    """The message for something routereplay 0.3.0 removed (``what``, e.g. "codec
    'ctx-ans'", "format version 1"): which release reads it and how to convert it."""
    # NOTE: in an environment of its own: installing 0.2 over this one would downgrade it
    return (f"{what} was removed in routereplay 0.3.0; routereplay 0.2.x reads it and "
            "converts it, in an environment of its own: python -m venv rr02 && rr02/bin/pip "
            "install 'routereplay==0.2.*' && rr02/bin/routereplay convert --from sidecar IN "
            "--out OUT --codec xl-zstd")


def encode(ids: np.ndarray, codec: str = DEFAULT_CODEC, num_experts: int | None = None) -> bytes:
    """Encode ids [T, L_g, top_k] (uint8 or uint16) with ``codec``; ``num_experts``
    (logical routed experts) is required by ``ctx-zstd`` and ``xl-zstd``.

    Raises:
        ConfigError (a ValueError): unknown or removed codec, no num_experts.
        RecordError (a ValueError): not a uint8/uint16 array [T, L_g, top_k], or ids the
            codec cannot represent (out of range, a repeated expert in a row).
    """
    if not isinstance(ids, np.ndarray) or ids.ndim != 3 or ids.dtype not in (np.uint8, np.uint16):
        raise RecordError(f"ids must be a uint8 or uint16 array [T, L_g, top_k], got "
                          f"{getattr(ids, 'dtype', type(ids).__name__)} "
                          f"{getattr(ids, 'shape', '')}")
    if codec in REMOVED_CODECS:
        raise ConfigError(removed_codec_error(f"codec {codec!r}"))
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {CODECS}")
    if codec == "raw-lm":
        return layer_major.encode(ids)
    if num_experts is None:
        raise ConfigError(f"codec {codec!r} needs num_experts")
    if codec == "ctx-zstd":
        return ctx_zstd.encode(ids, num_experts)
    return xl_zstd.encode(ids, num_experts)


def encode_grid(ids: np.ndarray, codec: str, num_experts: int | None, token_block: int,
                layer_group: int, check: str = "auto") -> list[bytes]:
    """The sections of a version-3 grid (docs/FORMAT.md "Sections"): ids [T, L, top_k]
    in layer groups of ``layer_group`` x token blocks of ``token_block`` rows, group-major,
    each exactly ``encode(ids[rows, layers], codec, num_experts)``. ``ctx-zstd`` and
    ``xl-zstd`` do the per-row work once over the record (their per-section fixed cost is
    what limits a grid's encode speed). ``check``: ``xl-zstd``'s zstd-19 pass
    (routereplay.codec.xl_zstd.encode_grid: ``"auto"``, ``"always"`` or ``"never"``).

    Raises:
        as :func:`encode`.
    """
    t, nl = (ids.shape[0], ids.shape[1]) if isinstance(ids, np.ndarray) and ids.ndim == 3 \
        else (0, 0)
    if codec in ("ctx-zstd", "xl-zstd") and isinstance(ids, np.ndarray) and ids.ndim == 3 \
            and ids.dtype in (np.uint8, np.uint16) and num_experts is not None:
        if codec == "ctx-zstd":
            return ctx_zstd.encode_grid(ids, num_experts, token_block, layer_group)
        return xl_zstd.encode_grid(ids, num_experts, token_block, layer_group, check=check)
    return [encode(np.ascontiguousarray(ids[r0:r0 + token_block, l0:l0 + layer_group]), codec,
                   num_experts)
            for l0 in range(0, nl, layer_group) for r0 in range(0, max(t, 1), token_block)]


def decode(data: bytes, codec: str, shape: tuple[int, int, int], dtype: np.dtype,
           num_experts: int | None = None) -> np.ndarray:
    """Decode a section back to ids [T, L_g, top_k] of ``dtype``; ``shape`` is (T, L_g,
    top_k) from the frame metadata.

    Raises:
        SidecarError: unknown or removed codec (:func:`removed_codec_error`), a shape
            that is not three non-negative ints, a num_experts below 1 (``ctx-zstd``,
            ``xl-zstd``), or bytes that do not decode to ``shape``.
    """
    if len(shape) != 3 or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or n < 0 for n in shape) or shape[2] < 1:
        raise SidecarError(f"routing section shape {tuple(shape)} is not [T, layers, top_k >= 1]")
    shape = tuple(int(n) for n in shape)
    if codec in REMOVED_CODECS:
        raise SidecarError(removed_codec_error(f"routing codec {codec!r}"))
    if codec == "raw-lm":
        return layer_major.decode(data, shape, dtype)
    if codec not in CODECS:
        raise SidecarError(f"unknown routing codec {codec!r}; known: {CODECS}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
            or num_experts < 1:
        raise SidecarError(f"codec {codec!r} needs num_experts, an int >= 1, got {num_experts!r}")
    if codec == "ctx-zstd":
        return ctx_zstd.decode(data, shape, dtype, num_experts)
    return xl_zstd.decode(data, shape, dtype, num_experts)
