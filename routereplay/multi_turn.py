"""Multi-turn conversations: one routing record per turn (segment) -> the whole sequence.

A later turn re-sends the conversation so far as its prompt and asks only for the rows it
does not have (vLLM ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``):
segment i covers token positions [start_i, start_i + T_i).

Which row wins where segments overlap: the EARLIER turn (the segment that starts first;
among segments with the same start, the one that ends first: a later turn's sequence
extends the earlier one's, so it is never shorter). Its rows are the routing the
engine used when it sampled those tokens and computed their log-probs; a later turn
re-prefills them (from the prefix cache, or recomputed after a cache flush or a weight
update). Overlapping rows that differ are kept from the earlier segment and their
positions are listed in the merged record's ``recomputed`` spans, so a trainer can see
that the engine no longer agreed with itself there.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, WeightVersionSpan


def _spans(mask: np.ndarray, offset: int) -> list[tuple[int, int]]:
    """[(start, end)] token-position runs where ``mask`` is True (row i = position offset+i)."""
    m = np.concatenate([[False], mask, [False]])
    d = np.flatnonzero(np.diff(m.astype(np.int8)))
    return [(offset + int(a), offset + int(b)) for a, b in zip(d[::2], d[1::2])]


def merge_segments(segments: Sequence[RoutingRecord], sample_id: str) -> RoutingRecord:
    """Rebuild one conversation's routing from its turns.

    Args:
        segments: records of the turns (any order); ids [T_i, L_moe, top_k] with rows from
            token position ``start_i``.
        sample_id: id of the merged record.
    Returns:
        a record from position ``min(start_i)``: earlier turns win on overlaps, whatever
        the order of ``segments`` (see the module docstring), and every overlapping row a
        later turn computed differently is listed in ``recomputed`` (never dropped
        silently); token_ids, prompt_len and engine of the turn that reaches
        furthest (its sequence holds the whole conversation; every other turn's tokens must
        be a prefix of it); log-probs dropped (they belong to single turns);
        weight-version, prefix-cache and recomputed spans clipped to the rows each segment
        contributed.
    Raises:
        RecordError: no segments, segments of different layer/top_k shape, or a gap (token
            positions that no segment covers), naming the sample and the positions.
    """
    if not segments:
        raise RecordError(f"sample {sample_id!r}: no segments to merge")
    # NOTE: (start, end), not start alone: a turn resent in full after a weight update starts
    # where the first turn did; ordering by start only would let the caller's list order
    # decide, and the later turn's rows would replace the ones that produced the tokens.
    segs = sorted(segments, key=lambda r: (r.start, r.start + r.num_tokens))
    shape = segs[0].expert_ids.shape[1:]
    if any(r.expert_ids.shape[1:] != shape or r.expert_ids.dtype != segs[0].expert_ids.dtype for r in segs):
        raise RecordError(f"sample {sample_id!r}: segments differ in layers, top_k or dtype")
    start = segs[0].start
    end = max(r.start + r.num_tokens for r in segs)
    ids = np.zeros((end - start,) + shape, dtype=segs[0].expert_ids.dtype)
    have = np.zeros(end - start, dtype=bool)
    differs = np.zeros(end - start, dtype=bool)
    versions: list[WeightVersionSpan] = []
    recomputed: list[tuple[int, int]] = []
    cached: list[tuple[int, int]] = []
    for r in segs:
        a = r.start - start
        rows = slice(a, a + r.num_tokens)
        old = have[rows]
        differs[rows] |= old & (ids[rows] != r.expert_ids).any(axis=(1, 2))
        new = ~old
        ids[rows][new] = r.expert_ids[new]
        for p0, p1 in _spans(new, r.start):
            versions += [WeightVersionSpan(s.version, max(s.start, p0), min(s.end, p1))
                         for s in r.weight_versions if max(s.start, p0) < min(s.end, p1)]
            for src, dst in ((r.recomputed, recomputed), (r.prefix_cached, cached)):
                dst += [(max(x, p0), min(y, p1)) for x, y in src if max(x, p0) < min(y, p1)]
        have[rows] = True
    if not have.all():
        gaps = _spans(~have, start)
        raise RecordError(f"sample {sample_id!r}: turns leave token positions {gaps} without "
                          "routing (a later turn's start is past the earlier turn's last row)")
    recomputed = sorted(set(recomputed + _spans(differs, start)))
    # the turn that reaches furthest holds the whole conversation (ties: the longest tokens)
    last = max(segs, key=lambda r: (r.start + r.num_tokens,
                                    -1 if r.token_ids is None else len(r.token_ids)))
    if last.token_ids is not None:
        full = np.asarray(last.token_ids)
        for r in segs:
            if r.token_ids is not None and not np.array_equal(
                    np.asarray(r.token_ids), full[:len(r.token_ids)]):
                raise RecordError(f"sample {sample_id!r}: turn {r.sample_id!r}'s tokens are not a "
                                  f"prefix of turn {last.sample_id!r}'s: not one conversation")
        if len(full) != end + 1:
            raise RecordError(f"sample {sample_id!r}: {len(full)} tokens in turn "
                              f"{last.sample_id!r} but routing rows up to position {end}")
    versions.sort(key=lambda s: s.start)
    return RoutingRecord(sample_id=sample_id, expert_ids=ids, start=start, prompt_len=last.prompt_len,
                         token_ids=last.token_ids, logprobs=None, weight_versions=versions,
                         recomputed=recomputed, prefix_cached=sorted(set(cached)),
                         engine=last.engine)
