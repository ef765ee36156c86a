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


def _cli(args, timeout=120):
    return run_py(["-m", "routereplay.cli", *args], timeout=timeout)


def _engine_arrays(schema, n, seed):
    """vLLM-layout arrays [T, num_hidden_layers, top_k], dense layer 0 zero-filled."""
    import numpy as np
    out = {}
    for i in range(n):
        rec = random_record(schema, f"s{i}", 10 + 7 * i, seed + i)
        full = np.zeros((rec.num_tokens, schema.num_hidden_layers, schema.top_k), schema.id_dtype)
        full[:, list(schema.moe_layer_ids)] = rec.expert_ids
        out[f"s{i}"] = (rec.expert_ids, full)
    return out


def test_convert_npy_npz_folder_and_export(tmp_path, schema):
    import numpy as np
    arrs = _engine_arrays(schema, 3, 0)
    folder = tmp_path / "in"
    folder.mkdir()
    np.save(folder / "s0.npy", arrs["s0"][0].astype(np.int64))          # MoE layers only
    np.savez(folder / "more.npz", s1=arrs["s1"][1], s2=arrs["s2"][1])  # full layout
    out = tmp_path / "o.rrsc"
    p = _cli(["convert", "--from", "npy", str(folder), "--out", str(out), "--num-experts", "16",
              "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 0, p.stderr
    assert "wrote 3 records" in p.stdout
    info = json.loads(_cli(["inspect", str(out), "--json"]).stdout)
    assert [r["sample_id"] for r in info["records"]] == ["s1", "s2", "s0"]   # more.npz, s0.npy
    assert info["num_layers"] == 3 and info["codec"] == "ctx-zstd"
    for sid in ("s0", "s1", "s2"):
        p = _cli(["export", str(out), "--sample", sid, "--out", str(tmp_path / f"{sid}.npy")])
        assert p.returncode == 0, p.stderr
        np.testing.assert_array_equal(np.load(tmp_path / f"{sid}.npy"), arrs[sid][0])
    p = _cli(["export", str(out), "--sample", "s1", "--full-layers", "--out", str(tmp_path / "f.npy")])
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), arrs["s1"][1])
    p = _cli(["export", str(out), "--sample", "nope", "--out", str(tmp_path / "x.npy")])
    assert p.returncode == 2 and "'nope' is not in" in p.stderr


def test_convert_wire_formats(tmp_path, schema):
    import numpy as np
    from routereplay import wire
    arrs = _engine_arrays(schema, 3, 10)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 16,
                               "num_experts_per_tok": 4, "mlp_only_layers": [0]}))
    vl = tmp_path / "vllm.jsonl"
    vl.write_text("\n".join([
        wire.vllm_b64_npy(arrs["s0"][1]).decode(),
        json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "routed_experts":
                                                 wire.vllm_b64_npy(arrs["s1"][1]).decode()}]}),
        json.dumps({"id": "cmpl-2", "choices": [
            {"index": 0, "routed_experts": wire.vllm_b64_npy(arrs["s2"][1]).decode()},
            {"index": 1, "routed_experts": wire.vllm_b64_npy(arrs["s0"][1]).decode()}]}),
    ]) + "\n")
    sg = tmp_path / "sglang.txt"
    sg.write_text(wire.sglang_b64_int32(arrs["s1"][1]).decode() + "\n" + json.dumps(
        {"meta_info": {"id": "req-7", "routed_experts": wire.sglang_b64_int32(arrs["s2"][1]).decode()}}))
    for kind, src, want in [("vllm-b64", vl, {"vllm-1": "s0", "cmpl-1": "s1", "cmpl-2-0": "s2",
                                              "cmpl-2-1": "s0"}),
                            ("sglang-b64", sg, {"sglang-1": "s1", "req-7": "s2"})]:
        out = tmp_path / f"{kind}.rrsc"
        p = _cli(["convert", "--from", kind, str(src), "--out", str(out), "--config", str(tmp_path)])
        assert p.returncode == 0, p.stderr
        from routereplay.sidecar import SidecarReader
        r = SidecarReader(str(out))
        assert sorted(r.sample_ids()) == sorted(want)
        for sid, src_id in want.items():
            np.testing.assert_array_equal(r.read(sid).expert_ids, arrs[src_id][0])


