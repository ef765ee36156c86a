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
    assert mods == ["engine_patches", "engine_patches.vllm", "engine_patches.vllm.plugin"], mods
    assert "routereplay" not in p.stderr.lower()


def test_unsupported_vllm_logs_one_line_without_traceback(tmp_path):
    p = _run({"ROUTEREPLAY_SIDECAR": str(tmp_path / "s.rrsc")}, tmp_path, fake_version="0.99.0")
    assert p.returncode == 0, p.stderr[-3000:]
    ours = [ln for ln in p.stderr.splitlines() if "routereplay" in ln.lower()]
    assert len(ours) == 1, p.stderr[-3000:]
    assert "0.99.0" in ours[0] and ">=0.32,<0.34" in ours[0]
    assert "Traceback" not in p.stderr and "Failed to load plugin" not in p.stderr
    assert "engine_patches.vllm.capture" not in p.stdout
    assert not (tmp_path / "s.rrsc").exists()
