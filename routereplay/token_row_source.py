"""Routing rows keyed by (sample, token position, MoE layer), as one rank's routers saw
them, as a routing source (:class:`TokenRowSource`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from routereplay.errors import AlignmentError, UnknownSampleError
from routereplay.schema import RoutingSchema
from routereplay.source_rows import Rows, check_fetch_args, checked_ids
from routereplay.token_layout import Layout, Shard, TokenMap, host_array, token_map

class TokenRowSource:
    """Routing rows keyed by (sample, token position, MoE layer), as one rank's routers
    saw them, as a :class:`RoutingSource`.

    Filled microbatch by microbatch from router-order rows and the microbatch's layout:
    megatron-style per-layer lists (:meth:`add_layer_lists`, as ``RouterReplay.
    set_replay_data`` takes them) or an R2 recording (``RouterReplayer.step(...,
    record=True)``). A later step re-aligns by (sample, position), so it may cut its
    microbatches differently.

    NOTE: it holds only the rows this rank saw: each rank must see the same (sample,
    position) rows and MoE layers when it replays them (same data-parallel assignment,
    pipeline stage and CP/SP split). A row asked for that was never added is an error
    naming the sample, position and layer; a row added as missing (-1) takes the fallback.

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
