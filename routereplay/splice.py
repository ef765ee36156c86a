"""Splicing routing rows of several records of one sequence into one (the shared core of
:func:`routereplay.multi_turn.merge_segments` and
:func:`routereplay.disaggregation.merge_pd_legs`): the first record holding a position
wins, differing overlaps are listed as ``recomputed``."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, WeightVersionSpan

COMPARE = ("slots", "set")


def _spans(mask: np.ndarray, offset: int) -> list[tuple[int, int]]:
    """[(start, end)] token-position runs where ``mask`` is True (row i = position offset+i)."""
    m = np.concatenate([[False], mask, [False]])
    d = np.flatnonzero(np.diff(m.astype(np.int8)))
    return [(offset + int(a), offset + int(b)) for a, b in zip(d[::2], d[1::2])]


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Number of leading tokens two token-id sequences share (O(min(len a, len b)))."""
    x, y = np.asarray(a), np.asarray(b)
    n = min(len(x), len(y))
    ne = np.flatnonzero(x[:n] != y[:n])
    return int(ne[0]) if ne.size else n


def rows_differ(a: np.ndarray, b: np.ndarray, compare: str = "slots") -> np.ndarray:
    """bool [n]: which rows of two id arrays [n, L, K] differ in some layer.

    ``compare="slots"``: slot by slot (the same experts in another top-k order differ);
    ``"set"``: as expert sets per layer (order ignored).

    Raises:
        RecordError: an unknown ``compare``.
    """
    if compare == "set":
        a, b = np.sort(a, axis=-1), np.sort(b, axis=-1)
    elif compare != "slots":
        raise RecordError(f"compare must be one of {COMPARE}, got {compare!r}")
    return (a != b).any(axis=(1, 2))


class Spliced(NamedTuple):
    """What :func:`assemble` returns (spans are token positions)."""

    ids: np.ndarray                         # [end - start, L, K]
    start: int
    weight_versions: list[WeightVersionSpan]
    recomputed: list[tuple[int, int]]
    prefix_cached: list[tuple[int, int]]
    used: list[int]                         # rows each piece contributed, in pieces' order


def assemble(pieces: Sequence[tuple[RoutingRecord, int, int]], sample_id: str, *,
             compare: str = "slots", gap_hint: str = "") -> Spliced:
    """Splice rows of several records; the first piece holding a position wins.

    Args:
        pieces: ``(record, lo, hi)`` in precedence order: the record's rows at token positions
            [lo, hi) are usable (clipped to the rows it has); its other rows are neither taken
            nor compared (they route other tokens, or were never computed).
        compare: how usable overlapping rows are compared (:func:`rows_differ`).
        gap_hint: appended to the error for positions that no piece covers.
    Returns:
        :class:`Spliced`: spans clipped to the rows each piece contributed; recomputed also
        lists every position where a later piece's usable row differs from the row kept.
    Raises:
        RecordError: pieces of different layer/top_k shape or dtype, or token positions that
            no piece covers, naming the sample and the positions.
    """
    recs = [r for r, _, _ in pieces]
    shape, dtype = recs[0].expert_ids.shape[1:], recs[0].expert_ids.dtype
    if any(r.expert_ids.shape[1:] != shape or r.expert_ids.dtype != dtype for r in recs):
        raise RecordError(f"sample {sample_id!r}: segments differ in layers, top_k or dtype")
    rng = [(r, max(lo, r.start), min(hi, r.start + r.num_tokens)) for r, lo, hi in pieces]
    used = [0] * len(rng)
    if not any(lo < hi for _, lo, hi in rng):
        raise RecordError(f"sample {sample_id!r}: no usable rows in any segment")
    start = min(lo for _, lo, hi in rng if lo < hi)
    end = max(hi for _, lo, hi in rng if lo < hi)
    # NOTE: coverage from the intervals first, before allocating (end - start) rows
    gaps, reach = [], start
    for _, lo, hi in sorted((x for x in rng if x[1] < x[2]), key=lambda x: x[1]):
        if lo > reach:
            gaps.append((reach, lo))
        reach = max(reach, hi)
    if gaps:
        shown = gaps[:8] + ([("...", len(gaps) - 8)] if len(gaps) > 8 else [])
        raise RecordError(f"sample {sample_id!r}: token positions {shown} have no "
                          f"routing{gap_hint}")
    ids = np.zeros((end - start,) + shape, dtype=dtype)
    have = np.zeros(end - start, dtype=bool)
    differs = np.zeros(end - start, dtype=bool)
    versions: list[WeightVersionSpan] = []
    recomputed: list[tuple[int, int]] = []
    cached: list[tuple[int, int]] = []
    for i, (r, lo, hi) in enumerate(rng):
        if lo >= hi:
            continue
        rows = slice(lo - start, hi - start)
        src = r.expert_ids[lo - r.start:hi - r.start]
        old = have[rows]
        differs[rows] |= old & rows_differ(ids[rows], src, compare)
        new = ~old
        used[i] = int(new.sum())
        ids[rows][new] = src[new]
        for p0, p1 in _spans(new, lo):
            versions += [WeightVersionSpan(s.version, max(s.start, p0), min(s.end, p1))
                         for s in r.weight_versions if max(s.start, p0) < min(s.end, p1)]
            for spans, dst in ((r.recomputed, recomputed), (r.prefix_cached, cached)):
                dst += [(max(x, p0), min(y, p1)) for x, y in spans if max(x, p0) < min(y, p1)]
        have[rows] = True
    if not have.all():
        raise RecordError(f"sample {sample_id!r}: token positions {_spans(~have, start)} have "
                          f"no routing{gap_hint}")
    versions.sort(key=lambda s: s.start)
    return Spliced(ids, start, versions, sorted(set(recomputed + _spans(differs, start))),
                   sorted(set(cached)), used)
