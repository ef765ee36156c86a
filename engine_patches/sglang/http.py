"""JSON-over-HTTP calls to an SGLang server, on httpx (the ``sglang`` extra): one blocking
call (:func:`call`, used by the weight sync and the blocking client) and the error type."""
from __future__ import annotations

import json
from typing import Any

from routereplay.errors import RouteReplayError


class SGLangHTTPError(RouteReplayError):
    """An SGLang endpoint answered with an error status, or could not be reached."""


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


def decode_reply(method: str, path: str, status: int, raw: bytes) -> Any:
    """The decoded JSON (or text) of a reply.

    Raises:
        SGLangHTTPError: status >= 400, with the server's message.
    """
    if status >= 400:
        msg = raw.decode(errors="replace")[:500]
        raise SGLangHTTPError(f"{method} {path}: HTTP {status}: {msg}")
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def call(base_url: str, path: str, body: dict[str, Any] | None = None, *, method: str = "POST",
         timeout: float = 600.0, query: str = "", client: Any = None) -> Any:
    """``method`` ``base_url + path`` with a JSON body; returns the decoded JSON (or text).

    Args:
        client: an ``httpx.Client`` to reuse its connection pool (default: a one-off one).
    Raises:
        SGLangHTTPError: HTTP status >= 400 (with the server's message) or a transport
            error (connection refused, timeout), naming the endpoint.
    """
    httpx = httpx_module()
    own = client is None
    c = httpx.Client(timeout=timeout) if own else client
    try:
        r = c.request(method, url_of(base_url, path, query), json=body, timeout=timeout)
        return decode_reply(method, path, r.status_code, r.content)
    except httpx.HTTPError as e:
        raise SGLangHTTPError(f"{method} {path}: {type(e).__name__}: {e}") from None
    finally:
        if own:
            c.close()
