"""SGLang adapter, client and weight sync, on payloads produced by SGLang 0.5.23's own code
(tests/fixtures/sglang/make_fixtures.py) and a loopback HTTP server speaking SGLang's API."""
import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from engine_patches.sglang.client import SGLangRoutingClient, next_start, with_routing
from engine_patches.sglang.records import record_from_response, record_from_stream
from engine_patches.sglang.weight_sync import SGLangWeightSync
from routereplay.errors import ConfigError, RecordError, WeightSyncError
from routereplay.weight_sync import FromCheckpoint, FromDistributed, FromTensors
from routereplay.schema import RoutingSchema
from routereplay.multi_turn import merge_segments
from routereplay.sidecar import SidecarReader, SidecarWriter
from tests.conftest import run_py

FIX = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang",
                                  "sglang_0.5.23_payloads.json")))
SCHEMA = RoutingSchema.from_hf_config(FIX["config"])          # 4 layers, layer 0 dense, 8 x top-2
CASES = FIX["cases"]


def _truth(name, start=0):
    return np.array(CASES[name]["truth"])[start:, list(SCHEMA.moe_layer_ids)]


def _rec(name, **kw):
    c = CASES[name]
    return record_from_response(c["response"], SCHEMA, prompt_ids=c["prompt_ids"], **kw)


@pytest.mark.parametrize("name", ["basic", "prefix_hit", "start_len", "turn1", "turn2",
                                  "update_in_place", "retract", "openai"])
def test_records_match_the_routing_the_model_used(name):
    c = CASES[name]
    start = c["request"].get("routed_experts_start_len", 0)
    if start:                  # a later start: the row count alone cannot place the rows
        with pytest.raises(RecordError, match=f"start_len {start} with complete rows"):
            record_from_response(c["response"], SCHEMA)
    rec = record_from_response(c["response"], SCHEMA,            # start 0: inferred
                               start_len=start or None)
    assert rec.start == start
    np.testing.assert_array_equal(rec.expert_ids, _truth(name, start))
    assert rec.expert_ids.dtype == np.uint8 and rec.expert_ids.shape[1] == 3   # dense layer 0 stripped
    np.testing.assert_array_equal(record_from_response(c["response"], SCHEMA, start_len=start).expert_ids,
                                  rec.expert_ids)


def test_prefix_hit_rows_come_from_the_cache():
    rec, base = _rec("prefix_hit"), _rec("basic")
    assert rec.prefix_cached == [(0, 4)]
    np.testing.assert_array_equal(rec.expert_ids[:4], base.expert_ids[:4])
    assert rec.token_ids.tolist() == CASES["prefix_hit"]["prompt_ids"] + \
        CASES["prefix_hit"]["response"]["output_ids"]


def test_multi_turn_segments_rebuild_the_conversation():
    t1 = _rec("turn1")
    t2 = _rec("turn2", start_len=next_start(t1))
    assert (t1.start, t1.num_tokens, t2.start) == (0, 7, 7)
    conv = merge_segments([t2, t1], "conv")
    np.testing.assert_array_equal(conv.expert_ids, _truth("turn2"))     # the whole conversation
    assert conv.start == 0 and conv.recomputed == [] and conv.prompt_len == 11
    assert conv.token_ids.tolist() == CASES["turn2"]["prompt_ids"] + [94, 95, 96]


def test_weight_version_spans_cover_prompt_and_output_rows():
    rec = _rec("update_in_place")          # P=4, output spans v1 [0, 3), v2 [3, 5)
    assert CASES["update_in_place"]["response"]["meta_info"]["weight_versions"][0]["end"] == 3
    assert [(s.version, s.start, s.end) for s in rec.weight_versions] == [("v1", 0, 6), ("v2", 6, 8)]
    assert rec.recomputed == []
    assert [(s.version, s.start, s.end) for s in _rec("basic").weight_versions] == [("v1", 0, 9)]


def test_retracted_request_is_flagged_recomputed():
    rec = _rec("retract")
    assert CASES["retract"]["response"]["meta_info"]["num_retractions"] == 1
    assert rec.recomputed == [(0, 7)]
    # every row was re-prefilled under v2 (the fixture's truth), whatever sampled the tokens
    assert [(s.version, s.start, s.end) for s in rec.weight_versions] == [("v2", 0, 7)]


