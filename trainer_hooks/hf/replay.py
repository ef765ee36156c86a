"""Force recorded experts in a transformers 5 MoE model (reference replay).

    with hf_replay(model, forced) as used:       # forced: per MoE layer int64 [B*S, top_k]
        logits = model(input_ids).logits          # used[i]: top-k ids layer i really used

Every tensor built here is built on the model's device (forced ids move there once, when
the patch is installed; ``token_logprobs`` builds its inputs there), so the hook works
on CUDA as on CPU and adds no host-device copy per router call.

Each MoE block's router (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``,
``MixtralTopKRouter``) still computes its softmax over all experts; on rows with a forced
row it takes the recorded ids (in the engine's column order) instead of its own top-k and
gathers their probabilities as gate weights (renormalised like the model does), so the
router keeps receiving gradients. Rows whose forced ids are -1 (no routing recorded: the
last token, padding) use the router's own top-k. The patch is an instance attribute on
each router, removed on exit (nothing on disk, nothing global).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from routereplay.errors import AlignmentError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order.

    Raises:
        AlignmentError: no supported router (names the model class).
    """
    routers = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    if not routers:
        raise AlignmentError(f"{type(model).__name__} has no supported MoE router "
                             f"({', '.join(ROUTER_CLASSES)})")
    return routers


def _normalises(router: torch.nn.Module) -> bool:
    # NOTE: Mixtral always renormalises the top-k probabilities; Qwen follows norm_topk_prob.
    return bool(getattr(router, "norm_topk_prob", True))


def _forced_forward(router, forced: torch.Tensor | None, used: list):
    def forward(hidden_states):
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(h, router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        if forced is None:
            idx = own
        else:
            if forced.shape != own.shape:
                raise AlignmentError(f"replay ids {tuple(forced.shape)} do not match the router's "
                                     f"{tuple(own.shape)} (tokens x top_k)")
            idx = torch.where((forced >= 0).all(-1, keepdim=True), forced, own)
        weights = probs.gather(-1, idx)
        if _normalises(router):
            weights = weights / weights.sum(-1, keepdim=True)
        used.append(idx.detach())
        # NOTE: as the model's own router: Qwen casts the gate weights to the logits dtype,
        # Mixtral returns them in float32
        if not type(router).__name__.startswith("Mixtral"):
            weights = weights.to(logits.dtype)
        return logits, weights, idx
    return forward


def _checked(f: torch.Tensor, router: torch.nn.Module, layer: int) -> torch.Tensor:
    """Replay ids of one layer: integer, in [0, num_experts) or whole rows of -1, distinct."""
    f = torch.as_tensor(f)
    if f.dtype.is_floating_point or f.dtype == torch.bool or f.ndim != 2:
        raise AlignmentError(f"MoE layer {layer}: replay ids must be an integer [tokens, top_k] "
                             f"tensor, got {f.dtype} {tuple(f.shape)}")
    f = f.long()
    neg = f < 0
    if ((f < -1) | (f >= router.num_experts)).any() or (neg.any(-1) & ~neg.all(-1)).any():
        raise AlignmentError(f"MoE layer {layer}: replay ids outside [0, {router.num_experts}) or "
                             "rows only partly -1")
    s = torch.sort(f, -1).values
    if ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any():
        raise AlignmentError(f"MoE layer {layer}: replay ids repeat an expert within a row")
    return f


@contextlib.contextmanager
def hf_replay(model: torch.nn.Module, forced: Sequence[torch.Tensor | None] | None
              ) -> Iterator[list[torch.Tensor]]:
    """Force ``forced[i]`` (int64 [tokens, top_k], -1 rows = own routing) in MoE layer i.

    ``forced=None`` records without forcing. Yields a list that receives, per router call,
    the ids used (int64 [tokens, top_k], on the router's device), in layer order. The
    forced ids are checked where they are and then moved to each router's device once.

    Raises:
        AlignmentError: a layer count, shape, dtype or id that cannot be replayed.
    """
    routers = moe_routers(model)
    if forced is not None:
        if len(forced) != len(routers):
            raise AlignmentError(f"{len(forced)} layers of replay ids for {len(routers)} MoE routers")
        forced = [None if f is None else _checked(f, r, i).to(r.weight.device)
                  for i, (f, r) in enumerate(zip(forced, routers))]
    used: list[torch.Tensor] = []
    try:
        for i, r in enumerate(routers):
            r.forward = _forced_forward(r, None if forced is None else forced[i], used)
        yield used
    finally:
        for r in routers:
            r.__dict__.pop("forward", None)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (where its inputs must be built)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def replay_ids(record: RoutingRecord, schema: RoutingSchema, seq_len: int,
               device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per MoE layer int64 [seq_len, top_k] on ``device``: the record's ids at their token
    positions (row i = position start + i), -1 where the record has no row.

    Raises:
        AlignmentError: the record starts past the sequence.
    """
    if record.start > seq_len:
        raise AlignmentError(f"sample {record.sample_id!r}: routing starts at position "
                             f"{record.start}, past the {seq_len}-token sequence")
    out = np.full((seq_len, schema.num_moe_layers, schema.top_k), -1, dtype=np.int64)
    end = min(record.start + record.num_tokens, seq_len)
    out[record.start:end] = record.expert_ids[:end - record.start]
    # NOTE: one copy of the whole [seq_len, L_moe, K] block, then per-layer views.
    full = torch.from_numpy(out).to(device)
    return [full[:, i] for i in range(schema.num_moe_layers)]


def model_inputs(model: torch.nn.Module, token_ids: np.ndarray, schema: RoutingSchema,
                 record: RoutingRecord | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """What :func:`token_logprobs` feeds the model: the input ids int64 [1, N] on the
    model's device and the forced ids per MoE layer (int64 [N, K] on the host, where
    :func:`hf_replay` checks them before moving them to the routers' device; None without
    a record)."""
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).to(model_device(model))[None]
    forced = None if record is None else replay_ids(record, schema, ids.shape[1])
    return ids, forced


def token_logprobs(model: torch.nn.Module, token_ids: np.ndarray, schema: RoutingSchema,
                   record: RoutingRecord | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's log-probs with (``record`` given) or without replay, computed on the
    model's device.

    Args:
        token_ids: int [N], the sequence (prompt + generated).
    Returns:
        (lp float64 [N - 1]: log p(token_p | tokens_<p) for p = 1..N-1,
         used int64 [N, L_moe, top_k]: experts each position used), on the host.
    """
    ids, forced = model_inputs(model, token_ids, schema, record)
    with hf_replay(model, forced) as used:
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp.detach().double().cpu().numpy(), torch.stack(used, 1).cpu().numpy()
