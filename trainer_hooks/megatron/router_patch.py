"""What :meth:`RouterReplayer.step` installs on the model, and removes on exit (:func:`patched`).

- For the step only, the ``RouterReplay`` instances of the routers the replayer found get
  their own ``get_replay_topk``; the class, other models' routers and megatron's replay
  state (``set_replay_data`` / ``set_global_router_replay_action``) are untouched, and our
  instances' state is restored on exit. MTP routers keep their own routing.
- A forward hook wraps the chunk's output in an identity autograd node tagged with the key;
  its backward runs first in that microbatch's backward and tells the routers which
  microbatch the activation-recompute forward belongs to. A pre-hook on the chunk's first
  decoder layer adds a second tag whose backward runs last: the data is released there
  (under ``torch.no_grad()`` at the end of the forward; with grad but no backward, at step
  end). So a rank holds routing only for the microbatches in flight (and prefetched).
- With a capacity factor, a router forward hook sums the routing maps on the device (the
  dropped-assignment count); with expert bias on routers that mis-apply a padding mask,
  a chunk pre-hook refuses one (trainer_hooks.megatron.config_checks).

The hooks read the step state of ``rep``, the RouterReplayer.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from trainer_hooks.megatron.config_checks import padding_mask_hook
from trainer_hooks.core.errors import ReplayStateError
from trainer_hooks.core.microbatch import BackwardTag

_ABSENT = object()


def _first_decoder_layer(chunk: Any):
    m = chunk
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    dec = getattr(m, "decoder", None)
    layers = getattr(dec, "layers", None)
    return layers[0] if layers is not None and len(layers) else None


def refuse_patched(layers: list[list[tuple[Any, int]]]) -> None:
    """Raises ReplayStateError if a router of ``layers`` (per chunk, ``[(router, layer id)]``)
    is being replayed into by another replayer."""
    for chunk_layers in layers:
        for router, _ in chunk_layers:
            other = getattr(router.router_replay, "_rr_slot", None)
            if other is not None:
                raise ReplayStateError("another RouterReplayer is replaying into this "
                                       "model: one step at a time per model")


@contextlib.contextmanager
def patched(rep: Any) -> Iterator[None]:
    """Install the step's selection (``rep._select``) and hooks on the model of ``rep``."""
    # NOTE: megatron calls ``router_replay.get_replay_topk(...)`` on the instance, so the
    # replayer's routers get an instance attribute for the step; the class, every other
    # model's routers and megatron's replay state (action, target and recorded indices,
    # backward list) are left as they are, and the state of our routers' instances is
    # put back on exit, whatever ran in between.
    patched: list[tuple[Any, Any, tuple]] = []

    def patch(rr: Any, ci: int | None, li: int | None) -> None:
        patched.append((rr, rr.__dict__.get("get_replay_topk", _ABSENT), (
            rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx,
            list(rr.replay_backward_list))))
        rr.get_replay_topk = functools.partial(rep._select, ci, li)
        rr._rr_slot = (rep, ci, li)

    hooks = []
    try:
        for ci, ch in enumerate(rep.chunks):
            for li, (router, _) in enumerate(rep.layers[ci]):
                patch(router.router_replay, ci, li)
                if rep._count_drops:
                    hooks.append(router.register_forward_hook(functools.partial(
                        _count_routed, rep)))
            hooks.append(ch.register_forward_hook(_chunk_output_hook(rep, ci)))
            if rep._refuse_padding_mask and rep.layers[ci]:
                hooks.append(ch.register_forward_pre_hook(
                    padding_mask_hook(functools.partial(_where_now, rep, ci)), with_kwargs=True))
            first = _first_decoder_layer(ch)
            if first is not None:
                hooks.append(first.register_forward_pre_hook(_layer_input_hook(rep, ci),
                                                             with_kwargs=True))
        for router in rep.mtp_routers:
            patch(router.router_replay, None, None)
        yield
    finally:
        for h in hooks:
            h.remove()
        for rr, attr, state in reversed(patched):
            if attr is _ABSENT:
                rr.__dict__.pop("get_replay_topk", None)
            else:
                rr.get_replay_topk = attr
            rr._rr_slot = None
            (rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx,
             backward) = state
            rr.replay_backward_list = backward


def _where_now(rep: Any, ci: int) -> str:
    key = rep._fwd[ci]
    return rep._where_named(key, ci) if key is not None else \
        f"model chunk {ci} (outside microbatch())"


def _count_routed(rep, router, inp, out):
    # capacity-factor token dropping runs after replay inside the router: what the
    # experts receive can be fewer than top_k experts per token. Summed on the device,
    # read once when the step ends.
    ci = router.router_replay._rr_slot[1]
    if rep._fwd[ci] is None:          # recompute forward: counted already
        return
    routing_map = out[1]
    s = routing_map.sum()
    acc = rep._routed.get(s.device)
    rep._routed[s.device] = s if acc is None else acc + s
    rep._expected_routed += routing_map.shape[0] * rep.schema.top_k


def _chunk_output_hook(rep: Any, ci: int):
    def hook(module, args, out):
        key = rep._fwd[ci]
        if key is None or not torch.is_tensor(out) or not out.requires_grad:
            return None
        rep._held[(key, ci)].backward = True

        def begin():
            prev = rep._bwd[ci]
            if prev is not None and prev != key:
                # its backward is over (backwards run one at a time) but no end tag
                # fired (first layer's input needed no grad): release it now
                rep._release(prev, ci)
            rep._bwd[ci] = key
        return BackwardTag.apply(out, begin)
    return hook


def _layer_input_hook(rep: Any, ci: int):
    def hook(module, args, kwargs):
        key = rep._fwd[ci] if rep._fwd[ci] is not None else rep._bwd[ci]
        if key is None or not torch.is_grad_enabled():
            return None
        hs = kwargs.get("hidden_states", args[0] if args else None)
        if not torch.is_tensor(hs) or not hs.requires_grad:
            return None

        def end():
            if rep._bwd[ci] == key:
                rep._bwd[ci] = None
            rep._release(key, ci)
        tagged = BackwardTag.apply(hs, end)
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=tagged)
            return args, kwargs
        return (tagged,) + tuple(args[1:]), kwargs
    return hook
