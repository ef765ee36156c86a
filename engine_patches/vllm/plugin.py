"""vLLM general plugin: stream every finished request's routing into a sidecar.

Registered as the ``vllm.general_plugins`` entry point ``routereplay`` (pyproject.toml), so
vLLM loads it in every process it starts (API server, engine core, workers). It does
nothing unless ``ROUTEREPLAY_SIDECAR`` is set; then, with the engine started with
``--enable-return-routed-experts`` (``LLM(enable_return_routed_experts=True)``), every
finished request of offline ``LLM``, ``AsyncLLM`` and the OpenAI-compatible server is
written as one record (dense layers stripped, token ids, sampled-token log-probs when
requested, weight-version spans over all rows, ``routed_experts_prompt_start`` honoured).

Environment:

- ``ROUTEREPLAY_SIDECAR``: where records go: a file path or fsspec URL (one frontend
  process), or a folder (path ending in ``/`` or an existing folder): one stream per
  frontend process, ``vllm-<pid>.rrsc`` (``vllm serve --api-server-count N`` has N).
- ``ROUTEREPLAY_RESPONSE=reference`` (opt-in): ``CompletionOutput.routed_experts`` becomes a
  :class:`SidecarRef` string ``routereplay:<stream>#<sample id>`` once the record is
  written, so served responses carry that small reference in ``routed_experts`` instead of
  the base64 array. Default: vLLM's outputs and responses are unchanged.
- ``ROUTEREPLAY_CODEC``: routing codec of the stream (default ``ctx-zstd``).

Where it hooks (vLLM 0.32/0.33 ``vllm/v1/engine/output_processor.py``, the front-end place
where a finished request's ``CompletionOutput`` is built): ``RequestState.from_new_request``
(to remember the request's ``routed_experts_prompt_start``) and
``RequestState._new_completion_output`` (finished outputs); ``InputProcessor.__init__``
gives the model's config for the routing schema. Nothing is edited on disk; every patch is
undone by :func:`uninstall`; an unsupported vLLM fails at import (engine_patches.vllm).

A request whose routing is missing or malformed is never written as zeros: it is logged
as an error naming the request and counted (:func:`stats`); no failure of ours reaches
vLLM's output loop. An aborted request keeps the routing of the tokens it did generate and
is written like any other (one without routing is counted as aborted). A sample id seen
before in the stream (e.g. a second offline ``LLM`` in the process numbers its requests
from "0" again) gets a ``~N`` suffix.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from engine_patches.vllm import VLLM_VERSION
from engine_patches.vllm.records import record_from_parts
from routereplay.errors import RouteReplayError
from routereplay.schema import RoutingSchema

ENV_SIDECAR = "ROUTEREPLAY_SIDECAR"
ENV_RESPONSE = "ROUTEREPLAY_RESPONSE"
ENV_CODEC = "ROUTEREPLAY_CODEC"

log = logging.getLogger("routereplay.vllm")


class SidecarRef(str):
    """``routereplay:<stream>#<sample id>``: where a request's routing was written."""

    PREFIX = "routereplay:"

    @classmethod
    def make(cls, stream: str, sample_id: str) -> "SidecarRef":
        return cls(f"{cls.PREFIX}{stream}#{sample_id}")

    @staticmethod
    def parse(ref: str) -> tuple[str, str]:
        """(stream, sample id) of a reference string (split at the first ``#``: sample ids
        may contain ``#``, stream paths may not).

        Raises:
            ValueError: not a routereplay reference.
        """
        if not ref.startswith(SidecarRef.PREFIX) or "#" not in ref:
            raise ValueError(f"not a routereplay sidecar reference: {ref[:80]!r}")
        stream, _, sid = ref[len(SidecarRef.PREFIX):].partition("#")
        return stream, sid


