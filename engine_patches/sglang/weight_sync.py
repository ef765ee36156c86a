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
prefix rows computed with old weights under the new version. NOTE: SGLang cannot flush
while requests sit in the running batch (keep) or the waiting queue (retract puts them
back there), and it asserts the in-update flush succeeds; in those modes the update goes
without the flush and the cache is flushed after resume (``/flush_cache?timeout=``, which
waits for the batch to drain): requests admitted in between can still hit old-weight
prefixes. A version-only bump flushes while paused (abort) or after (wait, keep). If that
late flush fails, weights and version are already committed: the error says so by step.

Endpoints and fields: SGLang 0.5.23 ``entrypoints/http_server.py`` and
``managers/io_struct.py`` (``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightVersionReqInput``, ``ContinueGenerationReqInput``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from engine_patches.sglang import http
from routereplay.errors import RouteReplayError

MODES = ("abort", "wait", "keep", "retract")
_PAUSE = {"abort": "abort", "keep": "in_place", "retract": "retract"}


class WeightSyncError(RouteReplayError):
    """A weight-sync step failed; the message names the step. The server was resumed."""


@dataclasses.dataclass
class FromDisk:
    """``/update_weights_from_disk``: a checkpoint folder the server can read."""
    model_path: str
    load_format: str | None = None


@dataclasses.dataclass
class FromTensor:
    """``/update_weights_from_tensor``: one serialized (MultiprocessingSerializer, base64)
    named-tensor list per TP rank."""
    serialized_named_tensors: Sequence[str]
    load_format: str | None = None


@dataclasses.dataclass
class FromDistributed:
    """``/update_weights_from_distributed``: tensors broadcast over a weight-update group
    (``/init_weights_update_group`` first)."""
    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    group_name: str = "weight_update_group"


class SGLangWeightSync:
    """HTTP weight sync for one SGLang server.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        timeout: seconds per HTTP call.
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0):
        self.base_url, self.timeout = base_url, timeout

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
        """``/update_weight_version`` without aborting requests."""
        return self._post("/update_weight_version", {"new_version": str(new_version),
                                                     "abort_all_requests": False})

    def update_weights(self, source: FromDisk | FromTensor | FromDistributed, *,
                       weight_version: str | None, flush_cache: bool = True) -> Any:
        """One ``/update_weights_from_*`` call; raises WeightSyncError on success=false."""
        common = {"weight_version": weight_version, "flush_cache": flush_cache,
                  "abort_all_requests": False}
        if isinstance(source, FromDisk):
            path, body = "/update_weights_from_disk", {"model_path": source.model_path,
                                                       "load_format": source.load_format}
        elif isinstance(source, FromTensor):
            path, body = "/update_weights_from_tensor", {
                "serialized_named_tensors": list(source.serialized_named_tensors),
                "load_format": source.load_format}
        elif isinstance(source, FromDistributed):
            path, body = "/update_weights_from_distributed", {
                "names": list(source.names), "dtypes": list(source.dtypes),
                "shapes": [list(s) for s in source.shapes], "group_name": source.group_name}
        else:
            raise TypeError(f"unknown weight source {type(source).__name__}")
        res = self._post(path, {**body, **common})
        if isinstance(res, dict) and res.get("success") is False:
            raise WeightSyncError(f"{path}: {res.get('message', 'failed')}")
        return res

    # -- the whole sequence
    def sync(self, source: FromDisk | FromTensor | FromDistributed | None, version: str, *,
             mode: str = "abort", allow_retract: bool = False,
             drain_timeout_s: float = 60.0) -> list[str]:
        """Pause, update (or only bump the version when ``source`` is None), resume.

        Returns:
            the endpoints called, in order.
        Raises:
            ValueError: unknown mode, or ``retract`` without ``allow_retract``.
            WeightSyncError: a step failed (naming it); a paused server is resumed first.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "retract" and not allow_retract:
            raise ValueError("mode='retract' re-prefills running requests under the new weights, "
                             "so their routes no longer match their log-probs (miles #3277); "
                             "use 'abort' or 'keep', or pass allow_retract=True")
        calls: list[str] = []
        paused = False
        step = "pause_generation"
        try:
            if mode != "wait":
                self.pause(_PAUSE[mode])
                calls.append("/pause_generation")
                paused = True
            if source is not None:
                step = "update_weights"
                # NOTE: SGLang asserts the in-update flush succeeds, and it cannot flush with
                # requests running (keep) or queued again (retract): those flush after resume.
                self.update_weights(source, weight_version=version,
                                    flush_cache=mode in ("abort", "wait"))
                calls.append({FromDisk: "/update_weights_from_disk",
                              FromTensor: "/update_weights_from_tensor",
                              FromDistributed: "/update_weights_from_distributed"}[type(source)])
            else:
                step = "update_weight_version"
                res = self.update_weight_version(version)
                if isinstance(res, dict) and res.get("success") is False:
                    raise WeightSyncError(f"/update_weight_version: {res.get('message', 'failed')}")
                calls.append("/update_weight_version")
                if mode == "abort":                   # idle while paused: flush now
                    step = "flush_cache"
                    self.flush_cache()
                    calls.append("/flush_cache")
            if paused:
                step = "continue_generation"
                self.resume()
                calls.append("/continue_generation")
                paused = False
            if mode in ("keep", "retract") or (source is None and mode == "wait"):
                step = "flush_cache"
                self.flush_cache(timeout_s=drain_timeout_s)
                calls.append("/flush_cache")
        except BaseException as e:
            if paused:
                try:
                    self.resume()
                except RouteReplayError:
                    pass
            if isinstance(e, (RouteReplayError, OSError)):
                raise WeightSyncError(f"weight sync to version {version!r} failed at {step}: {e}") from None
            raise
        return calls