def test_openai_response_and_stream():
    rec = record_from_response(CASES["openai"]["response"], SCHEMA)
    assert rec.sample_id == "cmpl-oa1" and rec.weight_versions[0].version == "v1"
    resp = CASES["basic"]["response"]
    meta = dict(resp["meta_info"])
    routed = meta.pop("routed_experts")
    chunks = [{"text": "", "output_ids": resp["output_ids"][:i], "meta_info": {**meta, "completion_tokens": i}}
              for i in range(1, 4)]
    chunks.append({"text": "", "output_ids": resp["output_ids"], "meta_info": {**meta, "routed_experts": routed}})
    s = record_from_stream(chunks, SCHEMA)
    np.testing.assert_array_equal(s.expert_ids, _truth("basic"))
    with pytest.raises(RecordError, match="final chunk.*--enable-return-routed-experts"):
        record_from_stream(chunks[:-1], SCHEMA)


def test_fused_shared_expert_columns():
    f = FIX["fused_shared"]
    schema = RoutingSchema.from_hf_config(f["config"])        # DeepSeek-like: layer 0 dense
    # SGLang 0.5.23 strips the fused column from the response: the payload is top_k wide
    rec = record_from_response(f["response"], schema)
    np.testing.assert_array_equal(rec.expert_ids, np.array(f["truth"])[:, 1:])
    with pytest.raises(RecordError, match="req-fused.*pass num_fused_shared_experts=0"):
        record_from_response(f["response"], schema, num_fused_shared_experts=1, start_len=0)
    # an older layout that still carries the -1-padded shared column: width stated
    full = np.array(f["truth"], dtype="<i4")
    wide = np.concatenate([full, np.full(full.shape[:2] + (1,), -1, "<i4")], axis=2)
    resp = json.loads(json.dumps(f["response"]))
    resp["meta_info"]["routed_experts"] = base64.b64encode(wide.tobytes()).decode()
    np.testing.assert_array_equal(
        record_from_response(resp, schema, num_fused_shared_experts=1).expert_ids, rec.expert_ids)
    wide[0, 1, 2] = 3                                          # a routed id in the shared column
    resp["meta_info"]["routed_experts"] = base64.b64encode(wide.tobytes()).decode()
    with pytest.raises(RecordError, match="req-fused.*shared-expert columns"):
        record_from_response(resp, schema, num_fused_shared_experts=1)


def _with_payload(name, arr=None, raw=None, **meta):
    resp = json.loads(json.dumps(CASES[name]["response"]))
    if arr is not None:
        raw = np.ascontiguousarray(arr, dtype="<i4").tobytes()
    if raw is not None:
        resp["meta_info"]["routed_experts"] = base64.b64encode(raw).decode()
    resp["meta_info"].update(meta)
    return resp


def test_bad_payloads_name_the_request():
    truth = np.array(CASES["basic"]["truth"], dtype="<i4")
    with pytest.raises(RecordError, match="req-basic.*not a whole number of rows of num_hidden_layers x top_k = 4 x 2"):
        record_from_response(_with_payload("basic", raw=truth.tobytes()[:-4]), SCHEMA)
    bad = truth.copy()
    bad[5, 2, 1] = 8
    with pytest.raises(RecordError, match="req-basic'?, token 5, layer 2: expert id 8 outside"):
        record_from_response(_with_payload("basic", bad), SCHEMA)
    with pytest.raises(RecordError, match="req-off.*--enable-return-routed-experts.*return_routed_experts=True"):
        record_from_response(CASES["flag_off"]["response"], SCHEMA)
    with pytest.raises(RecordError, match="req-basic.*start_len 7 outside \\[0, prompt length 6\\]"):
        record_from_response(CASES["basic"]["response"], SCHEMA, start_len=7)
    with pytest.raises(RecordError, match="'req-basic': routing row-count mismatch: .* = 9 rows "
                       ".*implies 7 rows"):
        record_from_response(CASES["basic"]["response"], SCHEMA, start_len=2)
    with pytest.raises(RecordError, match="req-basic.*not base64"):
        record_from_response(_with_payload("basic", raw=None, routed_experts="@@@"), SCHEMA)
    for field, value in [("cached_tokens", "abc"), ("cached_tokens", 1000),
                         ("weight_versions", [{"version": "v1", "start": 0, "end": float("inf")}]),
                         ("weight_versions", [{"version": "v1", "start": 1, "end": 2}]),
                         ("num_retractions", -1)]:
        with pytest.raises(RecordError, match="req-basic"):
            record_from_response(_with_payload("basic", **{field: value}), SCHEMA)
    resp = _with_payload("basic", output_token_logprobs=[None] * 4)
    resp["output_ids"] = ["x"] * 4
    with pytest.raises(RecordError, match="req-basic.*malformed"):
        record_from_response(resp, SCHEMA, prompt_ids=CASES["basic"]["prompt_ids"])
    # a truncated payload without the start: refused, naming both readings
    short = _with_payload("basic", truth[:-1])
    with pytest.raises(RecordError, match="req-basic': 8 routing rows .*start_len 1 with "
                                          "complete rows, or start_len 0 with a payload "
                                          "truncated by 1 rows"):
        record_from_response(short, SCHEMA)
    short["routed_experts_start_len"] = 0
    with pytest.raises(RecordError, match="row-count mismatch: .* = 8 rows .*implies 9 rows"):
        record_from_response(short, SCHEMA)
    oa = json.loads(json.dumps(CASES["openai"]["response"]))
    oa["choices"].append(dict(oa["choices"][0], index=1))
    with pytest.raises(RecordError, match="cmpl-oa1.*2 choices"):
        record_from_response(oa, SCHEMA)


