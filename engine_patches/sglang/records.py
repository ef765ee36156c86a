"""SGLang responses -> routing records.

Accepted response shapes: those of :func:`routereplay.wire.sglang_fields` (``/generate``,
``Engine.generate``, the OpenAI endpoints; SGLang 0.5.7 to 0.5.23), the one parser of SGLang
responses; streams: :func:`record_from_stream`.

Rows: ``routed_experts`` covers token positions [start_len, seqlen - 1) with seqlen =
prompt_tokens + completion_tokens and start_len the request's ``routed_experts_start_len``.
Dense layers are zero-filled: they are stripped with the schema, and a non-zero dense row
is an error. The payload's row width is top_k + ``num_fused_shared_experts`` as the caller
states it (0 for SGLang 0.5.23, which strips them), never guessed from the byte count; the
fused columns (``-1`` padding or shared expert ids >= num_experts) are dropped.
"""
from __future__ import annotations

import base64
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from routereplay import wire
from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, SamplingInfo, check_written_rows, checked_moe_ids
from routereplay.schema import RoutingSchema
from routereplay.weight_versions import output_spans_to_rows

MAX_LINE_BYTES = 1 << 30          # one saved response (bytes)
FLAG_HINT = ("launch the SGLang server with --enable-return-routed-experts (Engine("
             "enable_return_routed_experts=True)) and send return_routed_experts=True in the "
             "request (OpenAI endpoints: extra_body)")


def _int(v: Any, what: str, rid: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise RecordError(f"request {rid!r}: {what} missing or not a non-negative integer ({v!r})")
    return v


def decode_routed_experts(b64: str, schema: RoutingSchema, rid: str,
                          num_fused_shared_experts: int = 0,
                          rows: int | None = None) -> np.ndarray:
    """SGLang's base64 int32 payload -> int32 [rows, num_hidden_layers, top_k].

    Args:
        num_fused_shared_experts: fused shared-expert columns the payload carries per row
            (see routereplay.wire.decode_sglang_b64_int32); they are dropped.
        rows: the row count the request implies, when known (checked).
    Raises:
        RecordError: naming the request: not base64, a row-count mismatch, not whole rows,
            or routed ids in the fused columns.
    """
    try:
        full = wire.decode_sglang_b64_int32(b64, schema.num_hidden_layers, schema.top_k,
                                            num_fused_shared_experts=num_fused_shared_experts,
                                            rows=rows)
        return wire.split_fused_shared_columns(full, schema.top_k, schema.num_experts)
    except RecordError as e:
        raise RecordError(f"request {rid!r}: {e}") from None


def record_from_response(resp: Mapping[str, Any], schema: RoutingSchema, *,
                         start_len: int | None = None, prompt_ids: Sequence[int] | None = None,
                         sample_id: str | None = None, num_fused_shared_experts: int = 0,
                         engine: str = "sglang",
                         sampling: SamplingInfo | None = None) -> RoutingRecord:
    """One SGLang response -> a validated RoutingRecord.

    Args:
        resp: a ``/generate`` or OpenAI response dict (routereplay.wire.sglang_fields);
            a stream's chunks: :func:`record_from_stream`.
        schema: the model's routing schema; the payload is int32 [rows,
            num_hidden_layers, top_k + num_fused_shared_experts], dense layers stripped.
        start_len: the request's ``routed_experts_start_len``; None takes it from the
            response (``routed_experts_start_len`` next to ``meta_info``), else only from
            seqlen - 1 rows (start 0). NOTE: any other count fits a later start as well as
            a payload truncated by as many rows, so it is refused (naming both).
        prompt_ids: the request's prompt token ids, to store token_ids (prompt + output).
        sample_id: record id; default the request id (meta_info ``id``, or the OpenAI
            response ``id``).
        num_fused_shared_experts: fused shared-expert columns per row (module doc).
        engine: the record's engine label.
        sampling: the sampling parameters behind the log-probs
            (routereplay.record.sampling_from_sglang), kept where the record has log-probs.
    Returns:
        record with ids [seqlen - 1 - start_len, L_moe, top_k] (``schema.id_dtype``:
        uint8 up to 256 experts, else uint16) from position start_len;
        weight-version spans over token positions (routereplay.weight_versions; prompt
        rows take the first span's version); ``recomputed`` = every row when
        ``num_retractions > 0`` (SGLang re-prefills a retracted request, overwriting its
        routes, possibly under new weights, while the earlier tokens' log-probs came from
        the old routes), those rows then carrying the last span's version;
        ``prefix_cached`` = [0, cached_tokens).
    Raises:
        RecordError: naming the request: routed_experts missing (says which flag), not
            base64, a row-count mismatch, start_len above the prompt length, an ambiguous
            start, ids out of range, routing on a dense layer, a run of rows never written
            (routereplay.record.check_written_rows); any other malformed field, naming the
            field's exception.
    """
    try:
        return _record_from_response(resp, schema, start_len=start_len, prompt_ids=prompt_ids,
                                     sample_id=sample_id,
                                     num_fused_shared_experts=num_fused_shared_experts,
                                     engine=engine, sampling=sampling)
    except RecordError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError, IndexError, KeyError) as e:
        rid = None
        if isinstance(resp, Mapping):
            mi = resp.get("meta_info")
            rid = mi.get("id") if isinstance(mi, Mapping) else resp.get("id")
        raise RecordError(f"request {rid if rid is not None else sample_id!r}: malformed "
                          f"response field ({type(e).__name__}: {e})"[:500]) from None


