"""Routing codecs: one layer group of a record's ids to bytes and back.

A codec works on ``ids: uint8|uint16 [T, L_g, top_k]`` (one group of MoE layers) and is
named by a short string stored in each routing section's metadata (docs/FORMAT.md):

- ``xl-zstd`` (default): per section the smaller of ``ctx-zstd`` (layer-major) and a
  token-major zstd frame of packed ids (zstd copies a token's path through the layers from
  an earlier token: the correlation across layers of trained models' routing), with
  zstd-19 on the plain array as the fallback that bounds it (routereplay.codec.xl_zstd).
  Chosen by measurement with format 3's geometry (benchmarks/README.md, issue 18): 4-10 %
  smaller whole files than ``ctx-zstd`` on a trained model's routing, within 0.3 % (a mode
  byte per section) on synthetic routing; one-layer grid sections code as ``ctx-zstd``.
- ``xl-ans`` (opt-in): a cross-layer context model learned from a stream's earlier records
  and stored once in the stream (a model frame), driving an rANS coder
  (routereplay.codec.xl_ans). On the cross-layer source at 1K-token records: whole streams
  at 1.039x the entropy rate (64 records; 1.024x at 256), about 14 % below ``xl-zstd``
  (7-8 % where layers are coupled less); 2 <= E
  <= 64. Coded by numba kernels where numba imports (routereplay.codec.xl_ans_jit: about
  61-66 MB/s encode, 84-92 decode a section at E=8 top-2; 11-15 at E=64 top-6), else by
  constriction (the same bytes, about 10 MB/s; 2-3 at E=64). Sections name their model frame by offset
  (:data:`ModelResolver`).
- ``xl-ans-rows``: the ``xl-ans`` model coded one symbol per row (routereplay.codec
  .xl_ans_rows), for top-1 and top-2 of at most 8 experts: the same size, about 140 / 210
  MB/s a section at E=8 top-2 (2-3x ``xl-ans``). A writer of ``xl-ans`` picks it per
  section where it applies; it is not a writer's codec (:data:`WRITER_CODECS`).
- ``ctx-zstd``: per-layer repeat bitmap and id bytes, then zstd with a Huffman table per
  layer (routereplay.codec.ctx_zstd); the default before format 3, and the default of a
  ``format_version=2`` writer (readers older than ``xl-zstd`` know it).
- ``ctx-ans``: our adaptive context model (repeat flags, popularity ranks with
  exclusion) driving constriction's rANS coder (routereplay.codec.ctx_ans). 2-5 % below
  ``ctx-zstd`` on most traces (11 % with long repeat runs), at 5-30 MB/s. Column order
  preserved.
- ``ctx-ans-sorted``: ``ctx-ans`` for streams declared ``column_order: "sorted"`` (the
  writer's choice for sorted streams).
- ``zstd-lm`` / ``raw-lm``: layer-major bytes, zstd-compressed or raw (version 1 streams).

Decoders never allocate more than the section's shape allows (its metadata, itself capped
by the reader), and where a frame does not declare its size, memory grows with the data.
"""
from __future__ import annotations

import numpy as np

from typing import Callable

from routereplay.codec import ctx_ans, ctx_zstd, layer_major, xl_ans, xl_ans_rows, xl_zstd
from routereplay.codec.layer_major import bounded_zstd_decompress
from routereplay.errors import ConfigError, RecordError, SidecarError

DEFAULT_CODEC = "xl-zstd"
V2_DEFAULT_CODEC = "ctx-zstd"          # a format-2 writer's default (older readers)
CODECS = ("ctx-zstd", "xl-zstd", "xl-ans", "xl-ans-rows", "ctx-ans", "ctx-ans-sorted", "zstd-lm",
          "raw-lm")

# what a writer may be set to: xl-ans-rows is a layout the xl-ans writer picks per section
WRITER_CODECS = tuple(c for c in CODECS if c != "xl-ans-rows")
_MODEL_CODECS = ("ctx-zstd", "xl-zstd", "xl-ans", "xl-ans-rows", "ctx-ans",
                 "ctx-ans-sorted")                                  # need num_experts
_XL_ANS = {"xl-ans": xl_ans, "xl-ans-rows": xl_ans_rows}       # codecs that name a model frame
# NOTE: an xl-ans section names its model by the offset of the model frame in its stream;
# a reader resolves it (reads, checks and caches the frame) through this callable.
ModelResolver = Callable[[int], "xl_ans.XlModel"]

__all__ = ["CODECS", "WRITER_CODECS", "DEFAULT_CODEC", "V2_DEFAULT_CODEC", "encode", "encode_grid", "decode", "bounded_zstd_decompress"]


