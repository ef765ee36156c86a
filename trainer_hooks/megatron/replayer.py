"""Routing replay for megatron-core training steps: per microbatch, keyed, sharded, lazy.

Usage inside an RL trainer (one replayer per model; ``model`` is the list of model chunks
that ``forward_backward_func`` gets, one chunk without VPP)::

    replayer = RouterReplayer(model, schema)
    batches = {k: Microbatch(sample_ids=[...], layout=Layout(...)) for k in range(num_mb)}
    with replayer.step(SidecarReader(path), batches):
        forward_backward_func(forward_step_func=forward_step, model=model, ...)

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        with replayer.microbatch(mb["key"], chunk):
            out = chunk(mb["tokens"], mb["position_ids"], mb["attention_mask"], ...)
        return out, loss_func

How it works (and why it is right under 1F1B, interleaved VPP and activation recompute):

- Replay data is keyed by (microbatch key, model chunk), never by call order. Entering
  :meth:`RouterReplayer.microbatch` decodes, from the source, only this rank's samples,
  token positions (after the context-parallel zig-zag and sequence-parallel split) and the
  chunk's MoE layers, validates them and holds them.
- A forward hook wraps the chunk's output in an identity autograd node tagged with the key;
  its backward runs first in that microbatch's backward and tells the routers which
  microbatch the activation-recompute forward belongs to. A pre-hook on the chunk's first
  decoder layer adds a second tag whose backward runs last: the data is released there
  (forward-only passes under ``torch.no_grad()`` release at the end of the forward; with
  grad enabled but no backward, data stays held until the step ends). So a rank holds
  routing only for the microbatches in flight.
- The recompute forward reuses the exact expert ids the first forward used (replayed rows
  and per-token fallback rows alike), so backward follows the forward's path.
- megatron-core's ``RouterReplay.get_replay_topk`` is swapped for the duration of
  :meth:`RouterReplayer.step` only, and only routers registered with this replayer are
  affected; MTP routers keep their own routing (they are never fed backbone routes).

Supported: megatron-core 0.16.x-0.19.x (``TransformerConfig.moe_enable_routing_replay``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.errors import AlignmentError, SchemaError
from routereplay.schema import RoutingSchema, schema_layers_for


# Selection-only router noise (see selection_noise); None when off.
_SELECT_NOISE: dict | None = None


def own_topk(scores, topk, num_groups, group_topk, default_compute_topk):
    """The trainer's own top-k (megatron's ``_compute_topk``); with :func:`selection_noise`
    on, near-ties are broken by noise while gate values are still gathered from the exact
    scores."""
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


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One microbatch of the global batch: which records, laid out how.

    Attributes:
        sample_ids: record id of each sample, in batch order (sample j of the layout).
        layout: the trainer's token layout of the microbatch (routereplay.align.Layout).
    """

    sample_ids: tuple[str, ...]
    layout: align.Layout

    def __post_init__(self):
        if isinstance(self.sample_ids, (str, bytes)):
            raise AlignmentError("Microbatch.sample_ids must be a sequence of ids, not a string")
        object.__setattr__(self, "sample_ids", tuple(str(x) for x in self.sample_ids))
        if len(self.sample_ids) != self.layout.batch_size:
            raise AlignmentError(f"microbatch names {len(self.sample_ids)} samples but its "
                                 f"layout has {self.layout.batch_size}")


@dataclasses.dataclass
class ReplayStats:
    """Counters of one step.

    Attributes:
        bytes_decoded: id bytes this rank decoded from the source (at the record's dtype,
            uint8/uint16): only its samples, token ranges and layers.
        bytes_held: id bytes currently held for replay ([N, L_local, K] per microbatch in
            flight, padding rows included; int16, int32 above 32767 experts).
        peak_bytes_held: maximum of bytes_held during the step.
        replayed_rows / fallback_rows: (token, layer) rows that used recorded routing / the
            fallback (padding rows excluded), counted on first forward only.
        dropped_assignments: (token, expert) assignments removed by capacity-factor token
            dropping after replay.
        microbatches: (microbatch, model chunk) loads in the step.
        peak_microbatches_held: most (microbatch, model chunk) entries held at once.
        load_seconds: wall time spent decoding, aligning and validating rows (seconds).
        select_seconds: wall time spent in the routers' replay selection (seconds).
    """

    bytes_decoded: int = 0
    bytes_held: int = 0
    peak_bytes_held: int = 0
    replayed_rows: int = 0
    fallback_rows: int = 0
    dropped_assignments: int = 0
    microbatches: int = 0
    peak_microbatches_held: int = 0
    load_seconds: float = 0.0
    select_seconds: float = 0.0


