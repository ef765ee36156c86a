"""Routing sources: the one interface a trainer reads recorded routing through.

A :class:`RoutingSource` answers, for one sample, "the rows of these MoE layers at these
token positions". Implemented by:

- :class:`routereplay.sidecar.SidecarReader`: decodes lazily from a sidecar stream, only
  the layer-group sections asked for; :class:`routereplay.sidecar.MultiSidecarReader`:
  several streams read as one;
- :class:`InMemorySource`: records in memory (``{sample_id: RoutingRecord}``, or
  :meth:`InMemorySource.from_batch` of a batch tensor ``routed_experts [b, s, L, K]``);
- :class:`TokenRowSource`: rows as one rank's routers saw them, keyed by (sample, token
  position, MoE layer), e.g. an R2 recording;
- :class:`NoRouting`: no routing at all (every row takes the trainer's fallback).

Every source checks the ids it takes or decodes once, with one rule (:func:`checked_ids`):
integers in ``[0, num_experts)`` before they are narrowed, distinct within a row.

Shapes follow the legend in :mod:`routereplay` (T rows, L_moe MoE layers, K = top_k).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from routereplay.errors import ConfigError
from routereplay.memory_source import InMemorySource
from routereplay.schema import RoutingSchema
from routereplay.source_rows import Rows, check_fetch_args, checked_ids, rows_of
from routereplay.token_row_source import TokenRowSource


@runtime_checkable
class RoutingSource(Protocol):
    """Where recorded routing is read from (see the module doc).

    Attributes:
        schema: the routing schema of every record in the source.
    """

    schema: RoutingSchema

    def __contains__(self, sample_id: object) -> bool:
        """Whether the source holds a record for ``sample_id``."""

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """Rows of one sample.

        Args:
            sample_id: the record's id.
            moe_layers: positions on the record's MoE-layer axis (0 .. L_moe - 1), in the
                order wanted.
            runs: token-position ranges ``[lo, hi)``; each is clipped to the record's rows
                ``[start, start + T)``.
        Returns:
            one :data:`Rows` ``(ids, first)`` per run, in the order of ``runs``: ids of
            ``schema.id_dtype`` [n, len(moe_layers), K] for positions
            ``[first, first + n)``; n = 0 where the record has no row in the run (no
            sentinel ids). Every id was checked when the source took or decoded it.
        Raises:
            UnknownSampleError (a KeyError): no record for ``sample_id``.
            SidecarError: corrupt stored data.
        """


# NOTE: sources may also offer ``token_ids(sample_id) -> int [N] | None``
# (source_token_ids) and ``column_order`` ("engine" or "sorted"; absent: engine;
# sorted_order_samples). Neither is on the Protocol: runtime_checkable isinstance() would
# then refuse every source that lacks them.


def sorted_order_samples(source: object, sample_ids: Iterable[str]) -> list[str]:
    """The ids among ``sample_ids`` whose rows ``source`` holds in "sorted" column order
    (ascending expert id per row, the engine's top-k slot order lost), in the given order.

    A source's order is its ``column_order`` attribute; a :class:`MultiSidecarReader`
    answers per sample from the stream that holds it; any other source is engine order
    (records are engine order by definition; records read from a sorted stream are not
    detected). Host work only: no routing decoded.

    Raises:
        ConfigError: a source's ``column_order`` that is neither "engine" nor "sorted".
        UnknownSampleError: (MultiSidecarReader with mixed orders) a sample no stream holds.
    """
    ids = list(sample_ids)
    order = getattr(source, "column_order", None)
    if order is None:
        streams = getattr(source, "readers", None)
        if streams is None or not callable(getattr(source, "stream_of", None)):
            return []
        # NOTE: each stream's order was checked when its header was read. Streams given
        # as bytes or file objects can share a name: any sorted one marks the name sorted.
        sorted_names = {rd.name for rd in streams if rd.column_order == "sorted"}
        if not sorted_names:
            return []
        if all(rd.name in sorted_names for rd in streams):
            return ids
        return [sid for sid in ids if source.stream_of(sid) in sorted_names]
    if order not in ("engine", "sorted"):
        raise ConfigError(f"routing source {type(source).__name__}: column_order {order!r} "
                          "is neither 'engine' nor 'sorted'")
    return ids if order == "sorted" else []


def source_token_ids(source: object, sample_id: str) -> np.ndarray | None:
    """The token ids int [N] a source holds for ``sample_id`` (the whole sequence,
    positions 0 .. N - 1), or None when it holds none.

    Uses the source's ``token_ids(sample_id)``, else its ``read`` with no MoE layers (a
    sidecar reader then decodes no routing section).

    Raises:
        UnknownSampleError: no such sample. SidecarError: corrupt stored data.
    """
    fn = getattr(source, "token_ids", None)
    if callable(fn):
        return fn(sample_id)
    read = getattr(source, "read", None)
    if callable(read):
        return read(sample_id, moe_layers=[], arrays=True).token_ids
    return None


class NoRouting:
    """A source without routing: every sample is present with no rows, so every router
    row takes the trainer's fallback (its own routing)."""

    def __init__(self, schema: RoutingSchema):
        self.schema = schema

    def __contains__(self, sample_id: object) -> bool:
        return True

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """See :meth:`RoutingSource.fetch`: n = 0 rows for every run."""
        layers, runs = check_fetch_args(moe_layers, runs, self.schema.num_moe_layers)
        empty = np.zeros((0, len(layers), self.schema.top_k), self.schema.id_dtype)
        return [(empty, lo) for lo, _ in runs]

    def token_ids(self, sample_id: str) -> None:
        """No token ids (nothing is replayed, so nothing is compared)."""
        return None


def as_source(source: object, schema: RoutingSchema) -> RoutingSource:
    """The :class:`RoutingSource` for what a caller passed: None -> :class:`NoRouting`, a
    mapping of records -> :class:`InMemorySource`, a source -> itself (its schema must be
    ``schema``).

    Raises:
        SchemaError: the source's schema differs from ``schema`` (names each field).
        RecordError: see :class:`InMemorySource`.
        ConfigError: anything else.
    """
    if source is None:
        return NoRouting(schema)
    if isinstance(source, Mapping):
        return InMemorySource(source, schema)
    if isinstance(source, RoutingSource):
        if source.schema != schema:
            schema.check_same(source.schema, what="routing source")
        return source
    raise ConfigError(f"not a routing source: {type(source).__name__} (expected a "
                    "SidecarReader, a RoutingSource, a mapping sample id -> RoutingRecord, "
                    "or None)")


__all__ = ["RoutingSource", "Rows", "sorted_order_samples", "InMemorySource", "TokenRowSource",
           "NoRouting",
           "as_source", "rows_of", "checked_ids", "source_token_ids", "check_fetch_args"]
