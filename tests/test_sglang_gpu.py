"""GPU check: a real SGLang server with routing capture, on the built-in tiny model.

Runs only with ``python -m pytest -m gpu`` on a CUDA machine with SGLang installed
(``pip install sglang``); deselected otherwise. Checks what the CPU tests cannot: the real
scheduler's rows (count, dense layers, id range), multi-turn start_len, and that after a
weight sync (abort mode, flush) a repeated prompt is recomputed under the new version.
"""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import require_cuda

pytestmark = pytest.mark.gpu


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model):
    require_cuda()
    pytest.importorskip("sglang", reason="SGLang is not installed on this GPU machine")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model, "--port",
         str(port), "--host", "127.0.0.1", "--enable-return-routed-experts",
         "--weight-version", "v1", "--mem-fraction-static", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    from engine_patches.sglang import http
    try:
        for _ in range(600):
            try:
                http.call(url, "/health", None, method="GET", timeout=5)
                break
            except Exception:
                assert proc.poll() is None, proc.stdout.read()[-4000:]
                time.sleep(1)
        yield url, tiny_model
    finally:
        proc.kill()


def test_real_sglang_routing_and_weight_sync(server):
    from engine_patches.sglang.client import SGLangRoutingClient, next_start
    from engine_patches.sglang.weight_sync import SGLangWeightSync
    from routereplay.weight_sync import FromCheckpoint
    from routereplay.schema import RoutingSchema
    from routereplay.multi_turn import merge_segments
    url, model = server
    schema = RoutingSchema.from_hf_config(model)
    client = SGLangRoutingClient(url, schema)
    prompt = list(range(5, 25))
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    resp, rec = client.generate({"input_ids": prompt, "sampling_params": sp})
    assert rec.num_tokens == len(prompt) + 16 - 1 and rec.start == 0
    assert rec.expert_ids.max() < schema.num_experts and rec.weight_versions[0].version == "v1"
    turn2 = prompt + resp["output_ids"] + [7, 8, 9]
    resp2, rec2 = client.generate({"input_ids": turn2, "sampling_params": sp},
                                  start_len=next_start(rec))
    conv = merge_segments([rec, rec2], "conv")
    assert conv.num_tokens == len(turn2) + 16 - 1
    assert rec2.prefix_cached and rec2.prefix_cached[0][1] > 0     # turn 1 came from the cache
    calls = SGLangWeightSync(url).sync(FromCheckpoint(model), "v2", mode="abort").calls
    assert calls[0] == "/pause_generation" and calls[-1] == "/continue_generation"
    resp3, rec3 = client.generate({"input_ids": prompt, "sampling_params": sp})
    assert resp3["meta_info"]["weight_version"] == "v2"
    assert rec3.prefix_cached == []                      # flushed: no old-weight prefix rows
    assert all(s.version == "v2" for s in rec3.weight_versions)
