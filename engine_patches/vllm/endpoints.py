"""HTTP routes of the routereplay capture API for ``vllm serve`` (vLLM 0.32's
``vllm.endpoint_plugins`` group, ``vllm/plugins/endpoint_plugins/interface.py``).

vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it; ``VLLM_PLUGINS`` also
filters the general plugins, and both of ours are called ``routereplay``, so one name
switches on capture and its routes::

    VLLM_PLUGINS=routereplay ROUTEREPLAY_SIDECAR=/data/rollouts/ \\
        vllm serve MODEL --enable-return-routed-experts

Routes (answered by the API-server process that receives them; with
``--api-server-count N`` each of the N processes has its own stream, so rotate each, or
rely on the automatic rotation at every weight-version change):

- ``POST /routereplay/rotate`` (optional JSON body ``{"weight_version": "..."}``): close the
  open stream (index written); answers ``{"closed": path or null, "streams": [...]}``.
- ``GET /routereplay/streams``: ``{"streams": [{"path", "weight_version", "records",
  "closed"}, ...]}``.
- ``POST /routereplay/flush``: make every record written so far readable.

The routes call the capture API of this process (engine_patches.vllm.plugin) and open no
path into the engine.
"""
# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (the Request parameter) as objects; as strings they would not resolve to the Request
# imported inside attach_router, and FastAPI would take `request` for a query parameter.
from typing import Any


class RouteReplayEndpoints:
    """The ``vllm.endpoint_plugins`` factory (a zero-argument class)."""

    name = "routereplay"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        """Register the routes on vLLM's FastAPI ``app``."""
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse

        from engine_patches.vllm import plugin

        router = APIRouter()

        def _streams() -> list[dict]:
            return [s.as_dict() for s in plugin.streams()]

        def _off() -> JSONResponse:
            return JSONResponse({"error": "routereplay capture is not installed in this process "
                                 "(set ROUTEREPLAY_SIDECAR)"}, status_code=409)

        @router.post("/routereplay/rotate")
        async def rotate(request: Request) -> Any:
            if not plugin.installed():
                return _off()
            version = None
            body = await request.body()
            if body.strip():
                try:
                    data = await request.json()
                except ValueError:
                    return JSONResponse({"error": "body must be JSON"}, status_code=400)
                version = data.get("weight_version") if isinstance(data, dict) else None
                if version is not None and not isinstance(version, str):
                    return JSONResponse({"error": "weight_version must be a string"},
                                        status_code=400)
            closed = plugin.rotate(version)
            return {"closed": closed, "streams": _streams()}

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
