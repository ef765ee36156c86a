"""EPLB replica refresh (engine_patches.vllm.eplb) on vLLM's own EPLB code: its initial map
builder, its DefaultEplbPolicy for the current placement, its rearrange_expert_weights_inplace
and its gloo EPLB communicator; vLLM rejects EPLB on CPU, so the placement is simulated
(tests/vllm_eplb_check.py). The real engine runs in tests/test_vllm_eplb_gpu.py (-m gpu)."""
import json

import numpy as np
import pytest

from routereplay.errors import RecordError
from tests.conftest import run_py

pytest.importorskip("vllm", reason="needs the engine extra")


@pytest.mark.parametrize("world", [1, 2])
def test_every_replica_gets_its_logical_experts_new_weights(tmp_path, world):
    out = tmp_path / "eplb.json"
    p = run_py(["tests/vllm_eplb_check.py", str(world), str(out)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == world
    cur = np.array(ranks[0]["current_map"])
    init = np.array(ranks[0]["initial_map"])
    assert (cur != init).any(-1).all()                   # the policy really rearranged
    assert sum(r["slots_wrong_before"] for r in ranks) > 0  # a plain reload is wrong ...
    assert all(r["all_slots_right_after"] for r in ranks)   # ... the refresh fixes every slot
    assert all(r["layers_refreshed"] == 2 for r in ranks)
    # hot experts are replicated: some logical expert has several physical slots
    assert max(np.bincount(cur[0])) > 1


def test_physical_slot_ids_are_refused_as_routing(schema):
    from routereplay.record import checked_moe_ids
    full = np.tile(np.arange(4, dtype=np.uint8), (5, 4, 1))       # [T, num_hidden_layers, k]
    full[:, 0] = 0                                                # layer 0 is dense: zero fill
    full[2, 2, 1] = 17                                            # a physical replica slot
    with pytest.raises(RecordError, match="sample 'x', token 2, layer 2: expert id 17 outside "
                                          r"\[0, 16\) \(a physical EPLB replica slot"):
        checked_moe_ids(full, schema, "x")


def test_plugin_refuses_a_bad_destination_and_parses_references(tmp_path, monkeypatch):
    from engine_patches.vllm import plugin
    from routereplay.errors import ConfigError, RouteReplayError
    with pytest.raises(RouteReplayError, match="does not exist"):
        plugin.install(str(tmp_path / "missing" / "x.rrsc"))
    with pytest.raises(RouteReplayError, match="ROUTEREPLAY_CODEC='ctx-zst': unknown codec"):
        plugin.install(str(tmp_path / "x.rrsc"), codec="ctx-zst")
    # a codec removed in 0.3.0 fails at install, naming the release that converts it
    with pytest.raises(ConfigError, match=r"ROUTEREPLAY_CODEC='ctx-ans-sorted': .*was removed "
                                          r"in routereplay 0\.3\.0.*routereplay==0\.2\.\*"):
        plugin.install(str(tmp_path / "x.rrsc"), codec="ctx-ans-sorted")
    # install() without codec= follows ROUTEREPLAY_CODEC, as the plugin's entry point does
    # (the framework review: the variable was ignored in-process, the streams xl-zstd)
    monkeypatch.setenv("ROUTEREPLAY_CODEC", "ctx-zst")
    with pytest.raises(RouteReplayError, match="ROUTEREPLAY_CODEC='ctx-zst': unknown codec"):
        plugin.install(str(tmp_path / "x.rrsc"))
    monkeypatch.setenv("ROUTEREPLAY_CODEC", "xl-ans")
    with pytest.raises(ConfigError, match="ROUTEREPLAY_CODEC='xl-ans': .*was removed in "
                                          "routereplay 0.3.0"):
        plugin.install(str(tmp_path / "x.rrsc"))
    monkeypatch.delenv("ROUTEREPLAY_CODEC")
    assert plugin.stats() == {}                        # nothing half-installed
    ref = plugin.SidecarRef.make("/data/r.rrsc", "req#7/1")
    assert plugin.SidecarRef.parse(ref) == ("/data/r.rrsc", "req#7/1")
    with pytest.raises(ValueError, match="not a routereplay"):
        plugin.SidecarRef.parse("AAAA")
