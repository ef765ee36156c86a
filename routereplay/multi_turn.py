"""Multi-turn conversations: one routing record per turn (segment) -> the whole sequence.

A later turn re-sends the conversation so far as its prompt and asks only for the rows it
does not have (vLLM ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``):
segment i covers token positions [start_i, start_i + T_i). :func:`next_start` gives that
start; with the new prompt's token ids it also stops at the first token where the new
prompt leaves the previous turn's sequence.

Token identity. Row p of a turn is the routing of token position p given tokens 0..p of
THAT turn's sequence (causal attention), so it stands for the conversation's row p only if
those tokens are the conversation's. A later turn's prompt need not extend the earlier
sequence: a chat template may re-render earlier turns (Qwen3's drops the ``<think>`` part
of earlier assistant turns), or the conversation may branch. The conversation's tokens are
those of the turn that reaches furthest; each turn's rows are used up to where its tokens
leave them (their longest common prefix). Without token ids this cannot be checked, so a
merge of several turns needs every turn's ``token_ids``, or ``assume_extends=True``.

Where segments overlap the EARLIER turn wins (the one that starts first; at the same start,
the one that ends first): its rows are the routing the engine used when it sampled those
tokens, while a later turn re-prefills them. Overlapping rows that differ are listed in the
merged record's ``recomputed`` spans. ``compare="slots"`` (default) compares rows slot by
slot (another top-k order counts as differing); ``compare="set"`` compares expert sets.

Legs of a prefill/decode-disaggregated request (``<uid>#prefill``, ``<uid>#decode``) are
not turns: merge them with :func:`routereplay.disaggregation.merge_pd_legs` first.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from routereplay.disaggregation import split_leg_key
from routereplay.errors import RecordError
from routereplay.record import RoutingRecord
from routereplay.splice import COMPARE, assemble, common_prefix_len


def next_start(previous: RoutingRecord,
               new_prompt_ids: Sequence[int] | np.ndarray | None = None) -> int:
    """The start to ask the next turn's routing from (vLLM ``routed_experts_prompt_start``,
    SGLang ``routed_experts_start_len``): the first token position whose routing the
    conversation lacks.

    Args:
        previous: the record of the previous turn (rows from ``previous.start``).
        new_prompt_ids: the next turn's prompt token ids. Given, the start is at most the
            longest common prefix of ``previous.token_ids`` and the new prompt (module doc:
            token identity), and at most ``len(new_prompt_ids) - 1`` (the engine computes
            the prompt's last token). Omitted: ``previous.start + previous.num_tokens``
            (the new prompt assumed to extend the previous sequence).
    Returns:
        absolute token position (>= 0).
    Raises:
        RecordError: ``new_prompt_ids`` given but ``previous`` has no token ids (nothing to
            compare with), or an empty new prompt; naming the sample.
    """
    end = previous.start + previous.num_tokens
    if new_prompt_ids is None:
        return end
    if previous.token_ids is None:
        raise RecordError(f"sample {previous.sample_id!r}: no token ids, so the next turn's "
                          "prompt cannot be compared with it (ask the engine for the token ids, "
                          "or use next_start(previous) if the prompt extends its sequence)")
    if len(new_prompt_ids) == 0:
        raise RecordError(f"sample {previous.sample_id!r}: the next turn's prompt is empty")
    return max(0, min(end, common_prefix_len(previous.token_ids, new_prompt_ids),
                      len(new_prompt_ids) - 1))


def merge_segments(segments: Sequence[RoutingRecord], sample_id: str, *,
                   assume_extends: bool = False, compare: str = "slots") -> RoutingRecord:
    """Rebuild one conversation's routing from its turns.

    Args:
        segments: records of the turns (any order); ids [T_i, L_moe, top_k] with rows from
            token position ``start_i``; with ``token_ids`` (module doc: token identity).
        sample_id: id of the merged record.
        assume_extends: the caller states that every turn's prompt extends the earlier
            turns' sequences; needed when some turns lack token ids (turns with token ids
            are still checked).
        compare: ``"slots"`` (default) or ``"set"``: how overlapping rows are compared for
            ``recomputed`` (:func:`routereplay.splice.rows_differ`).
    Returns:
        a record from position ``min(start_i)`` (module doc: earlier turns win, differing
        overlaps listed in ``recomputed``); token_ids, prompt_len and engine of the turn
        that reaches furthest; each turn's rows used only up to where its tokens leave the
        conversation's; log-probs dropped (they belong to single turns); weight-version,
        prefix-cache and recomputed spans clipped to the rows each segment contributed.
    Raises:
        RecordError: naming the sample, and the turns and positions: no segments; a P/D
            leg key; several turns, one without token ids, and no ``assume_extends``; two
            turns that reach equally far with different tokens; segments of different
            layer/top_k shape; a turn whose tokens leave the conversation's and that gives
            it no row; positions without routing (a gap between turns, or a turn asked from
            past where its prompt leaves the earlier sequence: use
            ``next_start(previous, new_prompt_ids)``); token ids whose count does not match
            the rows.
    """
    if not segments:
        raise RecordError(f"sample {sample_id!r}: no segments to merge")
    if compare not in COMPARE:
        raise RecordError(f"compare must be one of {COMPARE}, got {compare!r}")
    for r in segments:
        uid, leg = split_leg_key(r.sample_id)
        if leg is not None:
            raise RecordError(
                f"sample {sample_id!r}: segment {r.sample_id!r} is the {leg} leg of P/D request "
                f"{uid!r}, not a turn: merge its legs with "
                "routereplay.disaggregation.merge_pd_legs first and pass the result")
    if len(segments) > 1 and not assume_extends:
        bare = [r.sample_id for r in segments if r.token_ids is None]
        if bare:
            raise RecordError(
                f"sample {sample_id!r}: turns {bare} have no token ids, so the merge cannot check "
                "that each turn's prompt extends the earlier turns' sequences (a chat template "
                "that re-renders earlier turns, or a branch from an earlier prefix, would put "
                "an earlier turn's rows where other tokens stand): pass records with token_ids, "
                "or assume_extends=True if the prompts extend the earlier sequences token for "
                "token")
    # NOTE: (start, end), not start alone: a turn resent in full after a weight update starts
    # where the first turn did; ordering by start only would let the caller's list order
    # decide, and the later turn's rows would replace the ones that produced the tokens.
    segs = sorted(segments, key=lambda r: (r.start, r.start + r.num_tokens))
    # the turn that reaches furthest holds the whole conversation (ties: the longest tokens)
    last = max(segs, key=lambda r: (r.start + r.num_tokens,
                                    -1 if r.token_ids is None else len(r.token_ids)))
    with_tokens = [r for r in segs if r.token_ids is not None]
    ref = None if not with_tokens else (
        last if last.token_ids is not None else max(with_tokens, key=lambda r: len(r.token_ids)))
    for r in with_tokens:
        if r is not ref and len(r.token_ids) == len(ref.token_ids) and \
                r.start + r.num_tokens == ref.start + ref.num_tokens and \
                not np.array_equal(r.token_ids, ref.token_ids):
            raise RecordError(
                f"sample {sample_id!r}: turns {ref.sample_id!r} and {r.sample_id!r} both reach "
                f"position {len(r.token_ids) - 1} with different tokens (from position "
                f"{common_prefix_len(r.token_ids, ref.token_ids)}): two branches, not one "
                "conversation")
    pieces, leaves = [], []
    for r in segs:
        q = None
        if r.token_ids is not None and r is not ref:
            q = common_prefix_len(r.token_ids, ref.token_ids)
            if q >= r.start + r.num_tokens:
                q = None                    # every row's tokens are the conversation's
        if q is not None:
            leaves.append((r, q))
        pieces.append((r, r.start, r.start + r.num_tokens if q is None else q))

    def found(r: RoutingRecord, q: int) -> str:
        return (f"turn {r.sample_id!r}'s tokens are not a prefix of turn {ref.sample_id!r}'s "
                f"(the conversation): they differ from position {q} on (token "
                f"{int(r.token_ids[q])} vs {int(ref.token_ids[q]) if q < len(ref.token_ids) else 'none'}"
                "): a re-rendered or branched prefix (the chat template rendered earlier turns "
                "differently, or the conversation branches there)")
    if leaves:
        r, q = min(leaves, key=lambda x: x[1])
        hint = (f": {found(r, q)}; its rows from position {q} route other tokens and are not "
                f"used, and the later turn's rows do not reach back to {q}: ask the later turn "
                "from next_start(previous, new_prompt_ids)")
    else:
        hint = " (a later turn's start is past the earlier turn's last row)"
    out = assemble(pieces, sample_id, compare=compare, gap_hint=hint)
    for (r, _, _), n in zip(pieces, out.used):
        q = dict((id(x), y) for x, y in leaves).get(id(r))
        if q is not None and n == 0:
            raise RecordError(
                f"sample {sample_id!r}: {found(r, q)}, and its rows before {q} are the earlier "
                "turns' (it gives the conversation no row): not a turn of this conversation "
                "(another branch, or a turn rendered differently); leave it out")
    ids, start = out.ids, out.start
    if last.token_ids is not None:
        full = np.asarray(last.token_ids)
        end = start + len(ids)
        if len(full) != end + 1:
            raise RecordError(f"sample {sample_id!r}: {len(full)} tokens in turn "
                              f"{last.sample_id!r} but routing rows up to position {end}")
    return RoutingRecord(sample_id=sample_id, expert_ids=ids, start=start, prompt_len=last.prompt_len,
                         token_ids=last.token_ids, logprobs=None,
                         weight_versions=out.weight_versions, recomputed=out.recomputed,
                         prefix_cached=out.prefix_cached, engine=last.engine)
