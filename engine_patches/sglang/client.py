"""Ask SGLang for routing and stream it into a sidecar: an asyncio HTTP client for RL
rollouts (thousands of concurrent requests) and its blocking twin.

    async with AsyncSGLangRoutingClient("http://127.0.0.1:30000", schema, writer,
                                        max_concurrency=256) as client:
        results = await client.generate_many(payloads, sample_ids=uids)   # [(response, record)]
        resp, rec = await client.generate(payload, sample_id="uid-7")

    client = SGLangRoutingClient("http://127.0.0.1:30000", schema, writer)    # blocking
    resp, rec = client.generate({"input_ids": ids, "sampling_params": {...}})
    # multi-turn: the next turn asks only for rows not yet stored
    resp2, rec2 = client.generate({"input_ids": ids + out + user}, start_len=next_start(rec, ids + out + user))

Both run on httpx (the ``sglang`` extra): one keep-alive pool per client, at most
``max_concurrency`` requests in flight, retries with exponential backoff on transport
errors and HTTP 502/503/504 (any other failure fails at once, naming the request). Every
attempt has a wall-clock deadline and a reply-size bound derived from the request
(:func:`reply_bound`), so a slow, endless or hostile reply costs neither unbounded time nor
memory (engine_patches.sglang.http). Responses are decoded on a worker thread and each
record is written as soon as it is decoded (writes serialised); a response without routing
raises RecordError naming the request and the server flag.

NOTE: a retried ``/generate`` may run twice on the server (the first attempt's reply was
lost); only one reply is used, so the record is still that of one generation.
"""
from __future__ import annotations

import asyncio
import copy
import json
import random
import threading
import weakref
from typing import Any, Mapping, Sequence

from engine_patches.sglang import http
from engine_patches.sglang.records import MAX_LINE_BYTES, record_from_response
# NOTE: re-exported (the client's name since 0.1); token-aware: next_start(prev, new_prompt_ids)
from routereplay.multi_turn import next_start  # noqa: F401
from routereplay.record import RoutingRecord, SamplingInfo, sampling_from_sglang
from routereplay.errors import ConfigError
from routereplay.schema import RoutingSchema

RETRY_STATUS = http.RETRY_STATUS
REPLY_BYTES_PER_TOKEN = 1024       # a token's text, id and logprob entries (JSON), routing aside
REPLY_BYTES_PER_TOP_LOGPROB = 128  # one [logprob, id, text] alternative of a token
REPLY_FIXED_BYTES = 1 << 20        # meta_info and the rest of the body
TEMPLATE_TOKENS = 1024             # tokens a chat template may add to a text prompt


def with_routing(payload: Mapping[str, Any], start_len: int = 0) -> dict[str, Any]:
    """A copy of a ``/generate`` or OpenAI request body asking for routing.

    Sets ``return_routed_experts=True`` and ``routed_experts_start_len`` (absolute token
    position of the first row; 0 = the whole sequence). Over the OpenAI endpoints these are
    top-level body fields (the OpenAI Python client sends them through ``extra_body``).
    """
    p = copy.deepcopy(dict(payload))
    p["return_routed_experts"] = True
    p["routed_experts_start_len"] = int(start_len)
    return p


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def reply_bound(payload: Mapping[str, Any], schema: RoutingSchema, *, kind: str = "generate",
                num_fused_shared_experts: int = 0) -> int | None:
    """A generous bound (bytes) on the reply to ``payload``, or None when the request states
    no output length.

    T = prompt tokens + the stated output length (``sampling_params.max_new_tokens``;
    OpenAI: ``max_completion_tokens`` or ``max_tokens``). Prompt tokens: ``len(input_ids)``
    (or an OpenAI ``prompt`` of ids); for text, the request body's UTF-8 bytes (at most one
    token per byte) plus ``TEMPLATE_TOKENS``. Bound: base64 (4/3) of int32 ``[T,
    num_hidden_layers, top_k + num_fused_shared_experts]``, plus per token
    ``REPLY_BYTES_PER_TOKEN`` and ``REPLY_BYTES_PER_TOP_LOGPROB`` per top-logprob asked
    for, plus ``REPLY_FIXED_BYTES``.
    """
    if kind == "generate":
        sp = payload.get("sampling_params")
        new = _count(sp.get("max_new_tokens")) if isinstance(sp, Mapping) else None
        ids = payload.get("input_ids")
    else:
        new = _count(payload.get("max_completion_tokens"))
        new = _count(payload.get("max_tokens")) if new is None else new
        ids = payload.get("prompt") if kind == "completions" else None
    if new is None:
        return None
    if isinstance(ids, list) and all(_count(t) is not None for t in ids):
        prompt = len(ids)
    else:
        prompt = len(json.dumps(payload, ensure_ascii=False).encode()) + TEMPLATE_TOKENS
    top = max([_count(payload.get(k)) or 0 for k in ("top_logprobs_num", "top_logprobs",
                                                       "logprobs")])
    tokens = prompt + new
    row = 4 * schema.num_hidden_layers * (schema.top_k + num_fused_shared_experts)
    return (4 * -(-tokens * row // 3) + tokens * (REPLY_BYTES_PER_TOKEN
                                                 + REPLY_BYTES_PER_TOP_LOGPROB * top)
            + REPLY_FIXED_BYTES)


