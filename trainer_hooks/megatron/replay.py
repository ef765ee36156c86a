"""Feed recorded routing into megatron-core's RouterReplay, with per-token fallback.

megatron-core (0.16+) ``RouterReplay.get_replay_topk`` replaces the whole top-k of a layer
with ``target_topk_idx [num_tokens, k]``: it has no notion of rows without routing (the
last token, padding, truncated or skipped prompt rows). :func:`replay_patch` wraps that one
method (reversibly, only while the context is active) so that:

- rows whose replay ids are ``-1`` take the trainer's own top-k (per-token fallback);
- the experts a layer actually used are kept on the instance (``rr_used_topk``,
  int64 [num_tokens, k]) for routing-agreement metrics.

Token order is megatron's router input order: ``[s, b, h]`` flattened s-major, so row
``p * b + j`` is token position p of sample j in the microbatch.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch

from routereplay.errors import AlignmentError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

MISSING = -1

# Selection-only router noise (see selection_noise); None when off.
_SELECT_NOISE: dict | None = None


def _own_topk(scores, topk, num_groups, group_topk, default_compute_topk):
    """The trainer's own top-k; with selection noise on, near-ties are broken by noise while
    the gate values are still gathered from the exact scores."""
    if _SELECT_NOISE is None:
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    noise = torch.randn(scores.shape, generator=_SELECT_NOISE["gen"], dtype=torch.float32)
    _, idx = default_compute_topk(scores + (_SELECT_NOISE["std"] * noise).to(scores.dtype), topk,
                                  num_groups=num_groups, group_topk=group_topk)
    return scores.gather(1, idx), idx


@contextlib.contextmanager
def selection_noise(std: float, seed: int = 0) -> Iterator[None]:
    """Add N(0, std^2) noise to the router scores used for the trainer's own top-k
    *selection* only (gate values stay exact): isolates what routing flips alone do, as when
    engine and trainer break near-ties differently. Replayed rows are unaffected."""
    global _SELECT_NOISE
    old = _SELECT_NOISE
    _SELECT_NOISE = {"std": float(std), "gen": torch.Generator().manual_seed(seed)} if std else None
    try:
        yield
    finally:
        _SELECT_NOISE = old


def replay_tensors(records: Sequence[RoutingRecord], schema: RoutingSchema, seq_len: int,
                   layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Per-MoE-layer replay ids for a right-padded microbatch.

    Args:
        records: one per sample of the microbatch (batch index j = position in the list);
            record i covers token positions [start, start + T).
        schema: routing schema of the records and the model.
        seq_len: s, the padded sequence length of the microbatch (tokens).
        layers: positions on the record's MoE layer axis held by this model chunk
            (default all, in order).
    Returns:
        list over layers of int64 [s * b, top_k], s-major; rows without routing are -1.
    Raises:
        AlignmentError: a record has rows beyond ``seq_len``.
    """
    b = len(records)
    layers = list(range(schema.num_moe_layers)) if layers is None else list(layers)
    out = np.full((seq_len, b, len(layers), schema.top_k), MISSING, dtype=np.int64)
    for j, r in enumerate(records):
        if r.start + r.num_tokens > seq_len:
            raise AlignmentError(
                f"sample {r.sample_id!r}: routing rows cover token positions "
                f"[{r.start}, {r.start + r.num_tokens}) but the microbatch holds {seq_len} tokens")
        out[r.start:r.start + r.num_tokens, j] = r.ids[:, layers].astype(np.int64)
    flat = out.reshape(seq_len * b, len(layers), schema.top_k)
    return [torch.from_numpy(np.ascontiguousarray(flat[:, i])) for i in range(len(layers))]


