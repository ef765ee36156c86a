"""Routing sources: the one interface a trainer reads recorded routing through.

A :class:`RoutingSource` answers, for one sample, "the rows of these MoE layers at these
token positions". Implemented by:

- :class:`routereplay.sidecar.SidecarReader`: decodes lazily from a sidecar stream, only
  the layer-group sections asked for, each section once per call;
- :class:`routereplay.sidecar.MultiSidecarReader`: several streams (a folder, a glob, a
  list) read as one, sample ids unique across them;
- :class:`InMemorySource`: records already in memory (``{sample_id: RoutingRecord}``), e.g.
  routing an RL framework carries in its own data plane; :meth:`InMemorySource.from_batch`
  builds one from a batch tensor ``routed_experts [b, s, L, K]`` and its attention mask
  (verl's layout);
- :class:`TokenRowSource`: rows as one rank's routers saw them, keyed by (sample, token
  position, MoE layer): megatron-style per-layer lists (what
  ``RouterReplay.set_replay_data`` takes) or an R2 recording of the trainer's own routing;
- :class:`NoRouting`: no routing at all (every row takes the trainer's fallback).

Every source checks the ids it takes or decodes once, with one rule (:func:`checked_ids`):
integer ids, in ``[0, num_experts)`` before they are narrowed to the schema's id dtype,
distinct within a row. Sources also answer :meth:`RoutingSource.token_ids` (None when
they hold none), which the replayer compares with the trainer's tokens when asked to.

Shapes follow the legend in :mod:`routereplay` (T rows, L_moe MoE layers, K = top_k).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from routereplay.align import Layout, Shard, TokenMap, host_array, token_map
from routereplay.errors import AlignmentError, ConfigError, RecordError, UnknownSampleError
from routereplay.record import RoutingRecord, check_written_rows, checked_moe_ids, eplb_id_hint
from routereplay.schema import RoutingSchema

#: What :meth:`RoutingSource.fetch` returns per token run: ``(ids, first)``.
#:
#: - ``ids``: numpy array of ``schema.id_dtype`` (uint8 up to 256 experts, uint16 above),
#:   shape [n, len(moe_layers), K]: ``ids[i, j]`` are the K logical expert ids (in
#:   ``[0, num_experts)``, distinct within the row) that MoE layer ``moe_layers[j]`` routed
#:   token position ``first + i`` of the sample to, in the source's column order (the
#:   engine's top-k slot order; ascending for the samples :func:`sorted_order_samples`
#:   names). Read-only: it may be a view of the source's own data.
#: - ``first``: int, the token position (0-based, in the whole sequence: prompt and
#:   response) of row 0; the rows are the consecutive positions ``[first, first + n)``.
#:
#: There is no sentinel value: positions of the run the source holds no routing for are
#: simply not in the rows (``first`` after the run's ``lo``, or ``n`` short of its end;
#: ``n == 0`` and ``first`` = the clipped ``lo`` when it holds none). The replayer's
#: gather (:func:`routereplay.align.gather_rows`) is what marks those positions
#: :data:`routereplay.align.MISSING` (-1) for the trainer's fallback.
Rows = tuple[np.ndarray, int]


@runtime_checkable
class RoutingSource(Protocol):
    """Where recorded routing is read from (see the module doc).

    Attributes:
        schema: the routing schema of every record in the source.

    Optional members (not part of the structural check, so a source without them is still
    a RoutingSource): ``token_ids(sample_id)`` (see :func:`source_token_ids`) and
    ``column_order`` ("engine" or "sorted", see :func:`sorted_order_samples`; a source
    without it holds engine order).
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
            sentinel ids: see :data:`Rows`). Every id was checked (range, distinct in its
            row) when the source took or decoded it.
        Raises:
            UnknownSampleError (a KeyError): no record for ``sample_id``.
            SidecarError: corrupt stored data.
        """


# NOTE: sources may also offer ``token_ids(sample_id) -> int [N] | None`` (the whole
# sequence's token ids, None when the source holds none; see source_token_ids) and a
# ``column_order`` str (see sorted_order_samples). Neither is declared on the Protocol:
# runtime_checkable isinstance() would then refuse every source that lacks them.


def sorted_order_samples(source: object, sample_ids: Iterable[str]) -> list[str]:
    """The ids among ``sample_ids`` whose rows ``source`` holds in "sorted" column order
    (ascending expert id per row, the engine's top-k slot order lost), in the given order.

    A source's order is its ``column_order`` attribute (a :class:`SidecarReader`: its
    header's; a third-party source may declare one). A :class:`MultiSidecarReader` (no
    attribute of its own: its streams may differ) answers per sample from the stream that
    holds it. Any other source is engine order: :class:`InMemorySource` holds
    :class:`RoutingRecord` s, whose ids are engine column order by definition (records read
    from a sorted stream break that contract and are not detected), :class:`TokenRowSource`
    holds rows in the trainer's own router order, :class:`NoRouting` holds none.
    Host work only: one lookup per sample, no routing decoded.

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


