import json

from routereplay.sidecar import write_records
from tests.conftest import random_record, run_py


def test_demo_rejects_model_without_moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}))
    p = run_py(["-m", "routereplay.cli", "demo", "--model", str(tmp_path)], timeout=60)
    assert p.returncode == 2
    assert "no MoE expert count" in p.stderr and "Traceback" not in p.stderr


def test_demo_rejects_unmapped_model_type_before_rollout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8,
         "num_experts_per_tok": 2}))
    p = run_py(["-m", "routereplay.cli", "demo", "--model", str(tmp_path)], timeout=60)
    assert p.returncode == 2 and "model_type 'mixtral'" in p.stderr


def test_inspect_json_and_corruption(tmp_path, schema):
    path = tmp_path / "s.rrsc"
    write_records(str(path), schema, [random_record(schema, f"r{i}", 20, i) for i in range(3)])
    p = run_py(["-m", "routereplay.cli", "inspect", str(path), "--json"], timeout=60)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["num_records"] == 3 and out["num_tokens"] == 57
    assert out["records"][0] == {"sample_id": "r0", "num_tokens": 19, "versions": ["v0"]}
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 16 - 60])        # drop trailer and tear the index frame
    p = run_py(["-m", "routereplay.cli", "inspect", str(path)], timeout=60)
    assert p.returncode == 1 and "torn tail" in p.stdout and "recovered 3 records" in p.stdout
    assert "Traceback" not in p.stderr
