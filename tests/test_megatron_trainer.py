"""The replayer as RL frameworks use it, on real megatron-core (CPU, gloo, world size 1, in
a subprocess: tests/mcore_trainer_checks.py): verl's batch tensors with mixed padding,
megatron-style per-layer lists, coexistence with megatron's native RouterReplay API in the
same process, a decoder rebuilt after set-up (issue 16 item 1), R2 recording and replay,
sample and token checks before replay, metrics."""
import json

import numpy as np
import pytest

from routereplay.sidecar import write_records
from tests.conftest import run_py

pytestmark = pytest.mark.trainer
pytest.importorskip("megatron.core", reason="needs the trainer extra")


@pytest.fixture(scope="module")
def checks(tiny_model, tmp_path_factory):
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 500, n).tolist() for n in (21, 26, 18)]
    schema, recs = hf_records(tiny_model, seqs, prompt_len=8)
    p = tmp_path_factory.mktemp("mt") / "hf.rrsc"
    write_records(str(p), schema, recs)
    out = run_py(["tests/mcore_trainer_checks.py", tiny_model, str(p)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ")[1])


def test_batch_tensor_source_mixed_padding_and_metrics(checks):
    """verl's layout: routed_experts [b, s, num_hidden_layers, K] int16 with the attention
    mask (left-padded prompt, right-padded response): every real token but the last replays
    the recorded experts (the model's own routing differs); metrics for a logger."""
    b = checks["batch"]
    assert b["padding"] == "mixed" and b["offsets"] == [3, 0, 6]
    assert b["replayed"] and b["own_differs"]
    m = b["metrics"]
    # 3 samples x (len - 1) replayed rows x 3 MoE layers; the last tokens fall back
    assert m["routereplay/replayed_rows"] == (20 + 25 + 17) * 3
    assert m["routereplay/fallback_rows"] == 3 * 3
    assert m["routereplay/replayed_fraction"] == pytest.approx(186 / 195)
    assert m["routereplay/fallback_fraction"] == pytest.approx(9 / 195)
    assert m["routereplay/token_checked_samples"] == 3 == b["token_checked"]
    assert m["routereplay/bytes_decoded"] == 186 * 4 and m["routereplay/microbatches"] == 1
    assert m["routereplay/blocking_seconds"] >= m["routereplay/select_seconds"] > 0
    assert all(isinstance(v, (int, float)) for v in m.values())
    lists = checks["layer_lists"]
    assert lists == {"replayed": True, "replayed_rows": 186, "fallback_rows": 9}


def test_sample_ids_checked_before_any_compute_and_tokens_before_replay(checks):
    e = checks["errors"]
    assert e["unknown"] == ("UnknownSampleError: 1 sample(s) of the step are not in the "
                            "routing source: 'nope' (microbatch 1)")
    assert e["duplicate"] == ("AlignmentError: sample 'hf1' is named twice in the step: "
                              "microbatch 0 slot 1 and microbatch 1 slot 0 (one forward per "
                              "sample and step)")
    assert e["router_calls"] == 0                  # refused at step() entry
    assert e["tokens"].startswith("microbatch 0: sample 'hf1', token position 1: the trainer "
                                  "has token id ")


def test_coexists_with_megatron_native_replay_api(checks):
    """A second model using RouterReplay.set_replay_data / set_global_router_replay_action
    keeps replaying its own targets before, during and after the replayer's step; the class
    is not patched; megatron's state of our routers is restored, not cleared."""
    c = checks["coexist"]
    assert c == {"b_native_before": True, "class_untouched_in_step": True,
                 "b_native_in_step": True, "a_replayed": True, "state_restored": True,
                 "actions_after": ["RouterReplayAction.REPLAY_FORWARD"],
                 "b_native_after": True, "a_native_after": True,
                 "no_instance_attr_left": True}


def test_decoder_rebuilt_after_setup_is_replayed_or_refused(checks):
    """Issue 16 item 1: replacing model.decoder after RouterReplayer(model, schema) used to
    run with nothing replayed and replayed_rows == fallback_rows == 0."""
    r = checks["rebuilt"]
    assert r["rebuilt_before_step"] == {"replayed": True, "replayed_rows": 186}
    assert r["rebuilt_in_step"].startswith(
        "microbatch 0: the forward reached 0 of the replayer's 3 MoE routers (decoder "
        "layers [1, 2, 3] never selected through it)")


def test_r2_records_own_routing_and_replays_it_in_another_split(checks):
    """R2: the old-log-prob pass (one microbatch of 3, mixed padding) records the trainer's
    own routing; the update (routers moved, one sample per microbatch, with backward)
    replays exactly it, with the token check."""
    r = checks["r2"]
    assert r["replayed_own"] and r["own_rows_moved"] > 0
    assert r["recorded_rows"] == (21 + 26 + 18) * 3
    assert r["update_replayed_rows"] == 195 and r["update_fallback_rows"] == 0
    assert r["token_checked"] == 3 and r["samples"] == ["hf0", "hf1", "hf2"]
    assert all(g > 0 for g in r["router_grads"])
    assert r["not_recording"] == "this step did not record: use step(..., record=True)"
    assert r["token_mismatch"].startswith("microbatch 0: sample 'hf0', token position 4: the "
                                          "trainer has token id ")
