"""Streamed SGLang responses -> records: every chunk's routing rows kept, in order, and
checked against the chunks' token counts, or refused naming the request and the chunk.

The streams are built from payloads SGLang 0.5.23's own capturer produced
(tests/fixtures/sglang): the routed_experts bytes are split at row boundaries over the
chunks, as a server sending each step's rows with its chunk would (prompt rows with the
first), or all with the final chunk as SGLang 0.5.23 does."""
import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from engine_patches.sglang.client import SGLangRoutingClient
from engine_patches.sglang.records import record_from_response, record_from_stream
from routereplay.errors import ConfigError, RecordError
from routereplay.schema import RoutingSchema

FIX = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "sglang",
                                  "sglang_0.5.23_payloads.json")))
SCHEMA = RoutingSchema.from_hf_config(FIX["config"])          # 4 layers, layer 0 dense, 8 x top-2
CASES = FIX["cases"]
ROW = 4 * SCHEMA.num_hidden_layers * SCHEMA.top_k             # bytes of one int32 row


def _b64(raw, a, b):
    return base64.b64encode(raw[a * ROW:b * ROW]).decode()


def _generate_stream(name, layout):
    """/generate chunks of one fixture response: one chunk per output token, cumulative
    output_ids and completion_tokens (SGLang's default); routing rows by ``layout``:
    "final" (all with the finishing chunk, SGLang 0.5.23), "per_step" (the prompt rows
    [start, P) with the first chunk, then one row per chunk), "prompt_then_final" (the
    prompt rows first, the output rows with the finishing chunk)."""
    c = CASES[name]
    resp = c["response"]
    meta = dict(resp["meta_info"])
    raw = base64.b64decode(meta.pop("routed_experts"))
    start = c["request"].get("routed_experts_start_len", 0)
    p, g = meta["prompt_tokens"], meta["completion_tokens"]
    assert len(raw) == (p + g - 1 - start) * ROW
    chunks = []
    for i in range(1, g + 1):
        m = {**meta, "completion_tokens": i}
        if layout == "per_step":
            a = 0 if i == 1 else p - start + i - 2
            m["routed_experts"] = _b64(raw, a, p - start + i - 1)
        elif layout == "final" and i == g:
            m["routed_experts"] = _b64(raw, 0, p + g - 1 - start)
        elif layout == "prompt_then_final" and i in (1, g):
            m["routed_experts"] = _b64(raw, 0, p - start) if i == 1 else \
                _b64(raw, p - start, p + g - 1 - start)
        chunks.append({"text": "", "output_ids": resp["output_ids"][:i], "meta_info": m})
    return chunks


def _same_record(a, b):
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    assert (a.sample_id, a.start, a.prompt_len, a.recomputed, a.prefix_cached) == \
        (b.sample_id, b.start, b.prompt_len, b.recomputed, b.prefix_cached)
    assert [(s.version, s.start, s.end) for s in a.weight_versions] == \
        [(s.version, s.start, s.end) for s in b.weight_versions]
    assert a.token_ids.tolist() == b.token_ids.tolist()


@pytest.mark.parametrize("layout", ["final", "per_step", "prompt_then_final"])
@pytest.mark.parametrize("name", ["basic", "prefix_hit", "start_len", "update_in_place",
                                  "retract"])
def test_every_chunks_rows_are_kept_in_order(name, layout):
    c = CASES[name]
    start = c["request"].get("routed_experts_start_len", 0)
    chunks = _generate_stream(name, layout)
    assert sum("routed_experts" in ch["meta_info"] for ch in chunks) == \
        {"final": 1, "per_step": len(chunks), "prompt_then_final": 2}[layout]
    rec = record_from_stream(chunks, SCHEMA, start_len=start, prompt_ids=c["prompt_ids"])
    truth = np.array(c["truth"])[start:, list(SCHEMA.moe_layer_ids)]
    np.testing.assert_array_equal(rec.expert_ids, truth)     # prompt rows included
    assert rec.start == start and rec.num_tokens == len(truth)
    _same_record(rec, record_from_response(c["response"], SCHEMA, start_len=start,
                                           prompt_ids=c["prompt_ids"]))


