"""Weight sync for an SGLang server over its HTTP API, routing-safe.

One call does pause -> update weights -> (flush the prefix cache) -> set the weight version
-> resume, with the same modes as routereplay's vLLM path:

| mode | SGLang | running requests | their routing rows |
|---|---|---|---|
| ``abort`` | ``/pause_generation {"mode": "abort"}`` | aborted | none (no record) |
| ``wait`` | no pause; the update takes SGLang's writer lock, which waits for in-flight requests | finish on the old weights | old version only |
| ``keep`` | ``/pause_generation {"mode": "in_place"}`` | paused, then continue on the new weights with their old KV cache | rows before the switch old, after it new (``weight_versions`` spans) |
| ``retract`` | ``/pause_generation {"mode": "retract"}`` | re-prefilled under the new weights | recomputed: records get ``recomputed`` spans (``num_retractions``); refused unless ``allow_retract=True`` |

The update uses ``flush_cache=True`` (abort, wait) so that no later request is served
prefix rows computed with old weights. NOTE: SGLang cannot flush while requests sit in the
running batch (keep) or the waiting queue (retract), and it asserts the in-update flush
succeeds; in those modes the cache is flushed after resume (``/flush_cache?timeout=``,
waiting for the batch to drain): requests admitted in between can still hit old-weight
prefixes. A version-only bump flushes while paused (abort) or after (wait, keep). If that
late flush fails, weights and version are already committed: the error says so by step.

Sources and the report: :mod:`routereplay.weight_sync` (``FromCheckpoint`` ->
``/update_weights_from_disk``, ``FromTensors(serialized=...)`` ->
``/update_weights_from_tensor``, ``FromDistributed`` -> ``/update_weights_from_distributed``).
Frameworks with their own update path call :meth:`SGLangWeightSync.after_weight_update`
after it. SGLang reloads experts into its current EPLB placement itself, so no replica
refresh follows.

One label per update: :meth:`~SGLangWeightSync.sync` and
:meth:`~SGLangWeightSync.after_weight_update` first read the server's weight version
(:meth:`~SGLangWeightSync.current_version`; SGLang starts at ``"default"``, which counts)
and refuse an update under that label with WeightSyncError before anything is sent that
pauses or changes the server. ``reload_same_version=True`` runs it anyway (a deliberate
reload): the prefix cache is flushed as in any update; the label stays.

Endpoints and fields: SGLang 0.5.23 ``entrypoints/http_server.py`` and
``managers/io_struct.py`` (``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightVersionReqInput``, ``ContinueGenerationReqInput``; ``/model_info``'s
``weight_version``).
"""
from __future__ import annotations

import re
import time
from typing import Any

from engine_patches.sglang import http
from routereplay.errors import ConfigError, RouteReplayError, WeightSyncError
from routereplay.weight_sync import (FromCheckpoint, FromDistributed, FromTensors, SyncReport,
                                     check_mode, check_new_version, check_source)

MODES = ("abort", "wait", "keep", "retract")
_PAUSE = {"abort": "abort", "keep": "in_place", "retract": "retract"}
__all__ = ["SGLangWeightSync", "FromCheckpoint", "FromTensors", "FromDistributed", "SyncReport",
           "WeightSyncError"]
_VERSION_READS = ("/model_info", "/get_model_info")      # SGLang 0.5.23; before /model_info
_NOT_SERVED = re.compile(r": HTTP (404|405|501): ")       # http._exchange's status errors


def _endpoint(source: Any) -> tuple[str, dict[str, Any]]:
    """(endpoint, body) that loads ``source``.

    Raises:
        ConfigError: a source SGLang cannot take (FromTensors without ``serialized``).
    """
    if isinstance(source, FromCheckpoint):
        return "/update_weights_from_disk", {"model_path": source.path,
                                             "load_format": source.load_format}
    if isinstance(source, FromTensors):
        if not source.serialized:
            raise ConfigError(
                "FromTensors for SGLang needs serialized=: one payload per TP rank made with "
                "sglang.srt.utils.MultiprocessingSerializer.serialize(named_tensors, "
                "output_str=True) (SGLang's /update_weights_from_tensor takes no raw tensors)")
        return "/update_weights_from_tensor", {"serialized_named_tensors": list(source.serialized),
                                               "load_format": source.load_format}
    if isinstance(source, FromDistributed):
        return "/update_weights_from_distributed", {
            "names": list(source.names), "dtypes": list(source.dtypes),
            "shapes": [list(x) for x in source.shapes], "group_name": source.group_name,
            **dict(source.extra)}
    check_source(source)
    raise AssertionError("unreachable")