def _unwrap_config(chunk: Any):
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


class _Tag(torch.autograd.Function):
    """Identity whose backward calls ``cb()`` (marks where a microbatch's backward is)."""

    @staticmethod
    def forward(ctx, x, cb):
        ctx.cb = cb
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.cb()
        return g, None


@dataclasses.dataclass
class _Held:
    ids: torch.Tensor                  # int16/int32 [N, L_local, K], -1 = no routing
    used: dict[int, torch.Tensor]      # local layer -> int64 [N, K] selected in forward
    backward: bool = False


class RouterReplayer:
    """Replays recorded routing into megatron-core's routers, microbatch by microbatch.

    Args:
        model: a megatron model chunk or the list of chunks (VPP), possibly DDP-wrapped.
        schema: routing schema of the records (checked against the model's config).
        fallback: for rows without routing: "own" (the trainer's own top-k for that token)
            or "dummy" (distinct ids ``(n*K + arange(K)) % E``, for dispatchers that need fixed
            counts).
        validate: check id range, duplicates, partial rows and group limits before replay.
        num_groups, topk_group: group-limited routing to validate against (default from the
            config's moe_router_num_groups / moe_router_group_topk).
        min_coverage: raise if fewer than this share of a microbatch's token rows carry
            routing (0 = no check).
    Raises:
        SchemaError: see :func:`check_config`; a router's layer is not an MoE layer of the
            schema.
    """

    def __init__(self, model: Any, schema: RoutingSchema, *, fallback: str = "own",
                 validate: bool = True, num_groups: int | None = None,
                 topk_group: int | None = None, min_coverage: float = 0.0):
        if fallback not in ("own", "dummy"):
            raise ValueError(f"fallback must be 'own' or 'dummy', got {fallback!r}")
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.schema = schema
        self.fallback = fallback
        self.validate = validate
        self.min_coverage = float(min_coverage)
        cfg = _unwrap_config(self.chunks[0])
        check_config(cfg, schema)
        self.config = cfg
        self.num_groups = num_groups or getattr(cfg, "moe_router_num_groups", None)
        self.topk_group = topk_group or getattr(cfg, "moe_router_group_topk", None)
        # chunk -> [(router module, decoder layer id)], MTP routers apart.
        self.layers: list[list[tuple[Any, int]]] = []
        self.mtp_routers: list[Any] = []
        for ch in self.chunks:
            mine = []
            for name, m in ch.named_modules():
                if getattr(m, "router_replay", None) is None:
                    continue
                if "mtp" in name.split("."):
                    # NOTE: MTP layers reuse decoder layer numbers (NeMo-RL PR #3903): never
                    # feed them backbone routes.
                    self.mtp_routers.append(m)
                    continue
                if not getattr(m, "layer_number", None):
                    raise SchemaError(f"router {name} has no layer_number")
                mine.append((m, int(m.layer_number) - 1))
            mine.sort(key=lambda t: t[1])
            self.layers.append(mine)
        self.record_layers = [schema_layers_for(schema, [lid for _, lid in ch])
                              for ch in self.layers]
        self.stats = ReplayStats()
        self._active = False

    # -- step -------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, source: Any, microbatches: Mapping[Any, Microbatch] | Sequence[Microbatch],
             shard: align.Shard | None = None) -> Iterator["RouterReplayer"]:
        """Replay for one training or log-prob step; every state is cleared on exit.

        Args:
            source: a ``routereplay.sidecar.SidecarReader`` (decoded lazily, by sample, token
                range and layer group), a mapping sample id -> RoutingRecord, or None (no
                routing: every row takes the fallback, i.e. the trainer's own routing).
            microbatches: key -> Microbatch (a sequence is keyed by index).
            shard: this rank's CP/SP place (default: read from megatron's parallel_state
                and the config's sequence_parallel).
        """
        if self._active:
            raise RuntimeError("RouterReplayer.step is not re-entrant")
        for layers in self.layers:
            for router, _ in layers:
                other = getattr(router.router_replay, "_rr_slot", None)
                if other is not None:
                    raise RuntimeError("another RouterReplayer is replaying into this model: "
                                       "one step at a time per model")
        from megatron.core.transformer.moe.router_replay import RouterReplay
        self._source = source
        self._mbs = dict(enumerate(microbatches)) if not isinstance(microbatches, Mapping) \
            else dict(microbatches)
        self._shard = shard or _current_shard(self.config)
        self._held: dict[tuple[Any, int], _Held] = {}
        self._tmaps: dict[tuple[Any, int], align.TokenMap] = {}
        self._fwd: list[Any] = [None] * len(self.chunks)
        self._bwd: list[Any] = [None] * len(self.chunks)
        self.stats = ReplayStats()
        orig = RouterReplay.get_replay_topk
        replayer = self

        def get_replay_topk(inst, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            slot = getattr(inst, "_rr_slot", None)
            if slot is None or slot[0] is not replayer:
                return orig(inst, scores, topk, num_groups, group_topk, default_compute_topk)
            return replayer._select(slot[1], slot[2], scores, topk, num_groups, group_topk,
                                    default_compute_topk)

        hooks = []
        for ci, ch in enumerate(self.chunks):
            for li, (router, _) in enumerate(self.layers[ci]):
                router.router_replay._rr_slot = (self, ci, li)
                hooks.append(router.register_forward_hook(self._router_hook))
            for router in self.mtp_routers:
                router.router_replay._rr_slot = (self, None, None)
            hooks.append(ch.register_forward_hook(self._chunk_output_hook(ci)))
            first = _first_decoder_layer(ch)
            if first is not None:
                hooks.append(first.register_forward_pre_hook(self._layer_input_hook(ci),
                                                             with_kwargs=True))
        RouterReplay.get_replay_topk = get_replay_topk
        self._active = True
        try:
            yield self
        finally:
            RouterReplay.get_replay_topk = orig
            for h in hooks:
                h.remove()
            for ci in range(len(self.chunks)):
                for router, _ in self.layers[ci]:
                    router.router_replay._rr_slot = None
            for router in self.mtp_routers:
                router.router_replay._rr_slot = None
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
            self._held.clear()
            self._tmaps.clear()
            self.stats.bytes_held = 0
            self._source = None
            self._active = False

    @contextlib.contextmanager
    def microbatch(self, key: Any, chunk: Any = None) -> Iterator[None]:
        """Context for one forward of microbatch ``key`` through ``chunk`` (default: the
        only chunk). Loads this rank's rows for the chunk's layers on entry.

        Raises:
            KeyError: unknown key; AlignmentError: the rows fail validation or coverage.
        """
        if not self._active:
            raise RuntimeError("RouterReplayer.microbatch outside RouterReplayer.step")
        ci = self._chunk_index(chunk)
        if self._fwd[ci] is not None:
            raise RuntimeError(f"RouterReplayer.microbatch({key!r}) inside microbatch("
                               f"{self._fwd[ci]!r}) of the same model chunk")
        if key not in self._mbs:
            raise KeyError(f"microbatch key {key!r} is not in this step's microbatches "
                           f"({len(self._mbs)} keys)")
        if (key, ci) in self._held:
            raise RuntimeError(f"microbatch {key!r} is forwarded a second time while its first "
                               "forward's backward is still pending: one forward per "
                               "microbatch key and model chunk in a step")
        self._load(key, ci)
        self._fwd[ci] = key
        try:
            yield
        finally:
            self._fwd[ci] = None
            h = self._held.get((key, ci))
            if h is not None and not h.backward:
                self._release(key, ci)      # forward-only pass (or no graph): done

    # Optional callback(key, chunk_index, local_layer, token_map, used int64 [N, K]) called
    # once per (microbatch, layer) in the first forward: used by tests and metrics.
    on_used = None

    # -- internals --------------------------------------------------------------------
    def _chunk_index(self, chunk: Any) -> int:
        if chunk is None:
            if len(self.chunks) != 1:
                raise ValueError("several model chunks (VPP): pass the chunk to microbatch()")
            return 0
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise ValueError("microbatch(): chunk is not one of the replayer's model chunks")

    def token_map(self, key: Any) -> align.TokenMap:
        """This rank's router rows for microbatch ``key`` (see routereplay.align)."""
        return align.token_map(self._mbs[key].layout, self._shard)

    def _fetch_fn(self, mb: Microbatch, layers: list[int]):
        src = self._source

        def fetch(j: int, lo: int, hi: int):
            sid = mb.sample_ids[j]
            if src is None:         # no routing at all: every row takes the fallback
                return np.zeros((0, len(layers), self.schema.top_k), np.int64), lo
            if isinstance(src, Mapping):
                rec = src.get(sid)
                if rec is None:
                    raise AlignmentError(f"sample {sid!r}: no routing record in the source")
                a, b = max(lo, rec.start), min(hi, rec.start + rec.num_tokens)
                if b <= a:
                    return np.zeros((0, len(layers), self.schema.top_k), rec.ids.dtype), lo
                ids = rec.ids[a - rec.start:b - rec.start][:, layers]
                self.stats.bytes_decoded += ids.nbytes
                return ids, a
            try:
                rec = src.read(sid, layers=layers, tokens=(lo, hi), arrays=False)
            except KeyError:
                raise AlignmentError(f"sample {sid!r}: not in the sidecar") from None
            self.stats.bytes_decoded += rec.ids.nbytes
            return rec.ids, rec.start

        return fetch

    def _load(self, key: Any, ci: int) -> None:
        t0 = time.perf_counter()
        mb = self._mbs[key]
        tmap = self.token_map(key)
        layers = self.record_layers[ci]
        ids = align.gather_rows(tmap, self._fetch_fn(mb, layers), len(layers), self.schema.top_k)
        lids = [lid for _, lid in self.layers[ci]]
        if self.validate:
            align.check_rows(ids, tmap, self.schema, lids, mb.sample_ids,
                             num_groups=self.num_groups, topk_group=self.topk_group)
        if self.min_coverage and ids.size:
            have, total = align.coverage(ids, tmap)
            if total and have < self.min_coverage * total:
                raise AlignmentError(f"microbatch {key!r} (samples {list(mb.sample_ids)}): "
                                     f"{have} of {total} token rows carry routing, below "
                                     f"min_coverage={self.min_coverage}")
        if self.fallback == "dummy":
            ids = align.fill_dummy(ids, self.schema.num_experts)
        dt = torch.int16 if self.schema.num_experts <= 32767 else torch.int32
        t = torch.from_numpy(ids).to(dt)
        self._held[(key, ci)] = _Held(ids=t, used={})
        self._tmaps[(key, ci)] = tmap
        n = t.numel() * t.element_size()
        self.stats.bytes_held += n
        self.stats.peak_bytes_held = max(self.stats.peak_bytes_held, self.stats.bytes_held)
        self.stats.microbatches += 1
        self.stats.peak_microbatches_held = max(self.stats.peak_microbatches_held,
                                                len(self._held))
        self.stats.load_seconds += time.perf_counter() - t0

    def _release(self, key: Any, ci: int) -> None:
        h = self._held.pop((key, ci), None)
        self._tmaps.pop((key, ci), None)
        if h is not None:
            self.stats.bytes_held -= h.ids.numel() * h.ids.element_size()

    def _current(self, ci: int) -> tuple[Any, _Held, bool]:
        key = self._fwd[ci]
        recompute = key is None
        if recompute:
            # NOTE: outside microbatch(), only an activation-recompute forward (which runs
            # inside autograd's backward) may replay; anything else is a caller error.
            key = self._bwd[ci] if torch._C._current_graph_task_id() != -1 else None
        if key is None or (key, ci) not in self._held:
            raise AlignmentError(
                f"an MoE router of model chunk {ci} ran outside RouterReplayer.microbatch(): "
                "wrap the model call in forward_step with `with replayer.microbatch(key, chunk)`")
        return key, self._held[(key, ci)], recompute

    def _select(self, ci, li, scores, topk, num_groups, group_topk, default_compute_topk):
        if ci is None:       # MTP router: own routing
            return own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        t0 = time.perf_counter()
        try:
            return self._select_rows(ci, li, scores, topk, num_groups, group_topk,
                                     default_compute_topk)
        finally:
            self.stats.select_seconds += time.perf_counter() - t0

    def _select_rows(self, ci, li, scores, topk, num_groups, group_topk, default_compute_topk):
        key, held, recompute = self._current(ci)
        if li in held.used:
            # NOTE: the activation-recompute forward takes exactly the experts of the first
            # forward, fallback rows too.
            idx = held.used[li]
            if idx.shape[0] != scores.shape[0]:
                raise AlignmentError(self._shape_msg(key, ci, li, idx.shape[0], scores.shape[0]))
            return scores.gather(1, idx), idx
        target = held.ids[:, li].to(torch.int64)
        if target.shape != (scores.shape[0], topk):
            raise AlignmentError(self._shape_msg(key, ci, li, target.shape[0], scores.shape[0]))
        target = target.to(scores.device)
        missing = (target < 0).any(-1, keepdim=True)
        if bool(missing.any()):
            _, own = own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            idx = torch.where(missing, own, target)
        else:
            idx = target
        held.used[li] = idx.detach()
        tmap = self._tmaps[(key, ci)]
        real = torch.from_numpy(tmap.sample >= 0)
        nmiss = int((missing.squeeze(-1).cpu() & real).sum())
        self.stats.fallback_rows += nmiss
        self.stats.replayed_rows += int(real.sum()) - nmiss
        if self.on_used is not None:
            self.on_used(key, ci, li, tmap, idx.detach().cpu())
        return scores.gather(1, idx), idx

    def _shape_msg(self, key, ci, li, n_replay, n_router) -> str:
        lid = self.layers[ci][li][1]
        return (f"microbatch {key!r}, decoder layer {lid}: replay data has {n_replay} token "
                f"rows but the router sees {n_router} (the microbatch layout given to the "
                "replayer differs from the batch the model got)")

    def _router_hook(self, router, inp, out):
        ci = router.router_replay._rr_slot[1]
        if self._fwd[ci] is None:          # recompute forward: counted already
            return
        # capacity-factor token dropping runs after replay inside the router: what the
        # experts receive can be fewer than top_k experts per token.
        self.stats.dropped_assignments += out[1].shape[0] * self.schema.top_k - int(out[1].sum())

    def _chunk_output_hook(self, ci: int):
        def hook(module, args, out):
            key = self._fwd[ci]
            if key is None or not torch.is_tensor(out) or not out.requires_grad:
                return None
            self._held[(key, ci)].backward = True

            def begin():
                prev = self._bwd[ci]
                if prev is not None and prev != key:
                    # its backward is over (backwards run one at a time) but no end tag
                    # fired (first layer's input needed no grad): release it now
                    self._release(prev, ci)
                self._bwd[ci] = key
            return _Tag.apply(out, begin)
        return hook

    def _layer_input_hook(self, ci: int):
        def hook(module, args, kwargs):
            key = self._fwd[ci] if self._fwd[ci] is not None else self._bwd[ci]
            if key is None or not torch.is_grad_enabled():
                return None
            hs = kwargs.get("hidden_states", args[0] if args else None)
            if not torch.is_tensor(hs) or not hs.requires_grad:
                return None

            def end():
                if self._bwd[ci] == key:
                    self._bwd[ci] = None
                self._release(key, ci)
            tagged = _Tag.apply(hs, end)
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=tagged)
                return args, kwargs
            return (tagged,) + tuple(args[1:]), kwargs
        return hook


def _first_decoder_layer(chunk: Any):
    m = chunk
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    dec = getattr(m, "decoder", None)
    layers = getattr(dec, "layers", None)
    return layers[0] if layers is not None and len(layers) else None


def _current_shard(config: Any) -> align.Shard:
    from megatron.core import parallel_state as ps
    return align.Shard(cp_size=ps.get_context_parallel_world_size(),
                       cp_rank=ps.get_context_parallel_rank(),
                       tp_size=ps.get_tensor_model_parallel_world_size(),
                       tp_rank=ps.get_tensor_model_parallel_rank(),
                       sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