def test_prompt_rows_of_the_first_chunk_are_not_dropped_without_a_start():
    # the case: prompt rows in the first chunk, output rows in the last; no start
    # given: the complete assembly (seqlen - 1 rows) is placed from 0, the prompt kept
    rec = record_from_stream(_generate_stream("basic", "prompt_then_final"), SCHEMA)
    assert rec.start == 0 and rec.num_tokens == 9
    np.testing.assert_array_equal(rec.expert_ids, np.array(CASES["basic"]["truth"])[:, 1:])
    # a later start the chunks do not state stays ambiguous, refused with the blocks named
    with pytest.raises(RecordError, match=r"req-start_len.*start_len 3 with complete rows.*"
                                          r"stream of 3 chunks; rows per chunk: chunk 0: 2, "
                                          r"chunk 2: 2"):
        record_from_stream(_generate_stream("start_len", "prompt_then_final"), SCHEMA)
    # a start past the prompt (the rows read as output rows only, the prompt's dropped):
    # the first chunk already holds more rows than positions from there
    with pytest.raises(RecordError, match=r"request 'req-basic', stream chunk 0: the chunk's 6 "
                                          r"routing rows .* at most 0 rows from position 6 \(a "
                                          r"start_len later than the rows' start"):
        record_from_stream(_generate_stream("basic", "prompt_then_final"), SCHEMA, start_len=6)
    # stated on a chunk (as a client may store it), it is used
    chunks = _generate_stream("start_len", "per_step")
    chunks[0]["routed_experts_start_len"] = 3
    assert record_from_stream(chunks, SCHEMA).start == 3


