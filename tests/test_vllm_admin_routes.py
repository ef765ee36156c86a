"""The routereplay admin routes (``/routereplay/rotate``, ``/streams``, ``/flush``) in the app
vLLM's API server builds (``vllm.entrypoints.launchers.app.build_app`` with the server's own
argument parser, ``--api-key``, endpoint plugins loaded from the entry point named by
``VLLM_PLUGINS``; vLLM's real middleware stack), without the engine: records reach the
capture through vLLM's real front-end ``OutputProcessor`` (issue 27 item 3)."""
import asyncio

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the engine extra")

KEY = "rr-test-key"
ROUTES = [("POST", "/routereplay/rotate"), ("GET", "/routereplay/streams"),
          ("POST", "/routereplay/flush")]


def _build(monkeypatch, argv, env=None):
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    monkeypatch.setenv("VLLM_PLUGINS", "routereplay")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = build_app(args, supported_tasks=("generate",))
    assert {r.path for r in app.routes} >= {p for _, p in ROUTES}, "endpoint plugin not loaded"
    return app


@pytest.fixture
def capture(tmp_path, schema):
    """Capture installed into a folder; ``finish(rid)`` runs one finished request through
    vLLM's OutputProcessor (the patched RequestState path the server uses)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    from engine_patches.vllm import plugin
    folder = tmp_path / "streams"
    plugin.install(str(folder) + "/", schema=schema, reference=False, codec="xl-zstd")
    proc = OutputProcessor(tokenizer=None, log_stats=False)

    def finish(rid, prompt=(3, 4, 5, 6), gen=(7, 8)):
        proc.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=list(prompt), mm_features=None,
            sampling_params=SamplingParams(max_tokens=len(gen), detokenize=False),
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
            data_parallel_rank=None, external_req_id=rid), prompt=None)
        ids = np.tile(np.arange(4, dtype=np.uint8), (len(prompt) + len(gen) - 1, 4, 1))
        ids[:, 0] = 0                                                 # layer 0 is dense
        proc.process_outputs([EngineCoreOutput(request_id=rid, new_token_ids=list(gen),
                                               finish_reason=FinishReason.LENGTH,
                                               routed_experts=ids)])
    try:
        yield folder, finish
    finally:
        plugin.uninstall()


def _call(app, requests):
    """[(method, path, kwargs)] through httpx's ASGI transport (the body streamed as sent)."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as c:
            return [await c.request(m, p, **kw) for m, p, kw in requests]
    return asyncio.run(run())


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_routes_need_the_engines_api_key(monkeypatch, capture):
    folder, finish = capture
    finish("r0")
    for app in (_build(monkeypatch, ["--api-key", "other", KEY]),
                _build(monkeypatch, [], env={"VLLM_API_KEY": KEY})):
        bad = [{}, {"headers": _auth("wrong")}, {"headers": {"Authorization": KEY}}]
        got = _call(app, [(m, p, kw) for m, p in ROUTES for kw in bad]
                    + [("POST", "/v1/completions", {})])
        assert [(r.status_code, r.json()) for r in got] == [(401, {"error": "Unauthorized"})] * 10
        got = _call(app, [(m, p, {"headers": _auth()}) for m, p in ROUTES])
        assert [r.status_code for r in got] == [200, 200, 200], [r.text for r in got]
    # nothing was rotated by the refused calls: the first authorized rotate closed r0's stream
    assert got[1].json()["streams"][0]["records"] == 1
    # no key configured: vLLM's API is open, and so are the routes
    open_app = _build(monkeypatch, [])
    assert [r.status_code for r in _call(open_app, [(m, p, {}) for m, p in ROUTES])] == [200] * 3


