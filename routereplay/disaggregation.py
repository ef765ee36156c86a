"""Prefill/decode disaggregation: one request served by two engines -> one record.

A disaggregated request runs its prompt on a prefill engine (which samples the first
output token and hands the KV cache over) and its output on a decode engine. Each engine
records the rows it computed, under a leg key of the request (the key convention)::

    <uid>#prefill      the prefill engine's record: rows from the request's start through
                       the prompt's last token (position prompt_len - 1)
    <uid>#decode       the decode engine's record, asked from the first row it computes
                       (:func:`decode_start`): rows from there to the end of the sequence

(with vLLM's attempt and abort tails after the leg: ``<uid>#decode@1``,
``<uid>#decode!aborted``, :func:`engine_patches.vllm.records.sample_key`). Each engine
writes its leg to its own streams; the trainer merges them with :func:`merge_pd_legs` into
one record keyed ``<uid>`` before replay.

Which rows a decode engine computes (row i = token position start + i, see
:mod:`routereplay.record`): it receives the prompt's KV cache, never the prompt's rows, so
its prompt rows are whatever its buffers hold. vLLM 0.32 (``Scheduler``, after a remote KV
load: "a full prompt hit re-computes that token so the next one can be sampled")
recomputes the prompt's last token and samples the first output token itself: its first
computed row is ``prompt_len - 1``. SGLang 0.5 (``disaggregation/decode.py``: the prebuilt
batch "skips the prefill forward") takes the first output token from the prefill engine and
first runs the model on it: ``prompt_len``. Rows before the decode leg's first computed
row are never taken from it, never compared and never listed as ``recomputed``. So a
decode leg alone is not a request's routing: ``merge_segments`` and
:func:`check_request_key` refuse leg keys.
"""
from __future__ import annotations

import re

import numpy as np

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord
from routereplay.splice import assemble, common_prefix_len

PREFILL, DECODE = "prefill", "decode"
LEGS = (PREFILL, DECODE)
LEG_SEP = "#"
# the leg, then vLLM's optional attempt and abort tails (sample_key)
_LEG_RE = re.compile(r"^(?P<uid>.*)#(?P<leg>prefill|decode)(?P<tail>(@\d+)?(!aborted)?)$", re.S)

# engine name (first word of RoutingRecord.engine) -> first computed decode row - prompt_len
DECODE_FIRST_ROW = {"vllm": -1, "sglang": 0}


def leg_key(uid: str, leg: str) -> str:
    """``<uid>#prefill`` or ``<uid>#decode``: the sample id a leg's record is written under.

    Raises:
        RecordError: ``leg`` not one of :data:`LEGS`.
    """
    if leg not in LEGS:
        raise RecordError(f"request {uid!r}: leg must be one of {LEGS}, got {leg!r}")
    return f"{uid}{LEG_SEP}{leg}"


def split_leg_key(key: str) -> tuple[str, str | None]:
    """(request key, leg) of a record key: ``"u#decode@1"`` -> ``("u@1", "decode")``;
    a key without a leg suffix -> ``(key, None)``."""
    m = _LEG_RE.match(key) if isinstance(key, str) else None
    return (key, None) if m is None else (m["uid"] + m["tail"], m["leg"])


def check_request_key(key: str) -> None:
    """Refuse a P/D leg's key where the routing of a whole request is asked for (a trainer's
    lookup, a replay source).

    Raises:
        RecordError: ``key`` is ``<uid>#decode`` or ``<uid>#prefill`` (with optional tails),
            naming the request and :func:`merge_pd_legs`.
    """
    uid, leg = split_leg_key(key)
    if leg is not None:
        missing = ("its prompt rows were never computed by the decode engine"
                   if leg == DECODE else "it has no rows for the output")
        raise RecordError(
            f"sample {key!r} is the {leg} leg of P/D request {uid!r}, not a whole request "
            f"({missing}): merge the legs with routereplay.disaggregation.merge_pd_legs and "
            f"look up {uid!r}")


def decode_start(prompt_len: int, engine: str) -> int:
    """The token position a decode leg's routing must be asked from (vLLM
    ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``): the first row the
    decode engine computes (module doc).

    Args:
        prompt_len: the request's prompt tokens (>= 1); engine: ``"vllm"``, ``"sglang"``, or
            a record's ``engine`` field (``"vllm 0.32.0"``).
    Raises:
        RecordError: an engine whose decode convention is not known here (pass
            ``first_row=`` to :func:`merge_pd_legs`).
    """
    name = engine.split()[0].lower() if isinstance(engine, str) and engine.split() else ""
    if name not in DECODE_FIRST_ROW:
        raise RecordError(f"engine {engine!r}: its decode leg's first computed row is not known "
                          f"(known: {sorted(DECODE_FIRST_ROW)}); pass first_row= to "
                          "merge_pd_legs")
    return max(0, prompt_len + DECODE_FIRST_ROW[name])


