"""Turn vLLM 0.32 ``RequestOutput`` objects into routing records.

vLLM 0.32 conventions (``vllm/outputs.py``):
- ``CompletionOutput.routed_experts``: numpy uint8/uint16 [P + G - 1 - start,
  num_hidden_layers, top_k], logical expert ids (captured before the EPLB mapping), prompt
  rows included from ``SamplingParams.routed_experts_prompt_start``, dense layers zero.
- ``CompletionOutput.weight_versions``: spans over *output* token indexes.
- ``CompletionOutput.logprobs[i][token_ids[i]].logprob``: the sampled token's log-prob, as
  ``ModelConfig.logprobs_mode`` (``--logprobs-mode``) defines it: ``raw_logprobs`` (the
  default) before any sampling transform, ``processed_logprobs`` after them
  (``vllm/v1/sample/sampler.py``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from routereplay.errors import RecordError
from routereplay.record import (LOGPROB_MODES, RoutingRecord, SamplingInfo,
                                check_written_rows, checked_moe_ids)
from routereplay.schema import RoutingSchema
from routereplay.weight_versions import output_spans_to_rows


def sample_key(sample_id: str, attempt: int | None = None, *, aborted: bool = False) -> str:
    """The key a completion's record is stored under (the plugin's and
    :func:`record_from_output`'s rule): the caller's sample id; with an attempt number > 0,
    ``<id>@<attempt>``; an aborted completion, ``<key>!aborted`` (so a retry reusing the id
    is stored under the id itself). A key already in a stream is refused, never renamed.

    Raises:
        RecordError: ``attempt`` not an integer >= 0.
    """
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)
                                or attempt < 0):
        raise RecordError(f"sample {sample_id!r}: attempt must be an integer >= 0, got {attempt!r}")
    key = str(sample_id) if not attempt else f"{sample_id}@{attempt}"
    return f"{key}!aborted" if aborted else key


# SamplingParams fields (vLLM 0.32) of the logit transforms other than temperature, top_k,
# top_p and min_p, with the value that means "off". vLLM's sampler applies them after its raw
# log-probs and before its processed ones; the grammar mask of structured outputs is applied
# by the model runner before the sampler, so it changes both (gpu_model_runner.py).
VLLM_PROCESSORS = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0, "logit_bias": None, "allowed_token_ids": None,
                   "bad_words": None, "min_tokens": 0, "thinking_token_budget": None}


def sampling_from_vllm(params: Any, logprobs_mode: str = "raw_logprobs") -> SamplingInfo:
    """The :class:`~routereplay.record.SamplingInfo` of a request.

    Args:
        params: the request's ``vllm.SamplingParams`` (after its ``__post_init__``, which
            sets top_p 1, top_k 0 and min_p 0 for temperature < 1e-5).
        logprobs_mode: the engine's ``ModelConfig.logprobs_mode`` (``LLM(logprobs_mode=...)``,
            ``--logprobs-mode``; vLLM 0.32 default ``raw_logprobs``).
    Returns:
        temperature, top_p, top_k (vLLM's -1 as 0: off), min_p as requested; ``processors``:
        the :data:`VLLM_PROCESSORS` set to other than "off" in a processed mode, and
        ``structured_outputs`` in any mode when the request has them. NOTE: logits
        processors loaded into the engine (``--logits-processors``) are not visible here.
    Raises:
        RecordError: a parameter of the wrong type or range, or an unknown mode.
    """
    if logprobs_mode not in LOGPROB_MODES or logprobs_mode == "temperature_logprobs":
        raise RecordError(f"unknown vLLM logprobs_mode {logprobs_mode!r} (vLLM 0.32: "
                          "raw_logprobs, processed_logprobs, raw_logits, processed_logits)")
    procs = []
    if logprobs_mode.startswith("processed"):
        procs = [k for k, off in VLLM_PROCESSORS.items()
                 if getattr(params, k, off) not in (off, None, [], {})]
    if getattr(params, "structured_outputs", None) is not None:
        procs.append("structured_outputs")
    try:
        temperature, top_p, top_k, min_p = (float(params.temperature), float(params.top_p),
                                            int(params.top_k), float(params.min_p))
    except (AttributeError, TypeError, ValueError, OverflowError) as e:
        raise RecordError(f"malformed SamplingParams ({type(e).__name__}: {e})"[:300]) from None
    return SamplingInfo(logprobs_mode, temperature=temperature, top_p=top_p,
                        top_k=max(top_k, 0), min_p=min_p, processors=tuple(procs))


def record_from_output(output: Any, schema: RoutingSchema, *, sample_id: str | None = None,
                       attempt: int | None = None, start: int = 0,
                       engine: str = "vllm",
                       sampling: SamplingInfo | None = None) -> RoutingRecord:
    """Build a validated RoutingRecord from one ``vllm.RequestOutput`` (first completion).

    Args:
        output: a finished ``vllm.RequestOutput``.
        schema: the model's routing schema (dense layers are stripped with it).
        sample_id: the caller's id of the sample; default the request id.
        attempt: the caller's attempt number; the record is keyed :func:`sample_key`.
        start: the request's ``routed_experts_prompt_start``.
        sampling: :func:`sampling_from_vllm` of the request's SamplingParams and the
            engine's ``logprobs_mode`` (a ``RequestOutput`` carries neither).
    Returns:
        record with ids [P + G - 1 - start, L_moe, top_k], token ids, sampled-token
        log-probs (if requested with ``logprobs=0``) and weight-version spans over token
        positions (prompt rows take the version of the first output span).
    Raises:
        RecordError: as :func:`record_from_parts`.
    """
    c = output.outputs[0]
    sid = sample_key(str(sample_id if sample_id is not None else output.request_id), attempt,
                     aborted=str(getattr(c, "finish_reason", None)) == "abort")
    return record_from_parts(
        sid, schema, prompt=list(output.prompt_token_ids or []), generated=list(c.token_ids),
        routed_experts=c.routed_experts, start=start, logprobs=c.logprobs,
        weight_versions=c.weight_versions,
        num_cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0), engine=engine,
        sampling=sampling)


def record_from_parts(sid: str, schema: RoutingSchema, *, prompt: list[int], generated: list[int],
                      routed_experts: Any, start: int = 0, logprobs: Any = None,
                      weight_versions: Any = None, num_cached_tokens: int = 0,
                      engine: str = "vllm",
                      sampling: SamplingInfo | None = None) -> RoutingRecord:
    """The record of one finished completion from its parts (see :func:`record_from_output`).

    Args:
        routed_experts: vLLM's ``CompletionOutput.routed_experts`` (uint8/uint16
            [P + G - 1 - start, num_hidden_layers, top_k]) or None.
        logprobs: ``CompletionOutput.logprobs`` (one mapping token -> Logprob per generated
            token) or None.
        weight_versions: ``CompletionOutput.weight_versions`` (spans over output tokens).
        sampling: what the log-probs mean (:func:`sampling_from_vllm`); stored only with
            ``logprobs`` (NOTE: format-3 readers before the SAMPLING field refuse records
            that carry it).
    Raises:
        RecordError: naming the sample: routing missing (engine started without
            --enable-return-routed-experts, or request aborted), wrong row count, bad ids
            (token, layer), rows never written (routereplay.record.check_written_rows).
    """
    full = routed_experts
    if full is None:
        raise RecordError(
            f"sample {sid!r}: vLLM returned no routed_experts; start the engine with "
            "--enable-return-routed-experts (LLM(enable_return_routed_experts=True)); an "
            "aborted request also has none")
    try:
        gen, prompt = list(generated), list(prompt)
        full = np.asarray(full)
    except (TypeError, ValueError) as e:
        raise RecordError(f"sample {sid!r}: malformed prompt, generated or routed_experts from "
                          f"the engine ({type(e).__name__}: {e})"[:500]) from None
    n = len(prompt) + len(gen)
    if full.ndim != 3 or full.shape[0] != n - 1 - start:
        raise RecordError(
            f"sample {sid!r}: routed_experts has shape {tuple(full.shape)}, expected "
            f"[{n - 1 - start}, {schema.num_hidden_layers}, {schema.top_k}] for "
            f"{len(prompt)} prompt + {len(gen)} generated tokens, start={start}")
    ids = checked_moe_ids(full, schema, sid, start=start)
    # NOTE: the other parts come from the engine's objects; anything malformed in them is a
    # RecordError naming the sample and the part, never a foreign exception
    part = "logprobs"
    try:
        lp = None
        if logprobs is not None:
            lp = np.array([float(d[t].logprob) for d, t in zip(logprobs, gen)],
                          dtype=np.float32)
        part = "weight_versions"
        out_spans = [(str(s.version), int(s.start), int(s.end)) for s in (weight_versions or [])]
        for v, a, b in out_spans:
            if not 0 <= a <= b <= len(gen):
                raise RecordError(f"sample {sid!r}: weight-version span {v!r} [{a}, {b}) is not "
                                  f"within the {len(gen)} generated tokens")
        spans = output_spans_to_rows(out_spans, len(prompt))
        part = "prompt and generated token ids"
        tokens = np.asarray(prompt + gen)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or (tokens.size and (
                int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 31)):
            raise RecordError(f"sample {sid!r}: token ids must be integers in [0, 2^31)")
        part = "num_cached_tokens"
        cached = int(num_cached_tokens or 0)
        rec = RoutingRecord(
            sample_id=sid, expert_ids=ids, start=start, prompt_len=len(prompt),
            token_ids=tokens.astype(np.int32), logprobs=lp, weight_versions=spans,
            prefix_cached=[(0, cached)] if cached else [], engine=engine,
            sampling=sampling if lp is not None else None)
    except RecordError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise RecordError(f"sample {sid!r}: malformed {part} from the engine "
                          f"({type(e).__name__}: {e})"[:500]) from None
    rec.validate(schema)
    check_written_rows(ids, sid, start)
    return rec
