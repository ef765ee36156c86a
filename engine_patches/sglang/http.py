"""JSON-over-HTTP calls to an SGLang server, on httpx (the ``sglang`` extra): one request
attempt with an overall deadline and a reply-size bound (:func:`attempt`, used by the
clients), one blocking call (:func:`call`, used by the weight sync), and the error type.

Every attempt holds two bounds, whatever the server does:

- a deadline: ``timeout`` seconds of wall-clock time for the whole attempt (connect, send,
  wait, read the whole reply), not per socket read;
- a size bound: at most ``max_bytes`` bytes of reply body are read (a larger
  Content-Length fails before the body is read, a longer body as soon as it passes it).

Any failure is an :class:`SGLangHTTPError` naming the request and the reason: HTTP status,
transport error, deadline, size, or a body that is not JSON (including JSON nested too
deeply for Python's parser, and bytes that are not UTF-8).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from routereplay.errors import RouteReplayError

RETRY_STATUS = (502, 503, 504)
ERROR_BODY_BYTES = 4096        # of an error reply's body, for the message
CONTROL_REPLY_BYTES = 1 << 20  # control endpoints answer a small JSON object or a line of text
BYTES_PER_CONTAINER = 16       # a reply's JSON objects and arrays: at most one per this many bytes


class SGLangHTTPError(RouteReplayError):
    """An SGLang endpoint answered with an error status or a bad reply (too slow, too
    large, not JSON), or could not be reached.

    Attributes:
        retryable: a transport error, a missed deadline or HTTP 502/503/504: the clients'
            retry policy retries these; the rest fail at once.
    """

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


def httpx_module():
    """``import httpx`` with an error naming the extra when it is missing."""
    try:
        import httpx
    except ImportError:
        raise ImportError("engine_patches.sglang's HTTP clients need httpx: "
                          "pip install 'routereplay[sglang]'") from None
    return httpx


def url_of(base_url: str, path: str, query: str = "") -> str:
    return base_url.rstrip("/") + path + (f"?{query}" if query else "")


def decode_reply(what: str, raw: bytes | bytearray, allow_text: bool = False) -> Any:
    """The decoded JSON of a reply body (or its text, where ``allow_text``).

    Raises:
        SGLangHTTPError: naming ``what``: not JSON (or not UTF-8) without ``allow_text``,
            JSON nested deeper than Python's parser recurses (a RecursionError there), or
            more objects and arrays than one per ``BYTES_PER_CONTAINER`` bytes (checked
            before parsing: what is left, numbers, costs at most about 8x the bytes).
    """
    # NOTE: parsed JSON costs far more than its bytes where it is mostly containers
    # (`[{},...]`: 3 bytes each, ~60 as Python objects); real replies hold one per 20+
    # bytes. Counting brackets (inside strings too: conservative) is C-speed.
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > len(raw) // BYTES_PER_CONTAINER + 1024:
        raise SGLangHTTPError(f"{what}: reply JSON of {len(raw)} bytes holds {containers} "
                              f"objects or arrays, more than one per {BYTES_PER_CONTAINER} "
                              "bytes (its parse would cost many times its size)")
    try:
        return json.loads(raw)
    except RecursionError:
        raise SGLangHTTPError(f"{what}: reply JSON ({len(raw)} bytes) is nested too deeply "
                              "to parse") from None
    except ValueError as e:            # JSONDecodeError, UnicodeDecodeError
        if allow_text:                 # NOTE: /flush_cache answers a line of plain text
            return bytes(raw).decode(errors="replace")
        raise SGLangHTTPError(f"{what}: reply is not JSON ({type(e).__name__}: {e})"[:400]) from None


async def _read(r: Any, max_bytes: int, what: str) -> bytearray:
    """The raw body of streamed httpx response ``r``, read in chunks, failing as soon as it
    passes ``max_bytes``."""
    cl = r.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > max_bytes:
        raise SGLangHTTPError(f"{what}: reply announces {int(cl)} bytes, more than the "
                              f"{max_bytes}-byte bound (pass max_reply_bytes= for replies the "
                              "bound does not foresee)")
    buf = bytearray()
    async for chunk in r.aiter_raw():
        buf += chunk
        if len(buf) > max_bytes:
            raise SGLangHTTPError(f"{what}: reply passes the {max_bytes}-byte bound "
                                  f"(stopped after reading {len(buf)} bytes; pass "
                                  "max_reply_bytes= for replies the bound does not foresee)")
    return buf


async def _exchange(client: Any, method: str, url: str, body: Any, max_bytes: int,
                    what: str, allow_text: bool) -> Any:
    # NOTE: identity encoding, and the raw body: a compressed reply could inflate far past
    # the bytes read.
    async with client.stream(method, url, json=body,
                             headers={"Accept-Encoding": "identity"}) as r:
        if r.status_code >= 400:
            raw = bytearray()
            async for chunk in r.aiter_raw():
                raw += chunk
                if len(raw) >= ERROR_BODY_BYTES:
                    break
            msg = bytes(raw[:500]).decode(errors="replace")
            raise SGLangHTTPError(f"{what}: HTTP {r.status_code}: {msg}",
                                  retryable=r.status_code in RETRY_STATUS)
        enc = r.headers.get("content-encoding", "identity").strip().lower()
        if enc != "identity":
            raise SGLangHTTPError(f"{what}: reply is {enc}-encoded, identity was asked for")
        raw = await _read(r, max_bytes, what)
    return decode_reply(what, raw, allow_text)


async def attempt(client: Any, method: str, url: str, body: Any = None, *, timeout: float,
                  max_bytes: int, what: str, allow_text: bool = False) -> Any:
    """One request attempt on ``client`` (an ``httpx.AsyncClient``); the decoded reply.

    Args:
        timeout: seconds of wall-clock time for the whole attempt (connect, send, wait and
            read the reply); the client's own httpx timeouts apply inside it.
        max_bytes: bound on the reply body (bytes).
        what: names the request in errors (e.g. ``"POST /generate (sample 'uid-7')"``).
        allow_text: return a body that is not JSON as text (control endpoints).
    Raises:
        SGLangHTTPError: naming ``what`` and the reason; ``retryable`` for a transport
            error, the deadline, HTTP 502/503/504.
    """
    httpx = httpx_module()
    try:
        return await asyncio.wait_for(
            _exchange(client, method, url, body, max_bytes, what, allow_text), timeout)
    except asyncio.TimeoutError:
        raise SGLangHTTPError(f"{what}: no complete reply within {timeout:g} s",
                              retryable=True) from None
    except httpx.TransportError as e:          # incl. httpx's own timeouts
        raise SGLangHTTPError(f"{what}: {type(e).__name__}: {e}", retryable=True) from None
    except httpx.HTTPError as e:
        raise SGLangHTTPError(f"{what}: {type(e).__name__}: {e}") from None


def run_blocking(coro: Any) -> Any:
    """Run ``coro`` to completion from blocking code (a private event loop; on a fresh
    thread when this thread already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def call(base_url: str, path: str, body: dict[str, Any] | None = None, *, method: str = "POST",
         timeout: float = 600.0, query: str = "",
         max_reply_bytes: int = CONTROL_REPLY_BYTES) -> Any:
    """``method`` ``base_url + path`` with a JSON body (blocking, one attempt); returns the
    decoded JSON (or text).

    Args:
        timeout: seconds for the whole call, wall-clock (see :func:`attempt`).
        max_reply_bytes: bound on the reply body (default 1 MiB: SGLang's control
            endpoints answer a small JSON object or a line of text).
    Raises:
        SGLangHTTPError: HTTP status >= 400 (with the server's message), a transport error
            (connection refused, timeout), the deadline or the size bound passed, or a
            reply that is not JSON nor text, naming the endpoint.
    """
    httpx = httpx_module()
    what = f"{method} {path}"

    async def one() -> Any:
        async with httpx.AsyncClient(timeout=timeout) as c:
            return await attempt(c, method, url_of(base_url, path, query), body,
                                 timeout=timeout, max_bytes=max_reply_bytes, what=what,
                                 allow_text=True)
    return run_blocking(one())
