"""The asyncio SGLang client (httpx) against a loopback server speaking SGLang 0.5.23's
/generate with payloads from SGLang's own code (tests/fixtures/sglang): 200 concurrent
requests over a bounded, pooled set of keep-alive connections, with dropped connections,
HTTP 503 and a timeout retried, every record streamed into the sidecar writer."""
import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("httpx", reason="needs the sglang extra")

from engine_patches.sglang.client import AsyncSGLangRoutingClient, SGLangRoutingClient  # noqa: E402
from engine_patches.sglang.http import SGLangHTTPError  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import SidecarReader, SidecarWriter  # noqa: E402

FIX = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang",
                                  "sglang_0.5.23_payloads.json")))
SCHEMA = RoutingSchema.from_hf_config(FIX["config"])
CASES = {n: FIX["cases"][n] for n in ("basic", "prefix_hit", "turn1", "update_in_place", "retract")}
BY_PROMPT = {tuple(c["prompt_ids"]): n for n, c in CASES.items()}


class _Load(BaseHTTPRequestHandler):
    """/generate answering with the fixture response of the prompt; misbehaves on purpose
    on the first attempt of some requests: drops the connection (rid % 20 == 0), answers
    503 (rid % 20 == 5), or stalls past the client's timeout (rid == 7)."""
    protocol_version = "HTTP/1.1"          # keep-alive: connections are reused
    lock = threading.Lock()
    attempts: dict = {}
    inflight = peak = 0
    connections: set = set()

    def log_message(self, *a):
        pass

    def do_POST(self):
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rid = body["rid"]
        with cls.lock:
            cls.connections.add(self.client_address)
            cls.attempts[rid] = cls.attempts.get(rid, 0) + 1
            first = cls.attempts[rid] == 1
            cls.inflight += 1
            cls.peak = max(cls.peak, cls.inflight)
        try:
            assert self.path == "/generate" and body["return_routed_experts"] is True
            if first and rid % 20 == 0:
                self.close_connection = True          # no reply: the client sees a reset
                return
            if first and rid == 7:
                time.sleep(1.5)                       # past the client's 1 s timeout
            time.sleep(0.01)                          # so that requests overlap
            if first and rid % 20 == 5:
                code, out = 503, b'{"error": "overloaded"}'
            else:
                code = 200
                out = json.dumps(CASES[BY_PROMPT[tuple(body["input_ids"])]]["response"]).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        finally:
            with cls.lock:
                cls.inflight -= 1


@pytest.fixture
def load_server():
    _Load.attempts, _Load.inflight, _Load.peak, _Load.connections = {}, 0, 0, set()
    ThreadingHTTPServer.request_queue_size = 256        # NOTE: the default backlog is 5
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Load)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _payloads(n):
    names = list(CASES)
    return [{"input_ids": CASES[names[i % len(names)]]["prompt_ids"], "rid": i,
             "sampling_params": {"max_new_tokens": 4}} for i in range(n)], \
        [names[i % len(names)] for i in range(n)]


def _truth(name):
    return np.array(CASES[name]["truth"])[:, list(SCHEMA.moe_layer_ids)]


def test_200_concurrent_requests_pooled_bounded_retried_and_streamed(load_server):
    payloads, names = _payloads(200)
    w = SidecarWriter(None, SCHEMA)

    async def main():
        async with AsyncSGLangRoutingClient(load_server, SCHEMA, w, max_concurrency=32,
                                            timeout=1.0, retries=3, backoff_s=0.01) as c:
            t0 = time.perf_counter()
            out = await c.generate_many(payloads, sample_ids=[f"s{i}" for i in range(200)])
            return out, c.stats, time.perf_counter() - t0
    out, stats, wall = asyncio.run(main())
    w.close()
    assert len(out) == 200 and [rec.sample_id for _, rec in out] == [f"s{i}" for i in range(200)]
    # bounded: never more than 32 in flight, but really concurrent
    assert 4 < _Load.peak <= 32, _Load.peak
    # pooled: 200 requests (+ retries) over far fewer connections than requests
    assert len(_Load.connections) <= 32 + 10 + 1, len(_Load.connections)
    # retried: 10 dropped connections, 10 HTTP 503, 1 timeout (more transport errors when
    # the machine is loaded, e.g. refused connections, are retried the same way)
    bad = [i for i in range(200) if i % 20 in (0, 5) or i == 7]
    assert all(_Load.attempts[i] >= 2 for i in bad) and stats["retries"] >= 21
    assert stats["requests"] == 200 + stats["retries"] >= sum(_Load.attempts.values()) >= 221
    assert stats["records"] == 200
    assert wall < 20
    got = {r.sample_id: r for r in SidecarReader(w.getvalue()).records()}
    assert len(got) == 200
    for i, name in enumerate(names):
        np.testing.assert_array_equal(got[f"s{i}"].expert_ids, _truth(name))
        assert got[f"s{i}"].token_ids[:len(CASES[name]["prompt_ids"])].tolist() == \
            CASES[name]["prompt_ids"]


def test_retries_exhausted_name_the_endpoint_and_nothing_is_written(load_server):
    w = SidecarWriter(None, SCHEMA)

    async def main():
        async with AsyncSGLangRoutingClient(load_server, SCHEMA, w, retries=0) as c:
            return await c.generate_many(_payloads(2)[0][1:] + [{"input_ids": [1], "rid": 20}],
                                         sample_ids=["ok", "dropped"], return_exceptions=True)
    ok, err = asyncio.run(main())
    w.close()
    assert ok[1].sample_id == "ok"
    assert isinstance(err, SGLangHTTPError) and "POST /generate" in str(err) \
        and "after 1 attempts" in str(err)
    assert SidecarReader(w.getvalue()).sample_ids() == ["ok"]


def test_blocking_client_shares_the_policy(load_server):
    w = SidecarWriter(None, SCHEMA)
    with SGLangRoutingClient(load_server, SCHEMA, w, retries=1, backoff_s=0.01) as c:
        payloads, names = _payloads(6)
        for i in (0, 5):                    # dropped connection, then 503: both retried
            resp, rec = c.generate(payloads[i], sample_id=f"b{i}")
            np.testing.assert_array_equal(rec.expert_ids, _truth(names[i]))
    w.close()
    assert SidecarReader(w.getvalue()).sample_ids() == ["b0", "b5"]
