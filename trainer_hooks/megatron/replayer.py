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

- Replay data is keyed by (microbatch key, model chunk), never by call order. Loading a
  microbatch fetches from the routing source (routereplay.source) only this rank's
  samples, token positions (after the context-parallel zig-zag and sequence-parallel split)
  and the chunk's MoE layers, aligns and validates them. A background thread loads the next
  microbatches of the step (``prefetch`` ahead, in the order of ``microbatches``) while the
  current one computes; :meth:`RouterReplayer.microbatch` takes the loaded rows (waiting
  only if they are not ready) and starts one host-to-device copy of them.
- A forward hook wraps the chunk's output in an identity autograd node tagged with the key;
  its backward runs first in that microbatch's backward and tells the routers which
  microbatch the activation-recompute forward belongs to. A pre-hook on the chunk's first
  decoder layer adds a second tag whose backward runs last: the data is released there
  (forward-only passes under ``torch.no_grad()`` release at the end of the forward; with
  grad enabled but no backward, data stays held until the step ends). So a rank holds
  routing only for the microbatches in flight (and the ones prefetched).
- The recompute forward reuses the exact expert ids the first forward used (replayed rows
  and per-token fallback rows alike), so backward follows the forward's path.
- For the duration of :meth:`RouterReplayer.step` only, the ``RouterReplay`` instances of
  the routers this replayer found in the model (looked up again at every step) get their
  own ``get_replay_topk``; the class, other models' routers and megatron's replay state
  (actions, indices, set through ``RouterReplay.set_replay_data`` /
  ``set_global_router_replay_action``) are untouched, and the state of our routers'
  instances is restored on exit. MTP routers keep their own routing (never fed backbone
  routes).
- After each microbatch's forward, every MoE router of the chunk must have selected through
  the replayer (host bookkeeping): a microbatch with routing whose routers were not reached
  (a decoder rebuilt inside the step) is an error naming it, never a silent no-op.
- R2: ``step(None, mbs, record=True)`` records the routing every router used (the trainer's
  own) into a :class:`routereplay.source.TokenRowSource` keyed by (sample, position,
  layer); ``step(recorded.source(), mbs2)`` replays it with the same alignment and checks.

GPU hot path (DESIGN.md): a router call reads nothing back from the device. Which layers
have rows without routing, and how many rows are replayed or fall back, is known on the host
when the microbatch is loaded; the fallback merge is a ``torch.where`` on the device; the
dropped-assignment counter (capacity factor only) accumulates on the device and is read once
when :meth:`RouterReplayer.step` exits. :attr:`RouterReplayer.on_used` is an opt-in
debugging hook that does read back.

Shapes follow the legend in :mod:`routereplay` (N router rows of a rank, L_local MoE layers
of a model chunk, K = top_k, E = num_experts).

Supported: megatron-core 0.16.x-0.19.x (``TransformerConfig.moe_enable_routing_replay``).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import threading
import time
import types
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.errors import (AlignmentError, ConfigError, RouteReplayError, SchemaError,
                                UnknownSampleError)
from routereplay.disaggregation import check_request_key
from routereplay.schema import RoutingSchema, schema_layers_for
from routereplay.source import (NoRouting, RoutingSource, TokenRowSource, as_source,
                                sorted_order_samples, source_token_ids)
from trainer_hooks.megatron.version import MCORE_VERSION

_ABSENT = object()

# own_topk(scores [N, E], topk, num_groups, group_topk, default_compute_topk)
#   -> (probs [N, K], ids int64 [N, K]); megatron's RouterReplay.get_replay_topk arguments.
TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class UnknownMicrobatchError(RouteReplayError, KeyError):
    """``microbatch(key)`` with a key that is not in the step's microbatches (a KeyError,
    as before)."""

    def __str__(self) -> str:          # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class ReplayStateError(RouteReplayError, RuntimeError):
    """The replayer is used in a state where replay would be wrong: a nested or repeated
    ``step()``, ``microbatch()`` outside a step or nested in one of the same chunk, a second
    forward of a microbatch whose backward is pending, two replayers on one model (a
    RuntimeError, as before)."""


