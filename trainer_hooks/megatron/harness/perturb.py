"""Router perturbations (harness experiments).

- :func:`perturb_routers`: add seeded Gaussian noise to every MoE router's weights, so the
  trainer's own routing departs from the engine's (replay must still force the recorded
  experts);
- :func:`selection_noise`: noise on the router scores used for the trainer's own top-k
  *selection* only (gate values stay exact), set as the replayer's ``own_topk`` for a
  while: isolates what routing flips alone do, as when engine and trainer break near-ties
  differently. Replayed rows are unaffected.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from trainer_hooks.megatron import RouterReplayer


def perturb_routers(replayer: RouterReplayer, eps: float, seed: int) -> None:
    """Add N(0, eps^2) to the weight of every MoE router of ``replayer``'s model."""
    # NOTE: seeded by the global layer id, so every rank holding a replica of a router
    # (TP, EP/DP) adds the same noise.
    with torch.no_grad():
        for layers in replayer.layers:
            for router, lid in layers:
                g = torch.Generator().manual_seed(seed * 1000 + 7 + lid)
                noise = torch.randn(router.weight.shape, generator=g) * eps
                router.weight.add_(noise.to(router.weight.device, router.weight.dtype))


@contextlib.contextmanager
def selection_noise(replayer: RouterReplayer, std: float, seed: int = 0) -> Iterator[None]:
    """Within the block, ``replayer``'s own top-k selects on ``scores + N(0, std^2)`` and
    gathers gate values from the exact scores (std 0: no change)."""
    if not std:
        yield
        return
    gen = torch.Generator().manual_seed(seed)

    def noisy_topk(scores, topk, num_groups, group_topk, default_compute_topk):
        noise = torch.randn(scores.shape, generator=gen, dtype=torch.float32)
        noisy = scores + (std * noise).to(scores.device, scores.dtype)
        _, idx = default_compute_topk(noisy, topk, num_groups=num_groups, group_topk=group_topk)
        return scores.gather(1, idx), idx

    old = replayer.own_topk
    replayer.own_topk = noisy_topk
    try:
        yield
    finally:
        replayer.own_topk = old
