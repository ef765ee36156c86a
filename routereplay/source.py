"""Routing sources: the one interface a trainer reads recorded routing through.

A :class:`RoutingSource` answers, for one sample, "the rows of these MoE layers at these
token positions". Implemented by:

- :class:`routereplay.sidecar.SidecarReader`: decodes lazily from a sidecar stream, only
  the layer-group sections asked for, each section once per call;
- :class:`routereplay.sidecar.MultiSidecarReader`: several streams (a folder, a glob, a
  list) read as one, sample ids unique across them;
- :class:`InMemorySource`: records already in memory (``{sample_id: RoutingRecord}``), e.g.
  routing an RL framework carries in its own data plane, or an R2 pass;
- :class:`NoRouting`: no routing at all (every row takes the trainer's fallback).

Shapes follow the legend in :mod:`routereplay` (T rows, L_moe MoE layers, K = top_k).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from routereplay.errors import ConfigError, RecordError, UnknownSampleError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

# (ids, first): ids of the schema's id dtype [n, len(moe_layers), K] holding token
# positions [first, first + n) of one sample (n may be 0).
Rows = tuple[np.ndarray, int]


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
            one :data:`Rows` per run, ids of ``schema.id_dtype`` [n, len(moe_layers), K]
            for positions ``[first, first + n)``; n = 0 where the record has no row in the
            run. Every id was checked (range, distinct in its row) when the source took or
            decoded it.
        Raises:
            UnknownSampleError (a KeyError): no record for ``sample_id``.
            SidecarError: corrupt stored data.
        """


def _clip(start: int, num_tokens: int, lo: int, hi: int) -> tuple[int, int]:
    a = min(max(int(lo), start), start + num_tokens)
    return a, min(max(int(hi), a), start + num_tokens)


def check_fetch_args(moe_layers: Sequence[int], runs: Sequence[tuple[int, int]],
                     num_moe_layers: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``moe_layers`` and ``runs`` of a :meth:`RoutingSource.fetch` call as int lists.

    Raises:
        ConfigError: a layer position that is not an int in ``[0, num_moe_layers)`` or is
            repeated; a run that is not a pair of ints.
    """
    def as_int(x: object) -> int:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ConfigError(f"expected an integer, got {x!r}")
        return int(x)
    try:
        layers = [as_int(x) for x in moe_layers]
        pairs = []
        for run in runs:
            if len(run) != 2:
                raise ConfigError(f"a token run is a pair (lo, hi), got {run!r}")
            pairs.append((as_int(run[0]), as_int(run[1])))
    except TypeError:
        raise ConfigError(f"moe_layers and runs must be sequences, got {moe_layers!r}, "
                          f"{runs!r}") from None
    for lyr in layers:
        if not 0 <= lyr < num_moe_layers:
            raise ConfigError(f"MoE layer position {lyr} out of range [0, {num_moe_layers})")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"moe_layers {layers} repeat a MoE layer position")
    return layers, pairs


def rows_of(record: RoutingRecord, moe_layers: Sequence[int],
            runs: Sequence[tuple[int, int]]) -> list[Rows]:
    """:meth:`RoutingSource.fetch` on one in-memory record (views where possible).

    Raises:
        ConfigError: see :func:`check_fetch_args`.
    """
    layers, runs = check_fetch_args(moe_layers, runs, record.expert_ids.shape[1])
    out = []
    for lo, hi in runs:
        a, b = _clip(record.start, record.num_tokens, lo, hi)
        ids = record.expert_ids[a - record.start:b - record.start]
        out.append((ids[:, layers] if layers != list(range(ids.shape[1])) else ids, a))
    return out


class InMemorySource:
    """Records held in memory, as a :class:`RoutingSource`.

    Args:
        records: ``{sample_id: RoutingRecord}`` or an iterable of records (keyed by their
            ``sample_id``).
        schema: the routing schema the records must follow.
    Raises:
        RecordError: a record whose ids have the wrong shape, dtype (not
            ``schema.id_dtype``), an id out of range or a repeated id in a row (names the
            sample, token and layer); a key that differs from the record's sample id; the
            same sample id twice.
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
            rec.validate_ids(schema)
            self._records[key] = rec

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


__all__ = ["RoutingSource", "Rows", "InMemorySource", "NoRouting", "as_source", "rows_of",
           "check_fetch_args"]