class _Streamer:
    """Per-process state: the schema, the (lazily opened) writer, counters."""

    def __init__(self, dest: str, reference: bool, codec: str | None):
        self.dest_spec = dest
        self.reference = reference
        self.codec = codec
        self.schema: RoutingSchema | None = None
        self.writer = None
        self.path: str | None = None
        self.lock = threading.Lock()
        self.counts = {"written": 0, "missing": 0, "aborted": 0, "errors": 0}
        self.seen: dict[str, int] = {}
        self.seconds = 0.0          # wall time spent in on_finished (record + enqueue)

    def resolve(self) -> str:
        """The stream's path for this process.

        Raises:
            RouteReplayError: a local destination whose folder does not exist, or an
                unknown codec (``ROUTEREPLAY_CODEC``).
        """
        from routereplay.sidecar import writer_codec
        try:
            writer_codec(self.codec)                # the plugin writes engine column order
        except ValueError as e:
            raise RouteReplayError(f"{ENV_CODEC}={self.codec!r}: {e}") from None
        d = self.dest_spec
        if "://" in d:
            return d
        if d.endswith("/") or os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            return os.path.join(d, f"vllm-{os.getpid()}.rrsc")
        parent = os.path.dirname(os.path.abspath(d))
        if not os.path.isdir(parent):
            raise RouteReplayError(f"{ENV_SIDECAR}={d!r}: folder {parent} does not exist")
        if "#" in d:
            raise RouteReplayError(f"{ENV_SIDECAR}={d!r}: a stream path may not contain '#'")
        return d

    def writer_for(self, schema: RoutingSchema):
        from routereplay.sidecar import SidecarWriter
        if self.writer is None:
            self.path = self.resolve()
            self.writer = SidecarWriter(self.path, schema, codec=self.codec,
                                        extra_header={"engine": f"vllm {VLLM_VERSION}"})
        return self.writer

    def on_finished(self, state: Any, output: Any) -> None:
        if self.schema is None:
            return
        t0 = time.perf_counter()
        try:
            self._on_finished(state, output)
        except Exception as e:  # noqa: BLE001 - never break vLLM's output loop
            with self.lock:
                self.counts["errors"] += 1
            log.error("routereplay: request %s: %s: %s (not written)",
                      getattr(state, "external_req_id", "?"), type(e).__name__, e)
        finally:
            self.seconds += time.perf_counter() - t0

    def _on_finished(self, state: Any, output: Any) -> None:
        sid = str(state.external_req_id)
        if state.parent_req is not None:             # n > 1: one record per completion
            sid = f"{sid}/{state.request_index}"
        with self.lock:
            n = self.seen.get(sid, 0)
            self.seen[sid] = n + 1
        if n:
            log.warning("routereplay: sample id %s seen before in this stream: written as %s~%d",
                        sid, sid, n + 1)
            sid = f"{sid}~{n + 1}"
        if output.routed_experts is None:
            key = "aborted" if str(output.finish_reason) == "abort" else "missing"
            with self.lock:
                self.counts[key] += 1
            if key == "missing":
                log.error("routereplay: request %s finished without routed_experts (engine "
                          "started without --enable-return-routed-experts?): not written", sid)
            return
        try:
            rec = record_from_parts(
                sid, self.schema, prompt=list(state.prompt_token_ids or []),
                generated=list(state.detokenizer.output_token_ids),
                routed_experts=output.routed_experts, start=getattr(state, "_rr_start", 0),
                logprobs=state.logprobs_processor.logprobs,
                weight_versions=output.weight_versions,
                num_cached_tokens=int(state.num_cached_tokens or 0),
                engine=f"vllm {VLLM_VERSION}")
            with self.lock:
                w = self.writer_for(self.schema)
                w.write(rec)
                self.counts["written"] += 1
        except RouteReplayError as e:
            with self.lock:
                self.counts["errors"] += 1
            log.error("routereplay: request %s: %s (not written)", sid, e)
            return
        if self.reference:
            output.routed_experts = SidecarRef.make(self.path or "", sid)

    def close(self) -> None:
        with self.lock:
            if self.writer is not None:
                self.writer.close()


_STREAMER: _Streamer | None = None
_SAVED: list[tuple[Any, str, Any]] = []


