"""Routing replay for FSDP2 trainers of transformers MoE models: per microbatch, keyed.

Usage (one replayer per model; ``model`` may be wrapped by ``fully_shard``)::

    replayer = FSDPReplayer(model, schema)
    mbs = {k: Microbatch.from_attention_mask(ids_k, mask_k) for k, ...}   # this rank's
    with replayer.step(SidecarReader(path), mbs) as step:
        for k, batch in enumerate(my_microbatches):
            with replayer.microbatch(k):
                loss = loss_fn(model(**batch))
            loss.backward()                     # checkpoint recompute replays the same ids
    logger.log(step.stats.as_metrics())

Router rows are the model's ``hidden_states.reshape(-1, H)``: batch-major for a padded
``[b, s]`` batch, the packed order for ``[1, t]`` (``Layout`` with ``cu_seqlens_padded``),
and with Ulysses sequence parallelism (``ulysses=(rank, size)``) this rank's contiguous
``1/size`` slice of the packed sequence padded to a multiple of ``size`` (verl 0.9.1
verl/utils/ulysses.py ``ulysses_pad_and_slice_inputs``; :func:`ulysses_layout`).
Each rank names only its own microbatches, so it reads only its samples from the source.

Checks: every sample id at step entry (in the source, named once); token identity per
microbatch (``Microbatch.tokens``); rows against the schema; every MoE router reached in a
microbatch's forward; fallback rows counted per layer. The activation-recompute forward
(``torch.utils.checkpoint`` reentrant or not, transformers' gradient checkpointing) takes
exactly the ids of the first forward, fallback rows too: an identity node on the model's
output tells the routers whose backward is running. R2: ``step(None, mbs, record=True)``.

GPU hot path: no device value is read in a router call; one host-to-device copy per
microbatch (non-blocking from pinned memory); fallback is a ``torch.where`` on the device.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.errors import AlignmentError, ConfigError, SchemaError
from routereplay.schema import RoutingSchema, schema_layers_for
from routereplay.source import RoutingSource, TokenRowSource, as_source
from trainer_hooks.fsdp import routers as _routers
from trainer_hooks.core.errors import ReplayStateError, UnknownMicrobatchError
from trainer_hooks.core.microbatch import BackwardTag, Held, Microbatch, check_step_samples
from trainer_hooks.core.prefetch import Prefetcher
from trainer_hooks.core.stats import ReplayStats, ReplayStep

__all__ = ["FSDPReplayer", "hf_token_map", "ulysses_layout"]


def hf_token_map(layout: align.Layout, ulysses: tuple[int, int] | None = None
                 ) -> align.TokenMap:
    """Router rows of a transformers model for ``layout``: bshd ``[b, s]`` flattened
    batch-major (row ``j * s + c``), THD ``[1, t]`` in packed order; with ``ulysses=(rank,
    size)`` rows ``[rank * t / size, (rank + 1) * t / size)`` of the packed ``t`` slots.

    Returns: TokenMap (sample, position int64 [N]; -1 for padding).
    Raises:
        AlignmentError: Ulysses with a bshd layout, or ``t`` not a multiple of ``size``.
    """
    if ulysses is not None and ulysses[1] > 1:
        rank, size = ulysses
        if not layout.packed:
            raise AlignmentError("Ulysses sequence parallelism slices a packed [1, t] "
                                 "sequence: give a packed Layout (ulysses_layout)")
        return align.token_map(layout, align.Shard(cp_size=size, cp_rank=rank,
                                                   cp_layout="contiguous"))
    sample, pos = layout.grid()                      # [s, b] or [t, 1]
    return align.TokenMap(np.ascontiguousarray(sample.T).reshape(-1),
                          np.ascontiguousarray(pos.T).reshape(-1))


def ulysses_layout(lengths: Sequence[int], sp_size: int,
                   first: Sequence[int] | None = None) -> align.Layout:
    """The packed layout of samples of ``lengths`` tokens (no padding between them) whose
    packed axis is padded at the end to a multiple of ``sp_size``, as verl 0.9.1's
    ``ulysses_pad`` pads ``input_ids_rmpad`` before slicing it (verl/utils/ulysses.py)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    t = -(-cu[-1] // sp_size) * sp_size
    return align.Layout(lengths=tuple(int(n) for n in lengths), cu_seqlens_padded=tuple(cu),
                        seq_len=t, first=None if first is None else tuple(first))


class FSDPReplayer:
    """Replays recorded routing into a transformers MoE model's routers, per microbatch.

    Args:
        model: the transformers model (``fully_shard``-wrapped or not).
        schema: routing schema of the records (its MoE layer ids must match the routers').
        fallback: rows without routing: "own" (the router's own top-k) or "dummy".
        validate: check the rows against the schema before replay.
        min_coverage: raise if fewer than this share of a microbatch's rows carry routing.
        prefetch: microbatches loaded ahead on a background thread (0: load in microbatch()).
        ulysses: ``(rank, size)`` of this rank in its Ulysses sequence-parallel group (each
            rank's routers see its slice of the packed sequence); None: no sequence split.
    Raises:
        UnsupportedRouterError: a router class that is not supported (named).
        SchemaError: a router's decoder layer is not an MoE layer of the schema, an MoE
            layer of the schema holds no supported router, or the model's top_k / expert
            count differ from the schema's.
    """

    def __init__(self, model: torch.nn.Module, schema: RoutingSchema, *,
                 fallback: str = "own", validate: bool = True, min_coverage: float = 0.0,
                 prefetch: int = 2, ulysses: tuple[int, int] | None = None):
        if ulysses is not None and not (len(ulysses) == 2 and 0 <= ulysses[0] < ulysses[1]):
            raise ConfigError(f"ulysses must be (rank, size) with 0 <= rank < size, got "
                              f"{ulysses!r}")
        self.ulysses = None if ulysses is None else (int(ulysses[0]), int(ulysses[1]))
        if fallback not in ("own", "dummy"):
            raise ConfigError(f"fallback must be 'own' or 'dummy', got {fallback!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.model = model
        self.chunks = [model]
        self.schema = schema
        self.fallback, self.validate, self.prefetch = fallback, validate, prefetch
        self.min_coverage = float(min_coverage)
        self.layers = [_routers.find_routers(model)]
        for r, lid in self.layers[0]:
            if r.top_k != schema.top_k or r.num_experts != schema.num_experts:
                raise SchemaError(f"decoder layer {lid}: router top_k={r.top_k}, experts="
                                  f"{r.num_experts}; schema top_k={schema.top_k}, experts="
                                  f"{schema.num_experts}")
        missing = sorted(set(schema.moe_layer_ids) - {lid for _, lid in self.layers[0]})
        if missing:
            # NOTE: a gate class not recognised as a router (e.g. remote-code MoEGate) would
            # otherwise route on its own, silently
            raise SchemaError(f"decoder layers {missing} are MoE layers of the schema but hold "
                              f"no supported router (supported: "
                              f"{', '.join(_routers.SUPPORTED_ROUTERS)}): refusing to run them "
                              "without replay")
        self.record_layers = [schema_layers_for(schema, [lid for _, lid in self.layers[0]])]
        r0 = self.layers[0][0][0]
        self.num_groups = getattr(r0, "num_group", None)
        self.topk_group = getattr(r0, "topk_group", None)
        self._where = {id(r): li for li, (r, _) in enumerate(self.layers[0])}
        self._dtype = align.replay_dtype(schema.num_experts)
        self._shard = align.Shard() if self.ulysses is None else align.Shard(
            cp_size=self.ulysses[1], cp_rank=self.ulysses[0], cp_layout="contiguous")
        self._lock = threading.Lock()
        self._active = False
        self._held: dict[tuple[Any, int], Held] = {}
        self._fwd: Any = None
        self._bwd: Any = None
        self._last: Any = None
        self._step_no = 0
        self._tagged: set[Any] = set()
        self._begun: set[Any] = set()
        # NOTE: the identity tag goes on the model's output and on its decoder's (a trainer
        # with its own head or fused loss calls model.model): the tag of the output whose
        # backward runs says whose recompute follows
        base = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
        self._tag_modules = [model] + ([base] if isinstance(base, torch.nn.Module)
                                       and base is not model else [])
        self.stats = ReplayStats()

    @property
    def held(self) -> tuple[Any, ...]:
        """Keys of the microbatches in flight (entered, backward not over)."""
        return tuple(k for k, _ in self._held)

    # -- views used by the shared loader (trainer_hooks.core.prefetch) ---------------
    def token_map(self, key: Any) -> align.TokenMap:
        """This rank's router rows for microbatch ``key`` (:func:`hf_token_map`)."""
        return hf_token_map(self._mbs[key].layout, self.ulysses)

    def _where_named(self, key: Any, ci: int = 0) -> str:
        return f"microbatch {key!r}"

    # -- step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, source: Any, microbatches: Mapping[Any, Microbatch] | Sequence[Microbatch],
             *, record: bool = False) -> Iterator[ReplayStep]:
        """Replay for one step (log-prob or update); all state is cleared on exit and the
        routers are un-patched.

        Args:
            source: a routing source, a mapping sample id -> RoutingRecord, or None.
            microbatches: this rank's key -> Microbatch, in run order (a sequence is keyed
                by index).
            record: R2: record the routing every router used into a TokenRowSource
                (``ReplayStep.source()`` after the step).
        Raises:
            ReplayStateError: nested steps. UnknownSampleError: sample ids missing from the
                source (named with their microbatch). AlignmentError: a sample named twice.
            ConfigError: ``record`` with ``fallback="dummy"``; a router already patched.
        """
        if self._active:
            raise ReplayStateError("FSDPReplayer.step is not re-entrant")
        if record and self.fallback != "own":
            raise ConfigError("step(record=True) needs fallback='own'")
        self._source: RoutingSource = as_source(source, self.schema)
        self._mbs = dict(enumerate(microbatches)) if not isinstance(microbatches, Mapping) \
            else dict(microbatches)
        check_step_samples(self._mbs, self._source)
        w = self.layers[0][0][0].weight
        self._devices = [w.device]
        self._held, self._fwd, self._bwd, self._last = {}, None, None, None
        self._step_no += 1
        self._tagged, self._begun = set(), set()
        self._record = record
        self._recorded: list[tuple[Any, align.TokenMap, torch.Tensor]] = []
        self._loads = None
        self.stats = ReplayStats()
        handle = ReplayStep(self.stats, record)
        hooks = [m.register_forward_hook(self._output_hook) for m in self._tag_modules]
        try:
            with _routers.patched([r for r, _ in self.layers[0]], self._select):
                self._active = True
                self._loads = Prefetcher(self, self.prefetch)
                yield handle
                pending = sorted(map(repr, self._tagged - self._begun))
                if pending:
                    # NOTE: its backward after the step would recompute (checkpointing)
                    # with the routers un-patched: the router's own routing, silently
                    raise ReplayStateError(
                        f"microbatches {', '.join(pending)} ran a forward with grad inside "
                        "step() but their backward did not start before step() ended: call "
                        "backward inside step(), on the output of the model given to "
                        "FSDPReplayer (or of its decoder)")
                if record:
                    handle._source = self._recorded_source()
        finally:
            for hook in hooks:
                hook.remove()
            if self._loads is not None:
                self._loads.close()
            self._held.clear()
            self._recorded = []
            self.stats.bytes_held = 0
            self._source = None
            self._active = False

    @contextlib.contextmanager
    def microbatch(self, key: Any) -> Iterator[None]:
        """Context for the forward of microbatch ``key``: takes its rows (loaded ahead or
        now) and starts their one copy to the model's device.

        Raises:
            UnknownMicrobatchError: unknown key. ReplayStateError: outside a step, nested,
                a second forward of the key in the step, or a router not reached.
            Loading errors (AlignmentError, UnknownSampleError...) prefixed with the key.
        """
        if not self._active:
            raise ReplayStateError("FSDPReplayer.microbatch outside FSDPReplayer.step")
        if self._fwd is not None:
            raise ReplayStateError(f"microbatch({key!r}) inside microbatch({self._fwd!r})")
        if key not in self._mbs:
            raise UnknownMicrobatchError(f"microbatch key {key!r} is not in this step's "
                                         f"microbatches ({len(self._mbs)} keys)")
        if (key, 0) in self._held:
            raise ReplayStateError(f"microbatch {key!r} is forwarded a second time in the "
                                   "step: one forward per microbatch key")
        t0 = time.perf_counter()
        self._loads.after(key, 0)
        loaded = self._loads.take(key, 0)
        dev = self._devices[0]
        # NOTE: the one host-to-device copy of the microbatch, not waited for
        ids = loaded.ids if dev.type == "cpu" else loaded.ids.to(dev, non_blocking=True)
        self._held[(key, 0)] = Held(loaded=loaded, ids=ids, used={})
        self.stats.peak_microbatches_held = max(self.stats.peak_microbatches_held,
                                                len(self._held))
        self.stats.wait_seconds += time.perf_counter() - t0
        self._fwd = key
        grad = torch.is_grad_enabled()
        try:
            yield
            h = self._held[(key, 0)]
            if grad:
                # NOTE: a backward may follow (also when a whole-model reentrant checkpoint
                # ran the forward under no_grad, leaving no output to tag): held until
                # another microbatch's backward begins or the step ends
                h.backward = True
                self._last = key
            self._check_reached(key, h)
            if self._record:
                self._record_used(key, h)
        finally:
            self._fwd = None
            h = self._held.get((key, 0))
            if h is not None and not h.backward:
                self._release(key)

    # -- internals -------------------------------------------------------------------------
    def _release(self, key: Any) -> None:
        h = self._held.pop((key, 0), None)
        if h is not None:
            with self._lock:
                self.stats.bytes_held -= h.loaded.nbytes

    def _output_hook(self, module, args, out):
        key = self._fwd
        if key is None:
            return None
        name = "logits" if getattr(out, "logits", None) is not None else None
        t = out[name] if name else (out[0] if isinstance(out, (tuple, list)) or
                                    hasattr(out, "keys") else out)
        if not torch.is_tensor(t) or not t.requires_grad:
            return None

        step_no = self._step_no
        self._tagged.add(key)

        def begin():
            if not self._active or self._step_no != step_no:
                raise ReplayStateError(
                    f"the backward of microbatch {key!r} runs after its FSDPReplayer.step() "
                    "ended: its recompute would not replay; call backward inside step()")
            self._begun.add(key)
            prev = self._bwd
            if prev is not None and prev != key:
                self._release(prev)          # its backward is over
            self._bwd = key
        tagged = BackwardTag.apply(t, begin)
        if name:
            out[name] = tagged
            return out
        if torch.is_tensor(out):
            return tagged
        if hasattr(out, "keys"):
            out[next(iter(out.keys()))] = tagged
            return out
        return type(out)((tagged, *out[1:]))

    def _check_reached(self, key: Any, h: Held) -> None:
        n = len(self.layers[0])
        if len(h.used) == n:
            return
        missed = [self.layers[0][li][1] for li in range(n) if li not in h.used]
        raise ReplayStateError(
            f"microbatch {key!r}: the forward reached {len(h.used)} of the replayer's {n} MoE "
            f"routers (decoder layers {missed} never selected through it): the model called "
            "is not the one the replayer was built on, or it ran outside microbatch()")

    def _select(self, router: torch.nn.Module, choice: torch.Tensor) -> torch.Tensor:
        """Ids for one router call (int64 [N, K]); no device value is read."""
        t0 = time.perf_counter()
        li = self._where[id(router)]
        key = self._fwd
        if key is None and torch._C._current_graph_task_id() != -1:
            # the activation-recompute forward: the microbatch whose output's backward
            # began, else the last one run with grad (reentrant whole-model checkpoint)
            key = self._bwd if self._bwd is not None else self._last
        held = self._held.get((key, 0)) if key is not None else None
        lid = self.layers[0][li][1]
        if held is None:
            raise AlignmentError(f"decoder layer {lid}: an MoE router ran outside "
                                 "FSDPReplayer.microbatch(): wrap the model call in "
                                 "`with replayer.microbatch(key)`")
        if li in held.used:                   # recompute: exactly the first forward's ids
            idx = held.used[li]
            if idx.shape[0] != choice.shape[0]:
                raise AlignmentError(self._shape_msg(key, lid, idx.shape[0], choice.shape[0]))
            self.stats.select_seconds += time.perf_counter() - t0
            return idx
        n_rows = held.ids.shape[0]
        if n_rows != choice.shape[0]:
            raise AlignmentError(self._shape_msg(key, lid, n_rows, choice.shape[0]))
        target = held.ids[:, li].long()
        if held.loaded.own_layers[li]:
            own = _routers.own_topk(router, choice.detach())
            idx = torch.where(target[:, :1] < 0, own, target)
        else:
            idx = target
        held.used[li] = idx
        self.stats.fallback_rows += held.loaded.fallback[li]
        self.stats.replayed_rows += held.loaded.replayed[li]
        self.stats.select_seconds += time.perf_counter() - t0
        return idx

    def _shape_msg(self, key, lid, n_replay, n_router) -> str:
        return (f"microbatch {key!r}, decoder layer {lid}: replay data has {n_replay} token "
                f"rows but the router sees {n_router} (the microbatch layout given to the "
                "replayer differs from the batch the model got)")

    def _record_used(self, key: Any, h: Held) -> None:
        n = len(self.layers[0])
        used = torch.stack([h.used[li] for li in range(n)], 1).to(
            torch.int16 if self._dtype == np.int16 else torch.int32)
        if used.device.type == "cpu":
            host = used.clone()
        else:
            host = torch.empty(used.shape, dtype=used.dtype, pin_memory=True)
            host.copy_(used, non_blocking=True)
        self._recorded.append((key, h.loaded.tmap, host))
        self.stats.recorded_rows += int((h.loaded.tmap.sample >= 0).sum()) * n

    def _recorded_source(self) -> TokenRowSource:
        if self._devices[0].type == "cuda":
            torch.cuda.synchronize()
        src = TokenRowSource(self.schema)
        for key, tmap, host in self._recorded:
            mb = self._mbs[key]
            src.add(mb.sample_ids, mb.layout, tmap, host.numpy(), self.record_layers[0],
                    tokens=mb.tokens)
        return src
