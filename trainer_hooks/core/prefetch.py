"""Loading one (microbatch, model chunk)'s routing on the host, ahead of its forward.

:func:`load` fetches from the routing source (routereplay.source) only this rank's samples,
token positions (after the context-parallel zig-zag and sequence-parallel split) and the
chunk's MoE layers, aligns and validates them. A :class:`Prefetcher` runs the loads of the
next microbatches of the step (``prefetch`` ahead, in the order of ``microbatches``) on one
background thread while the current one computes; ``RouterReplayer.microbatch`` takes the
loaded rows (waiting only if they are not ready).
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np
import torch

from routereplay import align
from routereplay.errors import AlignmentError, RouteReplayError
from routereplay.source import NoRouting, source_token_ids
from trainer_hooks.core.microbatch import Loaded


def load(rep: Any, key: Any, ci: int, background: bool) -> Loaded:
    """Fetch, align and validate one (microbatch, chunk) of the step of ``rep`` (the
    RouterReplayer): host work only, counted in its stats.

    Raises:
        AlignmentError (routereplay.align's checks, ``min_coverage``); the source's errors.
    """
    t0 = time.perf_counter()
    mb = rep._mbs[key]
    tmap = rep.token_map(key)
    moe_layers = rep.record_layers[ci]
    decoded = 0

    def fetch(j: int, runs: list[tuple[int, int]]):
        nonlocal decoded
        rows = rep._source.fetch(mb.sample_ids[j], moe_layers, runs)
        decoded += sum(ids.nbytes for ids, _ in rows)
        return rows

    if ci == 0 and mb.tokens is not None and not isinstance(rep._source, NoRouting):
        # NOTE: once per microbatch (chunk 0), on the loading thread, before replay
        checked = align.check_tokens(
            mb.layout, mb.tokens, mb.sample_ids,
            lambda j: source_token_ids(rep._source, mb.sample_ids[j]))
        with rep._lock:
            rep.stats.token_checked_samples += checked
    ids = align.gather_rows(tmap, fetch, len(moe_layers), rep.schema.top_k, rep._dtype)
    lids = [lid for _, lid in rep.layers[ci]]
    if rep.validate:
        align.check_rows(ids, tmap, rep.schema, lids, mb.sample_ids,
                         num_groups=rep.num_groups, topk_group=rep.topk_group)
    if rep.min_coverage and ids.size:
        have, total = align.coverage(ids, tmap)
        if total and have < rep.min_coverage * total:
            raise AlignmentError(f"samples {list(mb.sample_ids)}: {have} of {total} token "
                                 f"rows carry routing, below min_coverage="
                                 f"{rep.min_coverage}")
    real = tmap.sample >= 0
    miss = ids[..., 0] == align.MISSING if ids.size else \
        np.zeros(ids.shape[:2], bool)                         # [N, L_local]
    fallback = tuple(int(x) for x in (miss & real[:, None]).sum(0))
    replayed = tuple(int(real.sum()) - f for f in fallback)
    if rep.fallback == "dummy":
        ids = align.fill_dummy(ids, rep.schema.num_experts, mb.sample_ids, lids,
                               rep._shard)
        own = (False,) * ids.shape[1]
    else:
        own = tuple(bool(x) for x in miss.any(0))
    t = torch.from_numpy(ids)
    if rep._devices[ci].type == "cuda":
        t = t.pin_memory()
    loaded = Loaded(ids=t, tmap=tmap, own_layers=own, replayed=replayed, fallback=fallback)
    with rep._lock:
        s = rep.stats
        s.bytes_decoded += decoded
        s.bytes_held += loaded.nbytes
        s.peak_bytes_held = max(s.peak_bytes_held, s.bytes_held)
        s.microbatches += 1
        s.prefetched += int(background)
        s.load_seconds += time.perf_counter() - t0
    return loaded


class Prefetcher:
    """The loads of one step of ``rep`` (the RouterReplayer): ``ahead`` (microbatch, chunk)
    entries per chunk queued on one background thread, in step order; with ``ahead=0``
    each is loaded in :meth:`take`."""

    def __init__(self, rep: Any, ahead: int):
        self._rep = rep
        self._ahead = ahead
        self._order = list(rep._mbs)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._pending: dict[tuple[Any, int], concurrent.futures.Future] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if ahead:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="routereplay-prefetch")
            for ci in range(len(rep.chunks)):
                self._queue_from(0, ci)

    def after(self, key: Any, ci: int) -> None:
        """Queue the loads of chunk ``ci`` that follow ``key`` in step order."""
        if self._pool is not None:
            self._queue_from(self._pos[key] + 1, ci)

    def _queue_from(self, i: int, ci: int) -> None:
        """Queue loads of keys ``i .. i + ahead - 1`` (step order) of chunk ``ci``."""
        for key in self._order[i:i + self._ahead]:
            if (key, ci) not in self._pending and (key, ci) not in self._rep._held:
                self._pending[(key, ci)] = self._pool.submit(load, self._rep, key, ci, True)

    def take(self, key: Any, ci: int) -> Loaded:
        """The loaded rows of (``key``, ``ci``), waited for or loaded now.

        Raises:
            what :func:`load` raised (RouteReplayError prefixed with the microbatch key).
        """
        fut = self._pending.pop((key, ci), None)
        try:
            return fut.result() if fut is not None else load(self._rep, key, ci, False)
        except RouteReplayError as e:
            where = self._rep._where_named(key, ci)
            if e.args and isinstance(e.args[0], str) and not e.args[0].startswith(where):
                e.args = (f"{where}: {e.args[0]}",) + e.args[1:]
            raise
        except Exception as e:
            e.add_note(f"while loading routing for {self._rep._where_named(key, ci)}")
            raise

    def close(self) -> None:
        """Cancel queued loads and wait for a running one."""
        if self._pool is not None:
            # NOTE: the source is not read after step() returns: queued loads are
            # cancelled, a running one is waited for.
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