def _route(payload: Mapping[str, Any], start_len: int, kind: str) -> tuple[str, dict, Any]:
    """(endpoint, body, prompt ids or None) of one request."""
    if kind not in ("generate", "completions", "chat"):
        raise ConfigError(f"unknown request kind {kind!r}")
    if payload.get("stream"):
        # NOTE: a streamed reply is server-sent events, not one JSON body; without this it
        # would fail only after the whole generation, as "reply is not JSON"
        raise ConfigError("the payload asks for stream=True: this client reads one JSON reply "
                          "per request; read the stream yourself and pass its chunks to "
                          "engine_patches.sglang.records.record_from_stream")
    path = {"generate": "/generate", "completions": "/v1/completions",
            "chat": "/v1/chat/completions"}[kind]
    ids = payload.get("input_ids") if kind == "generate" else None
    return path, with_routing(payload, start_len), ids if isinstance(ids, list) else None


def _check_policy(max_concurrency: int, retries: int, timeout: float,
                  max_reply_bytes: int | None) -> None:
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
    if not timeout or timeout <= 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
    if max_reply_bytes is not None and not _count(max_reply_bytes):
        raise ConfigError(f"max_reply_bytes must be an integer >= 1, got {max_reply_bytes!r}")


def _backoff(attempt: int, base: float) -> float:
    """Exponential backoff with jitter (seconds) before retry ``attempt`` (1-based)."""
    return base * (2 ** (attempt - 1)) * (0.5 + random.random())