def test_a_bad_weight_version_is_refused_and_the_next_stream_is_written(monkeypatch, capture):
    from routereplay.sidecar import SidecarReader
    folder, finish = capture
    app = _build(monkeypatch, ["--api-key", KEY])
    finish("r1")
    bodies = ({"weight_version": "x" * (2 << 20)}, {"weight_version": "x" * 257},
              {"weight_version": "v\n2"}, {"weight_version": 2}, {"weight_version": ""},
              {"weight_versoin": "v2"}, ["v2"], b"{", b"[" * 60000)
    got = _call(app, [("POST", "/routereplay/rotate", dict(
        headers=_auth(), **({"content": b} if isinstance(b, bytes) else {"json": b})))
        for b in bodies])
    assert [r.status_code for r in got] == [413] + [400] * 8     # the 2 MiB label: 413
    errors = [r.json()["error"] for r in got]
    assert "257 characters long, above the limit of 256" in errors[1] and len(errors[1]) < 200
    assert "'\\n' at position 1" in errors[2] and "must be a string" in errors[3]
    assert "must not be empty" in errors[4] and "weight_versoin" in errors[5]
    assert "JSON object" in errors[6] and errors[7] == errors[8] == "body must be JSON"
    (streams,) = _call(app, [("GET", "/routereplay/streams", {"headers": _auth()})])
    assert streams.json()["streams"] == [
        {"name": streams.json()["streams"][0]["name"], "weight_version": None, "records": 1,
         "closed": False}]                                    # not closed by a refused call
    (rot,) = _call(app, [("POST", "/routereplay/rotate",
                          {"headers": _auth(), "json": {"weight_version": "step-2"}})])
    assert rot.status_code == 200
    finish("r2")
    (fl,) = _call(app, [("POST", "/routereplay/flush", {"headers": _auth()})])
    first, second = fl.json()["streams"]
    assert (first["records"], first["closed"], second["records"], second["closed"]) == (
        1, True, 1, False) and second["weight_version"] == "step-2"
    assert rot.json()["closed"] == first["name"]
    with SidecarReader(str(folder / second["name"])) as r:
        assert r.sample_ids() == ["r2"] and r.header["extra"]["weight_version"] == "step-2"
    from engine_patches.vllm import plugin
    assert plugin.stats()["errors"] == 0 and plugin.stats()["written"] == 2
    from routereplay.errors import ConfigError
    for label, why in (("x" * (2 << 20), "above the limit of 256"), (7, "must be a string")):
        with pytest.raises(ConfigError, match=why):
            plugin.rotate(label)
    assert plugin.streams()[-1].closed is False                 # refused before any close


def test_a_body_over_the_limit_is_refused_after_a_bounded_read(monkeypatch, capture):
    app = _build(monkeypatch, ["--api-key", KEY])
    sent = []

    async def body(n_chunks=4096):                 # 4096 x 64 KiB = 256 MiB, if all were read
        for i in range(n_chunks):
            sent.append(i)
            yield b" " * (64 << 10)
    got = _call(app, [("POST", "/routereplay/rotate", {"headers": _auth(), "content": body()})])
    assert (got[0].status_code, got[0].json()) == (
        413, {"error": "request body above 65536 bytes"})          # endpoints.MAX_BODY
    assert len(sent) <= 3, len(sent)            # 64 KiB read, the rest never pulled
    sent.clear()                                   # a declared length: refused unread
    got = _call(app, [("POST", "/routereplay/rotate", {
        "headers": dict(_auth(), **{"Content-Length": str(256 << 20)}), "content": body(2)})])
    assert got[0].status_code == 413 and sent == []
    sent.clear()                                   # without the key: the body is not read
    got = _call(app, [("POST", "/routereplay/rotate", {"content": body()})])
    assert got[0].status_code == 401 and sent == []


def test_streams_name_no_server_path(monkeypatch, capture):
    folder, finish = capture
    app = _build(monkeypatch, ["--api-key", KEY])
    finish("r3")
    (rot,) = _call(app, [("POST", "/routereplay/rotate", {"headers": _auth()})])
    finish("r4")
    (ls,) = _call(app, [("GET", "/routereplay/streams", {"headers": _auth()})])
    assert str(folder) not in rot.text + ls.text
    names = [s["name"] for s in ls.json()["streams"]]
    assert rot.json()["closed"] == names[0] and len(names) == 2 and "/" not in "".join(names)
    from engine_patches.vllm import plugin
    assert [str(folder / n) for n in names] == [s.path for s in plugin.streams()]