def checked_ids(ids: object, schema: RoutingSchema, sample_id: str, *, start: int = 0,
                layer_ids: Sequence[int] | None = None,
                positions: Sequence[int] | None = None) -> np.ndarray:
    """The one check every source applies to the ids it takes: integer ids (any width,
    signed or not; a CPU torch tensor is accepted) of shape [T, L, K], each in
    ``[0, num_experts)`` (checked before narrowing, which would wrap 258 -> 2 and -1 ->
    255), distinct within a row.

    Args:
        ids: int [T, len(layer_ids), K].
        start: token position of row 0 (for messages).
        layer_ids: decoder-layer ids of the L layers (default every MoE layer).
        positions: token position of each row, when the rows are not consecutive
            positions from ``start`` (for messages).
    Returns:
        ``schema.id_dtype`` [T, L, K] (``ids`` itself when it already has that dtype).
    Raises:
        RecordError: naming the sample, the token position and the decoder layer of the
            first bad id (bool, float or other non-integer ids, wrong shape included).
    """
    layer_ids = list(schema.moe_layer_ids if layer_ids is None else layer_ids)
    try:
        a = host_array(ids, f"sample {sample_id!r}: expert ids")
    except AlignmentError as e:
        raise RecordError(str(e)) from None
    if a.ndim != 3 or a.dtype.kind not in "iu" or a.shape[1:] != (len(layer_ids), schema.top_k):
        raise RecordError(f"sample {sample_id!r}: expert ids are {a.dtype} {tuple(a.shape)}, "
                          f"expected integer [T, {len(layer_ids)} MoE layers, "
                          f"top_k={schema.top_k}]")
    def where(t: int, lyr: int) -> str:
        p = start + t if positions is None else int(positions[t])
        return f"sample {sample_id!r}, token {p}, layer {layer_ids[lyr]}"

    if a.size:
        bad = ((a < 0) | (a >= schema.num_experts)).reshape(-1)
        i = int(np.argmax(bad))
        if bad[i]:
            t, lyr, k = (int(x) for x in np.unravel_index(i, a.shape))
            v = int(a[t, lyr, k])
            raise RecordError(f"{where(t, lyr)}: expert id {v} outside "
                              f"[0, {schema.num_experts})"
                              f"{eplb_id_hint(v, a.dtype, schema.num_experts)}")
    out = a if a.dtype == schema.id_dtype else a.astype(schema.id_dtype)
    if schema.top_k > 1 and out.size:
        srt = np.sort(out, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1).reshape(-1)
        i = int(np.argmax(dup))
        if dup[i]:
            t, lyr = (int(x) for x in np.unravel_index(i, out.shape[:2]))
            hint = (" (all-zero row: the capturer was never bound, a dense layer was read "
                    "as MoE, or a row without routing was not masked out: pass "
                    "routing_mask= for batches whose prompt rows carry no routing)"
                    if not out[t, lyr].any() else "")
            raise RecordError(f"{where(t, lyr)}: duplicate expert ids {out[t, lyr].tolist()} "
                              f"in one top-k row{hint}")
    return out