def test_convert_sglang_json_and_export(tmp_path):
    lines = [CASES[n]["response"] for n in ("basic", "start_len", "update_in_place", "openai")]
    lines[1] = {**lines[1], "routed_experts_start_len": 3}       # as the request was sent
    src = tmp_path / "responses.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(FIX["config"]))
    out = tmp_path / "s.rrsc"
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-json", str(src), "--out",
                str(out), "--config", str(tmp_path / "model")], timeout=120)
    assert p.returncode == 0, p.stderr
    r = SidecarReader(str(out))
    assert r.sample_ids() == ["req-basic", "req-start_len", "req-update_in_place", "cmpl-oa1"]
    assert r.read("req-start_len").start == 3
    p = run_py(["-m", "routereplay.cli", "export", str(out), "--sample", "req-start_len", "--out",
                str(tmp_path / "x.npy")], timeout=120)
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), _truth("start_len", 3))
    src.write_text(json.dumps(CASES["basic"]["response"]) + "\n" +
                   json.dumps(CASES["flag_off"]["response"]) + "\n")
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "sglang-json", str(src), "--out",
                str(out), "--config", str(tmp_path / "model")], timeout=120)
    assert p.returncode == 1 and "responses.jsonl:2: request 'req-off'" in p.stderr
    assert SidecarReader(str(out)).sample_ids() == ["req-basic"]


