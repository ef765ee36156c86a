"""Routing records held in memory as a routing source (:class:`InMemorySource`), also built
from a padded batch tensor as RL frameworks carry it (:meth:`InMemorySource.from_batch`)."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from routereplay.errors import AlignmentError, ConfigError, RecordError, UnknownSampleError
from routereplay.record import RoutingRecord, check_written_rows, checked_moe_ids
from routereplay.schema import RoutingSchema
from routereplay.source_rows import Rows, checked_ids, rows_of
from routereplay.token_layout import Layout, host_array, jagged_parts

class InMemorySource:
    """Records held in memory, as a :class:`RoutingSource`.

    Args:
        records: ``{sample_id: RoutingRecord}`` or an iterable of records (keyed by their
            ``sample_id``).
        schema: the routing schema the records must follow.
    Raises:
        RecordError: a record whose ids have the wrong shape or dtype, an id out of range
            or repeated in a row (names the sample, token and layer); a key that differs
            from the record's sample id; the same sample id twice.
    """

    def __init__(self, records: Mapping[str, RoutingRecord] | Iterable[RoutingRecord],
                 schema: RoutingSchema):
        self.schema = schema
        if isinstance(records, Mapping):
            items = list(records.items())
        elif isinstance(records, Iterable) and not isinstance(records, (str, bytes)):
            items = [(getattr(r, "sample_id", None), r) for r in records]
        else:
            raise ConfigError(f"records must be a mapping sample id -> RoutingRecord or an "
                              f"iterable of records, got {type(records).__name__}")
        self._records: dict[str, RoutingRecord] = {}
        for key, rec in items:
            if not isinstance(rec, RoutingRecord):
                raise RecordError(f"sample {key!r}: expected a RoutingRecord, got "
                                  f"{type(rec).__name__}")
            if key != rec.sample_id:
                raise RecordError(f"key {key!r} holds the record of sample {rec.sample_id!r}")
            if key in self._records:
                raise RecordError(f"sample {key!r} given twice")
            ids = checked_ids(rec.expert_ids, schema, key, start=rec.start)
            if ids is not rec.expert_ids:           # narrowed to the id dtype: a new record
                rec = dataclasses.replace(rec, expert_ids=ids)
            self._records[key] = rec

    @classmethod
    def _checked(cls, records: list[RoutingRecord], schema: RoutingSchema) -> "InMemorySource":
        """A source of records whose ids were checked already (``_record``) and whose
        sample ids are unique (``_check_ids_count``): the constructor without checking
        either a second time."""
        self = cls.__new__(cls)
        self.schema = schema
        self._records = {rec.sample_id: rec for rec in records}
        return self

    @classmethod
    def from_batch(cls, routed_experts: object, attention_mask: object,
                   sample_ids: Sequence[str], schema: RoutingSchema, *,
                   routing_mask: object = None, input_ids: object = None) -> "InMemorySource":
        """Records from a batch as RL frameworks carry it: padded (verl's ``routed_experts``
        in ``DataProto``, aligned with ``input_ids``: prompt left-padded, response
        right-padded) or jagged (verl's worker after ``left_right_2_no_padding``).

        Padded: row j of the batch is sample ``sample_ids[j]``; its real tokens (the
        attention mask, contiguous) are token positions 0, 1, ... in column order, and
        ``routed_experts[j, c]`` is the routing of the token in column c.

        Jagged (``routed_experts`` a torch nested tensor ``[b, j, L, K]``, jagged or
        strided layout, on the CPU): sample j's part holds the rows of its real tokens from
        position 0: ``n_j`` rows (one per token, the last a placeholder, as
        ``left_right_2_no_padding`` cuts them from the padded tensor) or ``n_j - 1`` rows
        (the engine's rows, as verl's ``align_r3_router_replay_data`` takes them). ``n_j``
        is the length of sample j in ``input_ids`` (nested ``[b, j]``), else the row
        count of ``attention_mask`` (padded ``[b, s]``, or None), else the part's length.

        Layer axis (NOTE: decided by its size, never guessed from values): ``L =
        schema.num_moe_layers``: the MoE layers; ``L = schema.num_hidden_layers``: the
        engines' layout, dense layers stripped (one holding routing is an error). Any other
        size is refused.

        Args:
            routed_experts: int [b, s, L, K] (numpy or CPU torch; any integer width), or a
                CPU torch nested tensor of integer parts [n_j or n_j - 1, L, K].
            attention_mask: [b, s] 0/1 or bool; None with jagged ``routed_experts``.
            sample_ids: the framework's id of each row (unique; for verl's GRPO groups see
                ``trainer_hooks.verl.sample_keys``).
            routing_mask: [b, s] 0/1 or bool (jagged: a nested bool tensor [b, j], as verl's
                ``build_r3_replay_mask``), the positions that carry routing; they must be
                real tokens and contiguous per sample. Default: every real token but the
                last (the engines record no row for the last sampled token, and verl fills
                it with a placeholder).
            input_ids: optional int [b, s] (jagged: nested [b, j]); stored as each record's
                token ids so the replayer can compare them with the trainer's tokens.
        Raises:
            AlignmentError: shapes that do not agree, a non-contiguous mask row, routing
                columns outside the real tokens or with a hole (naming the sample and the
                token position), a jagged part whose row count is neither n_j nor n_j - 1,
                a tensor subclass other than a nested tensor.
            RecordError: an id out of range, repeated in a row, routing on a dense layer
                (naming the sample, token position and decoder layer), or a run of rows
                never written (expert 0 in every MoE layer: check_written_rows); a sample
                id given twice (names both batch rows).
        """
        parts = jagged_parts(routed_experts, "routed_experts")
        if parts is not None:
            return cls._from_jagged(parts, attention_mask, sample_ids, schema,
                                    routing_mask=routing_mask, input_ids=input_ids)
        ids = host_array(routed_experts, "routed_experts")
        if ids.ndim != 4 or ids.dtype.kind not in "iu" or ids.shape[3] != schema.top_k:
            raise AlignmentError(f"routed_experts is {ids.dtype} {tuple(ids.shape)}, expected "
                                 f"integer [b, s, L, top_k={schema.top_k}]")
        b, s, n_layers, _ = ids.shape
        full = _full_layout(n_layers, schema)
        if attention_mask is None:
            raise AlignmentError("attention_mask is needed with a padded routed_experts "
                                 "[b, s, L, K] (None only with a nested, jagged one)")
        mask = host_array(attention_mask, "attention_mask")
        if mask.shape != (b, s):
            raise AlignmentError(f"attention_mask {tuple(mask.shape)} does not match "
                                 f"routed_experts [b={b}, s={s}]")
        _check_ids_count(sample_ids, b)
        lay = Layout.from_attention_mask(mask)
        cols = lay.columns()
        rmask = None if routing_mask is None else host_array(routing_mask, "routing_mask")
        if rmask is not None and rmask.shape != (b, s):
            raise AlignmentError(f"routing_mask {tuple(rmask.shape)} does not match "
                                 f"routed_experts [b={b}, s={s}]")
        toks = None if input_ids is None else host_array(input_ids, "input_ids")
        if toks is not None and (toks.shape != (b, s) or toks.dtype.kind not in "iu"):
            raise AlignmentError(f"input_ids {toks.dtype} {tuple(toks.shape)} does not match "
                                 f"routed_experts [b={b}, s={s}]")
        records = []
        for j, (sid, a, n) in enumerate(zip(sample_ids, cols, lay.lengths)):
            sid = str(sid)
            if rmask is None:
                start, t = 0, max(n - 1, 0)
            else:
                r = rmask[j] != 0
                outside = r.copy()
                outside[a:a + n] = False
                if outside.any():
                    c = int(np.argmax(outside))
                    raise AlignmentError(f"sample {sid!r}: routing_mask marks column {c}, a "
                                         "padding column")
                start, t = _routed_run(r[a:a + n], sid)
            records.append(_record(sid, ids[j, a + start:a + start + t], start, schema, full,
                                   None if toks is None else toks[j, a:a + n]))
        return cls._checked(records, schema)

    @classmethod
    def _from_jagged(cls, parts: list[np.ndarray], attention_mask: object,
                     sample_ids: Sequence[str], schema: RoutingSchema, *,
                     routing_mask: object, input_ids: object) -> "InMemorySource":
        """from_batch of a nested routed_experts (see there)."""
        b = len(parts)
        _check_ids_count(sample_ids, b)
        for j, p in enumerate(parts):
            if p.ndim != 3 or p.dtype.kind not in "iu" or p.shape[2] != schema.top_k:
                raise AlignmentError(f"routed_experts part of sample {str(sample_ids[j])!r} is "
                                     f"{p.dtype} {tuple(p.shape)}, expected integer "
                                     f"[n, L, top_k={schema.top_k}]")
        full = _full_layout(parts[0].shape[1] if parts else schema.num_moe_layers, schema)
        if any(p.shape[1] != (parts[0].shape[1]) for p in parts):
            raise AlignmentError("routed_experts parts differ in their layer count")
        toks = None
        if input_ids is not None:
            toks = jagged_parts(input_ids, "input_ids")
            if toks is None:
                raise AlignmentError("input_ids must be nested [b, j] like routed_experts "
                                     "(the padded ids go with a padded routed_experts)")
            if len(toks) != b or any(t.ndim != 1 or t.dtype.kind not in "iu" for t in toks):
                raise AlignmentError(f"input_ids: {len(toks)} integer sequences expected, one "
                                     f"per sample ({b})")
        if toks is not None:
            lengths = [t.shape[0] for t in toks]
        elif attention_mask is not None:
            mask = host_array(attention_mask, "attention_mask")
            if mask.ndim != 2 or mask.shape[0] != b:
                raise AlignmentError(f"attention_mask {tuple(mask.shape)} does not match the "
                                     f"{b} samples of routed_experts")
            lengths = [int(x) for x in (mask != 0).sum(1)]
        else:
            lengths = [p.shape[0] for p in parts]
        rparts = None
        if routing_mask is not None:
            rparts = jagged_parts(routing_mask, "routing_mask")
            if rparts is None or len(rparts) != b:
                raise AlignmentError("routing_mask must be nested [b, j] like routed_experts")
        records = []
        for j, (sid, p, n) in enumerate(zip(sample_ids, parts, lengths)):
            sid = str(sid)
            if p.shape[0] not in (n, n - 1):
                raise AlignmentError(
                    f"sample {sid!r}: {p.shape[0]} routing rows for {n} tokens (expected {n}, "
                    f"the last a placeholder, or {n - 1}, the engine's rows)")
            if rparts is None:
                start, t = 0, max(n - 1, 0)
            else:
                r = rparts[j] != 0
                if r.shape != (n,):
                    raise AlignmentError(f"sample {sid!r}: routing_mask has {r.shape[0]} "
                                         f"positions for {n} tokens")
                start, t = _routed_run(r, sid)
                if start + t > p.shape[0]:
                    raise AlignmentError(f"sample {sid!r}, token position {p.shape[0]}: "
                                         "routing_mask marks a position past the routing rows")
            records.append(_record(sid, p[start:start + t], start, schema, full,
                                   None if toks is None else toks[j]))
        return cls._checked(records, schema)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def sample_ids(self) -> list[str]:
        """Sample ids, in insertion order."""
        return list(self._records)

    def record(self, sample_id: str) -> RoutingRecord:
        """The whole record of ``sample_id``.

        Raises:
            UnknownSampleError: no such sample.
        """
        try:
            return self._records[sample_id]
        except KeyError:
            raise UnknownSampleError(f"sample {sample_id!r}: no routing record in the source",
                                     sample_id) from None

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """See :meth:`RoutingSource.fetch`."""
        return rows_of(self.record(sample_id), moe_layers, runs)

    def token_ids(self, sample_id: str) -> np.ndarray | None:
        """See :meth:`RoutingSource.token_ids`: the record's ``token_ids``."""
        return self.record(sample_id).token_ids


