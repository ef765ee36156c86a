"""The SGLang clients (asyncio, blocking) and the weight sync's HTTP calls against a hostile
server on 127.0.0.1 (raw sockets): deeply nested JSON, a reply trickled one byte at a time
(status line and headers too), replies far above the size bound (announced or not), bytes
that are not UTF-8. Every case is a library error naming the request, within the deadline,
with the bytes read and the memory spent bounded by the reply bound, not by the server."""
import asyncio
import json
import os
import socketserver
import threading
import time
import tracemalloc

import pytest

pytest.importorskip("httpx", reason="needs the sglang extra")

from engine_patches.sglang import client as sgc  # noqa: E402
from engine_patches.sglang.client import AsyncSGLangRoutingClient, SGLangRoutingClient  # noqa: E402
from engine_patches.sglang.http import SGLangHTTPError  # noqa: E402
from engine_patches.sglang.weight_sync import SGLangWeightSync  # noqa: E402
from routereplay.errors import WeightSyncError  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402

FIX = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang",
                                  "sglang_0.5.23_payloads.json")))
SCHEMA = RoutingSchema.from_hf_config(FIX["config"])
BASIC = FIX["cases"]["basic"]
PAYLOAD = {"input_ids": BASIC["prompt_ids"], "sampling_params": {"max_new_tokens": 4}}
DEPTH = 5_000                   # deeper than Python's parser recurses; padded below so that
PAD = b" " * (DEPTH * 16)       # the bracket count stays within the container bound
TRICKLE_STEP_S, TRICKLE_S = 0.25, 6.0
HUGE = 200 << 20
CHUNK = b" " * (1 << 20)
TIMEOUT = 1.0
KINDS = ["async", "blocking", "weight_sync"]


class _Hostile(socketserver.StreamRequestHandler):
    """One request per connection; the first path segment picks the misbehaviour. ``sent``
    records, per path, the body bytes the server got onto the socket."""
    sent: dict = {}

    def handle(self):
        try:
            path = self.rfile.readline().decode().split(" ")[1]
            n = 0
            while (h := self.rfile.readline()) not in (b"\r\n", b""):
                k, _, v = h.decode().partition(":")
                n = int(v) if k.strip().lower() == "content-length" else n
            self.rfile.read(n)
            getattr(self, path.split("/")[1])(path)
        except OSError:                 # the client hung up, as it should
            pass

    @staticmethod
    def _head(extra: bytes = b"") -> bytes:
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + extra + b"\r\n")

    def _send(self, head: bytes, body: bytes) -> None:
        self.wfile.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def ok(self, path):
        self._send(self._head()[:-2], json.dumps(BASIC["response"]).encode())

    def nested(self, path):
        self._send(self._head()[:-2], b"[" * DEPTH + PAD + b"]" * DEPTH)

    def containers(self, path):                 # 3 bytes a container: ~27x as Python objects
        self._send(self._head()[:-2], b'{"meta_info": [' + b"{}," * 200_000 + b"{}]}")

    def binary(self, path):
        self._send(self._head()[:-2], b'{"text": "\xff\xfe"}')

    def trickle(self, path):
        msg = self._head(b"Content-Length: 2\r\n") + b"{}"
        end = time.monotonic() + TRICKLE_S
        for i in range(len(msg)):
            if time.monotonic() > end:
                return
            self.wfile.write(msg[i:i + 1])
            time.sleep(TRICKLE_STEP_S)

    def _huge(self, path, head):
        sent = 0
        try:
            self.wfile.write(head)
            while sent < HUGE:
                self.wfile.write(CHUNK)
                sent += len(CHUNK)
        finally:
            type(self).sent[path] = sent

    def huge(self, path):                       # no Content-Length: the body ends at close
        self._huge(path, self._head())

    def announced(self, path):
        self._huge(path, self._head(b"Content-Length: %d\r\n" % HUGE))


@pytest.fixture(scope="module")
def hostile():
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Hostile)
    srv.daemon_threads, srv.block_on_close = True, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _call(kind, base, **kw):
    """The error one request of ``kind`` raises, and the seconds it took."""
    t0 = time.monotonic()
    try:
        if kind == "async":
            async def main():
                async with AsyncSGLangRoutingClient(base, SCHEMA, retries=0, timeout=TIMEOUT,
                                                    **kw) as c:
                    return await c.generate(PAYLOAD, sample_id="h1")
            asyncio.run(main())
        elif kind == "blocking":
            with SGLangRoutingClient(base, SCHEMA, retries=0, timeout=TIMEOUT, **kw) as c:
                c.generate(PAYLOAD, sample_id="h1")
        else:
            SGLangWeightSync(base, timeout=TIMEOUT).pause()
    except Exception as e:          # NOTE: any type, so that the checks below tell what went wrong
        return e, time.monotonic() - t0
    raise AssertionError(f"{kind} request to {base} raised nothing")


