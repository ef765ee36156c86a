"""HTTP admin routes of the routereplay capture API for ``vllm serve`` (vLLM 0.32's
``vllm.endpoint_plugins`` group, ``vllm/plugins/endpoint_plugins/interface.py``).

vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it; ``VLLM_PLUGINS`` also
filters the general plugins, and both of ours are called ``routereplay``, so one name
switches on capture and its routes::

    VLLM_PLUGINS=routereplay ROUTEREPLAY_SIDECAR=/data/rollouts/ \\
        vllm serve MODEL --enable-return-routed-experts --api-key KEY

Routes (answered by the API-server process that receives them; with
``--api-server-count N`` each of the N processes has its own stream, so rotate each, or
rely on the automatic rotation at every weight-version change):

- ``POST /routereplay/rotate`` (optional JSON body ``{"weight_version": "..."}``, at most
  :data:`MAX_BODY` bytes): close the open stream (index written); answers
  ``{"closed": name or null, "streams": [...]}``.
- ``GET /routereplay/streams``: ``{"streams": [{"name", "weight_version", "records",
  "closed"}, ...]}``.
- ``POST /routereplay/flush``: make every record written so far readable.

Admin routes, behind the engine's own API key (they change what is written). vLLM 0.32's
``AuthenticationMiddleware`` (``vllm/entrypoints/serve/middleware/authenticate.py``) checks
``--api-key`` (else ``VLLM_API_KEY``) only for paths under ``/v1``, ``/v2``, ``/inference``
and ``/cohere``; every route here runs that middleware's own ``verify_token`` with the same
keys before anything else (the body is not read), answering as it does: 401
``{"error": "Unauthorized"}``. Without a key configured vLLM's API is open, and so are these.

Errors: 400 (a body that is not a JSON object, an unknown field, a bad ``weight_version``:
:func:`routereplay.weight_versions.check_version_label`, the reason in ``error``), 413 (a
body over :data:`MAX_BODY`; refused from ``Content-Length`` when given, else after at most
``MAX_BODY`` bytes are read), 409 (capture is not installed in this process).

Streams are named by their file name inside the configured ``ROUTEREPLAY_SIDECAR`` folder,
never by a server path (NOTE: an API-key holder learns nothing of the server's file system
or of an fsspec URL's host or credentials); :func:`engine_patches.vllm.plugin.streams` keeps
the full paths. The routes call this process's capture API (engine_patches.vllm.plugin).
"""
# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (the Request parameter) as objects; as strings they would not resolve to the Request
# imported inside attach_router, and FastAPI would take `request` for a query parameter.
import json
from typing import Any

MAX_BODY = 64 << 10
"""Largest request body the routes read (bytes); a ``weight_version`` is at most 256
characters (``routereplay.weight_versions.MAX_VERSION_LABEL``)."""


def stream_name(path: str) -> str:
    """The name a route gives a stream: its file name in the destination folder
    (``/data/rollouts/vllm-...-3fa9c2d41b07.0001.rrsc`` -> ``vllm-...-3fa9c2d41b07.0001.rrsc``;
    fsspec URLs alike)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def api_keys(app: Any) -> list[str]:
    """The keys vLLM's ``AuthenticationMiddleware`` gets for ``app``: ``--api-key`` (a list;
    ``app.state.args``, set by vLLM's ``build_app`` before endpoint plugins attach), else
    ``VLLM_API_KEY``; empty ones dropped (``init_entrypoints_middleware``, vLLM 0.32). Empty
    list: no key, the API is open."""
    from vllm import envs
    args = getattr(app.state, "args", None)
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


class RouteReplayEndpoints:
    """The ``vllm.endpoint_plugins`` factory (a zero-argument class)."""

    name = "routereplay"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        """Register the admin routes on vLLM's FastAPI ``app``, guarded by the API key(s)
        of :func:`api_keys` (read now: vLLM reads them right after, for its middleware)."""
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse
        from fastapi.routing import APIRoute
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        from engine_patches.vllm import plugin
        from routereplay.weight_versions import check_version_label

        keys = api_keys(app)
        # NOTE: vLLM's own check, not a copy of it: the middleware object is used only for
        # verify_token (it never wraps an app here). Checked per route, not by path: the
        # middleware guards fixed prefixes (/v1, ...), and moving the routes under one, or
        # widening its module-level GUARDED_PREFIX, would change vLLM's or our paths.
        auth = AuthenticationMiddleware(app, tokens=keys) if keys else None

        class AdminRoute(APIRoute):
            """Every route of the router answers 401 before its handler runs without a key."""

            def get_route_handler(self):
                handler = super().get_route_handler()

                async def guarded(request: Request):
                    if auth is not None and not auth.verify_token(request.headers):
                        return JSONResponse({"error": "Unauthorized"}, status_code=401)
                    return await handler(request)
                return guarded

        router = APIRouter(route_class=AdminRoute)

        def _error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": message}, status_code=status)

        def _streams() -> list[dict]:
            return [dict(name=stream_name(s.path), weight_version=s.weight_version,
                         records=s.records, closed=s.closed) for s in plugin.streams()]

        def _off() -> JSONResponse:
            return _error(409, "routereplay capture is not installed in this process "
                          "(set ROUTEREPLAY_SIDECAR)")

        async def _body(request: Request) -> bytes | JSONResponse:
            """The body, at most MAX_BODY bytes read; else a 413 (or 400) response."""
            too_big = _error(413, f"request body above {MAX_BODY} bytes")
            declared = request.headers.get("content-length")
            if declared is not None:
                if not (declared.isascii() and declared.isdigit()):
                    return _error(400, f"bad Content-Length {declared[:40]!r}")
                if int(declared) > MAX_BODY:
                    return too_big
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY:     # NOTE: the rest is never read
                    return too_big
            return bytes(body)

        @router.post("/routereplay/rotate")
        async def rotate(request: Request) -> Any:
            if not plugin.installed():
                return _off()
            body = await _body(request)
            if isinstance(body, JSONResponse):
                return body
            version = None
            if body.strip():
                try:
                    data = json.loads(body)
                except (ValueError, RecursionError):        # NOTE: 64 KiB of '[' recurses
                    return _error(400, "body must be JSON")
                if not isinstance(data, dict):
                    return _error(400, "body must be a JSON object")
                unknown = sorted(set(data) - {"weight_version"})
                if unknown:
                    return _error(400, f"unknown field(s) {unknown[:5]}: only weight_version")
                version = data.get("weight_version")
                if version is not None:
                    try:
                        check_version_label(version)
                    except ValueError as e:
                        return _error(400, str(e))
            closed = plugin.rotate(version)
            return {"closed": None if closed is None else stream_name(closed),
                    "streams": _streams()}

        @router.get("/routereplay/streams")
        async def streams() -> Any:
            if not plugin.installed():
                return _off()
            return {"streams": _streams()}

        @router.post("/routereplay/flush")
        async def flush() -> Any:
            if not plugin.installed():
                return _off()
            plugin.flush()
            return {"streams": _streams()}

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """No per-app state: the routes use this process's capture state."""
        return None