class SGLangWeightSync:
    """HTTP weight sync for one SGLang server.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        timeout: seconds per HTTP call, wall-clock, overall (not per socket read). Replies
            are bounded to ``http.CONTROL_REPLY_BYTES`` (1 MiB); a slower, larger or
            malformed reply is an ``SGLangHTTPError`` (a ``WeightSyncError`` from :meth:`sync`).
        initial_version: if given, set as the server's weight version now
            (:meth:`set_version`).

    Attributes:
        version: the label this object last set on the server (None before any); counts as
            the current version only where the server reports none.
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0,
                 initial_version: str | None = None):
        self.base_url, self.timeout = base_url, timeout
        self.version: str | None = None
        if initial_version is not None:
            self.set_version(initial_version)

    # -- single endpoints
    def _post(self, path: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        return http.call(self.base_url, path, body, timeout=self.timeout, **kw)

    def pause(self, mode: str = "abort") -> Any:
        """``/pause_generation``: mode "abort" | "retract" | "in_place"."""
        return self._post("/pause_generation", {"mode": mode})

    def resume(self) -> Any:
        """``/continue_generation``."""
        return self._post("/continue_generation", {"torch_empty_cache": False})

    def flush_cache(self, timeout_s: float | None = None) -> Any:
        """``/flush_cache`` (fails while requests are running unless ``timeout_s`` lets
        them drain)."""
        return self._post("/flush_cache", None,
                          query="" if timeout_s is None else f"timeout={timeout_s:g}")

    def update_weight_version(self, new_version: str) -> Any:
        """``/update_weight_version`` without aborting requests.

        Raises:
            WeightSyncError: the server answered success=false.
        """
        res = self._post("/update_weight_version", {"new_version": str(new_version),
                                                    "abort_all_requests": False})
        if isinstance(res, dict) and res.get("success") is False:
            raise WeightSyncError(f"/update_weight_version: {res.get('message', 'failed')}")
        self.version = str(new_version)
        return res

    def current_version(self) -> str | None:
        """The server's weight version: ``weight_version`` of ``GET /model_info`` (``GET
        /get_model_info`` where that answers HTTP 404/405/501); where the server reports
        none (neither served, or no such field), :attr:`version`.

        Raises:
            SGLangHTTPError: a read failed otherwise (status, transport, bad reply).
        """
        for path in _VERSION_READS:
            try:
                info = self._post(path, None, method="GET")
            except http.SGLangHTTPError as e:
                if _NOT_SERVED.search(str(e)):
                    continue
                raise
            v = info.get("weight_version") if isinstance(info, dict) else None
            return self.version if v is None else str(v)
        return self.version

    def set_version(self, version: str) -> None:
        """Set the server's weight version without touching weights (e.g. the first
        version, before any rollout): responses then carry it in ``weight_versions``."""
        self.update_weight_version(version)

    def update_weights(self, source: FromCheckpoint | FromTensors | FromDistributed, *,
                       weight_version: str | None, flush_cache: bool = True) -> Any:
        """One ``/update_weights_from_*`` call; raises WeightSyncError on success=false."""
        path, body = _endpoint(source)
        res = self._post(path, {**body, "weight_version": weight_version,
                                "flush_cache": flush_cache, "abort_all_requests": False})
        if isinstance(res, dict) and res.get("success") is False:
            raise WeightSyncError(f"{path}: {res.get('message', 'failed')}")
        if weight_version is not None:
            self.version = str(weight_version)
        return res

    def _check_label(self, version: str, reload_same_version: bool, *,
                     after_update: bool = False) -> None:
        """Read the server's version and refuse ``version`` if it is that one; before
        anything that pauses or changes the server."""
        try:
            current = self.current_version()
        except RouteReplayError as e:
            what = "after_weight_update" if after_update else "weight sync"
            raise WeightSyncError(f"{what} to version {str(version)!r} failed at reading the "
                                  f"server's weight version: {e}. Nothing was sent that pauses "
                                  "or changes the server.") from None
        check_new_version(str(version), current, reload_same_version=reload_same_version,
                          after_update=after_update)

    # -- composable step for frameworks with their own update path
    def after_weight_update(self, version: str, *, drain_timeout_s: float = 60.0,
                            reload_same_version: bool = False) -> SyncReport:
        """What must follow an update the caller made itself (without ``weight_version``):
        set the weight version, then flush the prefix cache (``/flush_cache?timeout=``
        waits for running requests to drain).

        Args:
            reload_same_version: allow ``version`` to be the current one (module doc).
        Raises:
            WeightSyncError: ``version`` is the server's current weight version (without
                ``reload_same_version``; nothing is sent), or naming the failed step; the
                version may already be set.
        """
        rep = SyncReport(version=str(version), mode="none")
        t = time.perf_counter()
        self._check_label(version, reload_same_version, after_update=True)
        step = "/update_weight_version"
        try:
            self.update_weight_version(version)
            rep.calls.append(step)
            rep.seconds["version"] = time.perf_counter() - t
            t = time.perf_counter()
            step = "/flush_cache"
            self.flush_cache(timeout_s=drain_timeout_s)
            rep.calls.append(step)
            rep.seconds["reset"] = time.perf_counter() - t
        except RouteReplayError as e:
            raise WeightSyncError(f"after_weight_update to version {version!r} failed at "
                                  f"{step}: {e}") from None
        return rep

    # -- the whole sequence
    def sync(self, source: FromCheckpoint | FromTensors | FromDistributed | None, version: str, *,
             mode: str = "abort", allow_retract: bool = False,
             drain_timeout_s: float = 60.0, reload_same_version: bool = False) -> SyncReport:
        """Pause, update (or only bump the version when ``source`` is None), resume.

        Args:
            reload_same_version: allow ``version`` to be the current one (module doc).
        Returns:
            the report; ``calls`` lists the endpoints called, in order (not the version
            read before the pause).
        Raises:
            ConfigError: unknown mode, ``retract`` without ``allow_retract``, or a bad
                source (naming it), before anything is sent to the server.
            WeightSyncError: ``version`` is the server's current weight version (without
                ``reload_same_version``) or the version read failed, before the pause; a
                step failed (naming it); a paused server is resumed first.
        """
        check_mode(mode, MODES)
        if mode == "retract" and not allow_retract:
            raise ConfigError("mode='retract' re-prefills running requests under the new weights, "
                              "so their routes no longer match their log-probs (miles #3277); "
                              "use 'abort' or 'keep', or pass allow_retract=True")
        check_source(source, allow_none=True)
        endpoint = None if source is None else _endpoint(source)[0]   # NOTE: before the pause
        self._check_label(version, reload_same_version)
        rep = SyncReport(version=str(version), mode=mode)
        calls = rep.calls
        paused = False
        step = "pause_generation"
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            rep.seconds[name] = rep.seconds.get(name, 0.0) + now - t
            t = now
        try:
            if mode != "wait":
                self.pause(_PAUSE[mode])
                calls.append("/pause_generation")
                paused = True
                lap("pause")
            if source is not None:
                step = "update_weights"
                # NOTE: SGLang asserts the in-update flush succeeds, and it cannot flush with
                # requests running (keep) or queued again (retract): those flush after resume.
                self.update_weights(source, weight_version=version,
                                    flush_cache=mode in ("abort", "wait"))
                calls.append(endpoint)
                lap("update")
            else:
                step = "update_weight_version"
                self.update_weight_version(version)
                calls.append("/update_weight_version")
                lap("version")
                if mode == "abort":                   # idle while paused: flush now
                    step = "flush_cache"
                    self.flush_cache()
                    calls.append("/flush_cache")
                    lap("reset")
            if paused:
                step = "continue_generation"
                self.resume()
                calls.append("/continue_generation")
                paused = False
                lap("resume")
            if mode in ("keep", "retract") or (source is None and mode == "wait"):
                step = "flush_cache"
                self.flush_cache(timeout_s=drain_timeout_s)
                calls.append("/flush_cache")
                lap("reset")
        except BaseException as e:
            if paused:
                try:
                    self.resume()
                except RouteReplayError:
                    pass
            if isinstance(e, (RouteReplayError, OSError)):
                raise WeightSyncError(f"weight sync to version {version!r} failed at {step}: {e}"
                                      + (" The server was resumed." if paused else "")) from None
            raise
        return rep
