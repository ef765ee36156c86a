"""How vLLM's own plugin loader (vllm.plugins.load_general_plugins) treats the routereplay
plugin (issue 17 item 2): with ROUTEREPLAY_SIDECAR unset nothing of ours beyond the entry
point is imported and nothing is logged; on an unsupported vLLM one clear line, no
traceback. Each case in a fresh interpreter (vLLM loads plugins once per process)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("vllm", reason="needs the engine extra")

PROBE = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
ours = sorted(m for m in sys.modules if m.startswith(("engine_patches", "routereplay")))
print("MODULES", json.dumps(ours))
"""


def _run(env_extra, tmp_path, fake_version=None):
    env = {k: v for k, v in os.environ.items() if k not in ("ROUTEREPLAY_SIDECAR", "VLLM_PLUGINS")}
    path = [REPO]
    if fake_version:
        # a "vllm" distribution of another version ahead of the installed one on sys.path
        d = tmp_path / "fakevllm" / f"vllm-{fake_version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {fake_version}\n")
        path.insert(0, str(tmp_path / "fakevllm"))
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_unset_sidecar_imports_nothing_and_logs_nothing(tmp_path):
    p = _run({}, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    mods = json.loads(p.stdout.split("MODULES", 1)[1])
    # capture_names: the plugin's and the capture's shared names (imports nothing itself)
    assert mods == ["engine_patches", "engine_patches.vllm", "engine_patches.vllm.capture_names",
                    "engine_patches.vllm.plugin"], mods
    assert "routereplay" not in p.stderr.lower()


def test_unsupported_vllm_logs_one_line_without_traceback(tmp_path):
    p = _run({"ROUTEREPLAY_SIDECAR": str(tmp_path / "s.rrsc")}, tmp_path, fake_version="0.99.0")
    assert p.returncode == 0, p.stderr[-3000:]
    ours = [ln for ln in p.stderr.splitlines() if "routereplay" in ln.lower()]
    assert len(ours) == 1, p.stderr[-3000:]
    assert "0.99.0" in ours[0] and ">=0.32,<0.34" in ours[0]
    assert "Traceback" not in p.stderr and "Failed to load plugin" not in p.stderr
    assert "engine_patches.vllm.capture" not in json.loads(p.stdout.split("MODULES", 1)[1])
    assert not (tmp_path / "s.rrsc").exists()


def test_engine_env_sets_only_what_the_machine_needs():
    from engine_patches.vllm.harness import triton_cpu
    env = triton_cpu.engine_env({})
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env     # vLLM 0.32 picks Model Runner V2 itself
    if triton_cpu._has_cuda():
        assert env == {}
    else:
        assert set(env) == {"PYTHONPATH", "TRITON_INTERPRET"}
        assert env["PYTHONPATH"] == triton_cpu.SITE_DIR


def test_weight_transfer_sources_map_to_vllm_update_info():
    import numpy as np

    from engine_patches.vllm.weight_sync import update_info
    from routereplay.errors import ConfigError
    from routereplay.weight_sync import FromDistributed, FromTensors
    src = FromDistributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]],
                          extra={"ipc_handles_pickled": "x"})
    assert update_info(src) == {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"],
                                "shapes": [[2, 3], [4]], "ipc_handles_pickled": "x"}
    with pytest.raises(ConfigError, match="2 names, 1 dtypes"):
        FromDistributed(["a", "b"], ["float32"], [[1], [1]])
    # the example: a dict of tensors is taken as its items, not unpacked wrongly
    assert FromTensors({"w": np.zeros(2)}).named_tensors[0][0] == "w"
    with pytest.raises(ConfigError, match="FromTensors: item 0"):
        FromTensors([("w",)])
