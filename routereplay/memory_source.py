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
from routereplay.token_layout import Layout, host_array

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
    def from_batch(cls, routed_experts: object, attention_mask: object,
                   sample_ids: Sequence[str], schema: RoutingSchema, *,
                   routing_mask: object = None, input_ids: object = None) -> "InMemorySource":
        """Records from a padded batch as RL frameworks carry it (verl's
        ``routed_experts``, aligned with ``input_ids``: prompt left-padded, response
        right-padded).

        Row j of the batch is sample ``sample_ids[j]``; its real tokens (the attention
        mask, contiguous) are token positions 0, 1, ... in column order, and
        ``routed_experts[j, c]`` is the routing of the token in column c.

        Layer axis (NOTE: decided by its size, never guessed from values): ``L =
        schema.num_moe_layers``: the MoE layers; ``L = schema.num_hidden_layers``: the
        engines' layout, dense layers stripped (one holding routing is an error). Any other
        size is refused.

        Args:
            routed_experts: int [b, s, L, K] (numpy or CPU torch; any integer width).
            attention_mask: [b, s] 0/1 or bool.
            sample_ids: the framework's id of each row (unique).
            routing_mask: [b, s] 0/1 or bool, the columns that carry routing; they must be
                real tokens and contiguous per row. Default: every real token but the last
                (the engines record no row for the last sampled token, and verl fills it
                with a placeholder).
            input_ids: optional int [b, s]; stored as each record's token ids so the
                replayer can compare them with the trainer's tokens.
        Raises:
            AlignmentError: shapes that do not agree, a non-contiguous mask row, routing
                columns outside the real tokens or with a hole (naming the sample and the
                token position).
            RecordError: an id out of range, repeated in a row, routing on a dense layer
                (naming the sample, token position and decoder layer), or a run of rows
                never written (expert 0 in every MoE layer: check_written_rows).
        """
        ids = host_array(routed_experts, "routed_experts")
        if ids.ndim != 4 or ids.dtype.kind not in "iu" or ids.shape[3] != schema.top_k:
            raise AlignmentError(f"routed_experts is {ids.dtype} {tuple(ids.shape)}, expected "
                                 f"integer [b, s, L, top_k={schema.top_k}]")
        b, s, n_layers, _ = ids.shape
        if n_layers == schema.num_moe_layers:
            full = False
        elif n_layers == schema.num_hidden_layers:
            full = True
        else:
            raise AlignmentError(f"routed_experts has {n_layers} layers: expected the "
                                 f"{schema.num_moe_layers} MoE layers or all "
                                 f"{schema.num_hidden_layers} decoder layers of the schema")
        mask = host_array(attention_mask, "attention_mask")
        if mask.shape != (b, s):
            raise AlignmentError(f"attention_mask {tuple(mask.shape)} does not match "
                                 f"routed_experts [b={b}, s={s}]")
        if isinstance(sample_ids, (str, bytes)) or len(sample_ids) != b:
            raise AlignmentError(f"{b} batch rows need {b} sample ids")
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
                pos = np.flatnonzero(r[a:a + n])
                start, t = (int(pos[0]), pos.size) if pos.size else (0, 0)
                if t and pos[-1] - pos[0] + 1 != t:
                    hole = int(pos[np.flatnonzero(np.diff(pos) != 1)[0]]) + 1
                    raise AlignmentError(f"sample {sid!r}, token position {hole}: no routing "
                                         "between routed positions (routing rows must be "
                                         "contiguous)")
            rows = ids[j, a + start:a + start + t]
            if full:
                rows = checked_moe_ids(rows, schema, sid, start=start, full_layout=True)
            rows = checked_ids(rows, schema, sid, start=start)
            # NOTE: a batch buffer never filled (or P/D prompt rows) reads as expert 0
            check_written_rows(rows, sid, start)
            records.append(RoutingRecord(
                sid, rows, start=start,
                token_ids=None if toks is None else toks[j, a:a + n].astype(np.int64)))
        return cls(records, schema)

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