def test_openai_stream_with_routing_per_chunk():
    c = CASES["openai"]
    resp = c["response"]
    raw = base64.b64decode(resp["sglext"]["routed_experts"])
    p, g = resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"]      # 3, 3
    base = {"id": resp["id"], "object": "text_completion", "created": 0, "model": "tiny"}
    blocks = [(0, p)] + [(p + i - 1, p + i) for i in range(1, g)]
    chunks = [{**base, "choices": [{"index": 0, "text": "x", "finish_reason": None}],
               "sglext": {"routed_experts": _b64(raw, a, b)}} for a, b in blocks]
    chunks.append({**base, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    chunks.append({**base, "choices": [], "usage": resp["usage"]})
    rec = record_from_stream(chunks, SCHEMA, start_len=0)
    assert rec.sample_id == "cmpl-oa1" and rec.start == 0 and rec.num_tokens == p + g - 1
    np.testing.assert_array_equal(rec.expert_ids, record_from_response(resp, SCHEMA).expert_ids)
    # the middle block lost on the way: refused at the end, every block listed
    with pytest.raises(RecordError, match=r"'cmpl-oa1'.*row-count mismatch in a stream of 4 "
                                          r"chunks: 4 rows in 2 blocks, 3 prompt \+ 3 output "
                                          r"tokens from position 0 have 5; rows per chunk: "
                                          r"chunk 0: 3, chunk 1: 1"):
        record_from_stream(chunks[:1] + chunks[2:], SCHEMA, start_len=0)


def test_a_dropped_chunk_is_refused_naming_the_blocks():
    chunks = _generate_stream("basic", "per_step")
    del chunks[2]                        # its row and its token: the next chunk's count tells
    with pytest.raises(RecordError, match=r"'req-basic'.*row-count mismatch in a stream of 3 "
                                          r"chunks: 8 rows in 3 blocks, 6 prompt \+ 4 output "
                                          r"tokens from position 0 have 9; rows per chunk: "
                                          r"chunk 0: 6, chunk 1: 1, chunk 2: 1; first short: "
                                          r"chunk 2, 8 rows where its token counts imply 9"):
        record_from_stream(chunks, SCHEMA, start_len=0)
    chunks = _generate_stream("basic", "per_step")
    del chunks[0]["meta_info"]["routed_experts"]           # the prompt rows never arrived
    with pytest.raises(RecordError, match=r"3 rows in 3 blocks.*have 9.*first short: chunk 1, "
                                          r"1 rows where its token counts imply 7"):
        record_from_stream(chunks, SCHEMA, start_len=0)


def test_repeated_rows_are_refused_at_the_chunk_that_repeats_them():
    # cumulative blocks (each chunk all rows so far), or a retracted request's re-prefill
    c = CASES["basic"]
    raw = base64.b64decode(c["response"]["meta_info"]["routed_experts"])
    chunks = _generate_stream("basic", "per_step")
    for i, ch in enumerate(chunks):
        ch["meta_info"]["routed_experts"] = _b64(raw, 0, 6 + i)
    with pytest.raises(RecordError, match=r"request 'req-basic', stream chunk 1: the chunk's 7 "
                                          r"routing rows bring the stream to 13 rows, but 6 "
                                          r"prompt \+ 2 output tokens by this chunk have at most "
                                          r"7 rows from position 0.*chunk 0: 6, chunk 1: 7"):
        record_from_stream(chunks, SCHEMA, start_len=0)
    with pytest.raises(RecordError, match=r"stream chunk 1: .* at most 7 rows from position 0"):
        record_from_stream(chunks, SCHEMA)                # no start: bounded from 0
    with pytest.raises(RecordError, match=r"start_len must be an integer >= 0, got -1"):
        record_from_stream(chunks, SCHEMA, start_len=-1)


def test_chunks_that_do_not_fit_one_request_are_refused():
    chunks = _generate_stream("basic", "per_step")
    chunks[2]["meta_info"]["id"] = "req-other"
    with pytest.raises(RecordError, match=r"request 'req-basic', stream chunk 2: the chunk "
                                          r"belongs to request 'req-other'"):
        record_from_stream(chunks, SCHEMA, start_len=0)
    # incremental output ids (--incremental-streaming-output) are not stitched
    chunks = _generate_stream("basic", "per_step")
    for i, ch in enumerate(chunks):
        ch["output_ids"] = CASES["basic"]["response"]["output_ids"][i:i + 1]
    with pytest.raises(RecordError, match=r"stream chunk 1: 1 output_ids that do not extend "
                                          r"the previous chunk's 1 to completion_tokens=2.*"
                                          r"--incremental-streaming-output"):
        record_from_stream(chunks, SCHEMA, start_len=0, prompt_ids=CASES["basic"]["prompt_ids"])
    # a block cut inside a row
    chunks = _generate_stream("basic", "per_step")
    raw = base64.b64decode(chunks[0]["meta_info"]["routed_experts"])
    chunks[0]["meta_info"]["routed_experts"] = base64.b64encode(raw[:-4]).decode()
    with pytest.raises(RecordError, match=r"stream chunk 0: routed_experts holds 188 bytes: "
                                          r"not a whole number of rows"):
        record_from_stream(chunks, SCHEMA, start_len=0)
    chunks[0]["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(RecordError, match=r"stream chunk 0: routed_experts is not base64"):
        record_from_stream(chunks, SCHEMA, start_len=0)
    with pytest.raises(RecordError, match="empty SGLang stream"):
        record_from_stream([], SCHEMA)


def test_client_refuses_a_streamed_request_before_sending_it():
    posts = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            posts.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b'data: {"text": ""}\n\ndata: [DONE]\n\n'
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with SGLangRoutingClient(f"http://127.0.0.1:{srv.server_port}", SCHEMA,
                                 retries=0, timeout=10) as client:
            with pytest.raises(ConfigError, match="stream=True.*record_from_stream"):
                client.generate({"input_ids": [1, 2, 3], "stream": True,
                                 "sampling_params": {"max_new_tokens": 4}})
            with pytest.raises(ConfigError, match="stream=True"):
                client.completions({"prompt": [1, 2, 3], "stream": True, "max_tokens": 4})
        assert posts == []
    finally:
        srv.shutdown()
        srv.server_close()