class AsyncSGLangRoutingClient:
    """Concurrent requests to an SGLang server with routing on; records go to ``writer``.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        schema: the served model's routing schema.
        writer: a SidecarWriter (or None to only return records).
        max_concurrency: requests in flight at most (and pooled connections).
        timeout: seconds per request attempt, wall-clock, overall (not per socket read).
        connect_timeout: seconds for connecting, within ``timeout``.
        retries: extra attempts after a transport error, a missed deadline or HTTP
            502/503/504.
        backoff_s: first retry delay (doubled each retry, with jitter).
        num_fused_shared_experts: fused shared-expert columns the server's payload carries
            per row (0 for SGLang 0.5.23).
        max_reply_bytes: bound on every reply body (bytes), instead of :func:`reply_bound`
            (or ``records.MAX_LINE_BYTES``, 1 GiB, for requests that state no output
            length); for replies it does not foresee (e.g. ``return_hidden_states``).
        client: an ``httpx.AsyncClient`` to use instead of the client's own pool.
    Raises:
        ConfigError: a bad policy value.

    Use as ``async with``, or call :meth:`aclose`.
    """

    def __init__(self, base_url: str, schema: RoutingSchema, writer: Any = None, *,
                 max_concurrency: int = 64, timeout: float = 600.0,
                 connect_timeout: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 num_fused_shared_experts: int = 0, max_reply_bytes: int | None = None,
                 client: Any = None):
        _check_policy(max_concurrency, retries, timeout, max_reply_bytes)
        httpx = http.httpx_module()
        self.base_url, self.schema, self.writer, self.timeout = base_url, schema, writer, timeout
        self.retries, self.backoff_s = retries, backoff_s
        self.num_fused_shared_experts = num_fused_shared_experts
        self.max_reply_bytes = max_reply_bytes
        self._own = client is None
        self._client = client if client is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)),
            limits=httpx.Limits(max_connections=max_concurrency,
                                max_keepalive_connections=max_concurrency))
        self._sem = asyncio.Semaphore(max_concurrency)
        self._wlock = asyncio.Lock()
        self.stats = {"requests": 0, "retries": 0, "records": 0}

    async def __aenter__(self) -> "AsyncSGLangRoutingClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (if the client made it)."""
        if self._own:
            await self._client.aclose()

    async def post(self, path: str, body: dict[str, Any], *, max_reply_bytes: int | None = None,
                   name: str | None = None) -> Any:
        """POST with the concurrency bound, deadline and retries; the decoded JSON.

        Args:
            max_reply_bytes: bound on this reply (bytes); the client's, when set, wins;
                neither: ``records.MAX_LINE_BYTES`` (1 GiB).
            name: the sample or request named in errors.
        Raises:
            SGLangHTTPError: naming the endpoint (and ``name``): an HTTP error, a reply that
                is too large or not JSON, or a transport error or missed deadline after the
                retries (with the attempts).
        """
        what = f"POST {path}" + (f" (sample {name!r})" if name is not None else "")
        limit = self.max_reply_bytes or max_reply_bytes or MAX_LINE_BYTES
        url = http.url_of(self.base_url, path)
        async with self._sem:
            attempt = 0
            while True:
                attempt += 1
                self.stats["requests"] += 1
                try:
                    return await http.attempt(self._client, "POST", url, body,
                                              timeout=self.timeout, max_bytes=limit, what=what)
                except http.SGLangHTTPError as e:
                    if not e.retryable:
                        raise
                    if attempt > self.retries:
                        raise http.SGLangHTTPError(f"{e} (after {attempt} attempts)",
                                                   retryable=True) from None
                    self.stats["retries"] += 1
                    await asyncio.sleep(_backoff(attempt, self.backoff_s))

    async def request(self, payload: Mapping[str, Any], *, kind: str = "generate",
                      start_len: int = 0, sample_id: str | None = None
                      ) -> tuple[dict, RoutingRecord]:
        """One request (``kind``: "generate", "completions", "chat") -> (response, record);
        the record is written to the writer before this returns.

        Raises:
            SGLangHTTPError: see :meth:`post`; RecordError: a response without (valid)
                routing, naming the request; ConfigError: an unknown ``kind``, or a payload
                with ``stream`` set (nothing sent: streams go through
                engine_patches.sglang.records.record_from_stream).
        """
        path, body, ids = _route(payload, start_len, kind)
        resp = await self.post(
            path, body, name=sample_id if sample_id is not None else payload.get("rid"),
            max_reply_bytes=reply_bound(payload, self.schema, kind=kind,
                                        num_fused_shared_experts=self.num_fused_shared_experts))
        rec = await asyncio.to_thread(
            record_from_response, resp, self.schema, start_len=start_len, prompt_ids=ids,
            sample_id=sample_id, num_fused_shared_experts=self.num_fused_shared_experts,
            sampling=request_sampling(payload, kind))
        if self.writer is not None:
            async with self._wlock:              # NOTE: one writer call at a time
                await asyncio.to_thread(self.writer.write, rec)
        self.stats["records"] += 1
        return resp, rec

    async def generate(self, payload: Mapping[str, Any], *, start_len: int = 0,
                       sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        """POST /generate (one prompt); returns (response, record)."""
        return await self.request(payload, kind="generate", start_len=start_len,
                                  sample_id=sample_id)

    async def completions(self, payload: Mapping[str, Any], *, start_len: int = 0,
                          sample_id: str | None = None, chat: bool = False
                          ) -> tuple[dict, RoutingRecord]:
        """POST /v1/completions (or /v1/chat/completions); returns (response, record)."""
        return await self.request(payload, kind="chat" if chat else "completions",
                                  start_len=start_len, sample_id=sample_id)

    async def generate_many(self, payloads: Sequence[Mapping[str, Any]], *,
                            sample_ids: Sequence[str] | None = None,
                            start_lens: Sequence[int] | None = None, kind: str = "generate",
                            return_exceptions: bool = False) -> list:
        """All ``payloads`` concurrently (bounded by ``max_concurrency``); results in input
        order: (response, record), or the exception when ``return_exceptions``.

        Raises:
            ConfigError: ``sample_ids``/``start_lens`` of another length than ``payloads``.
            RecordError, SGLangHTTPError: the first failure (without ``return_exceptions``).
        """
        n = len(payloads)
        for name, v in (("sample_ids", sample_ids), ("start_lens", start_lens)):
            if v is not None and len(v) != n:
                raise ConfigError(f"{name} has {len(v)} entries for {n} payloads")
        return await asyncio.gather(*(
            self.request(p, kind=kind, start_len=start_lens[i] if start_lens else 0,
                         sample_id=sample_ids[i] if sample_ids else None)
            for i, p in enumerate(payloads)), return_exceptions=return_exceptions)


class SGLangRoutingClient:
    """The blocking twin of :class:`AsyncSGLangRoutingClient` (same requests, records,
    deadline, size bound and retry policy): it runs one on a private event loop thread, so
    calls from several threads share its pool (up to 64 requests in flight).

    NOTE: an event loop, not httpx's blocking client: that one's timeouts are per socket
    read, so a server trickling bytes (even in the headers) could hold a call past any
    deadline, and a blocked read cannot be interrupted.

    Args: as :class:`AsyncSGLangRoutingClient` (no ``max_concurrency`` nor ``client``).
    Call :meth:`close` (or use ``with``) to stop the loop thread and close the pool.
    """

    def __init__(self, base_url: str, schema: RoutingSchema, writer: Any = None, *,
                 timeout: float = 600.0, connect_timeout: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, num_fused_shared_experts: int = 0,
                 max_reply_bytes: int | None = None):
        _check_policy(1, retries, timeout, max_reply_bytes)
        http.httpx_module()
        self.base_url, self.schema, self.writer, self.timeout = base_url, schema, writer, timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="sglang-client")
        self._thread.start()
        # NOTE: a client dropped without close() stops its loop thread when collected
        self._stop = weakref.finalize(self, self._loop.call_soon_threadsafe, self._loop.stop)

        async def make() -> AsyncSGLangRoutingClient:     # NOTE: built on the loop it uses
            return AsyncSGLangRoutingClient(
                base_url, schema, writer, timeout=timeout, connect_timeout=connect_timeout,
                retries=retries, backoff_s=backoff_s, max_reply_bytes=max_reply_bytes,
                num_fused_shared_experts=num_fused_shared_experts)
        self._async = self._run(make())
        self.stats = self._async.stats

    def _run(self, coro: Any) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()                   # NOTE: e.g. KeyboardInterrupt while waiting
            raise

    def close(self) -> None:
        """Close the pool and stop the loop thread (idempotent)."""
        if self._loop.is_closed():
            return
        self._run(self._async.aclose())
        self._stop()
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "SGLangRoutingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> Any:
        """See :meth:`AsyncSGLangRoutingClient.post`."""
        return self._run(self._async.post(path, body, **kw))

    def request(self, payload: Mapping[str, Any], *, kind: str = "generate", start_len: int = 0,
                sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        """See :meth:`AsyncSGLangRoutingClient.request`."""
        return self._run(self._async.request(payload, kind=kind, start_len=start_len,
                                             sample_id=sample_id))

    def generate(self, payload: Mapping[str, Any], *, start_len: int = 0,
                 sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        """POST /generate (one prompt); returns (response, record)."""
        return self.request(payload, kind="generate", start_len=start_len, sample_id=sample_id)

    def completions(self, payload: Mapping[str, Any], *, start_len: int = 0,
                    sample_id: str | None = None, chat: bool = False) -> tuple[dict, RoutingRecord]:
        """POST /v1/completions (or /v1/chat/completions); returns (response, record)."""
        return self.request(payload, kind="chat" if chat else "completions",
                            start_len=start_len, sample_id=sample_id)


def request_sampling(payload: Mapping[str, Any], kind: str = "generate") -> SamplingInfo:
    """The sampling parameters behind a request's log-probs: ``sampling_params`` of a
    ``/generate`` payload, the top-level fields of an OpenAI one (SGLang's adapter maps
    them onto the same)."""
    if kind == "generate":
        sp = payload.get("sampling_params")
    else:
        sp = {k: payload[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                      "frequency_penalty", "presence_penalty",
                                      "repetition_penalty") if k in payload}
    return sampling_from_sglang(sp if isinstance(sp, Mapping) else None,
                                custom_logit_processor=payload.get("custom_logit_processor"))

