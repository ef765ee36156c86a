"""Alignment of routing records to a trainer's token layout.

A trainer does not see a record's tokens the way the engine did: samples are padded (left
or right), packed back to back (THD, ``cu_seqlens``), split across context-parallel ranks
(zig-zag), scattered across tensor-parallel ranks (sequence parallel), and each pipeline
stage / VPP chunk holds only some MoE layers. Everything here is numpy; it only answers
"which (sample, token position) is router input row n on this rank", fetches those rows,
and checks them.

Conventions (megatron-core, the layout its routers see):

- bshd microbatch: hidden states ``[s, b, h]`` flattened s-major, so router row
  ``c * b + j`` is column c of sample j.
- THD (packed): ``[t, 1, h]``; row n is packed position n. Sample j occupies
  ``[cu_seqlens_padded[j], cu_seqlens_padded[j] + lengths[j])``; the rest of its padded
  segment is padding.
- Context parallel (``get_batch_on_this_cp_rank``): the sequence axis is cut into
  ``2 * cp`` equal chunks and rank r keeps chunks r and ``2*cp - 1 - r``; with THD the cut is
  made per sample on its padded segment (Transformer Engine's
  ``thd_get_partitioned_indices``).
- Sequence parallel: after CP, the local sequence axis is cut into ``tp`` contiguous chunks,
  TP rank t keeps chunk t (megatron's ``scatter_to_sequence_parallel_region``).
- A record's row i is token position ``record.start + i``; positions outside
  ``[start, start + num_tokens)`` (the last token, skipped prompt rows, truncation) have no
  routing: their rows are ``MISSING`` (-1) and get the trainer's fallback.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from routereplay.errors import AlignmentError
from routereplay.schema import RoutingSchema

MISSING = -1


def host_array(x: Any, what: str) -> np.ndarray:
    """``x`` (numpy array, sequence, or torch tensor on the CPU) as a numpy array.

    NOTE: alignment and checks run on the host from host data; a tensor on an accelerator
    would need a device-to-host copy (a synchronisation), so it is refused, not copied.

    Raises:
        AlignmentError: a tensor on another device than the CPU.
    """
    if type(x).__module__.startswith("torch"):
        dev = getattr(x, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            raise AlignmentError(f"{what} is a tensor on {dev}: pass the host copy (the batch "
                                 "before it is moved to the device); routing is aligned on "
                                 "the host")
        return x.detach().numpy()
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Token layout of one microbatch (all ranks of a model replica see the same one).

    Attributes:
        lengths: tokens of each sample in the microbatch (after any truncation), in batch
            order. Sample j holds token positions ``[first[j], first[j] + lengths[j])`` of its
            record's sequence.
        seq_len: bshd: padded sequence length s (tokens); THD: packed length, at least
            ``cu_seqlens_padded[-1]`` (slots past it are padding; 0 = exactly that).
        padding: bshd only: "right" (tokens at columns [0, len)), "left" (at
            [s - len, s)) or "mixed" (at [offsets[j], offsets[j] + len): any per-sample
            placement, e.g. verl's left-padded prompt + right-padded response).
        cu_seqlens_padded: THD only: int [b + 1] start of each sample's padded segment in the
            packed axis (megatron ``PackedSeqParams.cu_seqlens_q_padded``); None = bshd.
        first: first token position of each sample (default 0; > 0 when the trainer drops
            a left part of the sequence).
        offsets: bshd with ``padding="mixed"`` only: column of each sample's first token.
    """

    lengths: tuple[int, ...]
    seq_len: int = 0
    padding: str = "right"
    cu_seqlens_padded: tuple[int, ...] | None = None
    first: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))
        if self.first is not None:
            object.__setattr__(self, "first", tuple(int(x) for x in self.first))
            if len(self.first) != len(self.lengths) or min(self.first, default=0) < 0:
                raise AlignmentError(f"layout: first {self.first} must give one position >= 0 "
                                     f"per sample ({len(self.lengths)} samples)")
        if any(n < 0 for n in self.lengths):
            raise AlignmentError(f"layout: negative sample length in {self.lengths}")
        if self.seq_len < 0:
            raise AlignmentError(f"layout: negative seq_len {self.seq_len}")
        if self.cu_seqlens_padded is not None:
            cu = tuple(int(x) for x in self.cu_seqlens_padded)
            object.__setattr__(self, "cu_seqlens_padded", cu)
            if len(cu) != len(self.lengths) + 1 or cu[0] != 0:
                raise AlignmentError(f"layout: cu_seqlens_padded {cu} needs {len(self.lengths) + 1} "
                                     "entries starting at 0")
            for j, n in enumerate(self.lengths):
                if cu[j + 1] - cu[j] < n:
                    raise AlignmentError(f"layout: sample #{j} has {n} tokens but its packed "
                                         f"segment [{cu[j]}, {cu[j + 1]}) holds {cu[j + 1] - cu[j]}")
        else:
            if self.padding not in ("right", "left", "mixed"):
                raise AlignmentError(f"layout: padding must be 'right', 'left' or 'mixed', got "
                                     f"{self.padding!r}")
            if self.lengths and max(self.lengths) > self.seq_len:
                raise AlignmentError(f"layout: a sample has {max(self.lengths)} tokens but "
                                     f"seq_len is {self.seq_len}")
        if (self.offsets is not None) != (self.padding == "mixed" and not self.packed):
            raise AlignmentError("layout: offsets are given with padding='mixed' (bshd), and "
                                 f"only then (padding={self.padding!r}, offsets={self.offsets})")
        if self.offsets is not None:
            off = tuple(int(x) for x in self.offsets)
            object.__setattr__(self, "offsets", off)
            if len(off) != len(self.lengths):
                raise AlignmentError(f"layout: {len(off)} offsets for {len(self.lengths)} samples")
            for j, (a, n) in enumerate(zip(off, self.lengths)):
                if a < 0 or a + n > self.seq_len:
                    raise AlignmentError(f"layout: sample #{j} at columns [{a}, {a + n}) does not "
                                         f"fit seq_len {self.seq_len}")

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_padded is not None

    @property
    def batch_size(self) -> int:
        """Samples in the microbatch."""
        return len(self.lengths)

    @classmethod
    def packed_from_lengths(cls, lengths: Sequence[int], multiple: int = 1,
                            first: Sequence[int] | None = None) -> "Layout":
        """THD layout with each sample's segment padded to a multiple of ``multiple`` tokens
        (megatron needs ``2 * cp * tp`` with CP and SP)."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + -(-int(n) // multiple) * multiple)
        return cls(lengths=tuple(lengths), cu_seqlens_padded=tuple(cu),
                   first=None if first is None else tuple(first))

    @classmethod
    def from_attention_mask(cls, attention_mask: Any, *, packed: bool = False,
                            multiple: int = 1, first: Sequence[int] | None = None) -> "Layout":
        """The layout of a padded batch, from its attention mask.

        Each row's real tokens must be contiguous (left, right or both sides padded: verl's
        bshd batches put a left-padded prompt before a right-padded response); sample j is
        row j and its tokens are positions ``first[j], first[j] + 1, ...`` in column order.

        Args:
            attention_mask: [b, s] of 0/1 or bool (numpy array, or a CPU torch tensor; a 1-D
                mask is one sample), True/1 = real token. Not the [b, 1, s, s] mask.
            packed: False: the bshd layout of the batch as it is (``padding`` "right",
                "left" or "mixed" with per-sample ``offsets``). True: the THD layout the
                trainer builds by removing the padding and packing the rows in order
                (megatron ``PackedSeqParams``; verl's remove-padding path), each sample's
                segment padded to a multiple of ``multiple`` tokens (``2 * cp * tp`` with
                CP and SP).
            multiple: see ``packed``.
            first: first token position of each sample (default 0).
        Raises:
            AlignmentError: a mask that is not [b, s] of 0/1, or a row whose real tokens
                are not contiguous (names the row and the column of the first hole).
        """
        m = host_array(attention_mask, "attention_mask")
        if m.ndim == 1:
            m = m[None]
        if m.ndim != 2 or not (m.dtype == bool or m.dtype.kind in "iu"):
            raise AlignmentError(f"attention_mask must be [b, s] of 0/1 or bool, got "
                                 f"{m.dtype} {tuple(m.shape)} (the 4-D [b, 1, s, s] mask "
                                 "is not accepted: pass the 2-D padding mask)")
        if m.dtype != bool:
            if m.size and (m.min() < 0 or m.max() > 1):
                raise AlignmentError("attention_mask holds values other than 0 and 1 (a "
                                     "segment-id mask of packed rows? give the packed layout "
                                     "as Layout(lengths, cu_seqlens_padded=...))")
            m = m != 0
        b, s = m.shape
        lengths = m.sum(1)
        lead = np.where(lengths > 0, m.argmax(1), 0)
        for j in range(b):
            n = int(lengths[j])
            if n and not m[j, lead[j]:lead[j] + n].all():
                hole = int(lead[j]) + int(np.argmin(m[j, lead[j]:lead[j] + n]))
                raise AlignmentError(f"attention_mask row {j}: its real tokens are not "
                                     f"contiguous (column {hole} is padding between real "
                                     "tokens)")
        lengths_t = tuple(int(x) for x in lengths)
        if packed:
            lay = cls.packed_from_lengths(lengths_t, multiple=multiple, first=first)
            return lay
        offsets = tuple(int(x) for x in lead)
        if all(a == 0 for a in offsets):
            return cls(lengths=lengths_t, seq_len=s, padding="right",
                       first=None if first is None else tuple(first))
        if all(a + n == s for a, n in zip(offsets, lengths_t)):
            return cls(lengths=lengths_t, seq_len=s, padding="left",
                       first=None if first is None else tuple(first))
        return cls(lengths=lengths_t, seq_len=s, padding="mixed", offsets=offsets,
                   first=None if first is None else tuple(first))

    def columns(self) -> tuple[int, ...]:
        """bshd: column of each sample's first token; THD: its packed offset
        (``cu_seqlens_padded[j]``)."""
        if self.packed:
            return tuple(self.cu_seqlens_padded[:-1])
        if self.padding == "mixed":
            return self.offsets
        return tuple(0 if self.padding == "right" else self.seq_len - n for n in self.lengths)

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """(sample, position) of every token slot before any parallel split.

        Returns:
            two int64 arrays [s, b] (bshd) or [t, 1] (THD): the sample index in the
            microbatch and the token position in its sequence; -1 for padding slots.
        """
        b = self.batch_size
        first = self.first or (0,) * b
        if self.packed:
            t = max(self.cu_seqlens_padded[-1], self.seq_len)
            sample = np.full((t, 1), MISSING, np.int64)
            pos = np.full((t, 1), MISSING, np.int64)
            for j, n in enumerate(self.lengths):
                a = self.cu_seqlens_padded[j]
                sample[a:a + n, 0] = j
                pos[a:a + n, 0] = first[j] + np.arange(n)
            return sample, pos
        s = self.seq_len
        sample = np.full((s, b), MISSING, np.int64)
        pos = np.full((s, b), MISSING, np.int64)
        for j, (n, a) in enumerate(zip(self.lengths, self.columns())):
            sample[a:a + n, j] = j
            pos[a:a + n, j] = first[j] + np.arange(n)
        return sample, pos


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's place in the sequence splits (megatron parallel_state)."""

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self):
        if not (self.cp_size >= 1 and 0 <= self.cp_rank < self.cp_size
                and self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise AlignmentError(f"shard: need 0 <= cp_rank < cp_size and 0 <= tp_rank < "
                                 f"tp_size, got {self}")


def _cp_zigzag(x: np.ndarray, cp: int, r: int, what: str) -> np.ndarray:
    n = x.shape[0]
    if n % (2 * cp):
        raise AlignmentError(f"context parallel size {cp}: {what} of {n} tokens is not a "
                             f"multiple of 2*cp = {2 * cp}")
    c = n // (2 * cp)
    return np.concatenate([x[r * c:(r + 1) * c], x[(2 * cp - 1 - r) * c:(2 * cp - r) * c]])


@dataclasses.dataclass(frozen=True)
class TokenMap:
    """Where each router input row of this rank comes from.

    Attributes:
        sample: int64 [N], index of the sample in the microbatch; -1 for padding.
        position: int64 [N], token position in the sample's sequence; -1 for padding.
    N is the number of tokens this rank's routers see for the microbatch.
    """

    sample: np.ndarray
    position: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.sample.shape[0])

    def ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Contiguous runs of positions needed per sample: {j: [(lo, hi), ...]} (hi exclusive)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for j in np.unique(self.sample[self.sample >= 0]):
            p = np.unique(self.position[self.sample == j])
            cut = np.flatnonzero(np.diff(p) != 1) + 1
            out[int(j)] = [(int(run[0]), int(run[-1]) + 1) for run in np.split(p, cut)]
        return out


