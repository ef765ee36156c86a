"""Ask SGLang for routing and stream it into a sidecar: an asyncio HTTP client for RL
rollouts (thousands of concurrent requests), its blocking twin, and the offline Engine.

    async with AsyncSGLangRoutingClient("http://127.0.0.1:30000", schema, writer,
                                        max_concurrency=256) as client:
        results = await client.generate_many(payloads, sample_ids=uids)   # [(response, record)]
        resp, rec = await client.generate(payload, sample_id="uid-7")

    client = SGLangRoutingClient("http://127.0.0.1:30000", schema, writer)    # blocking
    resp, rec = client.generate({"input_ids": ids, "sampling_params": {...}})
    # multi-turn: the next turn asks only for rows not yet stored
    resp2, rec2 = client.generate({"input_ids": ids + out + user}, start_len=next_start(rec))

Both clients run on httpx (the ``sglang`` extra): one connection pool per client (keep-alive
connections reused), at most ``max_concurrency`` requests in flight (asyncio semaphore;
the pool holds as many connections), per-request timeouts, retries with exponential
backoff on transport errors (connection refused or reset, timeouts, a server that closed
the connection) and on HTTP 502/503/504; any other HTTP error fails at once, naming the
request. Every record is written to the sidecar writer as soon as its response is decoded
(response decoding runs on a worker thread, so the event loop keeps serving other
requests; writes are serialised); a response without routing raises RecordError naming the
request and the server flag.

NOTE: a retried ``/generate`` may run twice on the server (the first attempt's reply was
lost); only one reply is used, so the record is still that of one generation.
"""
from __future__ import annotations

import asyncio
import copy
import random
import time
from typing import Any, Mapping, Sequence

from engine_patches.sglang import http
from engine_patches.sglang.records import record_from_response
from routereplay.errors import ConfigError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

RETRY_STATUS = (502, 503, 504)


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


def next_start(previous: RoutingRecord) -> int:
    """The first token position whose routing ``previous`` (an earlier turn) lacks."""
    return previous.start + previous.num_tokens


def _route(payload: Mapping[str, Any], start_len: int, kind: str) -> tuple[str, dict, Any]:
    """(endpoint, body, prompt ids or None) of one request."""
    if kind not in ("generate", "completions", "chat"):
        raise ConfigError(f"unknown request kind {kind!r}")
    path = {"generate": "/generate", "completions": "/v1/completions",
            "chat": "/v1/chat/completions"}[kind]
    ids = payload.get("input_ids") if kind == "generate" else None
    return path, with_routing(payload, start_len), ids if isinstance(ids, list) else None


def _check_policy(max_concurrency: int, retries: int, timeout: float) -> None:
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
    if not timeout or timeout <= 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")


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
        timeout: seconds per request attempt (``connect_timeout`` for connecting).
        retries: extra attempts after a transport error or HTTP 502/503/504.
        backoff_s: first retry delay (doubled each retry, with jitter).
        num_fused_shared_experts: fused shared-expert columns the server's payload carries
            per row (0 for SGLang 0.5.23).
        client: an ``httpx.AsyncClient`` to use instead of the client's own pool.
    Raises:
        ConfigError: a bad policy value.

    Use as ``async with``, or call :meth:`aclose`.
    """

    def __init__(self, base_url: str, schema: RoutingSchema, writer: Any = None, *,
                 max_concurrency: int = 64, timeout: float = 600.0,
                 connect_timeout: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 num_fused_shared_experts: int = 0, client: Any = None):
        _check_policy(max_concurrency, retries, timeout)
        httpx = http.httpx_module()
        self.base_url, self.schema, self.writer = base_url, schema, writer
        self.retries, self.backoff_s = retries, backoff_s
        self.num_fused_shared_experts = num_fused_shared_experts
        self._own = client is None
        self._client = client if client is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
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

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST with the concurrency bound and the retry policy; the decoded JSON.

        Raises:
            SGLangHTTPError: an HTTP error, or a transport error after the retries (naming
                the endpoint and the attempts).
        """
        httpx = http.httpx_module()
        async with self._sem:
            attempt = 0
            while True:
                attempt += 1
                self.stats["requests"] += 1
                try:
                    r = await self._client.post(http.url_of(self.base_url, path), json=body)
                    if r.status_code in RETRY_STATUS and attempt <= self.retries:
                        raise _Retryable(f"HTTP {r.status_code}")
                    return http.decode_reply("POST", path, r.status_code, r.content)
                except (httpx.TransportError, _Retryable) as e:
                    if attempt > self.retries:
                        raise http.SGLangHTTPError(
                            f"POST {path}: {type(e).__name__}: {e} (after {attempt} attempts)"
                        ) from None
                    self.stats["retries"] += 1
                    await asyncio.sleep(_backoff(attempt, self.backoff_s))

    async def request(self, payload: Mapping[str, Any], *, kind: str = "generate",
                      start_len: int = 0, sample_id: str | None = None
                      ) -> tuple[dict, RoutingRecord]:
        """One request (``kind``: "generate", "completions", "chat") -> (response, record);
        the record is written to the writer before this returns."""
        path, body, ids = _route(payload, start_len, kind)
        resp = await self.post(path, body)
        rec = await asyncio.to_thread(
            record_from_response, resp, self.schema, start_len=start_len, prompt_ids=ids,
            sample_id=sample_id, num_fused_shared_experts=self.num_fused_shared_experts)
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