class _FakeSGLang(BaseHTTPRequestHandler):
    """Implements the request/response fields of SGLang 0.5.23's HTTP API that we call."""
    calls: list = []
    fail: dict = {}
    running = 0
    version = "default"               # SGLang 0.5.23's weight_version until an update

    def log_message(self, *a):
        pass

    def _reply(self, code, obj):
        body = json.dumps(obj).encode() if not isinstance(obj, str) else obj.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        # NOTE: not in `calls`: the sync's read of the current version (GET /model_info)
        if self.path == "/model_info":
            return self._reply(200, {"model_path": "tiny", "weight_version": type(self).version})
        return self._reply(404, {"error": self.path})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        path, _, query = self.path.partition("?")
        type(self).calls.append((path, body, query))
        if path in self.fail:
            return self._reply(*self.fail[path])
        if path == "/generate":
            assert body["return_routed_experts"] is True
            return self._reply(200, CASES["basic"]["response"])
        if path == "/pause_generation":
            assert body["mode"] in ("abort", "retract", "in_place")
            return self._reply(200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            return self._reply(200, {"message": "Generation continued successfully.", "status": "ok"})
        if path.startswith("/update_weights_from_"):
            assert {"weight_version", "flush_cache", "abort_all_requests"} <= set(body)
            if body["weight_version"] is not None:
                type(self).version = body["weight_version"]
            return self._reply(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        if path == "/update_weight_version":
            type(self).version = body["new_version"]
            return self._reply(200, {"success": True, "message": f"Weight version updated to "
                                     f"{body['new_version']}", "new_version": body["new_version"]})
        if path == "/flush_cache":
            return self._reply(200, "Cache flushed.")
        return self._reply(404, {"error": path})


@pytest.fixture
def sglang_server():
    _FakeSGLang.calls, _FakeSGLang.fail, _FakeSGLang.version = [], {}, "default"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_client_streams_records_into_a_sidecar(sglang_server):
    w = SidecarWriter(None, SCHEMA)
    client = SGLangRoutingClient(sglang_server, SCHEMA, w)
    payload = {"input_ids": CASES["basic"]["prompt_ids"], "sampling_params": {"max_new_tokens": 4}}
    resp, rec = client.generate(payload)
    w.close()
    path, body, _ = _FakeSGLang.calls[-1]
    assert path == "/generate" and body["routed_experts_start_len"] == 0
    assert with_routing({"prompt": "x"}, 5) == {"prompt": "x", "return_routed_experts": True,
                                                 "routed_experts_start_len": 5}
    got = SidecarReader(w.getvalue()).read("req-basic")
    np.testing.assert_array_equal(got.expert_ids, _truth("basic"))
    assert got.token_ids.tolist()[:6] == CASES["basic"]["prompt_ids"]


@pytest.mark.parametrize("mode,source,want", [
    ("abort", FromCheckpoint("/ckpt/step2"), ["/pause_generation", "/update_weights_from_disk",
                                              "/continue_generation"]),
    ("keep", FromTensors(serialized=["AAAA"]), ["/pause_generation", "/update_weights_from_tensor",
                                                "/continue_generation", "/flush_cache"]),
    ("wait", FromDistributed(["w"], ["bfloat16"], [[2, 2]]), ["/update_weights_from_distributed"]),
    ("abort", None, ["/pause_generation", "/update_weight_version", "/flush_cache",
                     "/continue_generation"]),
])
def test_weight_sync_sequences(sglang_server, mode, source, want):
    rep = SGLangWeightSync(sglang_server).sync(source, "v2", mode=mode)
    assert rep.calls == want == [c[0] for c in _FakeSGLang.calls]
    assert rep.version == "v2" and rep.mode == mode and rep.seconds
    sent = dict((c[0], c[1]) for c in _FakeSGLang.calls)
    if mode != "wait":
        assert sent["/pause_generation"]["mode"] == {"abort": "abort", "keep": "in_place"}[mode]
    upd = [b for p, b in sent.items() if p.startswith("/update_weights_from_")]
    if upd:
        assert upd[0]["weight_version"] == "v2"
        assert upd[0]["flush_cache"] is (mode != "keep")     # keep: flushed after resume
    if "/flush_cache" in sent and mode == "keep":          # after resume: wait for the batch
        assert [c[2] for c in _FakeSGLang.calls if c[0] == "/flush_cache"] == ["timeout=60"]


def test_weight_sync_failure_resumes_and_names_the_step(sglang_server):
    _FakeSGLang.fail = {"/update_weights_from_disk": (400, {"success": False,
                                                            "message": "shape mismatch"})}
    with pytest.raises(WeightSyncError, match="failed at update_weights.*HTTP 400.*shape mismatch"):
        SGLangWeightSync(sglang_server).sync(FromCheckpoint("/bad"), "v3", mode="abort")
    assert [c[0] for c in _FakeSGLang.calls][-1] == "/continue_generation"
    with pytest.raises(ValueError, match="retract.*allow_retract"):
        SGLangWeightSync(sglang_server).sync(FromCheckpoint("/x"), "v3", mode="retract")
    _FakeSGLang.fail = {}
    rep = SGLangWeightSync(sglang_server).sync(FromCheckpoint("/x"), "v3", mode="retract",
                                               allow_retract=True)
    assert rep.calls == ["/pause_generation", "/update_weights_from_disk", "/continue_generation",
                         "/flush_cache"]
    assert _FakeSGLang.calls[-4][1]["mode"] == "retract"
    assert _FakeSGLang.calls[-3][1]["flush_cache"] is False     # SGLang would fail the update
    # a bad source is refused before the server is paused, naming the source
    _FakeSGLang.calls = []
    with pytest.raises(ConfigError, match="unknown weight source str"):
        SGLangWeightSync(sglang_server).sync("not a source", "v4")
    with pytest.raises(ConfigError, match="FromTensors for SGLang needs serialized="):
        SGLangWeightSync(sglang_server).sync(FromTensors({"w": np.zeros(2)}), "v4")
    assert _FakeSGLang.calls == []


def test_weight_sync_composes_with_a_framework_update_path(sglang_server):
    ws = SGLangWeightSync(sglang_server, initial_version="v0")          # the first version
    assert _FakeSGLang.calls[-1][:2] == ("/update_weight_version",
                                         {"new_version": "v0", "abort_all_requests": False})
    _FakeSGLang.calls = []
    rep = ws.after_weight_update("v1", drain_timeout_s=5)
    assert rep.calls == ["/update_weight_version", "/flush_cache"] == [c[0] for c in _FakeSGLang.calls]
    assert _FakeSGLang.calls[-1][2] == "timeout=5" and rep.version == "v1"
    _FakeSGLang.fail = {"/flush_cache": (500, {"error": "busy"})}
    with pytest.raises(WeightSyncError, match="v2.*failed at /flush_cache.*HTTP 500"):
        ws.after_weight_update("v2")
