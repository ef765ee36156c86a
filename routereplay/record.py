"""Routing record: the routing of one sample (one request / one sequence).

Row convention (vLLM 0.32 ``CompletionOutput.routed_experts``, SGLang 0.5
``meta_info["routed_experts"]``): row i holds the top-k experts of token position
``start + i`` for every MoE layer, in the engine's top-k column order. A sequence of
``N = prompt_len + num_generated`` tokens has ``T = N - 1 - start`` rows: the last sampled
token is never fed through the model, so it has no row.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import numpy as np

from routereplay.errors import RecordError
# NOTE: the sampling concept lives in routereplay.sampling; its names stay importable here
from routereplay.sampling import (LOGPROB_MODES, MAX_SAMPLING_PROCESSORS,  # noqa: F401
                                  MAX_SAMPLING_TEXT, SGLANG_PROCESSORS, SamplingInfo,
                                  sampling_from_sglang)
from routereplay.schema import RoutingSchema


@dataclasses.dataclass(frozen=True)
class WeightVersionSpan:
    """Token positions ``[start, end)`` whose rows were computed with weights ``version``.

    Positions are absolute token positions of the sequence (prompt included), the same
    axis as ``RoutingRecord.start``; vLLM 0.32 ``CompletionOutput.weight_versions`` counts
    output tokens only and is shifted by the engine adapter.
    """

    version: str
    start: int
    end: int


@dataclasses.dataclass
class RoutingRecord:
    """Routing of one sample plus what is needed to replay and validate it.

    Shapes follow the legend in :mod:`routereplay` (T rows, L_moe MoE layers, K = top_k).

    Attributes:
        sample_id: the caller's id of the sample (the RL framework's uid, or the engine's
            request id); unique within a stream.
        expert_ids: uint8 or uint16 [T, L_moe, K], logical expert ids, engine column order;
            dense layers already stripped (see RoutingSchema.strip_dense).
        start: token position of row 0 (vLLM ``routed_experts_prompt_start``).
        prompt_len: number of prompt tokens, or None if unknown.
        token_ids: optional int32 [N], the full sequence (prompt + generated tokens).
        logprobs: optional float32 [N - prompt_len], the engine's log-prob of each sampled
            token (natural log), aligned with token_ids[prompt_len:].
        weight_versions: spans over token positions, prompt included.
        recomputed: spans of token positions whose rows were recomputed (retract, preemption).
        prefix_cached: spans of token positions served from the prefix cache.
        engine: engine name and version, e.g. "vllm 0.32.0".
        sampling: the sampling parameters and log-prob mode behind ``logprobs``
            (:class:`SamplingInfo`), or None when unknown (``verify`` then says so).
    """

    sample_id: str
    expert_ids: np.ndarray
    start: int = 0
    prompt_len: int | None = None
    token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    weight_versions: list[WeightVersionSpan] = dataclasses.field(default_factory=list)
    recomputed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    prefix_cached: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    engine: str = ""
    sampling: SamplingInfo | None = None

    @property
    def num_tokens(self) -> int:
        """T, the number of routing rows."""
        return int(self.expert_ids.shape[0])

    def validate(self, schema: RoutingSchema) -> None:
        """Check field types, shape, dtype, id range, duplicate ids and row count.

        Raises:
            RecordError: naming the sample, and the token position and MoE decoder layer of
                the first bad row.
        """
        sid = self.sample_id
        if not isinstance(sid, str):
            raise RecordError(f"sample id must be a string, got {type(sid).__name__} {sid!r}")
        for name in ("start", "prompt_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise RecordError(f"sample {sid!r}: {name} must be an integer, got {v!r}")
        if not isinstance(self.engine, str):
            raise RecordError(f"sample {sid!r}: engine must be a string")
        if self.sampling is not None and not isinstance(self.sampling, SamplingInfo):
            raise RecordError(f"sample {sid!r}: sampling must be a SamplingInfo or None, got "
                              f"{type(self.sampling).__name__}")
        self.validate_ids(schema)
        if self.start < 0:
            raise RecordError(f"sample {sid!r}: negative start {self.start}")
        if self.token_ids is not None:
            n = len(self.token_ids)
            if self.expert_ids.shape[0] != n - 1 - self.start:
                raise RecordError(
                    f"sample {sid!r}: {self.expert_ids.shape[0]} routing rows but {n} tokens with "
                    f"start={self.start}: expected N - 1 - start = {n - 1 - self.start} rows")
            if self.prompt_len is not None and not (0 < self.prompt_len <= n):
                raise RecordError(f"sample {sid!r}: prompt_len {self.prompt_len} outside [1, {n}]")
            if self.logprobs is not None and self.prompt_len is not None \
                    and len(self.logprobs) != n - self.prompt_len:
                raise RecordError(
                    f"sample {sid!r}: {len(self.logprobs)} log-probs for "
                    f"{n - self.prompt_len} generated tokens")
        if self.prompt_len is not None and self.prompt_len < 0:
            raise RecordError(f"sample {sid!r}: negative prompt_len {self.prompt_len}")
        seq = self.start + self.num_tokens + 1          # tokens the rows imply
        if self.prompt_len is not None and self.prompt_len > seq:
            raise RecordError(f"sample {sid!r}: prompt_len {self.prompt_len} above the {seq} "
                              f"tokens that {self.num_tokens} rows from position {self.start} "
                              "imply")
        if self.logprobs is not None and len(self.logprobs) > seq - (self.prompt_len or 0):
            raise RecordError(f"sample {sid!r}: {len(self.logprobs)} log-probs, more than the "
                              f"{seq - (self.prompt_len or 0)} generated tokens the rows imply")
        if self.token_ids is not None:
            t = np.asarray(self.token_ids)
            if t.ndim != 1 or t.dtype.kind not in "iu" or (t.size and (
                    int(t.min()) < -(1 << 31) or int(t.max()) >= (1 << 31))):
                raise RecordError(f"sample {sid!r}: token_ids must be a 1-D integer array within "
                                  f"int32, got {t.dtype} {t.shape}")
        if self.logprobs is not None:
            lp = np.asarray(self.logprobs)
            if lp.ndim != 1 or lp.dtype.kind != "f":
                raise RecordError(f"sample {sid!r}: logprobs must be a 1-D float array, got "
                                  f"{lp.dtype} {lp.shape}")
        def is_int(x: Any) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
        # NOTE: spans are token positions of this sequence: [0, seq]. A position beyond it
        # (a forged or overflowing count, e.g. num_cached_tokens=10**30) would also be
        # written as a varint longer than readers accept, losing the record.
        for span in self.weight_versions:
            if not (isinstance(span, WeightVersionSpan) and isinstance(span.version, str)
                    and is_int(span.start) and is_int(span.end)
                    and 0 <= span.start <= span.end <= seq):
                raise RecordError(f"sample {sid!r}: bad weight-version span {span!r} (expected "
                                  f"WeightVersionSpan(version: str, 0 <= start <= end <= {seq}),"
                                  f" token positions of the {seq}-token sequence)")
        for name in ("recomputed", "prefix_cached"):
            for span in getattr(self, name):
                if not (isinstance(span, (tuple, list)) and len(span) == 2
                        and all(is_int(x) for x in span) and 0 <= span[0] <= span[1] <= seq):
                    raise RecordError(f"sample {sid!r}: bad {name} span {span!r} (expected "
                                      f"0 <= start <= end <= {seq}, token positions of the "
                                      f"{seq}-token sequence)")

    def validate_ids(self, schema: RoutingSchema, layer_ids: Sequence[int] | None = None) -> None:
        """Check ids only: [T, L, top_k] of the schema's dtype, in range, distinct per row.

        ``layer_ids``: the decoder-layer ids of the L layers held (default all MoE layers).

        Raises:
            RecordError: naming the sample, token position and decoder layer.
        """
        sid = self.sample_id
        ids = self.expert_ids
        layer_ids = list(schema.moe_layer_ids if layer_ids is None else layer_ids)
        if not isinstance(ids, np.ndarray) or ids.ndim != 3:
            raise RecordError(f"sample {sid!r}: ids must be an array [T, L_moe, top_k], "
                              f"got {getattr(ids, 'shape', type(ids))}")
        if ids.shape[1:] != (len(layer_ids), schema.top_k):
            raise RecordError(
                f"sample {sid!r}: ids shape {tuple(ids.shape)} does not match the schema "
                f"[T, L_moe={len(layer_ids)}, top_k={schema.top_k}]")
        if ids.dtype != schema.id_dtype:
            raise RecordError(
                f"sample {sid!r}: ids dtype {ids.dtype} != schema {schema.id_dtype} (engine "
                "arrays: narrow them with routereplay.record.checked_moe_ids(arr, schema, "
                "sample_id), which checks the range and drops dense layers; a plain astype "
                "would wrap out-of-range ids)")
        first_bad_row(ids, schema, self.sample_id, start=self.start, layer_ids=layer_ids)

    def meta(self) -> dict[str, Any]:
        """JSON-able metadata (everything but the arrays)."""
        return {
            "sample_id": self.sample_id,
            "num_tokens": self.num_tokens,
            "start": int(self.start),
            "prompt_len": None if self.prompt_len is None else int(self.prompt_len),
            "weight_versions": [[str(s.version), int(s.start), int(s.end)]
                                for s in self.weight_versions],
            "recomputed": [[int(a), int(b)] for a, b in self.recomputed],
            "prefix_cached": [[int(a), int(b)] for a, b in self.prefix_cached],
            "engine": self.engine,
            "sampling": None if self.sampling is None else self.sampling.to_json(),
        }

    def versions(self) -> list[str]:
        """Distinct weight versions, in order of first appearance."""
        seen: list[str] = []
        for s in self.weight_versions:
            if s.version not in seen:
                seen.append(s.version)
        return seen


def eplb_id_hint(value: int, dtype: np.dtype, num_experts: int) -> str:
    """The default hint for an expert id outside [0, num_experts) (see checked_moe_ids)."""
    dt = np.dtype(dtype)
    if dt.kind == "u" and value == np.iinfo(dt).max:
        return (f" (the largest {dt} value: a -1 sentinel stored as unsigned, i.e. a padded "
                "or missing row)")
    if value >= num_experts:
        return (" (a physical EPLB replica slot? routing must be recorded as logical expert "
                "ids, before the EPLB mapping)")
    return ""


# NOTE: checks run over row chunks of about this many ids, so their temporaries (masks,
# sorted copies) stay a few MiB however large the array.
CHECK_CHUNK_IDS = 1 << 20


PAIRWISE_TOP_K = 4        # up to this top_k, duplicates are found by comparing columns


def row_chunks(num_rows: int, ids_per_row: int) -> list[tuple[int, int]]:
    """Row ranges ``[(a, b), ...]`` covering ``num_rows`` rows, about
    :data:`CHECK_CHUNK_IDS` ids each."""
    step = max(1, CHECK_CHUNK_IDS // max(1, ids_per_row))
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def first_bad_row(ids: np.ndarray, schema: RoutingSchema, sample_id: str, *, start: int = 0,
                  layer_ids: Sequence[int] | None = None, check_range: bool = True,
                  check_duplicates: bool = True,
                  id_hint: Callable[[int], str] | None = None) -> None:
    """Raise on the first id out of ``[0, num_experts)`` or repeated within its row (per
    chunk of :data:`CHECK_CHUNK_IDS` ids, ranges before repeats).

    Args:
        ids: integer [T, L, top_k] (any integer dtype; checked before any narrowing).
        start: token position of row 0; ``layer_ids``: decoder layer of each of the L
            columns (default: the schema's MoE layers). Both only name the bad row.
        check_range: False when the dtype and the caller already bound the range.
        check_duplicates: False to check the range only.
        id_hint: value -> text appended to an out-of-range error (default
            :func:`eplb_id_hint`).
    Raises:
        RecordError: naming the sample, token position and decoder layer (with a hint for
            all-zero rows and for ids >= num_experts: EPLB replica slots?).
    Work: O(ids), temporaries bounded by :data:`CHECK_CHUNK_IDS` ids.
    """
    layer_ids = list(schema.moe_layer_ids if layer_ids is None else layer_ids)
    e = schema.num_experts
    t, nl, k = ids.shape
    signed = ids.dtype.kind == "i"
    check_range = check_range and (signed or np.iinfo(ids.dtype).max >= e)
    for a, b in row_chunks(t, nl * k):
        c = ids[a:b]
        if check_range and c.size and (int(c.max()) >= e or (signed and int(c.min()) < 0)):
            bad = (c >= e) | (c < 0) if signed else c >= e
            r, lyr, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
            v = int(c[r, lyr, col])
            hint = (id_hint or (lambda x: eplb_id_hint(x, ids.dtype, e)))(v)
            raise RecordError(f"sample {sample_id!r}, token {start + a + r}, layer "
                              f"{layer_ids[lyr]}: expert id {v} outside [0, {e}){hint}")
        if check_duplicates and k > 1 and c.size:
            if k <= PAIRWISE_TOP_K:
                # NOTE: K(K-1)/2 compares of columns cost less than a sort along a short
                # last axis and its reduction (a fifth of a writer's time at top-2)
                pairs = itertools.combinations(range(k), 2)
                i, j = next(pairs)
                dup = c[..., i] == c[..., j]
                for i, j in pairs:
                    dup |= c[..., i] == c[..., j]
            else:
                srt = np.sort(c, axis=-1)
                dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
            if dup.any():
                r, lyr = np.unravel_index(int(np.argmax(dup)), dup.shape)
                hint = (" (all-zero row: the capturer was never bound, or a dense layer "
                        "was read as MoE)" if not c[r, lyr].any() else "")
                raise RecordError(
                    f"sample {sample_id!r}, token {start + a + r}, layer {layer_ids[lyr]}: "
                    f"duplicate expert ids {c[r, lyr].tolist()} in one top-k row{hint}")


# NOTE: rows that were never written read as expert 0 everywhere (a capturer never bound,
# a P/D prefill worker that returns the prompt rows unwritten, a schema whose "MoE"
# layers are the model's dense, zero-filled ones); with top-1 such a row looks valid. A
# run of rows that is expert 0 in every MoE layer is refused once it covers
# UNWRITTEN_MIN_CELLS (token, MoE layer) cells and UNWRITTEN_MIN_TOKENS tokens: even a
# router giving expert 0 probability 1/2 in every cell produces such a run with
# probability <= 2^-64. The token minimum: one token's cells come from one forward pass,
# not independent draws (an attention sink such as BOS), so a few rows alone are never
# refused. Limit: a model with one or two MoE layers running a long span of one repeated
# token could route it to expert 0 everywhere; the rule assumes tokens route independently.
UNWRITTEN_MIN_CELLS = 64
UNWRITTEN_MIN_TOKENS = 4


def check_written_rows(ids: np.ndarray, sample_id: str, start: int = 0) -> None:
    """Refuse a run of rows that no router would produce: consecutive token rows that are
    expert 0 in every MoE layer and top-k column, at least :data:`UNWRITTEN_MIN_TOKENS`
    rows and :data:`UNWRITTEN_MIN_CELLS` (token, layer) cells long (the NOTE above).

    Args:
        ids: integer [T, L_moe, K] (dense layers already stripped), row i at token position
            ``start + i``.
        sample_id: names the sample in the error; ``start``: token position of row 0.
    Raises:
        RecordError: naming the sample, the token span [a, b) of the first such run and
            the likely causes (capturer never bound; P/D prefill rows not written; dense
            layers read as MoE).
    Work: O(T x L_moe x K) reads, one bool per row (plus a chunk's temporaries).
    """
    t = ids.shape[0]
    layers = ids.shape[1] if ids.ndim == 3 else 0
    if not t or not layers:
        return
    need = max(UNWRITTEN_MIN_TOKENS, -(-UNWRITTEN_MIN_CELLS // layers))    # rows
    if t < need:
        return
    zero = np.empty(t, bool)
    flat = ids.reshape(t, -1)
    for a, b in row_chunks(t, flat.shape[1]):
        zero[a:b] = ~flat[a:b].any(axis=1)
    if not zero.any():
        return
    edges = np.flatnonzero(np.diff(zero.astype(np.int8), prepend=0, append=0))
    runs = edges.reshape(-1, 2)                          # [a, b) of each all-zero run
    long = np.flatnonzero(runs[:, 1] - runs[:, 0] >= need)
    if long.size:
        a, b = (int(x) for x in runs[long[0]])
        raise RecordError(
            f"sample {sample_id!r}, tokens [{start + a}, {start + b}): {b - a} consecutive rows "
            f"are expert 0 in all {layers} MoE layers, which no router produces (runs of "
            f"{need} or more are refused): rows never written. Likely causes: the routing "
            "capturer was never bound (every row zero), prefill/decode disaggregation "
            "returned the prompt rows unwritten (a decode leg's or overlapped prefill's "
            "prompt rows), or the schema's MoE layers are dense layers of the model (zero-"
            "filled by the engine)")


def check_id_dtype(dtype: np.dtype, schema: RoutingSchema, sample_id: str) -> None:
    """Refuse an integer dtype that cannot hold every expert id ``0 .. num_experts - 1``.

    NOTE: such an array was already narrowed by whoever produced it (an 8-bit capture of a
    512-expert model holds ids modulo 256): its ids look valid and are wrong.

    Raises:
        RecordError: naming the sample, the dtype and the schema's expert count.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise RecordError(f"sample {sample_id!r}: routing ids must be integers, got {dtype}")
    if np.iinfo(dtype).max < schema.num_experts - 1:
        raise RecordError(
            f"sample {sample_id!r}: routing array of dtype {dtype} cannot hold expert ids up to "
            f"{schema.num_experts - 1} (num_experts={schema.num_experts}): the ids were "
            "narrowed (wrapped) before they got here; capture them as "
            f"{schema.id_dtype} or wider")


def checked_moe_ids(arr: np.ndarray, schema: RoutingSchema, sample_id: str, *, start: int = 0,
                    full_layout: bool = True, check_duplicates: bool = False,
                    id_hint: Callable[[int], str] | None = None) -> np.ndarray:
    """An engine's integer ids -> the record's ids, range-checked before narrowing.

    Args:
        arr: int [T, num_hidden_layers, top_k] (``full_layout``: vLLM/SGLang layout, dense
            layers zero-filled) or int [T, L_moe, top_k].
        start: token position of row 0 (for error messages).
        check_duplicates: also refuse a row repeating an expert (otherwise left to
            :meth:`RoutingRecord.validate`).
        id_hint: value -> text appended to the out-of-range error (default
            :func:`eplb_id_hint`).
    Returns:
        ids of ``schema.id_dtype`` [T, L_moe, top_k], a copy.
    Raises:
        RecordError: naming sample, token position and decoder layer: wrong shape; a dtype
            that cannot hold num_experts - 1; in the full layout, non-zero routing on a
            layer the schema calls dense (never dropped silently); an id outside
            [0, num_experts) or repeated in its row. NOTE: the range is checked before the
            cast to the id dtype, which would wrap 258 -> 2 and a -1 sentinel -> 255.
    Work: O(ids); memory: the output plus chunk temporaries (:data:`CHECK_CHUNK_IDS`).
    """
    want = schema.num_hidden_layers if full_layout else schema.num_moe_layers
    if not isinstance(arr, np.ndarray) or arr.ndim != 3 or arr.dtype.kind not in "iu" \
            or arr.shape[1:] != (want, schema.top_k):
        raise RecordError(
            f"sample {sample_id!r}: routing array has shape {getattr(arr, 'shape', None)} "
            f"{getattr(arr, 'dtype', type(arr))}, expected integer [T, {want} "
            f"({'num_hidden_layers' if full_layout else 'MoE layers'}), top_k={schema.top_k}]")
    check_id_dtype(arr.dtype, schema, sample_id)
    out = np.empty((arr.shape[0], schema.num_moe_layers, schema.top_k), schema.id_dtype)
    for a, b in row_chunks(arr.shape[0], want * schema.top_k):
        out[a:b] = moe_rows(arr[a:b], schema, sample_id, start=start + a,
                            full_layout=full_layout, check_duplicates=check_duplicates,
                            id_hint=id_hint)
    return out


def moe_rows(chunk: np.ndarray, schema: RoutingSchema, sample_id: str, *, start: int = 0,
             full_layout: bool = True, check_duplicates: bool = False,
             id_hint: Callable[[int], str] | None = None) -> np.ndarray:
    """The MoE-layer ids of one row chunk of an engine array, checked.

    Args:
        chunk: int [n, num_hidden_layers, top_k] (``full_layout``) or [n, L_moe, top_k],
            rows ``start .. start + n - 1``.
    Returns:
        int [n, L_moe, top_k] of ``chunk``'s dtype (a view or a copy).
    Raises:
        RecordError: see :func:`checked_moe_ids` (dense-layer routing, range, duplicates).
    """
    layer_ids = list(schema.moe_layer_ids)
    moe = chunk[:, layer_ids] if full_layout else chunk
    first_bad_row(moe, schema, sample_id, start=start, layer_ids=layer_ids,
                  check_duplicates=check_duplicates, id_hint=id_hint)
    # NOTE: after the MoE layers' own checks, so an array of sentinels is named as such
    dense = list(schema.dense_layer_ids()) if full_layout else []
    if dense:
        routed = chunk[:, dense].any(-1)                         # [n, L_dense]
        if routed.any():
            t, l = divmod(int(np.argmax(routed.reshape(-1))), len(dense))
            raise RecordError(
                f"sample {sample_id!r}, token {start + t}, layer {dense[l]}: the engine routed "
                f"this token to experts {chunk[t, dense[l]].tolist()} on a layer the schema "
                f"calls dense (MoE layers {_layer_ranges(layer_ids)}): the routing schema does "
                "not match the model's MoE layer placement")
    return moe


def _layer_ranges(ids: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> '1-3,5'."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