def source_token_ids(source: object, sample_id: str) -> np.ndarray | None:
    """The token ids int [N] a source holds for ``sample_id`` (the whole sequence,
    positions 0 .. N - 1), or None when it holds none.

    Uses the source's ``token_ids(sample_id)``; a sidecar reader (single or multi-stream)
    reads the record's ``token_ids`` section only (no routing section is decoded).

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

        Layer axis (NOTE: decided by its size, never guessed from values):
        ``L = schema.num_moe_layers`` is the MoE layers in order; ``L =
        schema.num_hidden_layers`` is the engines' layout (vLLM/SGLang: one slot per decoder
        layer, dense layers zero-filled): the dense layers are stripped by the schema, and
        a dense-layer slot that holds routing is an error (the schema does not match the
        model), never dropped. Any other size is refused.

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


class TokenRowSource:
    """Routing rows keyed by (sample, token position, MoE layer), as one rank's routers
    saw them, as a :class:`RoutingSource`.

    Filled microbatch by microbatch from router-order rows and the microbatch's layout:
    megatron-style per-layer lists (:meth:`add_layer_lists`: what
    ``RouterReplay.set_replay_data`` takes, one [num_local_tokens, K] tensor per local MoE
    layer, in the router's token order after packing and the CP/SP splits), or the
    trainer's own routing recorded in an R2 pass (``RouterReplayer.step(...,
    record=True)``). Replaying it in a later step re-aligns by (sample, position), so the
    later step may cut its microbatches differently.

    NOTE: it holds only the rows this rank saw. Each rank must see the same (sample,
    position) rows and MoE layers when it replays them: same data-parallel assignment and
    pipeline stage, and with CP or SP the same per-sample split (THD packing with the same
    segment padding keeps it; bshd needs the same microbatch composition and seq_len). A
    row asked for that was never added is an error naming the sample, position and
    layer; a row added as missing (-1) takes the trainer's fallback.

    Args:
        schema: routing schema of the rows.
    """

    # per (position, MoE layer) of a sample
    _UNSEEN, _ROUTED, _NONE = 0, 1, 2

    def __init__(self, schema: RoutingSchema):
        self.schema = schema
        self._ids: dict[str, np.ndarray] = {}        # id dtype [P, L_moe, K]
        self._state: dict[str, np.ndarray] = {}      # uint8 [P, L_moe]
        self._tokens: dict[str, np.ndarray] = {}

    def add(self, sample_ids: Sequence[str], layout: Layout, tmap: TokenMap, ids: object,
            moe_layers: Sequence[int], tokens: Sequence[np.ndarray] | None = None) -> None:
        """Add one microbatch's rows.

        Args:
            sample_ids: the record id of each sample of the microbatch.
            layout: its layout (gives each sample's positions, ``first + lengths``).
            tmap: router row -> (sample, position) (:func:`routereplay.align.token_map`).
            ids: signed int [N, len(moe_layers), K] in router row order; a row of -1 has no
                routing (takes the fallback when replayed); padding rows are ignored.
            moe_layers: positions of the rows' layers on the MoE axis.
            tokens: optional per-sample token ids (position order, from ``first[j]``),
                kept for the token check of the replaying step.
        Raises:
            AlignmentError: shapes that do not match the token map, a partly missing row, a
                (sample, position, layer) added twice with different experts.
            RecordError: see :func:`checked_ids`.
        """
        a = host_array(ids, "routing rows")
        layers = [int(x) for x in moe_layers]
        if a.ndim != 3 or a.shape != (tmap.num_rows, len(layers), self.schema.top_k) \
                or a.dtype.kind not in "iu":
            raise AlignmentError(f"routing rows are {a.dtype} {tuple(a.shape)}, expected "
                                 f"integer [{tmap.num_rows} router rows, {len(layers)} "
                                 f"layers, top_k={self.schema.top_k}]")
        if len(sample_ids) != layout.batch_size:
            raise AlignmentError(f"{len(sample_ids)} sample ids for a layout of "
                                 f"{layout.batch_size} samples")
        first = layout.first or (0,) * layout.batch_size
        lids = [self.schema.moe_layer_ids[i] for i in layers]
        for j, sid in enumerate(sample_ids):
            sid = str(sid)
            sel = np.flatnonzero(tmap.sample == j)
            p_end = first[j] + layout.lengths[j]
            if sid not in self._ids:
                self._ids[sid] = np.zeros((p_end, self.schema.num_moe_layers,
                                           self.schema.top_k), self.schema.id_dtype)
                self._state[sid] = np.zeros((p_end, self.schema.num_moe_layers), np.uint8)
            elif self._ids[sid].shape[0] < p_end:
                grow = p_end - self._ids[sid].shape[0]
                self._ids[sid] = np.concatenate([self._ids[sid], np.zeros(
                    (grow,) + self._ids[sid].shape[1:], self.schema.id_dtype)])
                self._state[sid] = np.concatenate([self._state[sid], np.zeros(
                    (grow, self.schema.num_moe_layers), np.uint8)])
            if tokens is not None and tokens[j] is not None and len(tokens[j]):
                t = np.asarray(tokens[j], np.int64)
                have = self._tokens.get(sid)
                full = np.full(max(p_end, 0 if have is None else len(have)), -1, np.int64)
                if have is not None:
                    full[:len(have)] = have
                full[first[j]:first[j] + len(t)] = t
                self._tokens[sid] = full
            if not sel.size:
                continue
            pos = tmap.position[sel]
            rows = a[sel]                                     # [n, L, K]
            none = (rows < 0).all(-1)                         # [n, L]
            part = (rows < 0).any(-1) & ~none
            if part.any():
                r, lyr = np.argwhere(part)[0]
                raise AlignmentError(f"sample {sid!r}, token position {int(pos[r])}, decoder "
                                     f"layer {lids[lyr]}: row {rows[r, lyr].tolist()} is "
                                     "partly missing (-1)")
            # NOTE: rows without routing hold a distinct placeholder while checked; their
            # state says they are missing.
            checked = checked_ids(np.where(none[..., None], np.arange(self.schema.top_k), rows),
                                  self.schema, sid, layer_ids=lids, positions=pos)
            st = np.where(none, self._NONE, self._ROUTED).astype(np.uint8)
            old_st = self._state[sid][pos][:, layers]
            old_ids = self._ids[sid][pos][:, layers]
            clash = (old_st != self._UNSEEN) & ((old_st != st) | (
                (st == self._ROUTED) & (old_ids != checked).any(-1)))
            if clash.any():
                r, lyr = np.argwhere(clash)[0]
                raise AlignmentError(f"sample {sid!r}, token position {int(pos[r])}, decoder "
                                     f"layer {lids[lyr]}: added twice with different routing")
            ix = np.ix_(pos, layers)
            self._state[sid][ix] = st
            self._ids[sid][ix] = checked

    def add_layer_lists(self, sample_ids: Sequence[str], layout: Layout,
                        per_layer: Sequence[object], moe_layers: Sequence[int],
                        shard: Shard = Shard(), tokens: Sequence[np.ndarray] | None = None
                        ) -> None:
        """Add one microbatch given as megatron's per-layer lists.

        Args:
            sample_ids, layout: the microbatch (record id of each sample, its layout).
            per_layer: one int [N, K] per MoE layer this rank holds (numpy or CPU torch),
                rows in the router's order for ``layout`` and ``shard`` (what
                ``RouterReplay.set_replay_data`` takes); -1 rows have no routing.
            moe_layers: the MoE-axis position of each list entry (not megatron's instance
                order: say which layer each tensor is for).
            shard: this rank's CP/SP place (routereplay.align.Shard).
            tokens: optional per-sample token ids, see :meth:`add`.
        Raises:
            AlignmentError: a list of the wrong length, tensors whose row count is not the
                rank's token count for ``layout``; see :meth:`add`.
        """
        if len(per_layer) != len(moe_layers):
            raise AlignmentError(f"{len(per_layer)} per-layer tensors for {len(moe_layers)} "
                                 "MoE layers")
        tmap = token_map(layout, shard)
        arrs = [host_array(x, f"per-layer tensor #{i}") for i, x in enumerate(per_layer)]
        for i, x in enumerate(arrs):
            if x.ndim != 2 or x.shape != (tmap.num_rows, self.schema.top_k):
                raise AlignmentError(f"per-layer tensor #{i} (MoE layer {moe_layers[i]}) is "
                                     f"{tuple(x.shape)}, expected [{tmap.num_rows} router "
                                     f"rows, top_k={self.schema.top_k}] for this layout")
        stacked = np.stack(arrs, 1) if arrs else np.zeros((tmap.num_rows, 0,
                                                           self.schema.top_k), np.int64)
        self.add(sample_ids, layout, tmap, stacked, moe_layers, tokens)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def sample_ids(self) -> list[str]:
        """Sample ids, in the order they were first added."""
        return list(self._ids)

    def fetch(self, sample_id: str, moe_layers: Sequence[int],
              runs: Sequence[tuple[int, int]]) -> list[Rows]:
        """See :meth:`RoutingSource.fetch`.

        Raises:
            UnknownSampleError: no rows of ``sample_id`` were added.
            AlignmentError: a wanted (position, layer) that was never added on this rank, a
                position routed on some of the wanted layers only, or a hole inside a run
                (naming the sample, position and decoder layer).
        """
        if sample_id not in self._ids:
            raise UnknownSampleError(f"sample {sample_id!r}: no routing rows in the source",
                                     sample_id)
        ids, state = self._ids[sample_id], self._state[sample_id]
        layers, runs = check_fetch_args(moe_layers, runs, self.schema.num_moe_layers)
        lids = [self.schema.moe_layer_ids[i] for i in layers]
        p_end = ids.shape[0]
        out = []
        for lo, hi in runs:
            a = min(max(int(lo), 0), p_end)
            b = min(max(int(hi), a), p_end)
            st = state[a:b][:, layers]                        # [n, L]
            unseen = st == self._UNSEEN
            if unseen.any():
                r, lyr = np.argwhere(unseen)[0]
                raise AlignmentError(
                    f"sample {sample_id!r}, token position {a + int(r)}, decoder layer "
                    f"{lids[lyr]}: no row was recorded for it on this rank (the rows must "
                    "come from the same data-parallel rank, pipeline stage and CP/SP split)")
            routed = st == self._ROUTED
            some = routed.any(1)
            if (some != routed.all(1)).any():
                r = int(np.argmax(some != routed.all(1)))
                raise AlignmentError(f"sample {sample_id!r}, token position {a + r}: routing "
                                     "for some of the MoE layers only")
            pos = np.flatnonzero(some)
            if not pos.size:
                out.append((ids[a:a][:, layers], a))
                continue
            if pos[-1] - pos[0] + 1 != pos.size:
                hole = int(pos[np.flatnonzero(np.diff(pos) != 1)[0]]) + 1
                raise AlignmentError(f"sample {sample_id!r}, token position {a + hole}: no "
                                     "routing between routed positions")
            out.append((ids[a + pos[0]:a + pos[-1] + 1][:, layers], a + int(pos[0])))
        return out

    def token_ids(self, sample_id: str) -> np.ndarray | None:
        """See :meth:`RoutingSource.token_ids`: the tokens added with the rows (None if
        none were; -1 at positions no microbatch gave)."""
        if sample_id not in self._ids:
            raise UnknownSampleError(f"sample {sample_id!r}: no routing rows in the source",
                                     sample_id)
        return self._tokens.get(sample_id)


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
