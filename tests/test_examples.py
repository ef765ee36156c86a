"""examples/ run end to end on the built-in tiny model: one real vLLM rollout (CPU build,
routing capture, the plugin's stream per policy version, two versions) shared by the
verl-style trainer (batch tensors + attention mask) and the slime-style trainer
(per-sample data, routing from the streams; R3 and R2), each on real megatron-core in its
own process."""
import json
import os

import numpy as np
import pytest

from tests.conftest import REPO, run_py

pytestmark = [pytest.mark.engine, pytest.mark.trainer]
pytest.importorskip("vllm", reason="needs the engine extra")
pytest.importorskip("megatron.core", reason="needs the trainer extra")


@pytest.fixture(scope="module")
def rollout(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout")
    p = run_py([os.path.join(REPO, "examples", "rollout_worker.py"), "--model", tiny_model,
                "--out", str(out)], timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    with open(out / "streams.json") as f:
        return out, json.load(f)


def _steps(tiny_model, rollout, script, *extra):
    p = run_py([os.path.join(REPO, "examples", script), "--model", tiny_model, "--rollout",
                str(rollout[0]), *extra], timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


def _expected_rows(rollout, version, num_moe_layers=3):
    """(replayed, fallback) rows of a version's batch: every real token but the last."""
    b = np.load(rollout[0] / f"batch-{version}.npz", allow_pickle=False)
    tokens = int(b["attention_mask"].sum())
    rows = len(b["uids"])
    return (tokens - rows) * num_moe_layers, rows * num_moe_layers


def test_rollout_worker_one_closed_stream_per_version(rollout):
    out, streams = rollout
    assert [(s["weight_version"], s["closed"], s["records"]) for s in streams] == [
        ("policy-0", True, 4), ("policy-1", True, 4)]
    from routereplay.sidecar import SidecarReader
    for s in streams:
        with SidecarReader(s["path"]) as r:
            v = s["weight_version"]
            assert r.sample_ids() == [f"{v}/{i}" for i in range(4)]      # the caller's ids


def test_verl_style_example(tiny_model, rollout):
    steps = _steps(tiny_model, rollout, "verl_style.py")
    assert [s["step"] for s in steps] == ["policy-0", "policy-1"]
    for s in steps:
        replayed, fallback = _expected_rows(rollout, s["step"])
        for p in ("old_logprob", "update"):
            assert s[f"{p}/routereplay/replayed_rows"] == replayed
            assert s[f"{p}/routereplay/fallback_rows"] == fallback
            assert s[f"{p}/routereplay/token_checked_samples"] == 4
            assert s[f"{p}/routing_agreement"] == 1.0
    # step 1 runs on the rollout's own weights (fp32 engine and trainer): replayed routing
    # gives the engine's log-probs
    assert steps[0]["k3_kl"] < 1e-6 and steps[0]["max_abs_dlogp"] < 1e-3


VERL_DIR = os.path.join(REPO, ".venv", "verl-0.9.1")


def test_verl_native_example(tiny_model, rollout):
    """examples/verl_native.py on the real vLLM rollout: verl 0.9.1's own data path
    (DataProto, left_right_2_no_padding, rearrange_micro_batches), routing agreement 1.0."""
    assert os.path.isdir(os.path.join(VERL_DIR, "verl")), \
        "verl 0.9.1 missing at .venv/verl-0.9.1: run scripts/bootstrap.sh"
    p = run_py([os.path.join(REPO, "examples", "verl_native.py"), "--model", tiny_model,
                "--rollout", str(rollout[0])], timeout=600,
               env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, VERL_DIR])))
    assert p.returncode == 0, p.stderr[-4000:]
    steps = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in steps] == ["policy-0", "policy-1"]
    for s in steps:
        assert s["routing_agreement/old_logprob"] == s["routing_agreement/update"] == 1.0
    assert steps[0]["max_abs_dlogp_vs_rollout"] < 1e-3


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_slime_style_example(tiny_model, rollout, mode):
    steps = _steps(tiny_model, rollout, "slime_style.py", "--mode", mode)
    assert [(s["step"], s["mode"]) for s in steps] == [("policy-0", mode), ("policy-1", mode)]
    for s in steps:
        replayed, fallback = _expected_rows(rollout, s["step"])
        old, upd = "old_logprob/routereplay/", "update/routereplay/"
        if mode == "r3":
            assert s[old + "replayed_rows"] == s[upd + "replayed_rows"] == replayed
            assert s[old + "token_checked_samples"] == 4
        else:
            # R2: the old-log-prob pass records the trainer's own routing of every token,
            # the update replays all of it (token ids checked against the recording)
            assert s[old + "replayed_rows"] == 0
            assert s[old + "recorded_rows"] == replayed + fallback
            assert s[upd + "replayed_rows"] == replayed + fallback
            assert s[upd + "fallback_rows"] == 0
        assert s[upd + "token_checked_samples"] == 4
    assert steps[0]["k3_kl"] < 1e-6
