"""Routing replay for megatron-core training steps: per microbatch, keyed, sharded, lazy.

Usage inside an RL trainer (one replayer per model; ``model`` is the list of model chunks
that ``forward_backward_func`` gets, one chunk without VPP)::

    replayer = RouterReplayer(model, schema)
    batches = {k: Microbatch(sample_ids=[...], layout=Layout(...)) for k in range(num_mb)}
    with replayer.step(SidecarReader(path), batches) as step:
        forward_backward_func(forward_step_func=forward_step, model=model, ...)
    logger.log(step.stats.as_metrics())

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        with replayer.microbatch(mb["key"], chunk):
            out = chunk(mb["tokens"], mb["position_ids"], mb["attention_mask"], ...)
        return out, loss_func

How it works (and why it is right under 1F1B, interleaved VPP and activation recompute):

- Replay data is keyed by (microbatch key, model chunk), never by call order; only this
  rank's rows are loaded, ahead of use (trainer_hooks.core.prefetch); autograd tags
  tell a recompute forward's microbatch (trainer_hooks.megatron.router_patch).
- The recompute forward reuses the exact expert ids of the first forward (fallback rows
  too), so backward follows the forward's path.
- After each microbatch's forward, every MoE router of the chunk must have selected through
  the replayer: routers not reached (a decoder rebuilt inside the step) are an error.
- R2: ``step(None, mbs, record=True)`` records the routing every router used (the
  trainer's own) into a :class:`routereplay.source.TokenRowSource`, replayed later by
  ``step(recorded.source(), mbs2)``.

GPU hot path (DESIGN.md): a router call reads nothing back from the device: what is
replayed or falls back is known on the host at load time, the fallback merge is a
``torch.where`` on the device, and the dropped-assignment counter (capacity factor only) is
read once when :meth:`RouterReplayer.step` exits (:attr:`RouterReplayer.on_used`, opt-in,
does read back).

Shapes follow the legend in :mod:`routereplay` (N router rows of a rank, L_local MoE layers
of a model chunk, K = top_k, E = num_experts).

Supported: megatron-core 0.16.x-0.19.x (``TransformerConfig.moe_enable_routing_replay``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.errors import AlignmentError, ConfigError, SchemaError
from routereplay.schema import RoutingSchema, schema_layers_for
from routereplay.source import RoutingSource, TokenRowSource, as_source, sorted_order_samples
from trainer_hooks.megatron.config_checks import (check_config, expert_bias_masks_experts,
                                                  unwrap_config)
from trainer_hooks.core.errors import ReplayStateError, UnknownMicrobatchError
from trainer_hooks.core.microbatch import Held, Microbatch, check_step_samples
from trainer_hooks.core.prefetch import Prefetcher
from trainer_hooks.megatron.router_patch import patched, refuse_patched
from trainer_hooks.core.stats import ReplayStats, ReplayStep

__all__ = ["RouterReplayer", "RouterCall", "megatron_topk", "TopK", "Microbatch", "ReplayStats",
           "ReplayStep", "check_config", "ReplayStateError", "UnknownMicrobatchError"]

# own_topk(scores [N, E], topk, num_groups, group_topk, default_compute_topk)
#   -> (probs [N, K], ids int64 [N, K]); megatron's RouterReplay.get_replay_topk arguments.
TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def megatron_topk(scores, topk, num_groups, group_topk, default_compute_topk):
    """The trainer's own top-k: megatron's ``_compute_topk`` (the replayer's default
    :attr:`RouterReplayer.own_topk`)."""
    return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)


@dataclasses.dataclass(frozen=True)
class RouterCall:
    """What one router is replaying right now (:meth:`RouterReplayer.router_call`).

    Attributes:
        key: the microbatch key.
        chunk: index of the model chunk.
        local_layer: index of the router among the chunk's MoE layers (0 .. L_local - 1).
        layer_id: the router's decoder layer (0-based).
        recompute: True in the activation-recompute forward (inside backward).
        used: int64 [N, K] on the model's device, the experts this router selected in the
            microbatch's first forward (replayed or fallback; None before it ran). Do not
            modify it.
    """

    key: Any
    chunk: int
    local_layer: int
    layer_id: int
    recompute: bool
    used: torch.Tensor | None


class RouterReplayer:
    """Replays recorded routing into megatron-core's routers, microbatch by microbatch.

    Args:
        model: a megatron model chunk or the list of chunks (VPP), possibly DDP-wrapped.
        schema: routing schema of the records (checked against the model's config).
        fallback: for rows without routing: "own" (the trainer's own top-k for that token)
            or "dummy" (K distinct ids per row, :func:`routereplay.align.fill_dummy`).
        validate: check what the layout adds (partial rows, routing on padding, group
            limits) before replay; the ids themselves are checked by the source.
        num_groups, topk_group: group-limited routing to validate against (default from the
            config's moe_router_num_groups / moe_router_group_topk).
        min_coverage: raise if fewer than this share of a microbatch's token rows carry
            routing (0 = no check).
        prefetch: microbatches of each model chunk loaded ahead on a background thread
            (fetch + align + validate), in the order of the step's ``microbatches``; 0 loads
            each one in ``microbatch()``. Prefetched rows count in ``stats.bytes_held``.
    Raises:
        SchemaError: see :func:`check_config`; a router's layer is not an MoE layer of the
            schema.
        ConfigError: a bad ``fallback`` or ``prefetch``. Also, in a step, a model call with
            ``padding_mask=`` and grad enabled where ``moe_router_enable_expert_bias=True``
            routers mis-apply the padding mask (megatron-core 0.16.1-0.19.2:
            docs/megatron.md, "Padding mask and expert bias").

    Attributes:
        layers: per model chunk, ``[(router module, decoder layer id), ...]`` in layer order
            (MTP routers apart, in ``mtp_routers``).
        record_layers: per model chunk, the MoE-axis positions of its layers in the records.
        stats: :class:`ReplayStats` of the current or last step.
        own_topk: the trainer's own top-k, used for fallback rows and MTP routers
            (:func:`megatron_topk`; replace it to experiment, e.g. with tie-breaking noise).
        on_used: optional debugging callback ``(key, chunk, local_layer, token_map,
            used int64 [N, K] on the CPU)`` called once per (microbatch, layer) in the first
            forward; it copies to the host, so it synchronises with the device.
    """

    def __init__(self, model: Any, schema: RoutingSchema, *, fallback: str = "own",
                 validate: bool = True, num_groups: int | None = None,
                 topk_group: int | None = None, min_coverage: float = 0.0, prefetch: int = 2):
        if fallback not in ("own", "dummy"):
            raise ConfigError(f"fallback must be 'own' or 'dummy', got {fallback!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.schema = schema
        self.fallback = fallback
        self.validate = validate
        self.min_coverage = float(min_coverage)
        self.prefetch = prefetch
        cfg = unwrap_config(self.chunks[0])
        check_config(cfg, schema)
        self.config = cfg
        self.num_groups = num_groups or getattr(cfg, "moe_router_num_groups", None)
        self.topk_group = topk_group or getattr(cfg, "moe_router_group_topk", None)
        # NOTE: without a capacity factor megatron drops nothing after the top-k, so the
        # router hook need not count (and launches no kernel).
        self._count_drops = getattr(cfg, "moe_expert_capacity_factor", None) is not None
        self.own_topk: TopK = megatron_topk
        self.on_used: Callable[..., None] | None = None
        self._discover()
        # NOTE: megatron-core's own bug (see expert_bias_masks_experts), refused per forward
        # by a chunk pre-hook with a message naming the ways around it
        self._refuse_padding_mask = bool(getattr(cfg, "moe_router_enable_expert_bias", False)) \
            and any(expert_bias_masks_experts(type(r))
                    for r in {type(r): r for ch in self.layers for r, _ in ch}.values())
        self._dtype = align.replay_dtype(schema.num_experts)
        self.stats = ReplayStats()
        self._lock = threading.Lock()
        self._active = False
        self._held: dict[tuple[Any, int], Held] = {}
        self._fwd: list[Any] = [None] * len(self.chunks)
        self._bwd: list[Any] = [None] * len(self.chunks)

    def _discover(self) -> None:
        """Find the model's MoE routers now (at construction and again at every
        :meth:`step`, so a decoder rebuilt after set-up is replayed into, not bypassed).

        Raises:
            SchemaError: a router without layer_number, or whose layer is not an MoE layer
                of the schema.
        """
        layers: list[list[tuple[Any, int]]] = []
        mtp: list[Any] = []
        for ch in self.chunks:
            mine = []
            for name, m in ch.named_modules():
                if getattr(m, "router_replay", None) is None:
                    continue
                if "mtp" in name.split("."):
                    # NOTE: MTP layers reuse decoder layer numbers (NeMo-RL PR #3903): never
                    # feed them backbone routes.
                    mtp.append(m)
                    continue
                if not getattr(m, "layer_number", None):
                    raise SchemaError(f"router {name} has no layer_number")
                mine.append((m, int(m.layer_number) - 1))
            mine.sort(key=lambda t: t[1])
            layers.append(mine)
        record_layers = [schema_layers_for(self.schema, [lid for _, lid in ch])
                         for ch in layers]
        self.layers, self.mtp_routers, self.record_layers = layers, mtp, record_layers
        self._where: dict[int, tuple[int, int]] = {   # id(router) -> (chunk, local layer)
            id(router): (ci, li) for ci, mine in enumerate(layers)
            for li, (router, _) in enumerate(mine)}

    # -- public read-only views ---------------------------------------------------------
    @property
    def held(self) -> tuple[tuple[Any, int], ...]:
        """(microbatch key, chunk index) of every entry in flight (entered, not released)."""
        return tuple(self._held)

    def router_call(self, router: Any) -> RouterCall | None:
        """What ``router`` is replaying now: call it from the router's own forward hooks
        (checks, debugging). None outside a replayed call (no step, no microbatch, an MTP
        or foreign router)."""
        where = self._where.get(id(router))
        if where is None or not self._active:
            return None
        ci, li = where
        key, recompute = self._key_now(ci)
        held = self._held.get((key, ci)) if key is not None else None
        if held is None:
            return None
        return RouterCall(key=key, chunk=ci, local_layer=li, layer_id=self.layers[ci][li][1],
                          recompute=recompute, used=held.used.get(li))

    def token_map(self, key: Any) -> align.TokenMap:
        """This rank's router rows for microbatch ``key`` of the current step (see
        routereplay.align)."""
        return align.token_map(self._mbs[key].layout, self._shard)

    # -- step -------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, source: Any, microbatches: Mapping[Any, Microbatch] | Sequence[Microbatch],
             shard: align.Shard | None = None, *, record: bool = False
             ) -> Iterator["ReplayStep"]:
        """Replay for one training or log-prob step; every state of the replayer is cleared
        on exit, and megatron's own replay state of its routers is restored. On entry the
        routers are found again and every sample id of the step is checked (in the source,
        named once).

        Args:
            source: a routing source (routereplay.source.RoutingSource), a mapping sample
                id -> RoutingRecord, or None (every row takes the fallback). Only the
                prefetch thread reads it during the step.
            microbatches: key -> Microbatch, in the order the schedule runs them (a sequence
                is keyed by index); prefetch follows this order.
            shard: this rank's CP/SP place (default: read from megatron's parallel_state
                and the config's sequence_parallel).
            record: R2: record the routing every router used in its first forward (replayed
                and fallback rows alike) into a :class:`routereplay.source.TokenRowSource`,
                returned by ``ReplayStep.source()`` after the step.
        Yields:
            a :class:`ReplayStep` (its ``stats``; ``source()`` after a recording step).
        Raises:
            ReplayStateError (a RuntimeError): nested steps, or another replayer replaying
                into this model.
            UnknownSampleError (a KeyError): sample ids missing from the source (names them
                with their microbatch keys).
            AlignmentError: a sample id named twice in the step (names both places).
            RecordError: a prefill/decode leg key (``<uid>#prefill``, ``<uid>#decode``) named
                as a whole request (routereplay.disaggregation.check_request_key).
            ConfigError: ``record`` with ``fallback="dummy"``.
            SchemaError / RecordError / ConfigError: see routereplay.source.as_source.
        """
        if self._active:
            raise ReplayStateError("RouterReplayer.step is not re-entrant")
        if record and self.fallback != "own":
            raise ConfigError("step(record=True) records the trainer's own routing for R2: "
                              "build the replayer with fallback='own'")
        self._discover()
        refuse_patched(self.layers)
        self._source: RoutingSource = as_source(source, self.schema)
        self._mbs = dict(enumerate(microbatches)) if not isinstance(microbatches, Mapping) \
            else dict(microbatches)
        step_ids = check_step_samples(self._mbs, self._source)
        self._shard = shard or _current_shard(self.config)
        self._devices = [_chunk_device(layers) for layers in self.layers]
        self._held = {}
        self._loads: Prefetcher | None = None
        self._fwd = [None] * len(self.chunks)
        self._bwd = [None] * len(self.chunks)
        self._routed: dict[torch.device, torch.Tensor] = {}   # device sums of routing maps
        self._expected_routed = 0
        self._record = record
        self._recorded: list[tuple[Any, int, align.TokenMap, torch.Tensor]] = []
        self.stats = ReplayStats()
        srt = sorted_order_samples(self._source, step_ids)
        self.stats.sorted_order_samples = len(srt)
        if srt:
            # NOTE: once per step (never per router call); stacklevel: the caller's `with`
            more = f" and {len(srt) - 3} more" if len(srt) > 3 else ""
            warnings.warn(
                f"routereplay: {len(srt)} of the step's {len(step_ids)} samples "
                f"({', '.join(map(repr, srt[:3]))}{more}) are held in sorted column order "
                "(a stream written with column_order='sorted'): they replay the recorded "
                "expert sets, but each row's top-k slots are in ascending expert id, not "
                "the engine's order, so what follows slot order (the sum normalising the k "
                "gate weights, engines' combine order, ordered comparisons, R2 recordings) "
                "can differ from the engine's in the last bits: not a bit-exact replay. "
                "Write streams with column_order='engine' (the default) for bit-exact "
                "replay (stats.sorted_order_samples counts these samples)",
                RuntimeWarning, stacklevel=3)
        handle = ReplayStep(self.stats, record)

        try:
            with patched(self):
                self._active = True
                self._loads = Prefetcher(self, self.prefetch)
                yield handle
                if record:
                    handle._source = self._recorded_source()
        finally:
            if self._loads is not None:
                self._loads.close()
                self._loads = None
            self._held.clear()
            self._recorded = []
            self.stats.bytes_held = 0
            if self._routed:
                # the one read-back of the step (capacity factor only)
                routed = sum(int(t.item()) for t in self._routed.values())
                self.stats.dropped_assignments = self._expected_routed - routed
            self._routed = {}
            self._source = None
            self._active = False

    def _recorded_source(self) -> TokenRowSource:
        """The R2 rows of the step as a source (one synchronisation, at step exit, for the
        device-to-host copies started at each microbatch's end)."""
        if any(d.type == "cuda" for d in self._devices):
            torch.cuda.synchronize()
        src = TokenRowSource(self.schema)
        for key, ci, tmap, host in self._recorded:
            mb = self._mbs[key]
            tokens = mb.tokens if ci == 0 else None
            src.add(mb.sample_ids, mb.layout, tmap, host.numpy(), self.record_layers[ci],
                    tokens=tokens)
        return src

    @contextlib.contextmanager
    def microbatch(self, key: Any, chunk: Any = None) -> Iterator[None]:
        """Context for one forward of microbatch ``key`` through ``chunk`` (default: the
        only chunk). Takes this rank's rows for the chunk's layers (loaded ahead, or loaded
        now) and starts their copy to the model's device.

        Raises:
            UnknownMicrobatchError (a KeyError): unknown key. ReplayStateError (a
                RuntimeError): outside a step, nested in a microbatch of the same chunk, or
                a second forward whose first one's backward is pending. An error of loading
                the microbatch (an unknown sample, corrupt data, AlignmentError from
                validation or coverage), also one met while it was prefetched;
                RouteReplayError messages are prefixed with the microbatch key (and chunk).
        """
        if not self._active:
            raise ReplayStateError("RouterReplayer.microbatch outside RouterReplayer.step")
        ci = self._chunk_index(chunk)
        if self._fwd[ci] is not None:
            raise ReplayStateError(f"RouterReplayer.microbatch({key!r}) inside microbatch("
                               f"{self._fwd[ci]!r}) of the same model chunk")
        if key not in self._mbs:
            raise UnknownMicrobatchError(f"microbatch key {key!r} is not in this step's "
                                         f"microbatches ({len(self._mbs)} keys)")
        if (key, ci) in self._held:
            raise ReplayStateError(f"microbatch {key!r} is forwarded a second time while its first "
                               "forward's backward is still pending: one forward per "
                               "microbatch key and model chunk in a step")
        t0 = time.perf_counter()
        self._loads.after(key, ci)
        loaded = self._loads.take(key, ci)
        dev = self._devices[ci]
        # NOTE: one copy per (microbatch, chunk), from pinned memory, not waited for: the
        # router kernels that read it are queued behind it on the same stream.
        ids = loaded.ids if dev.type == "cpu" else loaded.ids.to(dev, non_blocking=True)
        self._held[(key, ci)] = Held(loaded=loaded, ids=ids, used={})
        self.stats.peak_microbatches_held = max(self.stats.peak_microbatches_held,
                                                len(self._held))
        self.stats.wait_seconds += time.perf_counter() - t0
        self._fwd[ci] = key
        try:
            yield
            h = self._held.get((key, ci))
            if h is not None:
                self._check_reached(key, ci, h)
                if self._record:
                    self._record_used(key, ci, h)
        finally:
            self._fwd[ci] = None
            h = self._held.get((key, ci))
            if h is not None and not h.backward:
                self._release(key, ci)      # forward-only pass (or no graph): done

    def _check_reached(self, key: Any, ci: int, h: Held) -> None:
        """After a microbatch's forward: every MoE router of the chunk selected through the
        replayer (host bookkeeping only, no device read). NOTE: a router the replayer does
        not know (model.decoder rebuilt inside the step) routes on its own: the replayed
        rows would silently not be used."""
        n = len(self.layers[ci])
        if len(h.used) == n or not (sum(h.loaded.replayed) or self._record):
            return
        missed = [self.layers[ci][li][1] for li in range(n) if li not in h.used]
        raise ReplayStateError(
            f"{self._where_named(key, ci)}: the forward reached {len(h.used)} of the "
            f"replayer's {n} MoE routers (decoder layers {missed} never selected through it), "
            "so its routing was not replayed there: the model's routers are not the ones "
            "the replayer found when step() was entered (e.g. model.decoder rebuilt), or "
            "the model was not called inside microbatch()")

    def _record_used(self, key: Any, ci: int, h: Held) -> None:
        """R2: start the copy of the experts this microbatch used to the host (non-blocking
        into pinned memory; waited for once, at step exit)."""
        n = len(self.layers[ci])
        if not n:
            return
        used = torch.stack([h.used[li] for li in range(n)], 1).to(
            torch.int16 if self._dtype == np.int16 else torch.int32)       # [N, L_local, K]
        if used.device.type == "cpu":
            host = used.clone()
        else:
            host = torch.empty(used.shape, dtype=used.dtype, pin_memory=True)
            host.copy_(used, non_blocking=True)
        self._recorded.append((key, ci, h.loaded.tmap, host))
        real = int((h.loaded.tmap.sample >= 0).sum())
        self.stats.recorded_rows += real * n

    # -- internals -----------------------------------------------------------------------
    def _chunk_index(self, chunk: Any) -> int:
        if chunk is None:
            if len(self.chunks) != 1:
                raise ConfigError("several model chunks (VPP): pass the chunk to microbatch()")
            return 0
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise ConfigError("microbatch(): chunk is not one of the replayer's model chunks")

    def _where_named(self, key: Any, ci: int) -> str:
        return f"microbatch {key!r}" + (f", model chunk {ci}" if len(self.chunks) > 1 else "")

    def _release(self, key: Any, ci: int) -> None:
        h = self._held.pop((key, ci), None)
        if h is not None:
            with self._lock:
                self.stats.bytes_held -= h.loaded.nbytes

    # -- internals: router calls ------------------------------------------------------------
    def _key_now(self, ci: int) -> tuple[Any, bool]:
        """(microbatch key or None, recompute) of the forward now running through chunk ``ci``."""
        key = self._fwd[ci]
        recompute = key is None
        if recompute:
            # NOTE: outside microbatch(), only an activation-recompute forward (which runs
            # inside autograd's backward) may replay; anything else is a caller error.
            key = self._bwd[ci] if torch._C._current_graph_task_id() != -1 else None
        return key, recompute

    def _current(self, ci: int) -> tuple[Any, Held, bool]:
        key, recompute = self._key_now(ci)
        if key is None or (key, ci) not in self._held:
            raise AlignmentError(
                f"an MoE router of model chunk {ci} ran outside RouterReplayer.microbatch(): "
                "wrap the model call in forward_step with `with replayer.microbatch(key, chunk)`")
        return key, self._held[(key, ci)], recompute

    def _select(self, ci, li, scores, topk, num_groups, group_topk, default_compute_topk):
        if ci is None:       # MTP router: own routing
            return self.own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        t0 = time.perf_counter()
        try:
            return self._select_rows(ci, li, scores, topk, num_groups, group_topk,
                                     default_compute_topk)
        finally:
            self.stats.select_seconds += time.perf_counter() - t0

    def _select_rows(self, ci, li, scores, topk, num_groups, group_topk, default_compute_topk):
        # NOTE: no value of a device tensor is read here (shapes and host data only).
        key, held, recompute = self._current(ci)
        if li in held.used:
            # NOTE: the activation-recompute forward takes exactly the experts of the first
            # forward, fallback rows too.
            idx = held.used[li]
            if idx.shape[0] != scores.shape[0]:
                raise AlignmentError(self._shape_msg(key, ci, li, idx.shape[0], scores.shape[0]))
            return scores.gather(1, idx), idx
        n_rows, _, k = held.ids.shape
        if (n_rows, k) != (scores.shape[0], topk):
            raise AlignmentError(self._shape_msg(key, ci, li, n_rows, scores.shape[0]))
        target = held.ids[:, li].long()
        if held.loaded.own_layers[li]:
            _, own = self.own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            idx = torch.where(target[:, :1] < 0, own, target)
        else:
            idx = target
        held.used[li] = idx.detach()
        self.stats.fallback_rows += held.loaded.fallback[li]
        self.stats.replayed_rows += held.loaded.replayed[li]
        if self.on_used is not None:
            self.on_used(key, ci, li, held.loaded.tmap, idx.detach().cpu())
        return scores.gather(1, idx), idx

    def _shape_msg(self, key, ci, li, n_replay, n_router) -> str:
        lid = self.layers[ci][li][1]
        return (f"microbatch {key!r}, decoder layer {lid}: replay data has {n_replay} token "
                f"rows but the router sees {n_router} (the microbatch layout given to the "
                "replayer differs from the batch the model got)")


def _chunk_device(layers: list[tuple[Any, int]]) -> torch.device:
    """The device a chunk's routers compute on (their weight's), CPU for none."""
    for router, _ in layers:
        w = getattr(router, "weight", None)
        if torch.is_tensor(w):
            return w.device
    return torch.device("cpu")


def _current_shard(config: Any) -> align.Shard:
    from megatron.core import parallel_state as ps
    return align.Shard(cp_size=ps.get_context_parallel_world_size(),
                       cp_rank=ps.get_context_parallel_rank(),
                       tp_size=ps.get_tensor_model_parallel_world_size(),
                       tp_rank=ps.get_tensor_model_parallel_rank(),
                       sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
