"""EPLB replica refresh after a weight update (vLLM 0.32 ``vllm/distributed/eplb``).

With EPLB, physical expert slot p of an MoE layer holds logical expert
``physical_to_logical_map[layer, p]``, and rearrangements move experts between slots and
ranks. vLLM's weight loading (``reload_weights``, the weight-transfer engines) maps
checkpoint experts to slots through the *initial* placement
(``EplbState.build_initial_global_physical_to_logical_map``), so after a rearrangement an
update writes the new weights into the wrong slots. :func:`refresh_replicas` moves them to
where the current map wants them with vLLM's own ``rearrange_expert_weights_inplace(
old=initial, new=current)``, across EP ranks too (vLLM's EPLB communicator).

Routing capture is unaffected: vLLM 0.16+ records logical ids before the EPLB mapping
(``BaseRouter._select_experts``); records reject ids >= num_experts with an EPLB hint.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from routereplay.errors import ConfigError


def initial_map(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """vLLM's initial placement for every layer: int64 [num_layers, num_physical]."""
    from vllm.distributed.eplb.eplb_state import EplbState
    row = EplbState.build_initial_global_physical_to_logical_map(
        num_logical, num_physical - num_logical)
    return torch.tensor(row, dtype=torch.int64).unsqueeze(0).expand(num_layers, -1).contiguous()


def refresh_replicas(physical_to_logical_map: torch.Tensor,
                     expert_weights: Sequence[Sequence[torch.Tensor]],
                     expert_buffer: Sequence[torch.Tensor], ep_group: Any, communicator: Any,
                     num_logical: int) -> int:
    """Move freshly loaded expert weights from the initial placement to the current one.

    Args:
        physical_to_logical_map: int [num_moe_layers, num_physical] (EplbModelState), the
            current placement.
        expert_weights: per MoE layer, the layer's expert weight tensors, each
            [num_local_physical, ...] (``MixtureOfExperts.expert_weights``), as the update
            left them (initial placement).
        expert_buffer: one receive buffer per weight tensor of a layer
            (``EplbModelState.expert_buffer``).
        ep_group, communicator: vLLM's EP process group and EPLB communicator.
        num_logical: logical experts per layer.
    Returns:
        number of MoE layers whose placement differs from the initial one (rewritten).
    """
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    cur = physical_to_logical_map
    init = initial_map(cur.shape[0], num_logical, cur.shape[1]).to(cur.device)
    differs = int((init != cur).any(-1).sum())
    if differs:
        rearrange_expert_weights_inplace(init, cur, expert_weights, expert_buffer, ep_group,
                                         communicator)
    return differs


def refresh_worker(worker: Any, layer_ids: list[int] | None = None) -> int:
    """collective_rpc target (worker extension): refresh every EPLB model state of this
    worker after an update that wrote the experts of decoder layers ``layer_ids`` (None =
    all; [] = none: nothing moves); 0 when EPLB is off.

    Raises:
        ConfigError: EPLB is on and the update wrote only some MoE layers' experts (the
            refresh moves whole placements; send every MoE layer's experts or none).
    """
    runner = getattr(worker, "model_runner", None)
    state = getattr(runner, "eplb_state", None)
    if state is None or layer_ids == []:
        return 0
    model = runner.get_model()
    moe = {int(m.group(1)) for name, _ in model.named_modules()
           if (m := re.search(r"layers\.(\d+)\.mlp\.experts$", name))}
    if layer_ids is not None and not moe <= set(layer_ids):
        raise ConfigError("EPLB replica refresh after a partial expert update "
                           f"(layers {layer_ids}) is not supported: send every MoE layer's "
                           "expert weights, or none")
    from vllm.distributed.parallel_state import get_ep_group
    ep_group = get_ep_group().device_group
    n = 0
    states = getattr(state, "model_states", {})
    for ms in (states.values() if isinstance(states, dict) else states):
        n += refresh_replicas(ms.physical_to_logical_map, ms.model.expert_weights,
                              ms.expert_buffer, ep_group, ms.communicator,
                              int(ms.model.num_logical_experts))
    return n
