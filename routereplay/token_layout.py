"""The trainer's token layout: which (sample, token position) each router row of a rank is.

A trainer does not see a record's tokens the way the engine did: samples are padded (left
or right), packed back to back (THD, ``cu_seqlens``), split across context-parallel ranks
(zig-zag), scattered across tensor-parallel ranks (sequence parallel), and each pipeline
stage / VPP chunk holds only some MoE layers. Everything here is numpy; it answers "which
(sample, token position) is router input row n on this rank" (:func:`token_map`);
:mod:`routereplay.align` fetches those rows and checks them.

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
from typing import Any, Sequence

import numpy as np

from routereplay.errors import AlignmentError

MISSING = -1


def host_array(x: Any, what: str) -> np.ndarray:
    """``x`` (numpy array, sequence, or torch tensor on the CPU) as a numpy array.

    NOTE: alignment and checks run on the host from host data; a tensor on an accelerator
    would need a device-to-host copy (a synchronisation), so it is refused, not copied.

    Raises:
        AlignmentError: a tensor on another device than the CPU; a nested (jagged) tensor
            (read its rows with :func:`jagged_parts`) or another tensor without numpy().
    """
    if type(x).__module__.startswith("torch"):
        dev = getattr(x, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            raise AlignmentError(f"{what} is a tensor on {dev}: pass the host copy (the batch "
                                 "before it is moved to the device); routing is aligned on "
                                 "the host")
        if getattr(x, "is_nested", False):
            raise AlignmentError(f"{what} is a nested (jagged) tensor {tuple(x.shape)}: this "
                                 "argument takes a padded array; pass the jagged form where "
                                 "it is accepted (InMemorySource.from_batch) or the padded "
                                 "batch")
        try:
            return x.detach().numpy()
        except (RuntimeError, TypeError) as e:       # a tensor subclass without numpy()
            raise AlignmentError(f"{what} is a {type(x).__name__} that has no host array "
                                 f"({e}): pass a plain CPU tensor or numpy array") from None
    return np.asarray(x)


def jagged_parts(x: Any, what: str) -> list[np.ndarray] | None:
    """The per-sample parts of a torch nested tensor on the CPU (jagged ``[b, j, ...]`` as
    verl's ``left_right_2_no_padding`` builds it, or strided), as numpy arrays, sample j's
    ``[n_j, ...]``; None when ``x`` is not a nested tensor.

    Raises:
        AlignmentError: a nested tensor on another device than the CPU.
    """
    if not (type(x).__module__.startswith("torch") and getattr(x, "is_nested", False)):
        return None
    dev = getattr(x, "device", None)
    if dev is not None and dev.type != "cpu":
        raise AlignmentError(f"{what} is a nested tensor on {dev}: pass the host copy")
    import torch
    if x.layout == torch.jagged:
        vals = x.values().detach().numpy()
        off = x.offsets().tolist()
        return [vals[a:b] for a, b in zip(off[:-1], off[1:])]
    return [t.detach().numpy() for t in x.unbind()]


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

        Each row's real tokens must be contiguous (left, right or both sides padded, as verl's
        left-padded prompt + right-padded response); sample j is row j, its tokens positions
        ``first[j], first[j] + 1, ...`` in column order.

        Args:
            attention_mask: [b, s] of 0/1 or bool (numpy array or CPU torch tensor; 1-D: one
                sample), True/1 = real token. Not the [b, 1, s, s] mask.
            packed: False: the bshd layout of the batch as it is. True: the THD layout the
                trainer builds by removing the padding and packing the rows in order
                (megatron ``PackedSeqParams``; verl's remove-padding path), each segment
                padded to a multiple of ``multiple`` tokens (``2 * cp * tp`` with CP and SP).
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
            return cls.packed_from_lengths(lengths_t, multiple=multiple, first=first)
        offsets = tuple(int(x) for x in lead)
        first = None if first is None else tuple(first)
        if all(a == 0 for a in offsets):
            return cls(lengths=lengths_t, seq_len=s, padding="right", first=first)
        if all(a + n == s for a, n in zip(offsets, lengths_t)):
            return cls(lengths=lengths_t, seq_len=s, padding="left", first=first)
        return cls(lengths=lengths_t, seq_len=s, padding="mixed", offsets=offsets, first=first)

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
    """This rank's place in the sequence splits (megatron parallel_state).

    ``cp_layout``: how context parallelism splits the token rows: "zigzag" (megatron's and
    Transformer Engine's default: ``2 * cp`` chunks per sequence, rank r keeps chunks r and
    ``2cp-1-r``; per sample for THD) or "contiguous" (THD only: rank r keeps rows
    ``[r*T/cp, (r+1)*T/cp)`` of the whole padded packed buffer of T rows, verl's layout for
    attention variants that address rows by one rank-local start, e.g. DeepSeek-V4's
    ``dsv4_hybrid``).
    """

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp_layout: str = "zigzag"

    def __post_init__(self):
        if not (self.cp_size >= 1 and 0 <= self.cp_rank < self.cp_size
                and self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise AlignmentError(f"shard: need 0 <= cp_rank < cp_size and 0 <= tp_rank < "
                                 f"tp_size, got {self}")
        if self.cp_layout not in ("zigzag", "contiguous"):
            raise AlignmentError(f"shard: cp_layout must be 'zigzag' or 'contiguous', got "
                                 f"{self.cp_layout!r}")


def verl_thd_layout(lengths: Sequence[int], *, tp: int = 1, cp: int = 1,
                    cp_layout: str = "zigzag", fp8: bool = False,
                    min_local_rows: int | None = None,
                    first: Sequence[int] | None = None) -> Layout:
    """The THD layout verl 0.9's ``preprocess_thd_engine`` (verl/models/mcore/util.py)
    packs a micro-batch into, before the CP split (``token_map`` with
    ``Shard(cp_size=cp, cp_layout=...)`` then takes this rank's rows).

    Rule (verl's): each sequence is padded to a multiple of ``align = tp * cp * (2 if
    cp_layout == "zigzag" and cp > 1 else 1)``; with ``fp8`` (verl's ``use_fp8_padding``,
    fp8 ``e4m3`` / ``hybrid``) to a multiple of ``lcm(16, align)`` and the last sequence
    further so the total is a multiple of ``align * 128``; with ``min_local_rows`` (verl:
    ``csa_window_size`` of ``dsv4_hybrid``) the last sequence further so the total is at
    least ``cp * min_local_rows``. ``cu_seqlens_padded`` is verl's
    ``PackedSeqParams.cu_seqlens_q_padded``.

    Args:
        lengths: real tokens of each sequence (the nested ``input_ids`` parts), batch order.
        tp, cp: tensor- and context-parallel sizes (verl: megatron's parallel_state, or the
            micro-batch's ``local_cp_size`` with dynamic CP).
        first: optional first token position of each sequence (:class:`Layout` ``first``).
    Raises:
        AlignmentError: sizes < 1, an unknown ``cp_layout``, a negative length.
    """
    import math
    if tp < 1 or cp < 1 or cp_layout not in ("zigzag", "contiguous"):
        raise AlignmentError(f"verl_thd_layout: need tp, cp >= 1 and cp_layout 'zigzag' or "
                             f"'contiguous', got tp={tp}, cp={cp}, cp_layout={cp_layout!r}")
    align = tp * cp * (2 if cp_layout == "zigzag" and cp > 1 else 1)
    total_align = None
    if fp8:
        align, total_align = math.lcm(16, align), align * 128
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + -(-int(n) // align) * align)
    if total_align and len(cu) > 1:
        cu[-1] += -cu[-1] % total_align
    if min_local_rows is not None and len(cu) > 1 and cu[-1] < cp * min_local_rows:
        cu[-1] = cp * min_local_rows
    return Layout(lengths=tuple(int(n) for n in lengths), cu_seqlens_padded=tuple(cu),
                  first=None if first is None else tuple(first))


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
    if shard.cp_size > 1 and shard.cp_layout == "contiguous":
        n = sample.shape[0]
        if not layout.packed or n % shard.cp_size:
            raise AlignmentError(
                f"context parallel cp_layout='contiguous' splits a packed (THD) buffer into "
                f"cp={shard.cp_size} equal parts: got a "
                + (f"packed buffer of {n} rows" if layout.packed else "bshd layout"))
        c = n // shard.cp_size
        sample = sample[shard.cp_rank * c:(shard.cp_rank + 1) * c]
        pos = pos[shard.cp_rank * c:(shard.cp_rank + 1) * c]
    elif shard.cp_size > 1:
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
