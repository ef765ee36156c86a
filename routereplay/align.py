"""Alignment of routing records to a trainer's token layout: the rows of a rank's token map
(:mod:`routereplay.token_layout`, whose names are importable from here too) gathered from a
routing source, checked, and filled where no routing was recorded (``MISSING``, -1).
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from routereplay.errors import AlignmentError
from routereplay.schema import RoutingSchema
from routereplay.token_layout import (MISSING, Layout, Shard, TokenMap, host_array,  # noqa: F401
                                      jagged_parts, token_map, verl_thd_layout)

# fetch(j, runs) -> [(ids [n, L_local, K], first), ...]: the rows of sample j for each
# position run [lo, hi) of ``runs`` (one call per sample, all of its runs at once), as
# routereplay.source.RoutingSource.fetch returns them; n may be 0.
Fetch = Callable[[int, list[tuple[int, int]]], list[tuple[np.ndarray, int]]]


def replay_dtype(num_experts: int) -> np.dtype:
    """The width replay rows keep from the gather to the router: int16 (int32 above 32767
    experts), signed so that ``MISSING`` (-1) marks rows without routing."""
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


def gather_rows(tmap: TokenMap, fetch: Fetch, num_layers: int, top_k: int,
                dtype: np.dtype | type = np.int16) -> np.ndarray:
    """Routing rows for a token map.

    Args:
        tmap: this rank's rows (see :func:`token_map`).
        fetch: reads one sample's rows for its position runs (already restricted to the
            layers this rank needs); called once per sample (see :data:`Fetch`).
        num_layers: L_local, MoE layers returned by ``fetch``.
        top_k: K.
        dtype: signed integer dtype of the result (:func:`replay_dtype`).
    Returns:
        ``dtype`` [N, L_local, K]: replay ids in router row order; rows without routing
        (padding, positions the record does not cover) are all ``MISSING``.

    Raises:
        AlignmentError: ``fetch`` returned rows of another shape or too many rows.
    """
    out = np.full((tmap.num_rows, num_layers, top_k), MISSING, dtype)
    for j, runs in tmap.ranges().items():
        rows = np.flatnonzero(tmap.sample == j)
        p = tmap.position[rows]
        got = fetch(j, runs)
        if len(got) != len(runs):
            raise AlignmentError(f"sample #{j}: {len(got)} row blocks fetched for "
                                 f"{len(runs)} position runs")
        for (lo, hi), (ids, first) in zip(runs, got):
            n = ids.shape[0]
            if n == 0:
                continue
            if ids.shape[1:] != (num_layers, top_k) or first < lo or first + n > hi:
                raise AlignmentError(f"sample #{j}: fetched rows {tuple(ids.shape)} from "
                                     f"position {first} for run [{lo}, {hi}), expected "
                                     f"[<= {hi - lo}, {num_layers}, {top_k}] inside the run")
            sel = (p >= first) & (p < first + n)
            out[rows[sel]] = ids[p[sel] - first]
    return out


def check_rows(ids: np.ndarray, tmap: TokenMap, schema: RoutingSchema,
               layer_ids: Sequence[int], sample_ids: Sequence[str], *,
               num_groups: int | None = None, topk_group: int | None = None) -> None:
    """Validate what a layout adds to routing rows, before they reach a router (the ids'
    range and repeats are checked once, by the routing source: routereplay.source).

    Args:
        ids: signed int [N, L_local, K] from :func:`gather_rows`.
        tmap: the rows' token map.
        layer_ids: decoder-layer id (0-based) of each of the L_local layers.
        sample_ids: record id of each sample of the microbatch.
        num_groups, topk_group: group-limited routing (DeepSeek-V3 ``n_group`` and
            ``topk_group``): the experts of a row may come from at most ``topk_group`` of
            ``num_groups`` equal groups.
    Raises:
        AlignmentError: naming the sample, token position and decoder layer of the first bad
            row: a row that is partly missing, routing on a padding row, a group-limit
            violation; or rows of the wrong shape.
    """
    if ids.ndim != 3 or ids.shape[0] != tmap.num_rows or ids.shape[1] != len(layer_ids) \
            or ids.shape[2] != schema.top_k:
        raise AlignmentError(f"replay rows have shape {tuple(ids.shape)}, expected "
                             f"[{tmap.num_rows}, {len(layer_ids)}, {schema.top_k}]")
    if len(tmap.sample) and int(tmap.sample.max()) >= len(sample_ids):
        raise AlignmentError(f"token map names sample #{int(tmap.sample.max())} but only "
                             f"{len(sample_ids)} sample ids were given")
    if ids.size == 0:
        return
    e = schema.num_experts

    def fail(row: int, layer: int, why: str) -> None:
        j = int(tmap.sample[row])
        who = f"sample {sample_ids[j]!r}" if j >= 0 else "a padding slot"
        raise AlignmentError(f"{who}, token position {int(tmap.position[row])}, decoder layer "
                             f"{layer_ids[layer]} (router row {row}): {why}")

    miss = ids == MISSING
    all_miss = miss.all(-1)                                   # [N, L]
    partial = miss.any(-1) & ~all_miss
    if partial.any():
        r, l = np.argwhere(partial)[0]
        fail(r, l, f"row {ids[r, l].tolist()} is partly missing (-1)")
    pad = (tmap.sample < 0)[:, None] & ~all_miss
    if pad.any():
        r, l = np.argwhere(pad)[0]
        fail(r, l, "a padding slot carries routing")
    if num_groups and topk_group and num_groups > 1:
        if e % num_groups:
            raise AlignmentError(f"num_experts {e} is not divisible by num_groups {num_groups}")
        g = np.where(miss, MISSING, ids // (e // num_groups))
        gs = np.sort(g, -1)
        distinct = ((gs[..., 1:] != gs[..., :-1]) & (gs[..., 1:] != MISSING)).sum(-1) + 1
        over = (distinct > topk_group) & ~all_miss
        if over.any():
            r, l = np.argwhere(over)[0]
            fail(r, l, f"experts {ids[r, l].tolist()} span {int(distinct[r, l])} expert groups "
                       f"but routing is limited to topk_group={topk_group} of {num_groups}")


def coverage(ids: np.ndarray, tmap: TokenMap) -> tuple[int, int]:
    """Routing coverage of one rank's rows.

    Args:
        ids: signed int [N, L, K] (MISSING rows have no routing); tmap: its token map.
    Returns:
        (token-layer rows with routing, token-layer rows): padding slots are not counted,
        a token counts once per layer.
    """
    real = tmap.sample >= 0
    have = ~(ids == MISSING).all(-1)             # [N, L]
    return int(have[real].sum()), int(real.sum() * ids.shape[1])


@functools.lru_cache(maxsize=16)
def _bit_reversed(num_experts: int) -> np.ndarray:
    """[0, E) in bit-reversed order (reversed over the next power of two, values >= E
    dropped): consecutive entries land far apart in the expert range."""
    m = max(1, (num_experts - 1).bit_length())
    t = np.arange(1 << m, dtype=np.int64)
    r = np.zeros_like(t)
    for b in range(m):
        r |= ((t >> b) & 1) << (m - 1 - b)
    out = r[r < num_experts]
    out.flags.writeable = False
    return out


def fill_dummy(ids: np.ndarray, num_experts: int, sample_ids: Sequence[str] = (),
               layer_ids: Sequence[int] | None = None, shard: Shard = Shard()) -> np.ndarray:
    """Rows without routing -> distinct dummy ids, spread over experts, expert-parallel
    ranks, data-parallel ranks, microbatches and layers (for dispatchers that need exactly
    top_k distinct experts per row and no trainer fallback).

    Rule: the experts are walked as a cycle in bit-reversed order (``order``: for E = 8,
    0 4 2 6 1 5 3 7; for E not a power of two, the bit-reversed order of the next power of
    two without the values >= E). In layer l, the j-th row without routing (j = 0, 1, ... in
    row order) gets ``order[((c_l + j) * K + arange(K)) % E]``, where the start
    ``c_l = blake2b(sample_ids, sequence-split index, layer_ids[l]) % E``; the
    sequence-split index is ``cp_rank * tp + tp_rank`` with sequence parallel, ``cp_rank``
    without (tensor-parallel ranks that see the same rows get the same ids).

    - Distinct within a row (K <= E consecutive entries of the cycle), within [0, E).
    - Within one call and layer, the rows' windows tile the cycle, so per-expert counts
      differ by at most 1 (NOTE: numbering by the row's own index would flood a few experts
      when the rows without routing are spaced regularly).
    - Spread over expert-parallel ranks (NOTE: megatron places experts contiguously, EP rank
      r holding ``[r*E/ep, (r+1)*E/ep)``): for E and ep powers of two, any ep consecutive
      cycle entries hit every EP rank once, so one call's per-EP-rank counts differ by at
      most 1 in every layer; other E spread within 1.5x of the fair share
      (tests/test_dummy_fallback.py).
    - The hashed start makes microbatches (hence data-parallel ranks), context-/sequence-
      parallel ranks and layers begin at different points of the cycle; blake2b, not the
      salted ``hash()``, so every process and run computes the same ids.

    Args:
        ids: signed int [N, L, K] (``MISSING`` rows have no routing); returned as a new array
            of the same dtype.
        num_experts: E.
        sample_ids: the microbatch's sample ids (its record ids, in batch order).
        layer_ids: decoder layer id of each of the L layers (default ``0 .. L-1``).
        shard: this rank's place in the sequence splits.
    Raises:
        AlignmentError: ``layer_ids`` does not name L layers.
    """
    out = ids.copy()
    miss = (out == MISSING).all(-1)                 # [N, L]
    if not miss.any():
        return out
    n_layers, k = out.shape[1], out.shape[2]
    layer_ids = range(n_layers) if layer_ids is None else layer_ids
    if len(layer_ids) != n_layers:
        raise AlignmentError(f"fill_dummy: {len(layer_ids)} layer ids for rows of {n_layers} "
                             "layers")
    split = shard.cp_rank * shard.tp_size + shard.tp_rank if shard.sequence_parallel \
        else shard.cp_rank
    head = "\0".join(sample_ids).encode() + b"\1" + str(split).encode()
    start = np.array([int.from_bytes(hashlib.blake2b(head + b"\1" + str(int(lid)).encode(),
                                                     digest_size=8).digest(), "little")
                      % num_experts for lid in layer_ids], np.int64)       # [L]
    j = np.cumsum(miss, axis=0) - 1                 # [N, L]: index among the layer's dummy rows
    r, l = np.nonzero(miss)
    pos = ((start[l] + j[r, l])[:, None] * k + np.arange(k)[None]) % num_experts
    out[r, l] = _bit_reversed(num_experts)[pos].astype(out.dtype)
    return out


def tokens_by_sample(layout: Layout, tokens: Any) -> list[np.ndarray]:
    """Each sample's token ids, in position order, from the microbatch's input ids.

    Args:
        layout: the microbatch's layout.
        tokens: host integer ids laid out as the layout says: bshd ``[b, seq_len]``
            (a [b, s'] tensor with s' >= the columns used is accepted); THD ``[1, t]`` or
            ``[t]``; or a sequence of ``b`` 1-D arrays, sample j's ids in position order
            (``lengths[j]`` of them; packed layouts and bshd without padding only).
    Returns:
        int64 [lengths[j]] per sample.
    Raises:
        AlignmentError: ``tokens`` do not match the layout (shape, count, non-integer);
            per-sample sequences for a padded bshd layout (their placement could not be
            checked); a tensor on a device (see :func:`host_array`).
    """
    b = layout.batch_size
    if isinstance(tokens, (list, tuple)):
        if len(tokens) != b:
            raise AlignmentError(f"tokens: {len(tokens)} sequences for a microbatch of {b} "
                                 "samples")
        if not layout.packed and any(n < layout.seq_len for n in layout.lengths):
            # NOTE: per-sample ids say nothing of where the samples sit in a padded [b, s]
            # batch: a layout with the wrong padding side would pass the check.
            raise AlignmentError(
                "tokens: per-sample sequences cannot check a padded bshd layout (where each "
                "sample sits in its row); pass the microbatch's input ids [b, s] as the model "
                "gets them (or build it with Microbatch.from_attention_mask(..., input_ids=))")
        out = [host_array(t, f"tokens of sample #{j}") for j, t in enumerate(tokens)]
        for j, (t, n) in enumerate(zip(out, layout.lengths)):
            if t.ndim != 1 or t.shape[0] != n or (t.size and t.dtype.kind not in "iu"):
                raise AlignmentError(f"tokens of sample #{j}: {t.dtype} {tuple(t.shape)}, "
                                     f"expected {n} integer ids (the layout's length)")
        return [t.astype(np.int64) for t in out]
    t = host_array(tokens, "tokens")
    if t.size and t.dtype.kind not in "iu":
        raise AlignmentError(f"tokens must be integer ids, got {t.dtype}")
    cols = layout.columns()
    if layout.packed:
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1 or t.shape[0] < layout.cu_seqlens_padded[-1]:
            raise AlignmentError(f"tokens {tuple(t.shape)} do not match the packed layout "
                                 f"([1, t] with t >= {layout.cu_seqlens_padded[-1]})")
        return [t[a:a + n].astype(np.int64) for a, n in zip(cols, layout.lengths)]
    need = max((a + n for a, n in zip(cols, layout.lengths)), default=0)
    if t.ndim != 2 or t.shape[0] != b or t.shape[1] < need:
        raise AlignmentError(f"tokens {tuple(t.shape)} do not match the microbatch layout "
                             f"([b={b}, s={layout.seq_len}])")
    return [t[j, a:a + n].astype(np.int64) for j, (a, n) in
            enumerate(zip(cols, layout.lengths))]


def check_tokens(layout: Layout, trainer: Sequence[np.ndarray], sample_ids: Sequence[str],
                 recorded: Callable[[int], np.ndarray | None]) -> int:
    """Compare the trainer's token ids with the records' before replaying them.

    Args:
        layout: the microbatch's layout (``first`` places each sample's tokens).
        trainer: per sample, its token ids (:func:`tokens_by_sample`).
        sample_ids: record id of each sample.
        recorded: j -> the record's token ids int [N] (the whole sequence), or None when
            the routing source holds none for that sample.
    Returns:
        number of samples compared (samples with no tokens in the layout are not asked for).
    Raises:
        AlignmentError: naming the sample and the first differing token position (and the
            two ids), a trainer sequence that runs past the record's tokens, or a sample
            whose record holds no token ids (the check was asked for: never skipped
            silently).
    """
    first = layout.first or (0,) * layout.batch_size
    checked = 0
    for j, got in enumerate(trainer):
        if got.size == 0:
            continue
        want = recorded(j)
        sid = sample_ids[j]
        if want is None:
            raise AlignmentError(f"sample {sid!r}: the routing source holds no token ids to "
                                 "check the trainer's tokens against (record them, or do not "
                                 "pass tokens for this microbatch)")
        a = first[j]
        ref = np.asarray(want)[a:a + got.size]
        n = min(ref.size, got.size)
        diff = np.flatnonzero(ref[:n] != got[:n])
        if diff.size:
            p = int(diff[0])
            raise AlignmentError(f"sample {sid!r}, token position {a + p}: the trainer has "
                                 f"token id {int(got[p])}, the record {int(ref[p])} (the "
                                 "batch is not the rollout's sequence: shifted, truncated "
                                 "or another sample)")
        if got.size > ref.size:
            raise AlignmentError(f"sample {sid!r}, token position {a + ref.size}: the trainer "
                                 f"has {a + got.size} tokens, the record ends at "
                                 f"{len(want)}")
        checked += 1
    return checked