def _record_from_response(resp: Mapping[str, Any], schema: RoutingSchema, *,
                          start_len: int | None = None, prompt_ids: Sequence[int] | None = None,
                          sample_id: str | None = None, num_fused_shared_experts: int = 0,
                          engine: str = "sglang",
                          sampling: SamplingInfo | None = None) -> RoutingRecord:
    """The work of :func:`record_from_response`; foreign exceptions pass out."""
    f = wire.sglang_fields(resp)
    rid = str(f.id if f.id is not None else sample_id)
    if f.num_choices > 1:
        raise RecordError(f"request {rid!r}: OpenAI response with {f.num_choices} choices: "
                          "SGLang returns only the first choice's routing while usage counts all "
                          "of them; send n=1 per request")
    if start_len is None and isinstance(f.start_len, int):
        start_len = f.start_len
    if start_len is not None and (isinstance(start_len, bool) or not isinstance(start_len, int)):
        raise RecordError(f"request {rid!r}: start_len must be an integer, got {start_len!r}")
    sid = str(sample_id if sample_id is not None else rid)
    if not isinstance(f.routed_experts, str):
        raise RecordError(f"request {rid!r}: the response has no routed_experts; {FLAG_HINT}")
    prompt_len = _int(f.prompt_tokens, "prompt_tokens", rid)
    gen = _int(f.completion_tokens, "completion_tokens", rid)
    seqlen = prompt_len + gen
    if start_len is not None and not 0 <= start_len <= prompt_len:
        raise RecordError(f"request {rid!r}: routed_experts_start_len {start_len} outside "
                          f"[0, prompt length {prompt_len}]")
    want = None if start_len is None else max(0, seqlen - 1 - start_len)
    full = decode_routed_experts(f.routed_experts, schema, rid, num_fused_shared_experts,
                                 rows=want)
    rows = full.shape[0]
    if start_len is None:
        # NOTE: the row count decides the start here; one that no start in [0, prompt
        # length] explains is a row-count mismatch, not a bad start.
        lo, hi = max(0, seqlen - 1 - prompt_len), seqlen - 1
        nbytes = rows * schema.num_hidden_layers * (schema.top_k + num_fused_shared_experts) * 4
        inside = lo <= rows <= hi
        # widths that would make the payload a row count the tokens allow (outside that
        # range) or the one unambiguous count (inside it)
        fits = [f for f in range(wire.MAX_FUSED_SHARED_EXPERTS + 1)
                if f != num_fused_shared_experts
                and nbytes % (row := 4 * schema.num_hidden_layers * (schema.top_k + f)) == 0
                and (nbytes // row == hi if inside else lo <= nbytes // row <= hi)]
        if not inside:
            raise RecordError(
                f"request {rid!r}: routing row-count mismatch: {rows} rows for {prompt_len} "
                f"prompt + {gen} output tokens; routed_experts covers [start_len, seqlen - 1) "
                f"with start_len in [0, {prompt_len}], i.e. {lo} to {hi} rows"
                + (f" (rows of width top_k + {fits[0]} would fit: does the payload carry "
                   f"fused shared-expert columns? pass num_fused_shared_experts={fits[0]})"
                   if fits else ""))
        if rows != seqlen - 1:
            # NOTE: seqlen - 1 - rows missing rows are a later start or a truncated payload,
            # and the bytes cannot tell which: placing them by a guess puts every row at
            # another token's position (rows 12-26 standing for 0-14).
            gap = seqlen - 1 - rows
            raise RecordError(
                f"request {rid!r}: {rows} routing rows for {prompt_len} prompt + {gen} output "
                f"tokens ({seqlen - 1} rows from position 0) and no start_len: start_len "
                f"{gap} with complete rows, or start_len 0 with a payload truncated by {gap} "
                f"rows (or a start in between); pass start_len= (the request's "
                "routed_experts_start_len; saved responses: store it as "
                '"routed_experts_start_len" next to meta_info)'
                + (f"; rows of width top_k + {fits[0]} would be the complete {hi}: pass "
                   f"num_fused_shared_experts={fits[0]} if the payload carries fused "
                   "shared-expert columns" if fits else ""))
        start_len = 0
    ids = checked_moe_ids(np.ascontiguousarray(full), schema, sid, start=start_len,
                          id_hint=wire.sglang_id_hint(schema.num_experts, num_fused_shared_experts))
    spans = f.weight_versions
    if isinstance(spans, list) and spans:
        try:
            out_spans = [(s["version"], int(s["start"]), int(s["end"])) for s in spans]
        except (KeyError, TypeError, ValueError, OverflowError):
            raise RecordError(f"request {rid!r}: bad weight_versions {spans!r}"[:300]) from None
        prev = 0
        for v, a, b in out_spans:          # SGLang: contiguous from 0, clipped to the output
            if not (isinstance(v, str) and a == prev and a <= b <= gen):
                raise RecordError(f"request {rid!r}: weight_versions {spans!r} are not contiguous "
                                  f"spans over the {gen} output tokens"[:400])
            prev = b
        versions = output_spans_to_rows(out_spans, prompt_len)
    elif f.weight_version is not None:
        versions = output_spans_to_rows([(str(f.weight_version), 0, gen)], prompt_len)
    else:
        versions = []
    nret = _int(f.num_retractions or 0, "num_retractions", rid)
    recomputed = [(start_len, start_len + rows)] if nret and rows else []
    if nret and versions:
        # NOTE: a retracted request is re-prefilled, so its rows were (re)computed after the
        # retraction, under the version current then, in practice the last one; the output
        # spans above tell which version sampled each token, not which computed the rows.
        versions = output_spans_to_rows([(versions[-1].version, 0, gen)], prompt_len)
    cached = _int(f.cached_tokens or 0, "cached_tokens", rid)
    if cached > seqlen:
        raise RecordError(f"request {rid!r}: cached_tokens {cached} > sequence length {seqlen}")
    token_ids = logprobs = None
    if prompt_ids is not None and isinstance(f.output_ids, list):
        token_ids = np.asarray(list(prompt_ids) + list(f.output_ids), dtype=np.int32)
        if len(prompt_ids) != prompt_len:
            raise RecordError(f"request {rid!r}: {len(prompt_ids)} prompt ids given, the "
                              f"response says prompt_tokens={prompt_len}")
    if token_ids is not None and isinstance(f.output_logprobs, list) \
            and len(f.output_logprobs) == gen:
        logprobs = np.array([float(x[0]) for x in f.output_logprobs], dtype=np.float32)
    rec = RoutingRecord(sample_id=sid, expert_ids=ids, start=start_len, prompt_len=prompt_len,
                        token_ids=token_ids, logprobs=logprobs if token_ids is not None else None,
                        weight_versions=versions, recomputed=recomputed,
                        prefix_cached=[(0, cached)] if cached else [], engine=engine,
                        sampling=sampling if logprobs is not None and token_ids is not None
                        else None)
    rec.validate(schema)
    check_written_rows(ids, sid, start_len)
    return rec


def _chunk_count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def record_from_stream(chunks: Iterable[Mapping[str, Any]], schema: RoutingSchema, *,
                       start_len: int | None = None, num_fused_shared_experts: int = 0,
                       **kw: Any) -> RoutingRecord:
    """One request's streamed ``/generate`` chunks (or OpenAI stream chunks, JSON-decoded
    ``data:`` lines) -> a validated record, as :func:`record_from_response`.

    Routing: every chunk's ``routed_experts`` (``meta_info``, or ``sglext`` of an OpenAI
    chunk) is a base64 block of int32 rows; the record's rows are all blocks in chunk
    order, from ``start_len`` (SGLang 0.5.23 sends one block with the finishing chunk; a
    server sending each step's rows with its chunk is assembled the same way). Token
    counts: ``prompt_tokens`` / ``completion_tokens`` (OpenAI: ``usage``) of the last
    chunk that carries them; ``output_ids`` are cumulative, the last chunk's kept; other
    ``meta_info`` fields are merged, a later chunk's winning.

    Args:
        chunks: the request's chunks in arrival order (dicts).
        start_len: the request's ``routed_experts_start_len`` (None: a chunk's
            ``routed_experts_start_len`` field, else as in :func:`record_from_response`).
        num_fused_shared_experts, **kw: as :func:`record_from_response` (``prompt_ids``,
            ``sample_id``, ``engine``).
    Raises:
        RecordError: naming the request, and the chunk where one is at fault: an empty
            stream; a chunk that is not an object or belongs to another request; no
            routed_experts (names the server flag); a block not base64 or whole rows; more
            rows than a chunk's token counts allow; ``output_ids`` that do not extend the
            previous chunk's (``--incremental-streaming-output``); a total that differs
            from the final token counts (rows per chunk listed); and everything
            :func:`record_from_response` refuses.
    """
    if start_len is not None and _chunk_count(start_len) is None:
        raise RecordError(f"start_len must be an integer >= 0, got {start_len!r}")
    meta: dict[str, Any] = {}
    behind: tuple[int, int, int] | None = None    # first (chunk, rows, rows its counts imply)
    rid = output_ids = field_start = None
    blocks: list[tuple[int, str, np.ndarray]] = []       # (chunk, payload, int32 rows)
    total = n = 0

    def where(i: int) -> str:
        return f"request {rid!r}, stream chunk {i}"

    def per_chunk() -> str:
        shown = ", ".join(f"chunk {i}: {len(a)}" for i, _, a in blocks[:8])
        more = f", ... ({len(blocks) - 8} more blocks)" if len(blocks) > 8 else ""
        return f"rows per chunk: {shown}{more}"

    for i, ch in enumerate(chunks):
        n = i + 1
        if not isinstance(ch, Mapping):
            raise RecordError(f"{where(i)}: not a JSON object: {str(ch)[:80]}")
        count = routed = None
        if isinstance(ch.get("meta_info"), Mapping):                        # /generate
            m = ch["meta_info"]
            cid = m.get("id", ch.get("id"))
            routed = m.get("routed_experts")
            meta.update((k, v) for k, v in m.items() if k != "routed_experts")
            count = _chunk_count(m.get("completion_tokens"))
        else:                                                                # OpenAI
            cid = ch.get("id")
            ext = ch.get("sglext")
            routed = ext.get("routed_experts") if isinstance(ext, Mapping) else None
            usage = ch.get("usage")
            if isinstance(usage, Mapping):
                meta["prompt_tokens"] = usage.get("prompt_tokens")
                meta["completion_tokens"] = usage.get("completion_tokens")
                count = _chunk_count(usage.get("completion_tokens"))
        if cid is not None:
            if rid is None:
                rid = cid
            elif cid != rid:
                raise RecordError(f"{where(i)}: the chunk belongs to request {cid!r}: one "
                                  "stream is one request's chunks")
        if field_start is None and _chunk_count(ch.get("routed_experts_start_len")) is not None:
            field_start = ch["routed_experts_start_len"]
        ids = ch.get("output_ids")
        if isinstance(ids, list):
            # NOTE: SGLang's output_ids are cumulative unless the server streams them
            # incrementally; those cannot be told from cumulative ones chunk by chunk, so
            # the counts decide, and incremental ones are refused rather than stitched.
            prev = output_ids or []
            if ids[:len(prev)] != prev or (count is not None and len(ids) != count):
                raise RecordError(
                    f"{where(i)}: {len(ids)} output_ids that do not extend the previous "
                    f"chunk's {len(prev)}" + (f" to completion_tokens={count}"
                                              if count is not None else "")
                    + " (SGLang sends cumulative output_ids; a server launched with "
                    "--incremental-streaming-output sends each chunk's new ids only)")
            output_ids = ids
            count = len(ids) if count is None else count
        if routed is None:
            continue
        if not isinstance(routed, str):
            raise RecordError(f"{where(i)}: routed_experts is not a base64 string "
                              f"({type(routed).__name__})")
        try:
            block = wire.decode_sglang_b64_int32(
                routed, schema.num_hidden_layers, schema.top_k,
                num_fused_shared_experts=num_fused_shared_experts)
        except RecordError as e:
            raise RecordError(f"{where(i)}: {e}") from None
        blocks.append((i, routed, block))
        total += len(block)
        prompt = _chunk_count(meta.get("prompt_tokens"))
        if prompt is not None and count is not None:
            start = start_len if start_len is not None else field_start or 0
            bound = max(0, prompt + count - 1 - start)
            if total > bound:
                raise RecordError(
                    f"{where(i)}: the chunk's {len(block)} routing rows bring the stream to "
                    f"{total} rows, but {prompt} prompt + {count} output tokens by this chunk "
                    f"have at most {bound} rows from position {start} (a start_len later "
                    "than the rows' start, or a chunk repeating earlier rows: cumulative "
                    "blocks, or a retracted request's re-prefill); "
                    + per_chunk())
            if total < bound and behind is None:
                behind = (i, total, bound)
    if not n:
        raise RecordError("empty SGLang stream")
    if not blocks:
        raise RecordError(f"request {rid!r}: no chunk of the stream ({n} chunks) carried "
                          "routed_experts (SGLang sends it with the final chunk); " + FLAG_HINT)
    start = start_len if start_len is not None else field_start
    prompt, gen = (_chunk_count(meta.get(k)) for k in ("prompt_tokens", "completion_tokens"))
    if start is not None and prompt is not None and gen is not None \
            and total != max(0, prompt + gen - 1 - start):
        raise RecordError(
            f"request {rid!r}: routing row-count mismatch in a stream of {n} chunks: "
            f"{total} rows in {len(blocks)} blocks, {prompt} prompt + {gen} output tokens "
            f"from position {start} have {max(0, prompt + gen - 1 - start)}; " + per_chunk()
            + (f"; first short: chunk {behind[0]}, {behind[1]} rows where its token counts "
               f"imply {behind[2]}" if behind else ""))
    if len(blocks) == 1:
        routed = blocks[0][1]
    else:
        routed = base64.b64encode(b"".join(a.tobytes() for _, _, a in blocks)).decode("ascii")
    resp: dict[str, Any] = {"meta_info": {**meta, "id": rid, "routed_experts": routed}}
    if output_ids is not None:
        resp["output_ids"] = output_ids
    try:
        return record_from_response(resp, schema, start_len=start,
                                    num_fused_shared_experts=num_fused_shared_experts, **kw)
    except RecordError as e:
        if len(blocks) > 1:
            raise RecordError(f"{e} (assembled from a stream of {n} chunks; {per_chunk()})") \
                from None
        raise


def iter_jsonl(path: str, schema: RoutingSchema, **kw: Any):
    """Records of a file of saved SGLang responses, one JSON object per line (``/generate``
    or OpenAI); each record's sample id is its request id.

    Raises:
        RecordError: a line that is not a JSON object, or a bad response (names the file,
            line and request).
    """
    import json
    found = False
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_BYTES:
                raise RecordError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            found = True
            try:
                resp = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise RecordError(f"{path}:{lineno}: not JSON: {e!r}"[:300]) from None
            try:
                yield record_from_response(resp, schema, **kw)
            except RecordError as e:
                raise RecordError(f"{path}:{lineno}: {e}") from None
    if not found:
        raise RecordError(f"{path}: no responses (the file is empty)")
