"""Routing capture in vLLM's front end: every finished request's routing into a sidecar
stream, one closed, indexed stream per weight version. The public face is
:mod:`engine_patches.vllm.plugin` (``install``, ``rotate``, ``streams``, ...); this module
is its implementation and imports vLLM, so it is imported only once capture is switched on
(ImportError on an unsupported vLLM, from ``engine_patches.vllm.check_vllm_version``).

Where it hooks (vLLM 0.32/0.33, all in the front-end process):

- ``vllm/v1/engine/output_processor.py``: ``RequestState.from_new_request`` (remembers the
  request's ``routed_experts_prompt_start`` and its caller-owned identity) and
  ``RequestState._new_completion_output`` (a finished request's ``CompletionOutput``);
- ``vllm/v1/engine/input_processor.py``: ``InputProcessor.__init__`` (the model config, for
  the routing schema);
- ``LLMEngine.set_weight_version`` and ``AsyncLLM.update_weight_version`` (every weight
  version change): the current stream is closed and the next record opens a new one.

Every patch is undone by :func:`uninstall`; nothing is edited on disk; nothing of ours
reaches vLLM's output loop as an exception (failures are logged, naming the request, and
counted).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import re
import secrets
import socket
import threading
import time
import weakref
from typing import Any

from engine_patches.vllm import check_vllm_version
from engine_patches.vllm.capture_names import (ATTEMPT_ARG, ENV_CODEC, ENV_SIDECAR, SAMPLE_ID_ARG,
                                              SidecarRef, log)
from engine_patches.vllm.records import record_from_parts, sample_key, sampling_from_vllm
from routereplay.errors import ConfigError, RouteReplayError, StreamExistsError
from routereplay.record import SamplingInfo
from routereplay.schema import RoutingSchema
from routereplay.weight_versions import check_version_label

VLLM_VERSION = check_vllm_version()


@dataclasses.dataclass
class StreamInfo:
    """One routing stream of this process.

    Attributes:
        path: the stream's path or URL.
        weight_version: the weight version current while it was written (None: none known).
        records: records written to it.
        closed: True once closed (index and trailer written): readable without a scan.
    """

    path: str
    weight_version: str | None
    records: int
    closed: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _RequestInfo:
    start: int = 0
    sample_id: str | None = None
    attempt: int | None = None
    sampling: SamplingInfo | None = None


def unique_stream_stem(prefix: str) -> str:
    """``<prefix>-<UTC time>-<host>-<pid>-<random>``: a stream name no other process makes.

    NOTE: the pid alone repeats (a container gives the API server the same small pid on
    every start); the host keeps servers on one shared folder apart, the time orders a
    folder's streams, and 48 random bits cover two containers started in the same second.
    The writer also creates every stream exclusively.

    Example: ``vllm-20261202T031500Z-node7-1-3fa9c2d41b07``.
    """
    host = re.sub(r"[^A-Za-z0-9_.]+", "_", socket.gethostname())[:32] or "host"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{prefix}-{stamp}-{host}-{os.getpid()}-{secrets.token_hex(6)}"


class Streamer:
    """Per-process state: schema, the open stream's writer, closed streams, counters."""

    def __init__(self, dest: str, *, reference: bool = False, codec: str | None = None,
                 schema: RoutingSchema | None = None, weight_version: str | None = None):
        self.dest_spec = dest
        self.reference = reference
        self.codec = codec
        self.schema = schema
        self.logprobs_mode = "raw_logprobs"     # ModelConfig.logprobs_mode, set at start-up
        self.base = self._resolve()             # NOTE: a bad destination fails at start-up
        self.lock = threading.RLock()
        self.writer = None
        self.path: str | None = None
        self.seq = 0
        self.version = weight_version           # version of the open (or next) stream
        self.versions_done: set[str] = set()
        self.records = 0
        self.closed: list[StreamInfo] = []
        self.keys: dict[str, str] = {}          # key -> request id, in this version's streams
        self.counts = {"written": 0, "missing": 0, "aborted": 0, "duplicates": 0, "errors": 0}
        self.seconds = 0.0
        self.requests: "weakref.WeakKeyDictionary[Any, _RequestInfo]" = weakref.WeakKeyDictionary()

    # -- streams
    def _resolve(self) -> str:
        """Path of stream 0 of this process: in a folder (local, or a URL ending in ``/``)
        ``<folder>/<unique_stream_stem("vllm")>.rrsc``; a file path where nothing exists
        there yet, else :meth:`_unique_base`.

        Raises:
            RouteReplayError: a local destination whose folder does not exist, a '#' in
                the path; ConfigError: a bad codec (:meth:`check_codec`).
        """
        self.check_codec()
        d = self.dest_spec
        if "#" in d:
            raise RouteReplayError(f"{ENV_SIDECAR}={d!r}: a stream path may not contain '#'")
        if "://" in d:
            return d + unique_stream_stem("vllm") + ".rrsc" if d.endswith("/") else d
        if d.endswith("/") or os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            return os.path.join(d, unique_stream_stem("vllm") + ".rrsc")
        parent = os.path.dirname(os.path.abspath(d))
        if not os.path.isdir(parent):
            raise RouteReplayError(f"{ENV_SIDECAR}={d!r}: folder {parent} does not exist")
        if os.path.lexists(d):
            return self._unique_base(d, "exists (an earlier run's stream, or another "
                                        "API-server process's)")
        return d

    def _unique_base(self, path: str, why: str) -> str:
        """A file destination that is taken: this process's streams get unique names beside
        it (``<stem>-<UTC time>-<host>-<pid>-<random><ext>``), logged once, and nothing is
        ever written over it (several API servers given one file path, or a restart)."""
        stem, ext = os.path.splitext(path)
        base = unique_stream_stem(stem) + (ext or ".rrsc")
        log.warning("routereplay: %s=%s %s: this process writes its streams as %s instead; "
                    "give a folder for one stream per process", ENV_SIDECAR, path, why, base)
        return base

    def check_codec(self) -> None:
        """``ROUTEREPLAY_CODEC`` against the engine column order and, once known, the schema.

        Raises:
            ConfigError: naming the variable and why (an unknown codec; a codec removed in
                0.3.0, with the release that converts it).
        """
        from routereplay.sidecar import writer_codec
        try:
            writer_codec(self.codec, schema=self.schema)
        except ValueError as e:
            raise ConfigError(f"{ENV_CODEC}={self.codec!r}: {e}") from None

    def _path(self, seq: int) -> str:
        """Stream ``seq`` of this process: the base path, then ``<stem>.<seq:04d><ext>``."""
        if seq == 0:
            return self.base
        stem, ext = os.path.splitext(self.base)
        return f"{stem}.{seq:04d}{ext or '.rrsc'}"

    def _writer(self):
        from routereplay.sidecar import SidecarWriter
        if self.writer is None:
            self.path = self._path(self.seq)
            header = {"engine": f"vllm {VLLM_VERSION}", "stream_seq": self.seq}
            if self.version is not None:
                try:
                    header["weight_version"] = check_version_label(self.version)
                except ValueError as e:
                    # NOTE: a label set through the engine's own API (our routes refuse
                    # it): the header stays unlabelled, the records keep the engine's spans
                    log.error("routereplay: stream %s: %s: not in its header", self.path, e)
            # NOTE: with references handed to clients, each frame must be written and
            # flushed before the reference leaves: no background queue then.
            kw = dict(codec=self.codec, background=not self.reference, extra_header=header)
            try:
                self.writer = SidecarWriter(self.path, self.schema, **kw)
            except StreamExistsError:
                # NOTE: created exclusively: another process took the name since start-up
                # (API servers sharing a file path); never written over, a unique base instead
                self.base = self._unique_base(self.base, f"({self.path}) was taken by another "
                                              "process since start-up")
                self.path = self._path(self.seq)
                self.writer = SidecarWriter(self.path, self.schema, **kw)
        return self.writer

    def rotate(self, weight_version: str | None = None) -> str | None:
        """Close the open stream (index written) and label the next one with
        ``weight_version`` (kept when None). Returns the closed stream's path, or None when
        no record was written since the last rotation (no empty stream is made)."""
        with self.lock:
            closed = None
            if self.writer is not None:
                self.writer.close()
                closed = self.path
                self.closed.append(StreamInfo(self.path, self.version, self.records, True))
                if self.version is not None:
                    self.versions_done.add(self.version)
                self.writer, self.path, self.records = None, None, 0
                self.seq += 1
            if weight_version is not None and str(weight_version) != self.version:
                self.version = str(weight_version)
                # NOTE: sample ids are unique per weight version, over all its streams (a
                # trainer reads a version's streams as one): only a new version forgets them
                self.keys = {}
            return closed

    def on_version(self, version: str) -> None:
        """A weight-version change seen in this process: one stream per version."""
        try:
            if str(version) != self.version:
                self.rotate(str(version))
        except Exception as e:  # noqa: BLE001 - never break the caller's version update
            with self.lock:
                self.counts["errors"] += 1
            log.error("routereplay: closing the stream at version %s failed: %s: %s",
                      version, type(e).__name__, e)

    def streams(self) -> list[StreamInfo]:
        with self.lock:
            out = list(self.closed)
            if self.writer is not None:
                out.append(StreamInfo(self.path or "", self.version, self.records, False))
            return out

    # -- records
    def on_new_request(self, state: Any, request: Any) -> None:
        sp = request.sampling_params
        info = _RequestInfo(start=int(getattr(sp, "routed_experts_prompt_start", 0) or 0)
                            if sp else 0)
        extra = getattr(sp, "extra_args", None) or {}
        if extra.get(SAMPLE_ID_ARG) is not None:
            info.sample_id = str(extra[SAMPLE_ID_ARG])
        if extra.get(ATTEMPT_ARG) is not None:
            info.attempt = extra[ATTEMPT_ARG]
        if sp is not None and sp.logprobs is not None:
            try:
                info.sampling = sampling_from_vllm(sp, self.logprobs_mode)
            except RouteReplayError as e:
                # NOTE: the record is still written, its sampling unknown (verify says so)
                log.error("routereplay: request %s: sampling parameters not recorded: %s",
                          getattr(request, "request_id", "?"), e)
        self.requests[state] = info

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
        info = self.requests.get(state) or _RequestInfo()
        rid = str(state.external_req_id)
        uid = info.sample_id if info.sample_id is not None else rid
        if state.parent_req is not None:             # n > 1: one record per completion
            uid = f"{uid}/{state.request_index}"
            rid = f"{rid}/{state.request_index}"
        aborted = str(output.finish_reason) == "abort"
        key = sample_key(uid, info.attempt, aborted=aborted)
        if output.routed_experts is None:
            kind = "aborted" if aborted else "missing"
            with self.lock:
                self.counts[kind] += 1
            if kind == "missing":
                log.error("routereplay: request %s finished without routed_experts (engine "
                          "started without --enable-return-routed-experts?): not written", rid)
            return
        rec = record_from_parts(
            key, self.schema, prompt=list(state.prompt_token_ids or []),
            generated=list(state.detokenizer.output_token_ids),
            routed_experts=output.routed_experts, start=info.start,
            logprobs=state.logprobs_processor.logprobs,
            weight_versions=output.weight_versions,
            num_cached_tokens=int(state.num_cached_tokens or 0),
            engine=f"vllm {VLLM_VERSION}", sampling=info.sampling)
        final = rec.weight_versions[-1].version if rec.weight_versions else None
        with self.lock:
            if self.version is None and self.writer is None:
                self.version = final
            elif final is not None and final != self.version and final not in self.versions_done:
                # NOTE: a version change this process did not see (another API server or a
                # data-parallel front end set it): the record tells.
                self.rotate(final)
            if key in self.keys:
                self.counts["duplicates"] += 1
                log.error("routereplay: sample id %r of request %s was already written to %s by "
                          "request %s: not written (give each attempt its own %s, or a "
                          "distinct %s)", key, rid, self.path, self.keys[key], ATTEMPT_ARG,
                          SAMPLE_ID_ARG)
                return
            w = self._writer()
            w.write(rec)
            self.keys[key] = rid
            self.records += 1
            self.counts["written"] += 1
            path = self.path or ""
        if self.reference:
            output.routed_experts = SidecarRef.make(path, key)

    def flush(self) -> None:
        with self.lock:
            if self.writer is not None:
                self.writer.flush()

    def close(self) -> None:
        self.rotate()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.counts, path=self.path or (self.closed[-1].path if self.closed
                                                        else None),
                        seconds=self.seconds, streams=[s.as_dict() for s in self.streams()])