def token_map(layout: Layout, shard: Shard = Shard()) -> TokenMap:
    """Router input rows of one rank for a microbatch, in megatron's order.

    Args:
        layout: the microbatch's token layout (all ranks of a model replica share it).
        shard: this rank's context-parallel and sequence-parallel place.
    Returns:
        TokenMap of N rows: the rank's share of the s * b (bshd) or t (THD) token slots,
        N = s * b / cp (CP keeps 2 of 2*cp chunks), divided again by tp with sequence
        parallel.

    Raises:
        AlignmentError: the sequence cannot be split as configured (length not a multiple of
            2*cp, or of tp with sequence parallel).
    """
    sample, pos = layout.grid()
    if shard.cp_size > 1:
        if layout.packed:
            cu = layout.cu_seqlens_padded
            if sample.shape[0] != cu[-1]:
                raise AlignmentError("context parallel with packed sequences: pad the last "
                                     "segment instead of the packed axis (seq_len must equal "
                                     f"cu_seqlens_padded[-1] = {cu[-1]})")
            parts_s, parts_p = [], []
            for j in range(layout.batch_size):
                seg = slice(cu[j], cu[j + 1])
                what = f"sample #{j}'s packed segment"
                parts_s.append(_cp_zigzag(sample[seg], shard.cp_size, shard.cp_rank, what))
                parts_p.append(_cp_zigzag(pos[seg], shard.cp_size, shard.cp_rank, what))
            sample, pos = np.concatenate(parts_s), np.concatenate(parts_p)
        else:
            sample = _cp_zigzag(sample, shard.cp_size, shard.cp_rank, "the sequence")
            pos = _cp_zigzag(pos, shard.cp_size, shard.cp_rank, "the sequence")
    if shard.sequence_parallel and shard.tp_size > 1:
        n = sample.shape[0]
        if n % shard.tp_size:
            raise AlignmentError(f"sequence parallel over tp={shard.tp_size}: local sequence of "
                                 f"{n} tokens is not a multiple of tp")
        c = n // shard.tp_size
        sample = sample[shard.tp_rank * c:(shard.tp_rank + 1) * c]
        pos = pos[shard.tp_rank * c:(shard.tp_rank + 1) * c]
    return TokenMap(sample=sample.reshape(-1).copy(), position=pos.reshape(-1).copy())


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
    """Validate what a layout adds to routing rows, before they reach a router.

    The ids themselves (range ``[0, num_experts)``, distinct in a row) are checked once, by
    the routing source that decoded or took them (routereplay.source); this checks what
    alignment can get wrong or what the model's routing adds.

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
      differ by at most 1 (NOTE: numbering by the row's own index instead would flood a few
      experts when the rows without routing are spaced regularly, e.g. every other row).
    - Spread over expert-parallel ranks. NOTE: megatron places experts contiguously on EP
      ranks (EP rank r holds ``[r*E/ep, (r+1)*E/ep)``), so rows that all start at expert 0
      on every rank (the rule before issue 28) send up to all dummy assignments to EP rank
      0. For E a power of two and ep a power of two dividing it, the EP rank of
      ``order[t]`` is the bit reversal of ``t mod ep``: any ep consecutive cycle entries
      hit every EP rank once, so one call's per-EP-rank counts differ by at most 1 in every
      layer (one top-8 row covers all 8 ranks of EP=8), and over concurrent microbatches
      the hottest EP rank gets at most its fair share plus one assignment per microbatch.
      Other E (60, 96, 160, 384 tried) spread as well, within 1.5x of the fair share in
      the layouts of tests/test_dummy_fallback.py.
    - The hashed start makes different microbatches (hence data-parallel ranks, whose sample
      ids differ), context-/sequence-parallel ranks and layers begin at different points
      of the cycle. It is blake2b, not Python's salted ``hash()``: every process and every
      run computes the same ids (the recompute forward reuses the loaded ids anyway).

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
            # batch: a layout with the wrong padding side would pass the check and replay
            # onto the wrong tokens. The batch as fed to the model checks both.
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
