"""benchmarks/gpu_replay.py --cpu: the GPU benchmark's dry run on CPU, so it cannot rot.

The same script runs on a CUDA machine without flags (see benchmarks/README.md)."""
import re

import pytest

from tests.conftest import run_py

pytestmark = pytest.mark.trainer
pytest.importorskip("megatron.core", reason="needs the trainer extra")


def test_gpu_replay_dry_run_on_cpu():
    p = run_py(["benchmarks/gpu_replay.py", "--cpu", "--iters", "1"], timeout=420)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    m = re.search(r"without replay ([\d.]+), with replay ([\d.]+)", out)
    assert m and float(m.group(2)) == 1.0 and float(m.group(1)) < 1.0, out
    grads = re.search(r"router grad norms \(replayed step\): (.*)", out).group(1).split(", ")
    assert len(grads) == 3 and all(float(g) > 0 for g in grads)
    # the table: a 20-character condition name, then fwd+bwd ms, vs plain, syncs,
    # read-backs, ...
    rows = {r[:20].strip(): r[20:].split() for r in out.splitlines()
            if r.startswith(("plain ", "replay (sidecar) ", "replay (in memory) "))}
    assert set(rows) == {"plain", "replay (sidecar)", "replay (in memory)"}, out
    readbacks = {c: int(v[3]) for c, v in rows.items()}
    assert len(set(readbacks.values())) == 1, readbacks       # replay adds none