def merge_pd_legs(prefill: RoutingRecord, decode: RoutingRecord, sample_id: str | None = None,
                  *, first_row: int | None = None, compare: str = "slots") -> RoutingRecord:
    """One request's routing from its prefill leg and its decode leg.

    Args:
        prefill: the prefill engine's record, ids [T_p, L_moe, K] from ``prefill.start``;
            its rows up to the prompt's last token (position prompt_len - 1) are used.
        decode: the decode engine's record, ids [T_d, L_moe, K] from ``decode.start``, asked
            from :func:`decode_start` (or earlier: rows before ``first_row`` are not taken).
        sample_id: the merged record's id; default the request key of the legs' keys
            (``u#prefill`` + ``u#decode`` -> ``u``).
        first_row: the first token position the decode engine computed; default
            :func:`decode_start` of ``decode.engine``.
        compare: ``"slots"`` or ``"set"``, for rows both legs computed
            (:func:`routereplay.splice.rows_differ`).
    Returns:
        a record from ``prefill.start``: the prefill leg's rows before
        ``max(decode.start, first_row)``, the decode leg's from there (the decode leg wins
        where both computed a row, vLLM's prompt_len - 1: its row sampled the first output
        token; a differing prefill row there is listed in ``recomputed``); token_ids and
        engine of the decode leg (engine ``"<prefill engine> + <decode engine>"`` when they
        differ); prompt_len of the legs; log-probs of the decode leg when they cover every
        output token (``len == N - prompt_len``), else None; weight-version, prefix-cache
        and recomputed spans clipped to the rows each leg contributed.
    Raises:
        RecordError: naming the request and positions: keys that are not the two legs of one
            request; a prompt_len missing or different between the legs; prompts that
            differ; rows left without routing; layer/top_k/dtype that differ; an unknown
            engine without ``first_row``.
    """
    (pu, pl), (du, dl) = split_leg_key(prefill.sample_id), split_leg_key(decode.sample_id)
    if pl == DECODE or dl == PREFILL:
        raise RecordError(f"records {prefill.sample_id!r} and {decode.sample_id!r}: the legs are "
                          "swapped (merge_pd_legs(prefill, decode))")
    if pl and dl and pu != du:
        raise RecordError(f"records {prefill.sample_id!r} and {decode.sample_id!r} are legs of two "
                          f"requests ({pu!r}, {du!r})")
    if sample_id is None:
        sample_id = du if dl else pu if pl else None
        if sample_id is None:
            raise RecordError(f"records {prefill.sample_id!r} and {decode.sample_id!r}: no leg "
                              "keys (<uid>#prefill, <uid>#decode), so pass sample_id=")
    p = prefill.prompt_len
    if p is None or decode.prompt_len is None or p != decode.prompt_len:
        raise RecordError(f"sample {sample_id!r}: prompt_len of the prefill leg ({p}) and the "
                          f"decode leg ({decode.prompt_len}) must be known and equal")
    if prefill.token_ids is not None and decode.token_ids is not None:
        q = common_prefix_len(np.asarray(prefill.token_ids)[:p], np.asarray(decode.token_ids)[:p])
        if q < p:
            raise RecordError(f"sample {sample_id!r}: the legs' prompts differ from token "
                              f"position {q} on: not legs of one request")
    first = decode_start(p, decode.engine) if first_row is None else int(first_row)
    d0 = max(decode.start, first)
    hint = (f" (prefill leg {prefill.sample_id!r} has rows [{prefill.start}, "
            f"{min(p, prefill.start + prefill.num_tokens)}) of the prompt, decode leg "
            f"{decode.sample_id!r} is used from position {d0}: ask the decode leg from "
            f"decode_start(prompt_len, engine) = {first})")
    out = assemble(
        [(decode, d0, decode.start + decode.num_tokens), (prefill, prefill.start, p)],
        sample_id, compare=compare, gap_hint=hint)
    ids, start = out.ids, out.start
    if start != prefill.start or start >= d0:
        raise RecordError(f"sample {sample_id!r}: no prefill rows before position {d0}{hint}")
    n = None if decode.token_ids is None else len(decode.token_ids)
    if n is not None and n != start + len(ids) + 1:
        raise RecordError(f"sample {sample_id!r}: {n} tokens in the decode leg but routing rows "
                          f"up to position {start + len(ids)}")
    lp = decode.logprobs
    if lp is not None and (n is None or len(lp) != n - p):
        lp = None
    engine = prefill.engine if prefill.engine == decode.engine else \
        f"{prefill.engine} + {decode.engine}"
    return RoutingRecord(sample_id=sample_id, expert_ids=ids, start=start, prompt_len=p,
                         token_ids=decode.token_ids, logprobs=lp,
                         weight_versions=out.weight_versions, recomputed=out.recomputed,
                         prefix_cached=out.prefix_cached, engine=engine,
                         sampling=decode.sampling if lp is not None else None)
