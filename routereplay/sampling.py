"""Sampling parameters behind an engine's reported log-probs (``RoutingRecord.sampling``):
what a recompute must apply to its own logits to compare like with like (routereplay.verify,
docs/metrics.md "Sampling: comparing like with like")."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from routereplay.errors import RecordError


# What the engine's reported log-prob of a sampled token is (SamplingInfo.logprobs_mode):
# "raw_logprobs": log_softmax(logits), the model's full-vocabulary distribution (vLLM's
# default; SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB, or greedy); "processed_logprobs":
# log_softmax of the logits after the sampler's transforms (vLLM 0.32 processed_logprobs:
# temperature, min_p, top_k, top_p, in that order); "temperature_logprobs":
# log_softmax(logits / temperature), no truncation (SGLang 0.5's default); "raw_logits",
# "processed_logits": vLLM's logit modes, where the value is a logit, not a log-prob.
LOGPROB_MODES = ("raw_logprobs", "processed_logprobs", "temperature_logprobs", "raw_logits",
                 "processed_logits")
MAX_SAMPLING_TEXT = 64          # bytes (UTF-8) of the mode and of each processor name
MAX_SAMPLING_PROCESSORS = 16


@dataclasses.dataclass(frozen=True)
class SamplingInfo:
    """The sampling parameters that change what a record's log-probs mean.

    Attributes:
        logprobs_mode: what the engine reported (:data:`LOGPROB_MODES`; another non-empty
            name of at most :data:`MAX_SAMPLING_TEXT` bytes is kept, and ``verify``
            refuses it).
        temperature: >= 0 (below 1e-5: greedy, no scaling: vLLM's ``_SAMPLING_EPS``).
        top_p: in (0, 1] (1: off). top_k: >= 0 (0: off; vLLM's and SGLang's -1 is stored
            as 0). min_p: in [0, 1] (0: off).
        processors: names of the other logit transforms that changed the recorded
            log-probs (penalties, logit bias, allowed / bad tokens, min_tokens, grammar
            masks: the engine's parameter names), at most
            :data:`MAX_SAMPLING_PROCESSORS`, distinct, each 1..:data:`MAX_SAMPLING_TEXT`
            bytes. Which transforms count depends on the mode (vLLM applies grammar masks
            before its raw log-probs, the rest after them): the engine adapter decides.

    Raises:
        RecordError: a field of the wrong type or outside its range (NaN, inf included).
    """

    logprobs_mode: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    processors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def num(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            try:            # NOTE: float() first: a 400-digit JSON integer overflows isfinite
                f = None if isinstance(v, bool) or not isinstance(
                    v, (int, float, np.integer, np.floating)) else float(v)
            except (OverflowError, ValueError):
                f = None
            if f is None or not math.isfinite(f) or not (lo < f if lo_open else lo <= f) \
                    or f > hi:
                raise RecordError(f"sampling {name} must be a finite number in "
                                  f"{'(' if lo_open else '['}{lo}, {hi}], got "
                                  f"{str(v)[:40]!r}")
            object.__setattr__(self, name, f)
        num("temperature", 0.0, math.inf)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < 1 << 31:
            raise RecordError(f"sampling top_k must be an integer in [0, 2^31) (0: off), "
                              f"got {k!r}")
        object.__setattr__(self, "top_k", int(k))

        def text(v: Any, what: str) -> None:
            if not isinstance(v, str) or not v or len(v.encode("utf-8", "surrogatepass")) > \
                    MAX_SAMPLING_TEXT:
                raise RecordError(f"sampling {what} must be a non-empty string of at most "
                                  f"{MAX_SAMPLING_TEXT} bytes, got {str(v)[:80]!r}")
        text(self.logprobs_mode, "logprobs_mode")
        procs = self.processors
        if not isinstance(procs, (tuple, list)) or len(procs) > MAX_SAMPLING_PROCESSORS:
            raise RecordError(f"sampling processors must be a list of at most "
                              f"{MAX_SAMPLING_PROCESSORS} names, got {str(procs)[:80]!r}")
        for v in procs:
            text(v, "processor name")
        if len(set(procs)) != len(procs):
            raise RecordError(f"sampling processors repeat a name: {list(procs)}")
        object.__setattr__(self, "processors", tuple(procs))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of format 2's meta (docs/FORMAT.md, key ``sampling``)."""
        return {"logprobs_mode": self.logprobs_mode, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "processors": list(self.processors)}

    @classmethod
    def from_json(cls, obj: Any) -> "SamplingInfo":
        """:meth:`to_json`'s object back (exactly its keys).

        Raises:
            RecordError: not an object with exactly those keys, or a bad value.
        """
        keys = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(obj, dict) or set(obj) != keys:
            raise RecordError(f"sampling must be an object with keys {sorted(keys)}, got "
                              f"{str(obj)[:120]}")
        return cls(**obj)


def _bool_env(name: str) -> bool:
    # NOTE: SGLang's get_bool_env_var: "true" or "1", any case
    return os.environ.get(name, "false").strip().lower() in ("true", "1")


# SGLang 0.5 sampling_params keys that change the logits before its sampler (penalties,
# bias, min_new_tokens' stop-token mask, grammar masks), with the value that means "off"
SGLANG_PROCESSORS = {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                     "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": None,
                     "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None}


def sampling_from_sglang(sampling_params: Mapping[str, Any] | None, *,
                         return_original_logprob: bool | None = None,
                         custom_logit_processor: Any = None) -> SamplingInfo:
    """The :class:`SamplingInfo` of an SGLang 0.5 ``/generate`` request.

    Args:
        sampling_params: the request's ``sampling_params`` object (None: SGLang's
            defaults). Missing keys take SGLang's defaults (temperature 1, top_p 1,
            top_k -1, min_p 0).
        return_original_logprob: the server's ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (its
            output log-probs are then log_softmax(logits), before temperature); None reads
            this process's environment, right only where the server runs with the same one.
        custom_logit_processor: the request's ``custom_logit_processor`` (listed as a
            processor when set).
    Returns:
        mode ``raw_logprobs`` (original log-probs, greedy, or temperature 1),
        ``temperature_logprobs`` (SGLang's default: log_softmax(logits / temperature);
        its top-k / top-p / min-p truncation does not enter the reported log-probs) or
        ``batch_dependent_logprobs`` (top_k 1 at a temperature other than 0 or 1);
        ``processors``: the keys of :data:`SGLANG_PROCESSORS` set to other than "off",
        which SGLang applies to the logits before both log-prob paths.
    Raises:
        RecordError: a value of the wrong type or range.
    """
    sp = dict(sampling_params or {})
    try:
        temp = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
        top_k = sp.get("top_k", -1)
        top_k = -1 if top_k is None else int(top_k)
    except (TypeError, ValueError, OverflowError):
        raise RecordError(f"SGLang sampling_params temperature / top_k not numbers: "
                          f"{str(sp)[:120]}") from None
    original = (_bool_env("SGLANG_RETURN_ORIGINAL_LOGPROB") if return_original_logprob is None
                else bool(return_original_logprob))
    procs = [k for k, off in SGLANG_PROCESSORS.items()
             if sp.get(k) is not None and sp.get(k) != off and sp.get(k) != {}]
    if custom_logit_processor:
        procs.append("custom_logit_processor")
    # NOTE: SGLang turns temperature 0 into top_k 1 at temperature 1 (raw log-probs). A
    # request of top_k 1 at another temperature gets log_softmax(logits) in an all-greedy
    # batch and log_softmax(logits / T) otherwise: which one the record holds is unknown
    # ("batch_dependent_logprobs", which verify refuses by name).
    if original or temp < 1e-5 or temp == 1.0:
        mode = "raw_logprobs"
    else:
        mode = "batch_dependent_logprobs" if top_k == 1 else "temperature_logprobs"
    return SamplingInfo(mode, temperature=temp,
                        top_p=1.0 if sp.get("top_p") is None else sp["top_p"],
                        top_k=max(top_k, 0),
                        min_p=0.0 if sp.get("min_p") is None else sp["min_p"],
                        processors=tuple(procs))
