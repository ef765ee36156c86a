"""The engines' own routing wire formats: sizes to compare the sidecar against, and the one
decoder of each.

- vLLM 0.32 OpenAI server: ``choices[i].routed_experts`` = base64 of ``np.save`` bytes of
  the uint8/uint16 array [T, num_hidden_layers, top_k] (``vllm/utils/serial_utils.py``
  numpy2base64), dense layers included.
- SGLang 0.5: ``meta_info["routed_experts"]`` = base64 of raw little-endian int32, flat, no
  shape: [T, num_hidden_layers, W] with W = top_k, plus the fused shared-expert columns
  where the server returns them (DeepSeek ``num_fused_shared_experts``; SGLang 0.5.23 strips
  them, so W = top_k there). The payload cannot tell W by itself: several widths can divide
  the same byte count, so the caller states it (:func:`decode_sglang_b64_int32`).

:func:`sglang_fields` is the one parser of SGLang response objects (``/generate``,
``Engine.generate``, the OpenAI endpoints, or a bare ``{"id", "routed_experts"}``); the
SGLang adapter (``engine_patches.sglang.records``) and ``routereplay convert`` both use it.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from typing import Any, Callable, Mapping

import numpy as np

from routereplay.errors import RecordError

MAX_FUSED_SHARED_EXPERTS = 8      # only for the hint naming a width that would fit


def vllm_b64_npy(full_ids: np.ndarray) -> bytes:
    """vLLM's wire bytes for ``full_ids: uint8|uint16 [T, num_hidden_layers, top_k]``."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(full_ids), allow_pickle=False)
    return base64.b64encode(buf.getvalue())


def sglang_b64_int32(full_ids: np.ndarray) -> bytes:
    """SGLang's wire bytes for ``full_ids: int [T, num_hidden_layers, W]``."""
    return base64.b64encode(np.ascontiguousarray(full_ids, dtype="<i4").tobytes())


def decode_vllm_b64_npy(data: bytes | str) -> np.ndarray:
    """Inverse of :func:`vllm_b64_npy` (never unpickles: allow_pickle=False)."""
    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)


def _width_hint(nbytes: int, num_hidden_layers: int, top_k: int, rows: int | None,
                num_fused_shared_experts: int) -> str:
    """Which fused shared-expert column count would make ``nbytes`` fit (a hint only: the
    payload is never decoded with a width the caller did not state)."""
    fits = []
    for f in range(MAX_FUSED_SHARED_EXPERTS + 1):
        row = 4 * num_hidden_layers * (top_k + f)
        if f != num_fused_shared_experts and (
                nbytes == rows * row if rows is not None else nbytes % row == 0):
            fits.append(f)
    if not fits:
        return ""
    if rows is not None:
        f = fits[0]
        return (f"; it holds exactly {rows} rows of width {top_k + f} = top_k {top_k} + {f} "
                f"fused shared-expert column(s): pass num_fused_shared_experts={f}"
                + (" (SGLang 0.5.23 strips the fused columns)" if f == 0 else ""))
    return ("; it would be whole rows with num_fused_shared_experts in "
            f"{fits} (give the request's routed_experts_start_len to check the row count)")


