"""The transformers MoE routers the FSDP replayer drives, and its per-instance patch.

Each supported router returns ``(router_logits [N, E], top_k_weights [N, K],
top_k_index int64 [N, K])`` from ``forward(hidden_states)``. The patch (:func:`patched`)
sets an instance ``forward`` on the replayer's routers for one step and removes it on exit;
the class and every other model's routers are untouched. The patched forward computes the
router's own scores (gradients reach ``router.weight``), takes the ids the replayer gives
(``select(router, scores_for_choice, own) -> idx``) and gathers the gate weights at them,
as the class's own code does after its top-k.

Families (transformers 5.x):
- softmax top-k: Qwen3MoeTopKRouter, Qwen3NextTopKRouter (the same code in transformers
  5.19), Qwen2MoeTopKRouter (``norm_topk_prob``), MixtralTopKRouter (always renormalised;
  weights stay float32);
- top-k of the logits (with a bias), softmax over the k chosen: GptOssTopKRouter;
- sigmoid + ``e_score_correction_bias`` + group-limited top-k (DeepSeek-V3 style):
  DeepseekV3TopkRouter, Glm4MoeTopkRouter (weights ``* routed_scaling_factor``).
Any other router-like module (a ``*Router`` / ``*TopkRouter`` class with a ``weight``) in
the model is refused by class name (:class:`UnsupportedRouterError`).
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from routereplay.errors import ConfigError

SOFTMAX = ("Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen2MoeTopKRouter",
           "MixtralTopKRouter")
LOGIT_TOPK = ("GptOssTopKRouter",)
SIGMOID_GROUPED = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")
SUPPORTED_ROUTERS = SOFTMAX + LOGIT_TOPK + SIGMOID_GROUPED

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class UnsupportedRouterError(ConfigError):
    """The model has an MoE router class the replayer does not know: it is refused rather
    than left routing on its own (names the class and module)."""


def _is_router_like(m: torch.nn.Module) -> bool:
    n = type(m).__name__
    return n.lower().endswith(("router", "topkrouter")) and hasattr(m, "weight")


def find_routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """``[(router, decoder layer id), ...]`` of the model's MoE routers, in layer order.

    Raises:
        UnsupportedRouterError: a router-like module of an unsupported class, or none at all.
        ConfigError: a router outside ``...layers.<i>....`` (no decoder layer id).
    """
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in SUPPORTED_ROUTERS:
            hit = _LAYER.search(name)
            if hit is None:
                raise ConfigError(f"router {name} ({cls}) is not inside a decoder layer "
                                  "('layers.<i>.'): its layer id is unknown")
            out.append((m, int(hit.group(1))))
        elif _is_router_like(m):
            raise UnsupportedRouterError(
                f"router {name} is a {cls}, which trainer_hooks.fsdp does not replay "
                f"(supported: {', '.join(SUPPORTED_ROUTERS)}); refusing to run it without "
                "replay")
    if not out:
        raise UnsupportedRouterError(f"{type(model).__name__} has no supported MoE router "
                                     f"({', '.join(SUPPORTED_ROUTERS)})")
    out.sort(key=lambda t: t[1])
    return out


def own_topk(router: torch.nn.Module, choice: torch.Tensor) -> torch.Tensor:
    """The router's own top-k ids (int64 [N, K]) from its selection scores, as its class
    selects (softmax, gpt-oss logits: plain top-k; sigmoid: group-limited top-k of
    scores + bias)."""
    if type(router).__name__ in SOFTMAX + LOGIT_TOPK:
        return torch.topk(choice, router.top_k, dim=-1).indices
    e, g = router.num_experts, router.num_group
    group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    return torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]


def _forward(router: torch.nn.Module, select: Callable[..., torch.Tensor]):
    name = type(router).__name__

    def forward(hidden_states):
        if name in SOFTMAX:
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            idx = select(router, probs)
            w = probs.gather(-1, idx)
            if name.startswith("Mixtral") or router.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            if not name.startswith("Mixtral"):
                w = w.to(logits.dtype)
            return logits, w, idx
        if name in LOGIT_TOPK:
            logits = F.linear(hidden_states, router.weight, router.bias)
            idx = select(router, logits)
            w = torch.softmax(logits.gather(-1, idx), dim=1, dtype=logits.dtype)
            return logits, w, idx
        h = hidden_states.view(-1, router.hidden_dim)
        logits = F.linear(h.type(torch.float32), router.weight.type(torch.float32))
        scores = logits.sigmoid()
        idx = select(router, scores + router.e_score_correction_bias)
        w = scores.gather(1, idx)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * router.routed_scaling_factor, idx
    return forward


@contextlib.contextmanager
def patched(routers: list[torch.nn.Module], select: Callable[..., torch.Tensor]
            ) -> Iterator[None]:
    """Give each of ``routers`` an instance ``forward`` that selects through ``select(router,
    choice scores [N, E]) -> int64 [N, K]``, for the block's duration.

    Raises:
        ConfigError: a router already patched (another replayer on this model).
    """
    done: list[torch.nn.Module] = []
    try:
        for r in routers:
            if "forward" in r.__dict__:
                raise ConfigError(f"{type(r).__name__} already has an instance forward: "
                                  "another replayer (or hook) is replaying into this model")
            r.forward = _forward(r, select)
            done.append(r)
        yield
    finally:
        for r in done:
            r.__dict__.pop("forward", None)