def _names_the_request(kind, err):
    assert isinstance(err, SGLangHTTPError), repr(err)[:300]
    want = "POST /pause_generation" if kind == "weight_sync" else "POST /generate (sample 'h1')"
    assert want in str(err), str(err)


@pytest.mark.parametrize("kind", KINDS)
def test_json_of_mostly_containers_is_refused_before_parsing(hostile, kind):
    """(Attacker review) a reply within the size bound whose JSON is nearly all objects
    (`[{},{},...]`) cost 27x its bytes once parsed (+746 MiB from 28 MiB): refused by its
    bracket count before json.loads."""
    import tracemalloc
    tracemalloc.start()
    err, wall = _call(kind, hostile + "/containers")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    _names_the_request(kind, err)
    assert "200003 objects or arrays, more than one per 16 bytes" in str(err), str(err)
    assert peak < 8 * 600_000 + (4 << 20), peak          # not the ~16 MB a parse would take


@pytest.mark.parametrize("kind", KINDS)
def test_deeply_nested_json_is_a_library_error(hostile, kind):
    err, wall = _call(kind, hostile + "/nested")
    _names_the_request(kind, err)
    assert "nested too deeply" in str(err) and not err.retryable
    assert wall < 5, wall


@pytest.mark.parametrize("kind", KINDS)
def test_a_trickled_reply_is_cut_off_at_the_deadline(hostile, kind):
    # one byte every 0.25 s, from the status line on: no single read ever waits 1 s
    err, wall = _call(kind, hostile + "/trickle")
    assert TIMEOUT - 0.05 <= wall < TIMEOUT + 0.75, wall
    _names_the_request(kind, err)
    assert f"no complete reply within {TIMEOUT:g} s" in str(err) and err.retryable


@pytest.mark.parametrize("announce", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_far_above_the_bound_stops_early(hostile, kind, announce):
    path = f"/{'announced' if announce else 'huge'}/{kind}"
    tracemalloc.start()
    try:
        err, wall = _call(kind, hostile + path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the server could push only what the socket buffers hold past the bound
    key = path + ("/pause_generation" if kind == "weight_sync" else "/generate")
    t = time.monotonic()
    while key not in _Hostile.sent and time.monotonic() - t < 5:
        time.sleep(0.01)
    assert _Hostile.sent[key] < 32 << 20, _Hostile.sent[key]
    assert peak < 16 << 20, peak                # the 200 MiB reply is never held
    assert wall < 5, wall
    _names_the_request(kind, err)
    bound = 1 << 20 if kind == "weight_sync" else sgc.reply_bound(PAYLOAD, SCHEMA)
    assert 1 << 20 <= bound < 2 << 20
    assert (f"announces {HUGE} bytes, more than the {bound}-byte bound" if announce
            else f"passes the {bound}-byte bound") in str(err), str(err)
    assert not err.retryable


@pytest.mark.parametrize("kind", ["async", "blocking"])
def test_bytes_that_are_not_utf8_are_a_library_error(hostile, kind):
    err, _ = _call(kind, hostile + "/binary")
    _names_the_request(kind, err)
    assert "reply is not JSON (UnicodeDecodeError" in str(err) and not err.retryable


def test_weight_sync_names_the_step_of_a_hostile_reply(hostile):
    # NOTE: the sync reads the server's weight version first (an update under the current
    # label is refused before the pause): the hostile reply meets that read
    with pytest.raises(WeightSyncError, match="failed at reading the server's weight version: "
                                              "GET /model_info: reply JSON .* nested too deeply"):
        SGLangWeightSync(hostile + "/nested", timeout=TIMEOUT).sync(None, "v2", mode="abort")


def test_a_real_reply_fits_its_derived_bound(hostile):
    size = len(json.dumps(BASIC["response"]).encode())
    assert sgc.reply_bound(PAYLOAD, SCHEMA) > size
    assert sgc.reply_bound({"input_ids": [1, 2]}, SCHEMA) is None      # no output length stated
    with SGLangRoutingClient(hostile + "/ok", SCHEMA, retries=0, timeout=5) as c:
        _, rec = c.generate(PAYLOAD, sample_id="fits")
    assert rec.sample_id == "fits" and rec.num_tokens == len(BASIC["prompt_ids"]) + 4 - 1
    err, _ = _call("blocking", hostile + "/ok", max_reply_bytes=size - 1)
    assert isinstance(err, SGLangHTTPError) and \
        f"announces {size} bytes, more than the {size - 1}-byte bound" in str(err)