def encode(ids: np.ndarray, codec: str = DEFAULT_CODEC, num_experts: int | None = None, *,
           model: tuple[int, "xl_ans.XlModel"] | None = None, moe_layer0: int = 0) -> bytes:
    """Encode ids [T, L_g, top_k] (uint8 or uint16) with ``codec``.

    ``num_experts`` (logical routed experts) is required by the ``ctx-*`` and ``xl-*``
    codecs. ``xl-ans`` also needs ``model`` = (offset of its model frame in the stream,
    the model as a reader parses it) and ``moe_layer0``, the position of the section's
    first layer among the stream's MoE layers.

    Raises:
        ConfigError (a ValueError): unknown codec, no num_experts for a ``ctx-*`` or
            ``xl-*`` codec, ``xl-ans`` without ``model`` or with a model of other E.
        RecordError (a ValueError): not a uint8/uint16 array [T, L_g, top_k], or ids the
            codec cannot represent (out of range, a repeated expert in a row, unsorted rows
            for ``ctx-ans-sorted``).
    """
    if not isinstance(ids, np.ndarray) or ids.ndim != 3 or ids.dtype not in (np.uint8, np.uint16):
        raise RecordError(f"ids must be a uint8 or uint16 array [T, L_g, top_k], got "
                          f"{getattr(ids, 'dtype', type(ids).__name__)} "
                          f"{getattr(ids, 'shape', '')}")
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {CODECS}")
    if codec in ("raw-lm", "zstd-lm"):
        return layer_major.encode(ids, codec)
    if codec in _MODEL_CODECS and num_experts is None:
        raise ConfigError(f"codec {codec!r} needs num_experts")
    if codec == "ctx-zstd":
        return ctx_zstd.encode(ids, num_experts)
    if codec == "xl-zstd":
        return xl_zstd.encode(ids, num_experts)
    if codec in _XL_ANS:
        if model is None:
            raise ConfigError(f"codec {codec!r} needs model=(model frame offset, XlModel)")
        if model[1].num_experts != num_experts:
            raise ConfigError(f"xl-ans model is for {model[1].num_experts} experts, not {num_experts}")
        from routereplay.sidecar.layout import varint
        return varint(int(model[0])) + _XL_ANS[codec].encode(ids, model[1], moe_layer0)
    if codec in ("ctx-ans", "ctx-ans-sorted"):
        return ctx_ans.encode(ids, num_experts, sorted_rows=codec == "ctx-ans-sorted")
    raise ConfigError(f"unknown codec {codec!r}; known: {CODECS}")


def encode_grid(ids: np.ndarray, codec: str, num_experts: int | None, token_block: int,
                layer_group: int, check: str = "auto") -> list[bytes]:
    """The sections of a version-3 grid (docs/FORMAT.md "Sections"): ids [T, L, top_k]
    in layer groups of ``layer_group`` x token blocks of ``token_block`` rows, group-major,
    each exactly ``encode(ids[rows, layers], codec, num_experts)`` (not ``xl-ans``, whose
    sections need their stream's model: routereplay.sidecar.payload). ``ctx-zstd`` and
    ``xl-zstd`` do the per-row work once over the record (their per-section fixed cost is
    what limits a grid's encode speed). ``check``: ``xl-zstd``'s zstd-19 pass
    (routereplay.codec.xl_zstd.encode_grid: ``"auto"``, ``"always"`` or ``"never"``);
    other codecs ignore it.

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
           num_experts: int | None = None, *, models: ModelResolver | None = None,
           moe_layer0: int = 0) -> np.ndarray:
    """Decode a section back to ids [T, L_g, top_k] of ``dtype``.

    ``shape`` is (T, L_g, top_k) from the frame metadata. ``xl-ans`` sections also need
    ``models`` (model frame offset -> XlModel, raising SidecarError) and ``moe_layer0``
    (the section's first MoE-layer position).

    Raises:
        SidecarError: unknown codec, a shape that is not three non-negative ints, a
            num_experts below 1 (``ctx-*``, ``xl-*``), an ``xl-ans`` section without a
            model resolver or whose model does not resolve, or bytes that do not decode to
            ``shape``.
    """
    if len(shape) != 3 or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or n < 0 for n in shape) or shape[2] < 1:
        raise SidecarError(f"routing section shape {tuple(shape)} is not [T, layers, top_k >= 1]")
    shape = tuple(int(n) for n in shape)
    if codec in _MODEL_CODECS:
        if num_experts is None:
            raise SidecarError(f"codec {codec!r} needs num_experts")
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
                or num_experts < 1:
            raise SidecarError(f"num_experts {num_experts!r} is not an int >= 1")
    if codec in ("raw-lm", "zstd-lm"):
        return layer_major.decode(data, codec, shape, dtype)
    if codec == "ctx-zstd":
        return ctx_zstd.decode(data, shape, dtype, num_experts)
    if codec == "xl-zstd":
        return xl_zstd.decode(data, shape, dtype, num_experts)
    if codec in _XL_ANS:
        if models is None:
            raise SidecarError(f"an {codec} section needs its stream's model frames (read it "
                               "through SidecarReader)")
        if dtype != np.uint8:
            raise SidecarError(f"{codec} stores ids as uint8, not {np.dtype(dtype).str}")
        from routereplay.sidecar.layout import read_varint
        try:
            off, pos = read_varint(memoryview(data), 0)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt section
            raise SidecarError(f"{codec} section's model offset does not parse: {exc}") from None
        # NOTE: before the model is resolved: a section under the floor costs nothing
        if codec == "xl-ans":
            xl_ans.check_floor(len(data) - pos, shape[1], shape[2])
        else:
            xl_ans_rows.check_floor(len(data) - pos, shape[1])
        model = models(off)
        if model.num_experts != num_experts:
            raise SidecarError(f"xl-ans model at offset {off} is for {model.num_experts} "
                               f"experts, not {num_experts}")
        return _XL_ANS[codec].decode(bytes(data[pos:]), shape, dtype, model, moe_layer0)
    if codec in ("ctx-ans", "ctx-ans-sorted"):
        return ctx_ans.decode(data, shape, dtype, num_experts, sorted_rows=codec == "ctx-ans-sorted")
    raise SidecarError(f"unknown routing codec {codec!r}; known: {CODECS}")
