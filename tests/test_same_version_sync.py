"""A weight update labelled with the engine's current weight version is refused before the
engine is paused (issue 28, kind 2), unless ``reload_same_version=True``: the shared rule
(routereplay.weight_sync.check_new_version) and SGLang's sync against an HTTP server on
127.0.0.1 that keeps its weight version as SGLang 0.5.23 does (``GET /model_info``'s
``weight_version``, "default" at start, set by ``/update_weight_version`` and by a
successful ``/update_weights_from_*`` with ``weight_version``). The vLLM entry points are
checked on the real engine (tests/vllm_engine_checks.py, part_same_version)."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from routereplay.errors import WeightSyncError
from routereplay.weight_sync import FromCheckpoint

pytest.importorskip("httpx", reason="needs the sglang extra")

from engine_patches.sglang.weight_sync import SGLangWeightSync  # noqa: E402


class _Server(BaseHTTPRequestHandler):
    """SGLang 0.5.23's control endpoints that the sync uses, with a real weight version.
    ``reads``: the GET paths served (an older SGLang: only /get_model_info; a router in
    front: none)."""
    calls: list = []
    version = "default"
    reads = ("/model_info",)
    read_status = 200

    def log_message(self, *a):
        pass

    def _reply(self, code, obj):
        body = json.dumps(obj).encode() if not isinstance(obj, str) else obj.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        type(self).calls.append(("GET " + self.path, None))
        if self.path not in self.reads:
            return self._reply(404, {"detail": "Not Found"})
        if self.read_status != 200:
            return self._reply(self.read_status, {"error": "internal"})
        return self._reply(200, {"model_path": "/m", "weight_version": type(self).version})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        path = self.path.partition("?")[0]
        type(self).calls.append((path, body))
        if path in ("/pause_generation", "/continue_generation"):
            return self._reply(200, {"status": "ok"})
        if path.startswith("/update_weights_from_"):
            if body.get("weight_version") is not None:
                type(self).version = body["weight_version"]
            return self._reply(200, {"success": True, "message": "ok"})
        if path == "/update_weight_version":
            type(self).version = body["new_version"]
            return self._reply(200, {"success": True, "new_version": body["new_version"]})
        if path == "/flush_cache":
            return self._reply(200, "Cache flushed.")
        return self._reply(404, {"detail": "Not Found"})


@pytest.fixture
def server():
    _Server.calls, _Server.version = [], "default"
    _Server.reads, _Server.read_status = ("/model_info",), 200
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _posted():
    return [p for p, _ in _Server.calls if not p.startswith("GET ")]


def test_the_rule_refuses_only_the_current_label():
    from routereplay.weight_sync import check_new_version
    with pytest.raises(WeightSyncError, match="'step-3' refused: 'step-3' is already the "
                                              "engine's weight version.*not paused"):
        check_new_version("step-3", "step-3")
    with pytest.raises(WeightSyncError, match="after_weight_update to version 'step-3' refused"
                                              ".*Nothing was done.*finish_weight_update"):
        check_new_version("step-3", "step-3", after_update=True)
    check_new_version("step-3", "step-3", reload_same_version=True)
    check_new_version("step-4", "step-3")
    check_new_version("step-3", None)                  # unknown: nothing to compare


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_sglang_sync_under_the_current_label_is_refused_before_the_pause(server, mode):
    ws = SGLangWeightSync(server)
    rep = ws.sync(FromCheckpoint("/ckpt/a"), "step-1", mode=mode)
    assert _Server.version == "step-1" and rep.calls[0] == "/pause_generation"
    _Server.calls = []
    with pytest.raises(WeightSyncError, match="'step-1' refused.*not paused.*reload_same_version"):
        ws.sync(FromCheckpoint("/ckpt/b"), "step-1", mode=mode)
    assert _Server.calls == [("GET /model_info", None)]        # read, nothing posted
    # the server's version counts, not this object's memory: a fresh object, a version-only
    # step and the after-update step are refused the same way
    for call in (lambda: SGLangWeightSync(server).sync(FromCheckpoint("/ckpt/b"), "step-1"),
                 lambda: SGLangWeightSync(server).sync(None, "step-1"),
                 lambda: SGLangWeightSync(server).after_weight_update("step-1")):
        with pytest.raises(WeightSyncError, match="'step-1' refused"):
            call()
    assert _posted() == []
    # the server's first version is "default": an update labelled so is refused too
    _Server.version = "default"
    with pytest.raises(WeightSyncError, match="'default' refused"):
        ws.sync(FromCheckpoint("/ckpt/b"), "default", mode=mode)
    assert _posted() == []


def test_sglang_reload_of_the_same_version_flushes_the_prefix_cache(server):
    ws = SGLangWeightSync(server, initial_version="step-1")
    _Server.calls = []
    rep = ws.sync(FromCheckpoint("/ckpt/a"), "step-1", mode="abort", reload_same_version=True)
    assert rep.calls == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    upd = dict(_Server.calls)["/update_weights_from_disk"]
    assert upd["flush_cache"] is True and upd["weight_version"] == "step-1"
    rep = ws.sync(FromCheckpoint("/ckpt/a"), "step-1", mode="keep", reload_same_version=True)
    assert rep.calls[-1] == "/flush_cache"                       # after resume, as any keep
    rep = ws.after_weight_update("step-1", reload_same_version=True)
    assert rep.calls == ["/update_weight_version", "/flush_cache"] and _Server.version == "step-1"


def test_sglang_version_read_older_server_router_and_failure(server):
    # an SGLang before /model_info: /get_model_info answers
    _Server.reads, _Server.version = ("/get_model_info",), "step-5"
    with pytest.raises(WeightSyncError, match="'step-5' refused"):
        SGLangWeightSync(server).sync(FromCheckpoint("/c"), "step-5")
    assert [p for p, _ in _Server.calls] == ["GET /model_info", "GET /get_model_info"]
    # a server that reports no version (a router forwarding only some routes): the label
    # this object last set counts
    _Server.reads, _Server.calls = (), []
    ws = SGLangWeightSync(server)
    ws.sync(FromCheckpoint("/c"), "step-6")
    with pytest.raises(WeightSyncError, match="'step-6' refused"):
        ws.sync(FromCheckpoint("/c"), "step-6")
    ws.after_weight_update("step-7")
    with pytest.raises(WeightSyncError, match="'step-7' refused"):
        ws.after_weight_update("step-7")
    # a read that fails otherwise is an error before the pause, not a skipped check
    _Server.reads, _Server.read_status, _Server.calls = ("/model_info",), 500, []
    with pytest.raises(WeightSyncError, match="'step-8' failed at reading the server's weight "
                                              "version: GET /model_info: HTTP 500.*Nothing was "
                                              "sent"):
        ws.sync(FromCheckpoint("/c"), "step-8")
    assert _posted() == []