def stats() -> dict[str, Any]:
    """Counters of this process: written, missing, aborted, errors; the stream path; seconds
    spent on the output path (building and enqueueing records; the writer thread encodes)."""
    if _STREAMER is None:
        return {}
    return dict(_STREAMER.counts, path=_STREAMER.path, seconds=_STREAMER.seconds)


def flush() -> None:
    """Make every record written so far readable (waits for the writer's queue)."""
    if _STREAMER is not None and _STREAMER.writer is not None:
        _STREAMER.writer.flush()


def close() -> None:
    """Close this process's stream (index and trailer written). Also runs at exit."""
    if _STREAMER is not None:
        _STREAMER.close()


def _patch(obj: Any, name: str, value: Any) -> None:
    _SAVED.append((obj, name, obj.__dict__[name] if name in obj.__dict__ else getattr(obj, name)))
    setattr(obj, name, value)


def install(dest: str, *, reference: bool = False, codec: str | None = None,
            schema: RoutingSchema | None = None) -> None:
    """Stream finished requests' routing to ``dest`` in this process (see module doc).

    ``schema``: the model's routing schema, for an engine built before this call (otherwise
    it is taken from the next engine's config). Idempotent: a second call changes nothing.
    """
    global _STREAMER
    if _STREAMER is not None:
        return
    from vllm.v1.engine import input_processor as ip
    from vllm.v1.engine import output_processor as op

    st = _Streamer(dest, reference, codec)
    st.schema = schema
    st.resolve()                # NOTE: a bad destination or codec fails at start-up, not later
    _STREAMER = st
    orig_ip_init = ip.InputProcessor.__init__
    orig_from_new = op.RequestState.__dict__["from_new_request"].__func__
    orig_new_out = op.RequestState._new_completion_output

    def ip_init(self, vllm_config, *a, **k):
        orig_ip_init(self, vllm_config, *a, **k)
        if st.schema is None:
            mc = vllm_config.model_config
            try:
                st.schema = RoutingSchema.from_hf_config(getattr(mc, "hf_text_config", None)
                                                         or mc.hf_config)
            except RouteReplayError as e:
                log.error("routereplay: %s: routing is not streamed", e)

    def from_new_request(cls, tokenizer, request, *a, **k):
        state = orig_from_new(cls, tokenizer, request, *a, **k)
        sp = request.sampling_params
        state._rr_start = int(getattr(sp, "routed_experts_prompt_start", 0) or 0) if sp else 0
        return state

    def new_completion_output(self, token_ids, finish_reason, stop_reason):
        out = orig_new_out(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None:
            st.on_finished(self, out)
        return out

    _patch(ip.InputProcessor, "__init__", ip_init)
    _patch(op.RequestState, "from_new_request", classmethod(from_new_request))
    _patch(op.RequestState, "_new_completion_output", new_completion_output)
    if reference:
        _patch_serving()
    atexit.register(close)


def _patch_serving() -> None:
    """Served responses: a SidecarRef goes out as the string itself (vLLM would np.save it)."""
    import importlib
    for mod_name in ("vllm.entrypoints.openai.completion.serving",
                     "vllm.entrypoints.openai.chat_completion.serving",
                     "vllm.entrypoints.scale_out.token_in_token_out.serving"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        orig = mod.numpy2base64

        def numpy2base64(x, _orig=orig):
            return str(x) if isinstance(x, SidecarRef) else _orig(x)
        _patch(mod, "numpy2base64", numpy2base64)


def uninstall() -> None:
    """Undo :func:`install` (the stream is closed first)."""
    global _STREAMER
    close()
    while _SAVED:
        obj, name, old = _SAVED.pop()
        setattr(obj, name, old)
    _STREAMER = None


def register() -> None:
    """vLLM ``general_plugins`` entry point: install when ``ROUTEREPLAY_SIDECAR`` is set."""
    dest = os.environ.get(ENV_SIDECAR)
    if not dest:
        return
    install(dest, reference=os.environ.get(ENV_RESPONSE, "") == "reference",
            codec=os.environ.get(ENV_CODEC) or None)
