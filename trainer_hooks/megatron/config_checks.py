"""Refusals of megatron-core set-ups where replay would be bypassed or wrong: the config
(:func:`check_config`, at construction) and a padding mask on routers with megatron's
expert-bias bug (probed; refused per forward by :func:`padding_mask_hook`)."""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch

from routereplay.errors import ConfigError, SchemaError
from routereplay.schema import RoutingSchema
from trainer_hooks.megatron.version import MCORE_VERSION


def expert_bias_masks_experts(router_cls: type) -> bool:
    """Whether ``router_cls._apply_expert_bias`` (megatron-core's ``TopKRouter``) applies
    the flattened ``padding_mask`` bool [tokens] along the expert axis of ``routing_map``
    bool [tokens, experts] (``routing_map & (~padding_mask)``, megatron-core 0.16.1 to at
    least 0.19.2; NVIDIA/Megatron-LM issue #6111, fixed by PR #6114): a shape error in
    every grad-enabled forward with expert bias and a padding mask, unless tokens ==
    experts, where it silently counts the wrong experts.

    Probed, not read from the version, so a patched router is accepted: the undecorated
    function (``jit_fuser`` is ``torch.compile`` on torch >= 2.2; nothing is compiled) runs
    on a 2-token, 3-expert map with token 1 padding and must count [1, 1, 0]. False where
    the method is missing or cannot be probed (nothing to refuse).
    """
    fn = getattr(router_cls, "_apply_expert_bias", None)
    if fn is None:
        return False
    fn = inspect.unwrap(fn)
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    probe = types.SimpleNamespace(enable_expert_bias=True,
                                  local_tokens_per_expert=torch.zeros(3))
    routing_map = torch.tensor([[True, True, False], [False, True, True]])
    try:
        with torch.enable_grad():
            fn(probe, routing_map, padding_mask=torch.tensor([False, True]))
    except RuntimeError:
        return True
    except Exception:      # an implementation this probe does not fit: nothing to refuse
        return False
    return probe.local_tokens_per_expert.tolist() != [1.0, 1.0, 0.0]


def padding_mask_hook(where: Callable[[], str]):
    """A model chunk's forward pre-hook (``with_kwargs=True``) for routers where
    :func:`expert_bias_masks_experts`: raises ConfigError (naming ``where()``) on a call
    with ``padding_mask=`` and grad enabled."""
    def hook(module, args, kwargs):
        # NOTE: host check of the call's arguments (no device read), before megatron's
        # first MoE layer raises its shape error or miscounts (expert_bias_masks_experts)
        if kwargs.get("padding_mask") is None or not torch.is_grad_enabled():
            return None
        raise ConfigError(
            f"{where()}: padding_mask= in a forward with grad enabled, on a model with "
            f"moe_router_enable_expert_bias=True: megatron-core {MCORE_VERSION}'s "
            "TopKRouter._apply_expert_bias masks routing_map [tokens, experts] with the "
            "flattened padding_mask [tokens] along the expert axis (NVIDIA/Megatron-LM "
            "issue #6111): a shape error, or wrong expert-bias token counts when tokens "
            "== experts. Do not pass padding_mask (the replayer takes padding from the "
            "Layout; padding tokens then count in the expert-bias loads), use a packed "
            "THD layout, or patch _apply_expert_bias to mask with "
            "padding_mask.unsqueeze(-1) (upstream PR #6114); docs/megatron.md, "
            "'Padding mask and expert bias'")
    return hook


def unwrap_config(chunk: Any):
    """The ``config`` of a model chunk, through its wrappers' ``.module`` (DDP, Float16)."""
    m = chunk
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    return m.config


def check_config(config: Any, schema: RoutingSchema) -> None:
    """Refuse configurations where replay would be bypassed or wrong.

    Raises:
        SchemaError: routing replay not enabled, fused router (TE's fused top-k returns before
            the replay hook), sinkhorn routing, or a schema that differs from the model.
    """
    if not getattr(config, "moe_enable_routing_replay", False):
        raise SchemaError("TransformerConfig.moe_enable_routing_replay is False: megatron-core "
                          "builds no RouterReplay, routing cannot be replayed")
    if getattr(config, "moe_router_fusion", False):
        raise SchemaError("moe_router_fusion=True: the fused top-k kernel returns before "
                          "megatron's replay hook, replay would be silently bypassed")
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise SchemaError("moe_router_load_balancing_type='sinkhorn' routes without the top-k "
                          "replay hook, replay would be silently bypassed")
    if not getattr(config, "num_moe_experts", None):
        raise SchemaError("the model config has no MoE (num_moe_experts is not set)")
    if config.num_moe_experts != schema.num_experts or config.moe_router_topk != schema.top_k:
        raise SchemaError(f"model routes top-{config.moe_router_topk} of "
                          f"{config.num_moe_experts} experts, records top-{schema.top_k} of "
                          f"{schema.num_experts}")

