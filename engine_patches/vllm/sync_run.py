"""Driving one weight sync (or after-update step) on a vLLM engine: the engine calls a
generator yields, each step timed and recorded in the SyncReport, and on failure the error
naming the step and whether the engine was resumed or left paused."""
from __future__ import annotations

import time
from typing import Any, Iterator

from engine_patches.vllm.version_salt import _VersionSalt
from routereplay.errors import WeightSyncError
from routereplay.weight_sync import SyncReport


class _Run:
    """One sync (or after-update step) in progress: drives a call generator, times its
    steps, records the calls, and knows whether the engine must be resumed."""

    def __init__(self, gen: Iterator, rep: SyncReport, salt: _VersionSalt, version: str):
        self.gen, self.rep, self.salt = gen, rep, salt
        self.old_salt = (salt.version, salt.reloads)
        self.version = version
        self.step: str | None = None
        self.t = time.perf_counter()
        self.resume = False          # paused, and to be resumed on exit
        self.touched = False         # a call that writes weights has started

    def next(self, result: Any) -> tuple[str, tuple, dict] | None:
        """Record the last call's result; the next engine call, or None when done."""
        if self.step == "pause":
            self.resume = True
        try:
            item = self.gen.send(result) if self.step else next(self.gen)
        except StopIteration:
            self._lap()
            return None
        step, name, args, kwargs = item[:4]
        writes = item[4] if len(item) > 4 else step not in ("pause", "version")
        if step != self.step:
            if self.step is not None:
                self._lap()
            self.step = step
        self.touched = self.touched or (writes and step != "pause")
        self.rep.calls.append(name if name != "collective_rpc" else f"collective_rpc:{args[0]}")
        return name, args, kwargs

    def _lap(self) -> None:
        now = time.perf_counter()
        self.rep.seconds[self.step] = self.rep.seconds.get(self.step, 0.0) + now - self.t
        self.t = now

    def failed(self, e: Exception) -> WeightSyncError:
        self.salt.version, self.salt.reloads = self.old_salt
        if self.resume and self.touched:
            self.resume = False          # weights may be half updated: stay paused
            return _failed(self.version, self.step, e, paused=True)
        return _failed(self.version, self.step or "pause", e, paused=False,
                       resumed=self.resume)

    def resumed(self) -> None:
        self.rep.seconds["resume"] = time.perf_counter() - self.t


def _failed(version: str, step: str | None, e: Exception, *, paused: bool,
            resumed: bool = True) -> WeightSyncError:
    where = (" The engine is LEFT PAUSED: its weights may be partly updated; sync again, or "
             "resume it knowingly." if paused else
             " The engine was resumed." if resumed else "")
    if isinstance(e, WeightSyncError):
        return WeightSyncError(f"{e}.{where}")
    hint = ""
    if "routereplay_" in str(e) and ("attribute" in str(e) or "not found" in str(e)):
        # NOTE: the natural mistake: an engine built without routereplay's worker methods
        hint = (" The engine's workers lack routereplay's methods: build it with "
                "worker_extension_cls=engine_patches.vllm.worker_extension.WORKER_EXTENSION, "
                "or with_routereplay(YourExtension) if you set your own."
                + (" Until re-packed, the CPU MoE layers compute with stale packed weights."
                   if step == "reprepack" else ""))
    return WeightSyncError(f"weight sync to {version!r} failed at step {step!r}: "
                           f"{type(e).__name__}: {e}.{hint}{where}")


def _drive(engine: Any, run: _Run) -> SyncReport:
    try:
        result = None
        while (call := run.next(result)) is not None:
            name, args, kwargs = call
            result = getattr(engine, name)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any engine failure names the step
        raise run.failed(e) from e
    finally:
        if run.resume:
            engine.wake_up(tags=["scheduling"])
            run.resumed()
    return run.rep


async def _drive_async(engine: Any, run: _Run) -> SyncReport:
    try:
        result = None
        while (call := run.next(result)) is not None:
            name, args, kwargs = call
            result = await getattr(engine, name)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise run.failed(e) from e
    finally:
        if run.resume:
            await engine.resume_generation()
            run.resumed()
    return run.rep
