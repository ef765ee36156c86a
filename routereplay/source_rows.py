"""What a routing source's fetch returns (:data:`Rows`) and the checks every source applies:
the ids it takes or decodes (:func:`checked_ids`), the fetch arguments
(:func:`check_fetch_args`); :func:`rows_of` answers a fetch from one in-memory record."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from routereplay.errors import AlignmentError, ConfigError, RecordError
from routereplay.record import RoutingRecord, eplb_id_hint
from routereplay.schema import RoutingSchema
from routereplay.token_layout import host_array

#: What :meth:`RoutingSource.fetch` returns per token run: ``(ids, first)``.
#:
#: - ``ids``: ``schema.id_dtype`` (uint8 up to 256 experts, uint16 above)
#:   [n, len(moe_layers), K]: ``ids[i, j]`` are the K logical expert ids (in
#:   ``[0, num_experts)``, distinct within the row) of MoE layer ``moe_layers[j]`` at token
#:   position ``first + i``, in the source's column order (the engine's top-k slot order;
#:   ascending for :func:`sorted_order_samples`). Read-only: may be a view of the source.
#: - ``first``: int, the token position (0-based, whole sequence) of row 0.
#:
#: No sentinel value: positions the source holds no routing for are not in the rows
#: (``n == 0`` and ``first`` = the clipped ``lo`` when it holds none);
#: :func:`routereplay.align.gather_rows` marks them ``MISSING`` (-1) for the fallback.
Rows = tuple[np.ndarray, int]


def checked_ids(ids: object, schema: RoutingSchema, sample_id: str, *, start: int = 0,
                layer_ids: Sequence[int] | None = None,
                positions: Sequence[int] | None = None) -> np.ndarray:
    """The one check every source applies to the ids it takes: integer ids (any width,
    signed or not; a CPU torch tensor is accepted) of shape [T, L, K], each in
    ``[0, num_experts)`` (checked before narrowing, which would wrap 258 -> 2 and -1 ->
    255), distinct within a row.

    Args:
        ids: int [T, len(layer_ids), K].
        start: token position of row 0 (for messages).
        layer_ids: decoder-layer ids of the L layers (default every MoE layer).
        positions: token position of each row, when the rows are not consecutive
            positions from ``start`` (for messages).
    Returns:
        ``schema.id_dtype`` [T, L, K] (``ids`` itself when it already has that dtype).
    Raises:
        RecordError: naming the sample, the token position and the decoder layer of the
            first bad id (bool, float or other non-integer ids, wrong shape included).
    """
    layer_ids = list(schema.moe_layer_ids if layer_ids is None else layer_ids)
    try:
        a = host_array(ids, f"sample {sample_id!r}: expert ids")
    except AlignmentError as e:
        raise RecordError(str(e)) from None
    if a.ndim != 3 or a.dtype.kind not in "iu" or a.shape[1:] != (len(layer_ids), schema.top_k):
        raise RecordError(f"sample {sample_id!r}: expert ids are {a.dtype} {tuple(a.shape)}, "
                          f"expected integer [T, {len(layer_ids)} MoE layers, "
                          f"top_k={schema.top_k}]")
    def where(t: int, lyr: int) -> str:
        p = start + t if positions is None else int(positions[t])
        return f"sample {sample_id!r}, token {p}, layer {layer_ids[lyr]}"

    if a.size:
        bad = ((a < 0) | (a >= schema.num_experts)).reshape(-1)
        i = int(np.argmax(bad))
        if bad[i]:
            t, lyr, k = (int(x) for x in np.unravel_index(i, a.shape))
            v = int(a[t, lyr, k])
            raise RecordError(f"{where(t, lyr)}: expert id {v} outside "
                              f"[0, {schema.num_experts})"
                              f"{eplb_id_hint(v, a.dtype, schema.num_experts)}")
    out = a if a.dtype == schema.id_dtype else a.astype(schema.id_dtype)
    if schema.top_k > 1 and out.size:
        srt = np.sort(out, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1).reshape(-1)
        i = int(np.argmax(dup))
        if dup[i]:
            t, lyr = (int(x) for x in np.unravel_index(i, out.shape[:2]))
            hint = (" (all-zero row: the capturer was never bound, a dense layer was read "
                    "as MoE, or a row without routing was not masked out: pass "
                    "routing_mask= for batches whose prompt rows carry no routing)"
                    if not out[t, lyr].any() else "")
            raise RecordError(f"{where(t, lyr)}: duplicate expert ids {out[t, lyr].tolist()} "
                              f"in one top-k row{hint}")
    return out


def _clip(start: int, num_tokens: int, lo: int, hi: int) -> tuple[int, int]:
    a = min(max(int(lo), start), start + num_tokens)
    return a, min(max(int(hi), a), start + num_tokens)


def check_fetch_args(moe_layers: Sequence[int], runs: Sequence[tuple[int, int]],
                     num_moe_layers: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``moe_layers`` and ``runs`` of a :meth:`RoutingSource.fetch` call as int lists.

    Raises:
        ConfigError: a layer position that is not an int in ``[0, num_moe_layers)`` or is
            repeated; a run that is not a pair of ints.
    """
    def as_int(x: object) -> int:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ConfigError(f"expected an integer, got {x!r}")
        return int(x)
    try:
        layers = [as_int(x) for x in moe_layers]
        pairs = []
        for run in runs:
            if len(run) != 2:
                raise ConfigError(f"a token run is a pair (lo, hi), got {run!r}")
            pairs.append((as_int(run[0]), as_int(run[1])))
    except TypeError:
        raise ConfigError(f"moe_layers and runs must be sequences, got {moe_layers!r}, "
                          f"{runs!r}") from None
    for lyr in layers:
        if not 0 <= lyr < num_moe_layers:
            raise ConfigError(f"MoE layer position {lyr} out of range [0, {num_moe_layers})")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"moe_layers {layers} repeat a MoE layer position")
    return layers, pairs


def rows_of(record: RoutingRecord, moe_layers: Sequence[int],
            runs: Sequence[tuple[int, int]]) -> list[Rows]:
    """:meth:`RoutingSource.fetch` on one in-memory record (views where possible).

    Raises:
        ConfigError: see :func:`check_fetch_args`.
    """
    layers, runs = check_fetch_args(moe_layers, runs, record.expert_ids.shape[1])
    out = []
    for lo, hi in runs:
        a, b = _clip(record.start, record.num_tokens, lo, hi)
        ids = record.expert_ids[a - record.start:b - record.start]
        out.append((ids[:, layers] if layers != list(range(ids.shape[1])) else ids, a))
    return out
