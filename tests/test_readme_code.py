"""README.md's "Using a sidecar in code" example runs as written (the schema built by hand,
as its comment offers, since there is no HF config here), and its streams read back.

The newcomer reviews follow README.md literally; a stale example was found by hand before."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from routereplay.sidecar import SidecarReader

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_sidecar_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    code = next(b for b in blocks if 'SidecarWriter("rollout.rrsc", schema)' in b)
    hf = 'schema = RoutingSchema.from_hf_config("path/to/model")'
    assert hf in code
    code = code.replace(hf, "schema = RoutingSchema(num_hidden_layers=32, "
                            "moe_layer_ids=tuple(range(32)), top_k=2, num_experts=8)")
    monkeypatch.chdir(tmp_path)
    env: dict = {}
    exec(compile(code, str(README), "exec"), env)
    assert env["rec"].expert_ids.shape == (100, 2, 2)
    for name, ids in (("kept-12.rrsc", ["sample-9"]),
                      ("kept-13.rrsc", [f"sample-{i}" for i in range(10, 14)])):
        r = SidecarReader(str(tmp_path / name))
        assert r.sample_ids() == ids
        assert all(np.array_equal(r.read(i).expert_ids, env["ids"]) for i in ids)