def decode_sglang_b64_int32(data: str | bytes, num_hidden_layers: int, top_k: int, *,
                            num_fused_shared_experts: int = 0,
                            rows: int | None = None) -> np.ndarray:
    """Inverse of :func:`sglang_b64_int32`: int32 [rows, num_hidden_layers, W].

    Args:
        data: the base64 payload.
        num_fused_shared_experts: fused shared-expert columns the payload carries per row
            (0 for SGLang 0.5.23, which strips them, and for models without fused shared
            experts); W = top_k + num_fused_shared_experts. NOTE: never inferred from the
            byte count: a payload of 12 rows x 3 layers x 7 columns also divides into 14
            rows of 6 columns.
        rows: the row count the request implies (seqlen - 1 - routed_experts_start_len),
            when known; checked against the byte count.
    Raises:
        RecordError: not base64; a byte count that does not hold ``rows`` rows (a row-count
            mismatch) or no whole number of rows of width W; the message names a fused
            column count that would fit, as a hint.
    """
    if isinstance(num_fused_shared_experts, bool) or not isinstance(num_fused_shared_experts, int) \
            or num_fused_shared_experts < 0:
        raise RecordError(f"num_fused_shared_experts must be an integer >= 0, got "
                          f"{num_fused_shared_experts!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise RecordError(f"routed_experts is not base64 ({e})") from None
    width = top_k + num_fused_shared_experts
    row = 4 * num_hidden_layers * width
    shape = (f"num_hidden_layers x (top_k + fused shared-expert columns) = {num_hidden_layers} "
             f"x ({top_k} + {num_fused_shared_experts})" if num_fused_shared_experts else
             f"num_hidden_layers x top_k = {num_hidden_layers} x {top_k}")
    if rows is not None and len(raw) != rows * row:
        got = f"{len(raw) / row:g}" if len(raw) % row else str(len(raw) // row)
        raise RecordError(
            f"routing row-count mismatch: routed_experts holds {len(raw)} bytes = {got} rows "
            f"of {shape} int32, the request implies {rows} rows"
            + _width_hint(len(raw), num_hidden_layers, top_k, rows, num_fused_shared_experts))
    if len(raw) % row:
        raise RecordError(
            f"routed_experts holds {len(raw)} bytes: not a whole number of rows of {shape} "
            "int32" + _width_hint(len(raw), num_hidden_layers, top_k, None,
                                  num_fused_shared_experts))
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_hidden_layers, width)


def split_fused_shared_columns(full: np.ndarray, top_k: int, num_experts: int) -> np.ndarray:
    """int [T, L, top_k + F] -> the routed columns [T, L, top_k].

    SGLang pads the F fused shared-expert columns with -1 where a route was written without
    them, or holds the shared experts' ids there (numbered from ``num_experts``).

    Raises:
        RecordError: a fused column holds a routed expert id (the width is wrong).
    """
    if full.shape[2] == top_k:
        return full
    extra = full[..., top_k:]
    if not ((extra == -1) | (extra >= num_experts)).all():
        raise RecordError("the fused shared-expert columns hold routed expert ids: the payload "
                          "does not carry that many fused columns (num_fused_shared_experts)")
    return full[..., :top_k]


def sglang_id_hint(num_experts: int, num_fused_shared_experts: int) -> Callable[[int], str]:
    """Hint for an out-of-range id in SGLang routing (see checked_moe_ids): SGLang records
    logical ids before its EPLB mapping, so a replica slot is never the explanation; a -1
    or an id >= num_experts in the routed columns is a fused shared-expert column read as
    routed (the payload's width was stated wrong)."""
    def hint(v: int) -> str:
        if v == -1 or v >= num_experts:
            return (f" (a fused shared-expert {'pad' if v == -1 else 'id'} in a routed column? "
                    f"the payload was decoded with num_fused_shared_experts="
                    f"{num_fused_shared_experts}: state the number of fused shared-expert "
                    "columns it carries)")
        return ""
    return hint


@dataclasses.dataclass
class SGLangFields:
    """The fields of one SGLang response that routing records need (None: absent).

    Attributes:
        id: ``meta_info["id"]`` (``/generate``), the OpenAI response ``id``, or a bare
            object's ``id`` / ``sample_id``.
        routed_experts: the base64 int32 payload.
        prompt_tokens, completion_tokens, cached_tokens: token counts.
        weight_version: the single ``weight_version`` label.
        weight_versions: ``[{"version", "start", "end"}]`` spans over output tokens.
        num_retractions: how often the request was retracted (re-prefilled).
        output_ids: generated token ids (``/generate``).
        output_logprobs: ``[[logprob, token_id, text], ...]`` (``/generate``).
        num_choices: choices of an OpenAI response (1 otherwise).
        start_len: ``routed_experts_start_len`` stored next to the response by a client.
    """

    id: Any = None
    routed_experts: Any = None
    prompt_tokens: Any = None
    completion_tokens: Any = None
    cached_tokens: Any = 0
    weight_version: Any = None
    weight_versions: Any = None
    num_retractions: Any = 0
    output_ids: Any = None
    output_logprobs: Any = None
    num_choices: int = 1
    start_len: Any = None


def sglang_fields(resp: Any) -> SGLangFields:
    """Normalise one SGLang response (SGLang 0.5.7 to 0.5.23 layouts).

    - ``/generate`` and ``Engine.generate``: ``{"text", "output_ids", "meta_info": {"id",
      "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
      "weight_versions", "num_retractions", "routed_experts", "output_token_logprobs"}}``
      (``sglang/srt/managers/tokenizer_manager.py``).
    - OpenAI ``/v1/completions`` and ``/v1/chat/completions``: ``{"id", "choices", "usage":
      {"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}},
      "metadata": {"weight_version", "weight_versions"}, "sglext": {"routed_experts"}}``
      (0.5.23 puts ``sglext`` on the response; older releases ``sgl_ext`` on each choice).
    - a bare ``{"id" | "sample_id", "routed_experts"}`` object (routing saved on its own).

    Raises:
        RecordError: not a JSON object, or none of these layouts.
    """
    if not isinstance(resp, Mapping):
        raise RecordError(f"SGLang response must be a JSON object, got {type(resp).__name__}")
    start = resp.get("routed_experts_start_len")
    if isinstance(resp.get("meta_info"), Mapping):                          # /generate
        m = resp["meta_info"]
        f = SGLangFields(
            id=m.get("id"), routed_experts=m.get("routed_experts"),
            prompt_tokens=m.get("prompt_tokens"), completion_tokens=m.get("completion_tokens"),
            cached_tokens=m.get("cached_tokens", 0), weight_version=m.get("weight_version"),
            weight_versions=m.get("weight_versions"),
            num_retractions=m.get("num_retractions", 0), output_ids=resp.get("output_ids"),
            output_logprobs=m.get("output_token_logprobs"), start_len=start)
        if f.id is None:
            f.id = resp.get("id", resp.get("sample_id"))
        if f.completion_tokens is None and isinstance(resp.get("output_ids"), list):
            f.completion_tokens = len(resp["output_ids"])
        return f
    if isinstance(resp.get("choices"), list):                               # OpenAI
        usage = resp.get("usage") if isinstance(resp.get("usage"), Mapping) else {}
        meta = resp.get("metadata") if isinstance(resp.get("metadata"), Mapping) else {}
        ext = resp.get("sglext") or {}
        routed = ext.get("routed_experts") if isinstance(ext, Mapping) else None
        choices = resp["choices"]
        if routed is None and choices and isinstance(choices[0], Mapping):
            ch_ext = choices[0].get("sgl_ext") or {}
            routed = ch_ext.get("routed_experts") if isinstance(ch_ext, Mapping) else None
        details = usage.get("prompt_tokens_details") or {}
        return SGLangFields(
            id=resp.get("id"), routed_experts=routed, num_choices=len(choices),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_tokens=(details.get("cached_tokens") if isinstance(details, Mapping)
                           else 0) or 0,
            weight_version=meta.get("weight_version"),
            weight_versions=meta.get("weight_versions"), start_len=start)
    if "routed_experts" in resp:                                            # bare routing
        return SGLangFields(id=resp.get("id", resp.get("sample_id")),
                            routed_experts=resp["routed_experts"], start_len=start)
    raise RecordError("not an SGLang response: no meta_info (/generate), no choices (OpenAI) "
                      "and no routed_experts")