def megatron_topk(scores, topk, num_groups, group_topk, default_compute_topk):
    """The trainer's own top-k: megatron's ``_compute_topk`` (the replayer's default
    :attr:`RouterReplayer.own_topk`)."""
    return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One microbatch of the global batch: which records, laid out how.

    Attributes:
        sample_ids: record id of each sample, in batch order (sample j of the layout).
        layout: the trainer's token layout of the microbatch (routereplay.align.Layout).
        tokens: optional host token ids of the microbatch, compared with the records'
            token ids before replay (a mismatch is an error naming the sample and the first
            differing position): the input ids as the layout lays them out (bshd
            ``[b, s]``, THD ``[1, t]``; numpy or a CPU tensor, i.e. the batch before it is
            moved to the device) or, for packed layouts and bshd without padding, one 1-D
            array per sample; kept as one int64 array per sample
            (:func:`routereplay.align.tokens_by_sample`).
    Raises:
        AlignmentError: sample ids that are a string or do not match the layout's sample
            count; tokens that do not match the layout.
    """

    sample_ids: tuple[str, ...]
    layout: align.Layout
    tokens: tuple[np.ndarray, ...] | None = dataclasses.field(default=None, compare=False,
                                                                repr=False)

    def __post_init__(self):
        if isinstance(self.sample_ids, (str, bytes)):
            raise AlignmentError("Microbatch.sample_ids must be a sequence of ids, not a string")
        object.__setattr__(self, "sample_ids", tuple(str(x) for x in self.sample_ids))
        if len(self.sample_ids) != self.layout.batch_size:
            raise AlignmentError(f"microbatch names {len(self.sample_ids)} samples but its "
                                 f"layout has {self.layout.batch_size}")
        if self.tokens is not None:
            object.__setattr__(self, "tokens",
                               tuple(align.tokens_by_sample(self.layout, self.tokens)))

    @classmethod
    def from_attention_mask(cls, sample_ids: Sequence[str], attention_mask: Any, *,
                            input_ids: Any = None, packed: bool = False,
                            multiple: int = 1) -> "Microbatch":
        """A microbatch of a padded batch (verl's bshd layout: left-padded prompt,
        right-padded response), laid out as the trainer feeds it: as is (bshd) or with the
        padding removed and the rows packed (THD, ``packed=True``, segments padded to a
        multiple of ``multiple``); see :meth:`routereplay.align.Layout.from_attention_mask`.

        Args:
            sample_ids: record id of each row.
            attention_mask: host [b, s] 0/1 or bool.
            input_ids: optional host int [b, s]; checked against the records' token ids.
        """
        if isinstance(sample_ids, (str, bytes)):
            raise AlignmentError("Microbatch.from_attention_mask: sample_ids must be a "
                                 "sequence of ids (one per row), not a string")
        layout = align.Layout.from_attention_mask(attention_mask, packed=packed,
                                                  multiple=multiple)
        tokens = None
        if input_ids is not None:
            ids = align.host_array(input_ids, "input_ids")
            mask = align.host_array(attention_mask, "attention_mask")
            if ids.shape != mask.shape:
                raise AlignmentError(f"input_ids {tuple(ids.shape)} and attention_mask "
                                     f"{tuple(mask.shape)} differ in shape")
            # NOTE: bshd: the batch itself, so that the check covers where each sample
            # sits; packed: the rows' tokens in order (the layout packs them as the mask says)
            tokens = [row[m != 0] for row, m in zip(ids, mask)] if packed else ids
        return cls(sample_ids=tuple(sample_ids), layout=layout, tokens=tokens)


@dataclasses.dataclass
class ReplayStats:
    """Counters of one step (read them after :meth:`RouterReplayer.step` exits).

    Attributes:
        bytes_decoded: id bytes this rank fetched from the source (at the record's dtype,
            uint8/uint16): only its samples, token ranges and layers.
        bytes_held: replay id bytes currently held, loaded ahead or in flight
            ([N, L_local, K] per (microbatch, chunk), padding rows included; int16, int32
            above 32767 experts; once on the host or, after the copy, on the model's device).
        peak_bytes_held: maximum of bytes_held during the step (prefetched rows included).
        replayed_rows / fallback_rows: (token, layer) rows that used recorded routing / the
            fallback (padding rows excluded), counted on first forward only.
        dropped_assignments: (token, expert) assignments removed by capacity-factor token
            dropping after replay (0 without a capacity factor).
        microbatches: (microbatch, model chunk) loads in the step.
        prefetched: loads of them that ran on the background thread.
        peak_microbatches_held: most (microbatch, model chunk) entries in flight at once
            (entered and not yet released; prefetched ones not counted).
        load_seconds: time spent fetching, aligning and validating rows, on the background
            thread or in ``microbatch()`` (seconds).
        wait_seconds: time ``microbatch()`` blocked its caller: waiting for, or doing, the
            load, and starting the host-to-device copy (seconds).
        select_seconds: time spent in the routers' replay selection (seconds).
        token_checked_samples: samples whose trainer tokens were compared with the
            records' token ids (microbatches given ``tokens``).
        recorded_rows: (token, layer) rows recorded for R2 (``step(..., record=True)``),
            padding rows excluded.
        sorted_order_samples: samples of the step (with tokens in their layout) whose rows
            the source holds in sorted column order (a stream written with
            ``column_order="sorted"``): replayed with the recorded expert sets but not the
            engine's top-k slot order (:func:`routereplay.source.sorted_order_samples`;
            the step also warns once).
    """

    bytes_decoded: int = 0
    bytes_held: int = 0
    peak_bytes_held: int = 0
    replayed_rows: int = 0
    fallback_rows: int = 0
    dropped_assignments: int = 0
    microbatches: int = 0
    prefetched: int = 0
    peak_microbatches_held: int = 0
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    select_seconds: float = 0.0
    token_checked_samples: int = 0
    recorded_rows: int = 0
    sorted_order_samples: int = 0

    @property
    def blocking_seconds(self) -> float:
        """Time the replayer kept the training loop's thread busy: wait + select (seconds)."""
        return self.wait_seconds + self.select_seconds

    def as_metrics(self, prefix: str = "routereplay/") -> dict[str, float]:
        """The step's counters as a flat ``{name: number}`` dict for a metrics logger
        (``wandb.log(stats.as_metrics(), step=...)``, TensorBoard ``add_scalar`` per item).

        Keys (after ``prefix``): ``replayed_fraction`` / ``fallback_fraction`` (of the
        (token, layer) rows, padding excluded; 0.0 when there were none), ``replayed_rows``,
        ``fallback_rows``, ``dropped_assignments``, ``bytes_decoded`` (bytes),
        ``peak_bytes_held`` (bytes), ``blocking_seconds``, ``wait_seconds``,
        ``select_seconds``, ``load_seconds`` (seconds), ``microbatches``,
        ``token_checked_samples``, ``recorded_rows``, ``sorted_order_samples``.
        """
        rows = self.replayed_rows + self.fallback_rows
        m = {"replayed_fraction": self.replayed_rows / rows if rows else 0.0,
             "fallback_fraction": self.fallback_rows / rows if rows else 0.0,
             "replayed_rows": self.replayed_rows, "fallback_rows": self.fallback_rows,
             "dropped_assignments": self.dropped_assignments,
             "bytes_decoded": self.bytes_decoded, "peak_bytes_held": self.peak_bytes_held,
             "blocking_seconds": self.blocking_seconds, "wait_seconds": self.wait_seconds,
             "select_seconds": self.select_seconds, "load_seconds": self.load_seconds,
             "microbatches": self.microbatches,
             "token_checked_samples": self.token_checked_samples,
             "recorded_rows": self.recorded_rows,
             "sorted_order_samples": self.sorted_order_samples}
        return {prefix + k: v for k, v in m.items()}