def _patched_get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                             default_compute_topk=None):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A
    action = self.router_replay_action
    if action in (A.REPLAY_FORWARD, A.REPLAY_BACKWARD):
        target = (self.target_topk_idx if action == A.REPLAY_FORWARD
                  else self.replay_backward_list.pop(0))
        target = target.to(scores.device)
        if target.shape != (scores.shape[0], topk):
            insts = router_instances()
            where = insts.index(self) if self in insts else "?"
            raise AlignmentError(
                f"MoE router #{where} (local order): replay ids have shape "
                f"{tuple(target.shape)} but the router sees {scores.shape[0]} tokens with "
                f"top_k={topk} (microbatch layout differs from the replay data)")
        missing = target < 0
        if bool(missing.any()):
            _, own = _own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            row_missing = missing.any(-1, keepdim=True)
            idx = torch.where(row_missing, own, target)
        else:
            idx = target
        probs = scores.gather(1, idx)
        self.rr_used_topk = idx.detach()
        return probs, idx
    probs, idx = _own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
    if action == A.RECORD:
        self.record_indices(idx)
    self.rr_used_topk = idx.detach()
    return probs, idx


@contextlib.contextmanager
def replay_patch() -> Iterator[None]:
    """Install the fallback-aware ``get_replay_topk`` on megatron's RouterReplay class.

    Restores the original method on exit.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay
    orig = RouterReplay.get_replay_topk
    RouterReplay.get_replay_topk = _patched_get_replay_topk
    try:
        yield
    finally:
        RouterReplay.get_replay_topk = orig


def router_instances():
    """megatron's global RouterReplay list (one per local MoE router, construction order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    return RouterReplay.global_router_replay_instances


@contextlib.contextmanager
def replaying(per_layer: list[torch.Tensor] | None) -> Iterator[None]:
    """Run the model with replay of ``per_layer`` ids (or, with None, its own routing while
    still recording the used experts). Clears replay state on exit."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A
    insts = router_instances()
    with replay_patch():
        try:
            if per_layer is None:
                RouterReplay.set_global_router_replay_action(A.RECORD)
            else:
                if len(per_layer) != len(insts):
                    raise AlignmentError(f"{len(per_layer)} replay layers for {len(insts)} "
                                         "MoE routers in this model")
                RouterReplay.set_replay_data(per_layer)
                RouterReplay.set_global_router_replay_action(A.REPLAY_FORWARD)
            yield
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()


def used_topk(seq_len: int, batch: int) -> np.ndarray:
    """Experts each router used in the last forward: int64 [b, s, L_local, k]."""
    return _batch_major([inst.rr_used_topk.cpu().numpy() for inst in router_instances()],
                        seq_len, batch)


def _batch_major(per_layer: list[np.ndarray], seq_len: int, batch: int) -> np.ndarray:
    """Per-layer s-major rows [s*b, k] -> [b, s, L, k]."""
    arr = np.stack(per_layer, axis=1)                 # [s*b, L, k]
    return arr.reshape(seq_len, batch, len(per_layer), -1).transpose(1, 0, 2, 3)


@contextlib.contextmanager
def capture_routing_maps(model) -> Iterator[list]:
    """Record each router's output routing map (bool [num_tokens, num_experts]) per forward.

    Measured on the router's *output*, so it shows what the experts downstream receive,
    whether or not replay took effect. Yields the list of router modules (model order =
    RouterReplay construction order); read the maps with :func:`routing_map_topk`.
    """
    routers = [m for m in model.modules() if hasattr(m, "router_replay")]
    hooks = [r.register_forward_hook(
        lambda mod, inp, out: setattr(mod, "rr_routing_map", out[1].detach())) for r in routers]
    try:
        yield routers
    finally:
        for h in hooks:
            h.remove()


def routing_map_topk(routers, seq_len: int, batch: int, top_k: int) -> np.ndarray:
    """Expert sets from the captured routing maps: int64 [b, s, L_local, top_k], ascending.

    Raises:
        AlignmentError: a row of a map does not select exactly top_k experts.
    """
    per = []
    for i, r in enumerate(routers):
        m = r.rr_routing_map
        counts = m.sum(-1)
        if bool((counts != top_k).any()):
            raise AlignmentError(f"MoE router #{i}: routing map rows select "
                                 f"{int(counts.min())}..{int(counts.max())} experts, not {top_k}")
        idx = torch.topk(m.to(torch.int8), top_k, dim=-1).indices
        per.append(torch.sort(idx, -1).values.cpu().numpy())
    return _batch_major(per, seq_len, batch)