class _Retryable(Exception):
    """A reply that the retry policy retries (HTTP 502/503/504)."""


class SGLangRoutingClient:
    """The blocking twin of :class:`AsyncSGLangRoutingClient` (same requests, records,
    retry policy), one request at a time on a pooled ``httpx.Client``.

    Args: as :class:`AsyncSGLangRoutingClient` (no ``max_concurrency``).
    """

    def __init__(self, base_url: str, schema: RoutingSchema, writer: Any = None, *,
                 timeout: float = 600.0, connect_timeout: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, num_fused_shared_experts: int = 0):
        _check_policy(1, retries, timeout)
        httpx = http.httpx_module()
        self.base_url, self.schema, self.writer, self.timeout = base_url, schema, writer, timeout
        self.retries, self.backoff_s = retries, backoff_s
        self.num_fused_shared_experts = num_fused_shared_experts
        self._client = httpx.Client(timeout=httpx.Timeout(timeout, connect=connect_timeout))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "SGLangRoutingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST with the retry policy (see AsyncSGLangRoutingClient.post)."""
        httpx = http.httpx_module()
        attempt = 0
        while True:
            attempt += 1
            try:
                r = self._client.post(http.url_of(self.base_url, path), json=body)
                if r.status_code in RETRY_STATUS and attempt <= self.retries:
                    raise _Retryable(f"HTTP {r.status_code}")
                return http.decode_reply("POST", path, r.status_code, r.content)
            except (httpx.TransportError, _Retryable) as e:
                if attempt > self.retries:
                    raise http.SGLangHTTPError(f"POST {path}: {type(e).__name__}: {e} "
                                               f"(after {attempt} attempts)") from None
                time.sleep(_backoff(attempt, self.backoff_s))

    def request(self, payload: Mapping[str, Any], *, kind: str = "generate", start_len: int = 0,
                sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        path, body, ids = _route(payload, start_len, kind)
        resp = self.post(path, body)
        rec = record_from_response(resp, self.schema, start_len=start_len, prompt_ids=ids,
                                   sample_id=sample_id,
                                   num_fused_shared_experts=self.num_fused_shared_experts)
        if self.writer is not None:
            self.writer.write(rec)
        return resp, rec

    def generate(self, payload: Mapping[str, Any], *, start_len: int = 0,
                 sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        """POST /generate (one prompt); returns (response, record)."""
        return self.request(payload, kind="generate", start_len=start_len, sample_id=sample_id)

    def completions(self, payload: Mapping[str, Any], *, start_len: int = 0,
                    sample_id: str | None = None, chat: bool = False) -> tuple[dict, RoutingRecord]:
        """POST /v1/completions (or /v1/chat/completions); returns (response, record)."""
        return self.request(payload, kind="chat" if chat else "completions",
                            start_len=start_len, sample_id=sample_id)


def engine_generate(engine: Any, schema: RoutingSchema, *, input_ids: Sequence[int],
                    sampling_params: Mapping[str, Any], start_len: int = 0, writer=None,
                    sample_id: str | None = None, num_fused_shared_experts: int = 0,
                    **kw: Any) -> tuple[dict, RoutingRecord]:
    """Offline ``sglang.Engine.generate`` for one prompt with routing on.

    The engine must be built with ``enable_return_routed_experts=True``.
    """
    resp = engine.generate(input_ids=list(input_ids), sampling_params=dict(sampling_params),
                           return_routed_experts=True, routed_experts_start_len=start_len, **kw)
    rec = record_from_response(resp, schema, start_len=start_len, prompt_ids=input_ids,
                               sample_id=sample_id,
                               num_fused_shared_experts=num_fused_shared_experts)
    if writer is not None:
        writer.write(rec)
    return resp, rec
