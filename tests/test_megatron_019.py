"""megatron-core 0.19.2 (installed by scripts/bootstrap.sh into .venv/mcore-0.19.2, used
through PYTHONPATH): the same replay checks as with 0.16.1, at world size 1 and under the
interleaved pipeline schedule (VPP), where 0.19's routers carry their own layer numbers."""
import json
import os

import numpy as np
import pytest

from routereplay.sidecar import write_records
from tests.conftest import REPO, run_py

pytestmark = pytest.mark.trainer
MCORE_019 = os.path.join(REPO, ".venv", "mcore-0.19.2")


@pytest.mark.parametrize("layout", ["", "pp=2,vpp=2"])
def test_replay_on_megatron_core_0_19(tiny_model, tmp_path, layout):
    assert os.path.isdir(os.path.join(MCORE_019, "megatron")), \
        "megatron-core 0.19.2 missing: run scripts/bootstrap.sh"
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(0)
    schema, recs = hf_records(tiny_model, [rng.integers(3, 500, n).tolist() for n in (40, 33, 29)],
                              prompt_len=20)
    sc = tmp_path / "hf.rrsc"
    write_records(str(sc), schema, recs)
    env = dict(os.environ, PYTHONPATH=MCORE_019)
    p = run_py(["-c", "import trainer_hooks.megatron as m; print(m.MCORE_VERSION)"], 120, env=env)
    assert p.stdout.strip() == "0.19.2", p.stderr[-2000:]
    out = tmp_path / "r.json"
    p = run_py(["-m", "trainer_hooks.megatron.harness.recompute", "--model", tiny_model, "--sidecar",
                str(sc), "--out", str(out), "--check-record", "--parallel", layout], 420, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    c = res["checks"]
    assert c["record_replay"]["ids_equal"] and c["record_replay"]["lp_exact"]
    assert c["perturbed_own"]["set_agreement"] < 0.5
    assert c["perturbed_train"]["ids_equal"] and sum(c["recompute_rows_differing"]) == 0
    assert sum(c["recompute_rows_checked"]) > 0
    assert res["replay"]["routing_agreement"] == 1.0 and res["replay"]["max_abs_dlogp"] < 1e-4
    assert all(g > 0 for g in res["replay_backward"]["router_grad_norms"])
