"""Minimal JSON-over-HTTP calls to an SGLang server (stdlib only)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from routereplay.errors import RouteReplayError


class SGLangHTTPError(RouteReplayError):
    """An SGLang endpoint answered with an error status or unreadable JSON."""


def call(base_url: str, path: str, body: dict[str, Any] | None = None, *, method: str = "POST",
         timeout: float = 600.0, query: str = "") -> Any:
    """``method`` ``base_url + path`` with a JSON body; returns the decoded JSON (or text).

    Raises:
        SGLangHTTPError: HTTP status >= 400 (with the server's message) or a connection error.
    """
    url = base_url.rstrip("/") + path + (f"?{query}" if query else "")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        msg = e.read().decode(errors="replace")[:500]
        raise SGLangHTTPError(f"{method} {path}: HTTP {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SGLangHTTPError(f"{method} {path}: {e}") from None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
