"""Collection (harness): per-token log-probs and the experts every router used, from each
rank to rank 0, assembled per record.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from routereplay.errors import AlignmentError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.megatron import RouterReplayer
from trainer_hooks.megatron.harness.plan import BatchPlan


@dataclasses.dataclass
class RankPart:
    """What one rank collected in a pass.

    Attributes:
        lp: sample id -> float64 [len - 1], the trainer's log-prob of token p at p - 1.
        used: (sample id, token positions int64 [n], MoE-axis position, experts int64 [n, K])
            blocks, in router column order.
    """

    lp: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    used: list[tuple[str, np.ndarray, int, np.ndarray]] = dataclasses.field(default_factory=list)


class Collector:
    """Fills a :class:`RankPart` from ``RouterReplayer.on_used`` (experts) and the loss
    function (log-probs) during one pass."""

    def __init__(self, replayer: RouterReplayer, plan: BatchPlan):
        self.replayer, self.plan = replayer, plan
        self.part = RankPart()

    def on_used(self, key: int, ci: int, li: int, tmap, idx: torch.Tensor) -> None:
        """RouterReplayer.on_used: ``idx`` int64 [N, K] (CPU) of local layer ``li``."""
        mb = self.plan.microbatches[key]
        lpos = self.replayer.record_layers[ci][li]
        real = tmap.sample >= 0
        smp, pos, rows = tmap.sample[real], tmap.position[real], idx.numpy()[real]
        for j in np.unique(smp):
            sel = smp == j
            if mb.records[j] is not None:
                self.part.used.append((mb.sample_ids[j], pos[sel], lpos, rows[sel]))

    def on_logprobs(self, key: int, lp: torch.Tensor) -> None:
        """``lp`` float [b, s - 1]: log-prob of token p + 1 at p, for each row."""
        mb = self.plan.microbatches[key]
        lp = lp.detach().double().cpu()
        for j, (r, a) in enumerate(zip(mb.records, mb.offsets)):
            if r is not None:
                self.part.lp[r.sample_id] = lp[mb.row(j), a:a + len(r.token_ids) - 1].numpy()


def gather(obj: Any) -> list[Any] | None:
    """``obj`` of every rank, on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def assemble(parts: Sequence[RankPart], records: Sequence[RoutingRecord],
             schema: RoutingSchema) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Rank 0: per record, log-probs float64 [len - 1] and the experts used int64
    [len, L_moe, K] in router column order (-1 = no router saw that position).

    Raises:
        AlignmentError: a record got no log-probs from any rank.
    """
    lp: dict[str, np.ndarray | None] = {r.sample_id: None for r in records}
    used = {r.sample_id: np.full((len(r.token_ids), schema.num_moe_layers, schema.top_k), -1,
                                 np.int64) for r in records}
    for part in parts:
        lp.update(part.lp)
        for sid, pos, lpos, rows in part.used:
            used[sid][pos, lpos] = rows
    missing = [s for s, v in lp.items() if v is None]
    if missing:
        raise AlignmentError(f"no log-probs came back for samples {missing[:5]}")
    return lp, used


def router_grad_norms(replayer: RouterReplayer, schema: RoutingSchema,
                      sequence_parallel: bool) -> list[float]:
    """Norm of each MoE router's weight gradient, summed over the ranks that share the
    router (TP with sequence parallel and DP hold partial sums): one per MoE layer, on rank
    0 (empty elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    grads = {}
    for layers in replayer.layers:
        for router, lid in layers:
            g = router.weight.grad
            grads[lid] = torch.zeros_like(router.weight) if g is None else g.detach().clone()
    for lid in sorted(grads):
        if sequence_parallel:
            dist.all_reduce(grads[lid], group=ps.get_tensor_model_parallel_group())
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(grads[lid], group=ps.get_data_parallel_group())
    parts = gather({lid: float(g.float().norm()) for lid, g in grads.items()})
    if parts is None:
        return []
    merged: dict[int, float] = {}
    for p in parts:
        merged.update(p)
    return [merged[lid] for lid in schema.moe_layer_ids]