class ReplayStep:
    """What :meth:`RouterReplayer.step` yields.

    Attributes:
        stats: the step's :class:`ReplayStats` (final once the step has exited).
        recording: whether the step records routing (``record=True``).
    """

    def __init__(self, stats: ReplayStats, recording: bool):
        self.stats = stats
        self.recording = recording
        self._source: TokenRowSource | None = None

    def source(self) -> TokenRowSource:
        """R2: the routing every router used in the step, keyed by (sample, token position,
        MoE layer), as a routing source for a later ``step()`` (same rank).

        Raises:
            ReplayStateError: the step did not record, has not exited yet, or failed.
        """
        if not self.recording:
            raise ReplayStateError("this step did not record: use step(..., record=True)")
        if self._source is None:
            raise ReplayStateError("the recorded source exists once the recording step has "
                                   "exited without an error")
        return self._source


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


def _expert_bias_masks_experts(router_cls: type) -> bool:
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
class _Loaded:
    """Host side of one (microbatch, chunk), as the loader leaves it."""

    ids: torch.Tensor                  # int16/int32 [N, L_local, K] (pinned for CUDA), -1 = none
    tmap: align.TokenMap
    own_layers: tuple[bool, ...]       # per local layer: some row takes the own top-k
    replayed: tuple[int, ...]          # per local layer: real rows with recorded routing
    fallback: tuple[int, ...]          # per local layer: real rows without

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()