def test_convert_bad_input_names_sample_token_layer_and_keeps_earlier(tmp_path, schema):
    import numpy as np
    arrs = _engine_arrays(schema, 2, 20)
    bad = arrs["s1"][1].astype(np.int32)
    bad[5, 2, 1] = 40                                # expert 40 of 16, token 5, layer 2
    np.savez(tmp_path / "in.npz", a=arrs["s0"][1], b=bad)
    out = tmp_path / "o.rrsc"
    p = _cli(["convert", "--from", "vllm", str(tmp_path / "in.npz"), "--out", str(out),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1,2,3"])
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "sample 'b', token 5, layer 2: expert id 40" in p.stderr
    from routereplay.sidecar import SidecarReader
    r = SidecarReader(str(out))
    assert r.sample_ids() == ["a"] and not r.errors        # closed cleanly, 'a' kept
    (tmp_path / "w.txt").write_text(json.dumps({"id": "r9", "choices": [{"index": 0}]}) + "\n")
    p = _cli(["convert", "--from", "vllm-b64", str(tmp_path / "w.txt"), "--out", str(out),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 2 and "--enable-return-routed-experts" in p.stderr
    (tmp_path / "s.txt").write_text("QUJDRA==\n")                 # 4 bytes: not whole rows
    p = _cli(["convert", "--from", "sglang-b64", str(tmp_path / "s.txt"), "--out", str(out),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 2 and "sample 's-1'" in p.stderr and "whole number of rows" in p.stderr
    p = _cli(["convert", "--from", "npy", str(tmp_path / "in.npz"), "--out", str(out)])
    assert p.returncode == 2 and "--config" in p.stderr


def test_convert_refuses_bad_paths_and_forged_npy(tmp_path, schema):
    import numpy as np
    arrs = _engine_arrays(schema, 1, 30)
    folder = tmp_path / "in"
    folder.mkdir()
    np.save(folder / "g0.npy", arrs["s0"][0])
    before = (folder / "g0.npy").read_bytes()
    args = ["--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"]
    p = _cli(["convert", "--from", "npy", str(folder), "--out", str(folder / "g0.npy"), *args])
    assert p.returncode == 2 and "refusing" in p.stderr
    assert (folder / "g0.npy").read_bytes() == before                    # input untouched
    # a header claiming 10^12 rows: a clear error, no 14 TiB allocation
    hdr = np.lib.format.header_data_from_array_1_0(arrs["s0"][0])
    hdr["shape"] = (10**12, 3, 4)
    with open(tmp_path / "forged.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, hdr)
        f.write(b"\0" * 64)
    out = tmp_path / "o.rrsc"
    out.write_bytes(b"keep me")
    p = _cli(["convert", "--from", "npy", str(tmp_path / "forged.npy"), "--out", str(out), *args])
    assert p.returncode == 2 and "claims shape" in p.stderr and "Traceback" not in p.stderr
    assert out.read_bytes() == b"keep me"                                # not truncated
    (tmp_path / "empty.txt").write_text("")
    p = _cli(["convert", "--from", "vllm-b64", str(tmp_path / "empty.txt"), "--out", str(out), *args])
    assert p.returncode == 2 and "no routing payloads" in p.stderr
    for bad in (["--codec", "bogus"], ["--moe-layers", "a-b"], ["--layer-group", "0"]):
        p = _cli(["convert", "--from", "npy", str(folder), "--out", str(out), *args, *bad])
        assert p.returncode == 2 and "Traceback" not in p.stderr, (bad, p.stderr)
    p = _cli(["export", str(tmp_path / "missing.rrsc"), "--sample", "x", "--out", str(out)])
    assert p.returncode == 2 and "Traceback" not in p.stderr