STREAMER: Streamer | None = None
_SAVED: list[tuple[Any, str, Any]] = []


def _patch(obj: Any, name: str, value: Any) -> None:
    _SAVED.append((obj, name, obj.__dict__[name] if name in obj.__dict__ else getattr(obj, name)))
    setattr(obj, name, value)


def install(dest: str, *, reference: bool = False, codec: str | None = None,
            schema: RoutingSchema | None = None, weight_version: str | None = None) -> Streamer:
    """See :func:`engine_patches.vllm.plugin.install`."""
    global STREAMER
    if STREAMER is not None:
        return STREAMER
    from vllm.v1.engine import input_processor as ip
    from vllm.v1.engine import output_processor as op
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    st = Streamer(dest, reference=reference, codec=codec, schema=schema,
                  weight_version=weight_version)
    STREAMER = st
    orig_ip_init = ip.InputProcessor.__init__
    orig_from_new = op.RequestState.__dict__["from_new_request"].__func__
    orig_new_out = op.RequestState._new_completion_output
    orig_set_version = LLMEngine.set_weight_version
    orig_update_version = AsyncLLM.update_weight_version

    def ip_init(self, vllm_config, *a, **k):
        orig_ip_init(self, vllm_config, *a, **k)
        mc = vllm_config.model_config
        st.logprobs_mode = str(getattr(mc, "logprobs_mode", None) or "raw_logprobs")
        if st.schema is None:
            try:
                st.schema = RoutingSchema.from_hf_config(getattr(mc, "hf_text_config", None)
                                                         or mc.hf_config)
            except RouteReplayError as e:
                log.error("routereplay: %s: routing is not streamed", e)
        if st.schema is not None:
            st.check_codec()        # NOTE: at start-up, not on the first finished request

    def from_new_request(cls, tokenizer, request, *a, **k):
        state = orig_from_new(cls, tokenizer, request, *a, **k)
        try:
            st.on_new_request(state, request)
        except Exception as e:  # noqa: BLE001 - never break request admission
            log.error("routereplay: request %s: %s: %s", getattr(request, "request_id", "?"),
                      type(e).__name__, e)
        return state

    def new_completion_output(self, token_ids, finish_reason, stop_reason):
        out = orig_new_out(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None:
            st.on_finished(self, out)
        return out

    def set_weight_version(self, weight_version, *a, **k):
        res = orig_set_version(self, weight_version, *a, **k)
        st.on_version(weight_version)
        return res

    async def update_weight_version(self, new_version, *a, **k):
        res = await orig_update_version(self, new_version, *a, **k)
        st.on_version(new_version)
        return res

    _patch(ip.InputProcessor, "__init__", ip_init)
    _patch(op.RequestState, "from_new_request", classmethod(from_new_request))
    _patch(op.RequestState, "_new_completion_output", new_completion_output)
    _patch(LLMEngine, "set_weight_version", set_weight_version)
    _patch(AsyncLLM, "update_weight_version", update_weight_version)
    if reference:
        _patch_serving()
    atexit.register(close)
    return st


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


def close() -> None:
    """Close the open stream (index and trailer written). Also runs at exit."""
    if STREAMER is not None:
        STREAMER.close()


def uninstall() -> None:
    """Undo :func:`install` (the open stream is closed first)."""
    global STREAMER
    close()
    while _SAVED:
        obj, name, old = _SAVED.pop()
        setattr(obj, name, old)
    STREAMER = None