@dataclasses.dataclass
class _Held:
    loaded: _Loaded
    ids: torch.Tensor                  # the loaded ids on the model's device
    used: dict[int, torch.Tensor]      # local layer -> int64 [N, K] selected in forward
    backward: bool = False


class RouterReplayer:
    """Replays recorded routing into megatron-core's routers, microbatch by microbatch.

    Args:
        model: a megatron model chunk or the list of chunks (VPP), possibly DDP-wrapped.
        schema: routing schema of the records (checked against the model's config).
        fallback: for rows without routing: "own" (the trainer's own top-k for that token)
            or "dummy" (K distinct ids per row, for dispatchers that need fixed counts:
            :func:`routereplay.align.fill_dummy`, computed on the host at load time; the
            rows walk the experts round-robin in bit-reversed order from a start hashed from
            the microbatch's sample ids, the CP/SP rank and the layer, so dummy assignments
            spread over expert-parallel ranks, data-parallel ranks and layers instead of
            all starting at expert 0).
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
            ``padding_mask=`` and grad enabled on a model with
            ``moe_router_enable_expert_bias=True`` whose routers mis-apply the padding mask
            (megatron-core 0.16.1-0.19.2: docs/megatron.md, "Padding mask and expert
            bias"), raised before megatron's shape error (or its silent miscount).

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
        cfg = _unwrap_config(self.chunks[0])
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
        # NOTE: megatron-core's own bug (see _expert_bias_masks_experts), refused per forward
        # by a chunk pre-hook with a message naming the ways around it
        self._refuse_padding_mask = bool(getattr(cfg, "moe_router_enable_expert_bias", False)) \
            and any(_expert_bias_masks_experts(type(r))
                    for r in {type(r): r for ch in self.layers for r, _ in ch}.values())
        self._dtype = align.replay_dtype(schema.num_experts)
        self.stats = ReplayStats()
        self._lock = threading.Lock()
        self._active = False
        self._held: dict[tuple[Any, int], _Held] = {}
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
        key = self._fwd[ci]
        recompute = key is None
        if recompute:
            key = self._bwd[ci] if torch._C._current_graph_task_id() != -1 else None
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
        on exit, and megatron's own replay state of its routers is restored.

        On entry, before any compute: the model's routers are found again (a decoder
        rebuilt since the replayer was built is replayed into), and every sample id of the
        step is checked: present in the source (for samples with tokens in their layout)
        and named once in the step.

        Args:
            source: a routing source (routereplay.source.RoutingSource: a
                ``SidecarReader``, ``MultiSidecarReader``, ``InMemorySource``,
                ``TokenRowSource``), a mapping sample id -> RoutingRecord, or None (no
                routing: every row takes the fallback, i.e. the trainer's own routing).
                The prefetch thread is the only one that reads it during the step.
            microbatches: key -> Microbatch, in the order the schedule runs them (a sequence
                is keyed by index); prefetch follows this order.
            shard: this rank's CP/SP place (default: read from megatron's parallel_state
                and the config's sequence_parallel).
            record: R2: record the routing every router used in its first forward
                (the source's rows and fallback rows alike: with ``source=None`` the
                trainer's own routing) into a :class:`routereplay.source.TokenRowSource`,
                returned by ``ReplayStep.source()`` after the step, to replay in a later
                step (with the microbatches' tokens, for its token check).
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
        for layers in self.layers:
            for router, _ in layers:
                other = getattr(router.router_replay, "_rr_slot", None)
                if other is not None:
                    raise ReplayStateError("another RouterReplayer is replaying into this "
                                           "model: one step at a time per model")
        self._source: RoutingSource = as_source(source, self.schema)
        self._mbs = dict(enumerate(microbatches)) if not isinstance(microbatches, Mapping) \
            else dict(microbatches)
        step_ids = self._check_samples()
        self._order = list(self._mbs)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._shard = shard or _current_shard(self.config)
        self._devices = [_chunk_device(layers) for layers in self.layers]
        self._held = {}
        self._pending: dict[tuple[Any, int], concurrent.futures.Future] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
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
            rr.get_replay_topk = functools.partial(self._select, ci, li)
            rr._rr_slot = (self, ci, li)

        hooks = []
        try:
            for ci, ch in enumerate(self.chunks):
                for li, (router, _) in enumerate(self.layers[ci]):
                    patch(router.router_replay, ci, li)
                    if self._count_drops:
                        hooks.append(router.register_forward_hook(self._router_hook))
                hooks.append(ch.register_forward_hook(self._chunk_output_hook(ci)))
                if self._refuse_padding_mask and self.layers[ci]:
                    hooks.append(ch.register_forward_pre_hook(self._padding_mask_hook(ci),
                                                              with_kwargs=True))
                first = _first_decoder_layer(ch)
                if first is not None:
                    hooks.append(first.register_forward_pre_hook(self._layer_input_hook(ci),
                                                                 with_kwargs=True))
            for router in self.mtp_routers:
                patch(router.router_replay, None, None)
            self._active = True
            if self.prefetch:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="routereplay-prefetch")
                for ci in range(len(self.chunks)):
                    self._prefetch_from(0, ci)
            yield handle
            if record:
                handle._source = self._recorded_source()
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
            if self._pool is not None:
                # NOTE: the source is not read after step() returns: queued loads are
                # cancelled, a running one is waited for.
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
            self._pending.clear()
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

    def _check_samples(self) -> list[str]:
        """Every sample of the step with tokens in its layout is in the source, and no
        sample id is named twice (checked at step entry, before any compute). Returns
        those sample ids, in step order."""
        seen: dict[str, tuple[Any, int]] = {}
        missing: list[tuple[str, Any]] = []
        for key, mb in self._mbs.items():
            if not isinstance(mb, Microbatch):
                raise ConfigError(f"microbatch {key!r}: expected a Microbatch, got "
                                  f"{type(mb).__name__}")
            for j, (sid, n) in enumerate(zip(mb.sample_ids, mb.layout.lengths)):
                if n == 0:
                    continue                     # an empty slot: nothing is fetched
                if sid in seen:
                    k0, j0 = seen[sid]
                    raise AlignmentError(f"sample {sid!r} is named twice in the step: "
                                         f"microbatch {k0!r} slot {j0} and microbatch "
                                         f"{key!r} slot {j} (one forward per sample and step)")
                seen[sid] = (key, j)
                check_request_key(sid)           # NOTE: a P/D leg is not a whole request
                if sid not in self._source:
                    missing.append((sid, key))
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            named = ", ".join(f"{sid!r} (microbatch {key!r})" for sid, key in missing[:8])
            raise UnknownSampleError(f"{len(missing)} sample(s) of the step are not in the "
                                     f"routing source: {named}{more}", missing[0][0])
        return list(seen)

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
                the microbatch (an unknown sample,
                corrupt data, AlignmentError from validation or coverage), also one met
                while it was prefetched; RouteReplayError messages are prefixed with the
                microbatch key (and chunk with VPP).
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
        if self._pool is not None:
            self._prefetch_from(self._pos[key] + 1, ci)
        loaded = self._take(key, ci)
        dev = self._devices[ci]
        # NOTE: one copy per (microbatch, chunk), from pinned memory, not waited for: the
        # router kernels that read it are queued behind it on the same stream.
        ids = loaded.ids if dev.type == "cpu" else loaded.ids.to(dev, non_blocking=True)
        self._held[(key, ci)] = _Held(loaded=loaded, ids=ids, used={})
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

    def _check_reached(self, key: Any, ci: int, h: "_Held") -> None:
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

    def _record_used(self, key: Any, ci: int, h: "_Held") -> None:
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

    # -- internals: loading ---------------------------------------------------------------
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

    def _prefetch_from(self, i: int, ci: int) -> None:
        """Queue loads of keys ``i .. i + prefetch - 1`` (step order) of chunk ``ci``."""
        for key in self._order[i:i + self.prefetch]:
            if (key, ci) not in self._pending and (key, ci) not in self._held:
                self._pending[(key, ci)] = self._pool.submit(self._load, key, ci, True)

    def _take(self, key: Any, ci: int) -> _Loaded:
        fut = self._pending.pop((key, ci), None)
        try:
            return fut.result() if fut is not None else self._load(key, ci, False)
        except RouteReplayError as e:
            where = self._where_named(key, ci)
            if e.args and isinstance(e.args[0], str) and not e.args[0].startswith(where):
                e.args = (f"{where}: {e.args[0]}",) + e.args[1:]
            raise
        except Exception as e:
            e.add_note(f"while loading routing for {self._where_named(key, ci)}")
            raise

    def _load(self, key: Any, ci: int, background: bool) -> _Loaded:
        """Fetch, align and validate one (microbatch, chunk): host work only."""
        t0 = time.perf_counter()
        mb = self._mbs[key]
        tmap = self.token_map(key)
        moe_layers = self.record_layers[ci]
        decoded = 0

        def fetch(j: int, runs: list[tuple[int, int]]):
            nonlocal decoded
            rows = self._source.fetch(mb.sample_ids[j], moe_layers, runs)
            decoded += sum(ids.nbytes for ids, _ in rows)
            return rows

        if ci == 0 and mb.tokens is not None and not isinstance(self._source, NoRouting):
            # NOTE: once per microbatch (chunk 0), on the loading thread, before replay
            checked = align.check_tokens(
                mb.layout, mb.tokens, mb.sample_ids,
                lambda j: source_token_ids(self._source, mb.sample_ids[j]))
            with self._lock:
                self.stats.token_checked_samples += checked
        ids = align.gather_rows(tmap, fetch, len(moe_layers), self.schema.top_k, self._dtype)
        lids = [lid for _, lid in self.layers[ci]]
        if self.validate:
            align.check_rows(ids, tmap, self.schema, lids, mb.sample_ids,
                             num_groups=self.num_groups, topk_group=self.topk_group)
        if self.min_coverage and ids.size:
            have, total = align.coverage(ids, tmap)
            if total and have < self.min_coverage * total:
                raise AlignmentError(f"samples {list(mb.sample_ids)}: {have} of {total} token "
                                     f"rows carry routing, below min_coverage="
                                     f"{self.min_coverage}")
        real = tmap.sample >= 0
        miss = ids[..., 0] == align.MISSING if ids.size else \
            np.zeros(ids.shape[:2], bool)                         # [N, L_local]
        fallback = tuple(int(x) for x in (miss & real[:, None]).sum(0))
        replayed = tuple(int(real.sum()) - f for f in fallback)
        if self.fallback == "dummy":
            ids = align.fill_dummy(ids, self.schema.num_experts, mb.sample_ids, lids,
                                   self._shard)
            own = (False,) * ids.shape[1]
        else:
            own = tuple(bool(x) for x in miss.any(0))
        t = torch.from_numpy(ids)
        if self._devices[ci].type == "cuda":
            t = t.pin_memory()
        loaded = _Loaded(ids=t, tmap=tmap, own_layers=own, replayed=replayed, fallback=fallback)
        with self._lock:
            s = self.stats
            s.bytes_decoded += decoded
            s.bytes_held += loaded.nbytes
            s.peak_bytes_held = max(s.peak_bytes_held, s.bytes_held)
            s.microbatches += 1
            s.prefetched += int(background)
            s.load_seconds += time.perf_counter() - t0
        return loaded

    def _release(self, key: Any, ci: int) -> None:
        h = self._held.pop((key, ci), None)
        if h is not None:
            with self._lock:
                self.stats.bytes_held -= h.loaded.nbytes

    # -- internals: router calls ------------------------------------------------------------
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

    def _router_hook(self, router, inp, out):
        # capacity-factor token dropping runs after replay inside the router: what the
        # experts receive can be fewer than top_k experts per token. Summed on the device,
        # read once when the step ends.
        ci = router.router_replay._rr_slot[1]
        if self._fwd[ci] is None:          # recompute forward: counted already
            return
        routing_map = out[1]
        s = routing_map.sum()
        acc = self._routed.get(s.device)
        self._routed[s.device] = s if acc is None else acc + s
        self._expected_routed += routing_map.shape[0] * self.schema.top_k

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

    def _padding_mask_hook(self, ci: int):
        def hook(module, args, kwargs):
            # NOTE: host check of the call's arguments (no device read), before megatron's
            # first MoE layer raises its shape error or miscounts (_expert_bias_masks_experts)
            if kwargs.get("padding_mask") is None or not torch.is_grad_enabled():
                return None
            key = self._fwd[ci]
            where = self._where_named(key, ci) if key is not None else \
                f"model chunk {ci} (outside microbatch())"
            raise ConfigError(
                f"{where}: padding_mask= in a forward with grad enabled, on a model with "
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


def _chunk_device(layers: list[tuple[Any, int]]) -> torch.device:
    """The device a chunk's routers compute on (their weight's), CPU for none."""
    for router, _ in layers:
        w = getattr(router, "weight", None)
        if torch.is_tensor(w):
            return w.device
    return torch.device("cpu")


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