def _full_layout(n_layers: int, schema: RoutingSchema) -> bool:
    """Whether a batch's layer axis of ``n_layers`` is all decoder layers (True) or the MoE
    layers (False). Raises AlignmentError for any other size."""
    if n_layers == schema.num_moe_layers:
        return False
    if n_layers == schema.num_hidden_layers:
        return True
    raise AlignmentError(f"routed_experts has {n_layers} layers: expected the "
                         f"{schema.num_moe_layers} MoE layers or all "
                         f"{schema.num_hidden_layers} decoder layers of the schema")


def _check_ids_count(sample_ids: Sequence[str], b: int) -> None:
    """b sample ids, each once. RecordError for a repeated id, naming both batch rows and
    the group-id case (verl's ``uid`` is shared by the n samples of a prompt)."""
    if isinstance(sample_ids, (str, bytes)) or len(sample_ids) != b:
        raise AlignmentError(f"{b} batch rows need {b} sample ids")
    seen: dict[str, int] = {}
    for j, sid in enumerate(sample_ids):
        i = seen.setdefault(str(sid), j)
        if i != j:
            raise RecordError(
                f"sample {str(sid)!r} given twice (batch rows {i} and {j}): one id per sample. "
                "A group id shared by the n samples of a prompt (verl's uid) names no sample: "
                "key sample i of group uid f'{uid}/{i}' (trainer_hooks.verl.sample_keys, the "
                "vLLM capture's n > 1 keys; docs/verl.md)")


def _routed_run(r: np.ndarray, sid: str) -> tuple[int, int]:
    """(first position, count) of the routed positions of one sample's bool mask over its
    real tokens; AlignmentError for a hole."""
    pos = np.flatnonzero(r)
    start, t = (int(pos[0]), pos.size) if pos.size else (0, 0)
    if t and pos[-1] - pos[0] + 1 != t:
        hole = int(pos[np.flatnonzero(np.diff(pos) != 1)[0]]) + 1
        raise AlignmentError(f"sample {sid!r}, token position {hole}: no routing between "
                             "routed positions (routing rows must be contiguous)")
    return start, t


def _record(sid: str, rows: np.ndarray, start: int, schema: RoutingSchema, full: bool,
            tokens: np.ndarray | None) -> RoutingRecord:
    """One sample's record from its rows [t, L, K] (checked)."""
    if full:
        rows = checked_moe_ids(rows, schema, sid, start=start, full_layout=True)
    rows = checked_ids(rows, schema, sid, start=start)
    # NOTE: a batch buffer never filled (or P/D prompt rows) reads as expert 0
    check_written_rows(rows, sid, start)
    return RoutingRecord(sid, rows, start=start,
                         token_ids=None if tokens is None else tokens.astype(np.int64))
