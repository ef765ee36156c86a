import json
import os

from routereplay.sidecar import SidecarReader, write_records
from tests.conftest import random_record, run_py


def test_demo_rejects_model_without_moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}))
    p = run_py(["-m", "routereplay.cli", "demo", "--model", str(tmp_path)], timeout=60)
    assert p.returncode == 1                       # bad input: a runtime error
    assert "no MoE expert count" in p.stderr and "Traceback" not in p.stderr


def test_demo_rejects_unmapped_model_type_before_rollout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8,
         "num_experts_per_tok": 2}))
    p = run_py(["-m", "routereplay.cli", "demo", "--model", str(tmp_path)], timeout=60)
    assert p.returncode == 1 and "model_type 'mixtral'" in p.stderr


def test_demo_rejects_a_layout_the_model_cannot_split_before_rollout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 16,
         "num_experts_per_tok": 4, "num_attention_heads": 4, "num_key_value_heads": 2}))
    for spec, want in (("tp=3", "tp=3 must divide the model's num_attention_heads (4)"),
                       ("ep=3,dp=3", "ep=3 must divide the model's num_experts (16)"),
                       ("pp=3", "pp x vpp=3 must divide the model's num_hidden_layers (4)")):
        p = run_py(["-m", "routereplay.cli", "demo", "--model", str(tmp_path),
                    "--trainer-parallel", spec], timeout=60)
        assert p.returncode != 0 and want in p.stderr, (spec, p.stderr)


def test_inspect_json_and_corruption(tmp_path, schema):
    path = tmp_path / "s.rrsc"
    write_records(str(path), schema, [random_record(schema, f"r{i}", 20, i) for i in range(3)])
    p = run_py(["-m", "routereplay.cli", "inspect", str(path), "--json"], timeout=60)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["num_records"] == 3 and out["num_tokens"] == 57
    assert out["records"][0] == {"sample_id": "r0", "num_tokens": 19, "versions": ["v0"]}
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 16 - 10])        # drop trailer and tear the index frame
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
    assert info["num_layers"] == 3 and info["codec"] == "xl-zstd"
    for sid in ("s0", "s1", "s2"):
        p = _cli(["export", str(out), "--sample", sid, "--out", str(tmp_path / f"{sid}.npy")])
        assert p.returncode == 0, p.stderr
        np.testing.assert_array_equal(np.load(tmp_path / f"{sid}.npy"), arrs[sid][0])
    p = _cli(["export", str(out), "--sample", "s1", "--full-layers", "--out", str(tmp_path / "f.npy")])
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), arrs["s1"][1])
    p = _cli(["export", str(out), "--sample", "nope", "--out", str(tmp_path / "x.npy")])
    assert p.returncode == 1 and "'nope' is not in" in p.stderr


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
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "sample 'b', token 5, layer 2: expert id 40" in p.stderr
    from routereplay.sidecar import SidecarReader
    r = SidecarReader(str(out))
    assert r.sample_ids() == ["a"] and not r.errors        # closed cleanly, 'a' kept
    (tmp_path / "w.txt").write_text(json.dumps({"id": "r9", "choices": [{"index": 0}]}) + "\n")
    p = _cli(["convert", "--from", "vllm-b64", str(tmp_path / "w.txt"), "--out", str(out),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 1 and "--enable-return-routed-experts" in p.stderr
    (tmp_path / "s.txt").write_text("QUJDRA==\n")                 # 4 bytes: not whole rows
    p = _cli(["convert", "--from", "sglang-b64", str(tmp_path / "s.txt"), "--out", str(out),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 1 and "sample 's-1'" in p.stderr and "whole number of rows" in p.stderr
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
    assert p.returncode == 1 and "claims shape" in p.stderr and "Traceback" not in p.stderr
    assert out.read_bytes() == b"keep me"                                # not truncated
    (tmp_path / "empty.txt").write_text("")
    p = _cli(["convert", "--from", "vllm-b64", str(tmp_path / "empty.txt"), "--out", str(out), *args])
    assert p.returncode == 1 and "no routing payloads" in p.stderr
    for bad in (["--codec", "bogus"], ["--moe-layers", "a-b"], ["--layer-group", "0"]):
        p = _cli(["convert", "--from", "npy", str(folder), "--out", str(out), *args, *bad])
        assert p.returncode == 2 and "Traceback" not in p.stderr, (bad, p.stderr)
    p = _cli(["export", str(tmp_path / "missing.rrsc"), "--sample", "x", "--out", str(out)])
    assert p.returncode == 1 and "Traceback" not in p.stderr and "missing.rrsc" in p.stderr



def test_removed_codecs_format_2_and_seed_from_are_refused_by_name(tmp_path, schema, capsys):
    """0.3.0 removed the xl-ans and ctx-ans codecs (and the other 0.2 ones), writing format 2
    and --seed-from: a removed name is a usage error (exit 2) naming the release that
    converts it, not argparse's "invalid choice", and is left out of the help."""
    import numpy as np
    import pytest

    from routereplay.cli.main import build_parser, main
    np.save(tmp_path / "a.npy", random_record(schema, "a", 20, 0).expert_ids)
    sc = tmp_path / "s.rrsc"
    write_records(str(sc), schema, [random_record(schema, "b", 20, 1)])
    out = tmp_path / "o.rrsc"
    npy = ["convert", "--from", "npy", str(tmp_path / "a.npy"), "--out", str(out),
           "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"]
    removal = "was removed in routereplay 0.3.0; routereplay 0.2.x reads it and converts it"
    for args, what in ((npy + ["--codec", "xl-ans"], f"--codec xl-ans: codec 'xl-ans' {removal}"),
                       (npy + ["--codec", "ctx-ans"], f"--codec ctx-ans: codec 'ctx-ans' {removal}"),
                       (["convert", "--from", "sidecar", str(sc), "--out", str(out), "--codec",
                         "ctx-ans-sorted"],
                        f"--codec ctx-ans-sorted: codec 'ctx-ans-sorted' {removal}"),
                       (npy + ["--format-version", "2"],
                        "--format-version 2: writing format version 2 was removed in "
                        "routereplay 0.3.0: write format 3 (the default)")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"routereplay convert: error: {what}" in err, err
    assert not out.exists()
    for bad, want in ((["--seed-from", str(sc)], "unrecognized arguments: --seed-from"),
                      (["--codec", "bogus"], "invalid choice: 'bogus' (choose from 'xl-zstd', "
                                             "'ctx-zstd', 'raw-lm')"),
                      (["--format-version", "1"], "invalid choice: '1' (choose from 3)")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(npy + bad)
        assert e.value.code == 2 and want in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--help"])
    helptext = capsys.readouterr().out
    assert "--codec {xl-zstd,ctx-zstd,raw-lm}" in helptext and "--format-version {3}" in helptext
    assert not any(x in helptext for x in ("xl-ans", "ctx-ans", "zstd-lm", "seed"))
    assert main(npy + ["--format-version", "3", "--codec", "ctx-zstd"]) == 0  # scripts keep working
    with SidecarReader(str(out)) as r:
        assert r.version == 3 and r.codec == "ctx-zstd" and r.sample_ids() == ["a"]


def test_inspect_counts_the_model_frames_of_a_removed_codec(capsys):
    """A 0.2 stream written with xl-ans (tests/fixtures/legacy): inspect still reports its
    model frames (JSON model_frames, model_frame_bytes) and says the codec was removed."""
    from routereplay.cli.main import main
    path = os.path.join(os.path.dirname(__file__), "fixtures", "legacy", "xl-ans.rrsc")
    main(["inspect", path, "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["model_frames"] == 1 and info["model_frame_bytes"] > 0
    assert info["format_version"] == 3 and info["codec"] == "xl-ans"
    main(["inspect", path])
    text = capsys.readouterr().out
    assert "(1 xl-ans model frame, " in text
    assert "note: 1 xl-ans model frame: the codec 'xl-ans' was removed in routereplay 0.3.0; " \
           "routereplay 0.2.x reads it and converts it" in text, text

# --- issue 16 kind 13 / issue 17 item 1: the command line's contract -------------------------

def test_version_and_usage_vs_runtime_exit_codes(tmp_path, schema):
    from routereplay import __version__
    p = _cli(["--version"])
    assert p.returncode == 0 and p.stdout.strip() == f"routereplay {__version__}"
    p = run_py(["-m", "routereplay", "--version"], timeout=60)       # python -m routereplay
    assert p.returncode == 0 and __version__ in p.stdout
    assert _cli(["inspect"]).returncode == 2                         # usage: argparse
    p = _cli(["export", str(tmp_path / "none.rrsc"), "--sample", "x", "--out", str(tmp_path)])
    assert p.returncode == 2 and "--out" in p.stderr and "is a folder" in p.stderr
    p = _cli(["inspect", str(tmp_path / "none.rrsc")])
    assert p.returncode == 1 and "none.rrsc" in p.stdout


def test_export_and_convert_never_overwrite_their_input_or_leave_partials(tmp_path, schema):
    import numpy as np
    sc = tmp_path / "s.rrsc"
    write_records(str(sc), schema, [random_record(schema, "a", 20, 1)])
    before = sc.read_bytes()
    p = _cli(["export", str(sc), "--sample", "a", "--out", str(sc)])
    assert p.returncode == 2 and "refusing" in p.stderr and sc.read_bytes() == before
    np.save(tmp_path / "in.npy", random_record(schema, "x", 10, 2).expert_ids)
    out_dir = tmp_path / "outdir"
    out_dir.mkdir()
    p = _cli(["convert", "--from", "npy", str(tmp_path / "in.npy"), "--out", str(out_dir),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 2 and "is a folder" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.npy", "outdir", "s.rrsc"]      # no .partial


def test_no_spelling_of_an_input_is_overwritten(tmp_path, schema):
    """Inputs given as a glob, or named like the output's temporary file, are still inputs."""
    import numpy as np
    d = tmp_path / "d"
    d.mkdir()
    for name in ("a", "b"):
        write_records(str(d / f"{name}.rrsc"), schema, [random_record(schema, name, 12, 1)])
    before = (d / "a.rrsc").read_bytes()
    p = _cli(["export", str(d / "*.rrsc"), "--sample", "b", "--out", str(d / "a.rrsc")])
    assert p.returncode == 2 and "is the input" in p.stderr, p.stderr
    assert (d / "a.rrsc").read_bytes() == before
    part = tmp_path / "x.partial"
    write_records(str(part), schema, [random_record(schema, "x", 12, 1)])
    before = part.read_bytes()
    # NOTE: outputs go through a new random sibling (OUT.<12 hex>.partial), so an input
    # named like an old fixed temporary (OUT.partial) is never touched
    p = _cli(["export", str(part), "--sample", "x", "--out", str(tmp_path / "x")])
    assert p.returncode == 0, p.stderr
    assert part.read_bytes() == before and (tmp_path / "x").exists()
    npy = tmp_path / "r.rrsc.partial"
    with open(npy, "wb") as f:
        np.save(f, random_record(schema, "r", 10, 2).expert_ids)
    before = npy.read_bytes()
    p = _cli(["convert", "--from", "npy", str(npy), "--out", str(tmp_path / "r.rrsc"),
              "--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"])
    assert p.returncode == 0, p.stderr
    assert npy.read_bytes() == before and SidecarReader(str(tmp_path / "r.rrsc")).complete


def test_fifo_sidecar_is_refused_not_hung(tmp_path):
    fifo = tmp_path / "p.rrsc"
    os.mkfifo(fifo)
    for args in (["inspect", str(fifo)], ["export", str(fifo), "--sample", "x", "--out",
                                          str(tmp_path / "x.npy")]):
        p = _cli(args, timeout=60)
        assert p.returncode == 1 and "not a regular file" in (p.stdout + p.stderr), p
    fifo_in = tmp_path / "in.npy"
    os.mkfifo(fifo_in)
    p = _cli(["convert", "--from", "npy", str(fifo_in), "--out", str(tmp_path / "o.rrsc"),
              "--num-experts", "8", "--top-k", "2", "--moe-layers", "1-3"], timeout=60)
    assert p.returncode == 1 and "not a regular file" in p.stderr, p
    assert not any(x.startswith("o.rrsc") for x in os.listdir(tmp_path))


def test_ids_with_surrogates_or_control_characters_are_escaped(tmp_path, schema):
    sc = tmp_path / "s.rrsc"
    ids = ["lone\ud800surrogate", "x\nerror: faked line", "ok"]
    write_records(str(sc), schema, [random_record(schema, s, 12, i) for i, s in enumerate(ids)])
    p = _cli(["inspect", str(sc)])
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert not any(line.startswith("error:") for line in p.stdout.splitlines())
    assert "'x\\nerror: faked line'" in p.stdout and "\\ud800" in p.stdout
    out = json.loads(_cli(["inspect", str(sc), "--json"]).stdout)
    assert [r["sample_id"] for r in out["records"]] == ids


def test_broken_pipe_is_not_an_error(tmp_path, schema):
    import subprocess
    import sys
    sc = tmp_path / "many.rrsc"
    write_records(str(sc), schema, [random_record(schema, f"sample-{i:05d}", 3, i,
                                                  with_arrays=False) for i in range(3000)])
    proc = subprocess.Popen([sys.executable, "-m", "routereplay", "inspect", str(sc), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc.stdout.readline()
    proc.stdout.close()                                        # `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


def test_missing_optional_dependency_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'matplotlib':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import importlib.util\n"
            "importlib.util.find_spec = (lambda f: lambda n, *a: None if n == 'matplotlib' "
            "else f(n, *a))(importlib.util.find_spec)\n"
            "from routereplay.cli import main\n"
            f"sys.exit(main(['verify', {str(tmp_path / 's.rrsc')!r}, '--model', "
            f"{str(tmp_path)!r}, '--plot', {str(tmp_path / 'p.png')!r}]))\n")
    p = run_py(["-c", code], timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "'matplotlib'" in p.stderr and "pip install 'routereplay[verify]'" in p.stderr


def test_inspect_and_export_take_several_streams(tmp_path, schema):
    import numpy as np
    recs = [random_record(schema, f"s{i}", 12 + i, i) for i in range(4)]
    d = tmp_path / "run"
    d.mkdir()
    write_records(str(d / "v0.rrsc"), schema, recs[:2])
    write_records(str(d / "v1.rrsc"), schema, recs[2:])
    for args in ([str(d)], [str(d / "v0.rrsc"), str(d / "v1.rrsc")], [str(d / "v*.rrsc")]):
        out = json.loads(_cli(["inspect", *args, "--json"]).stdout)
        assert out["num_records"] == 4 and out["complete"] and len(out["streams"]) == 2
        assert out["records"][3]["stream"].endswith("v1.rrsc")
    p = _cli(["export", str(d), "--sample", "s3", "--out", str(tmp_path / "s3.npy")])
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "s3.npy"), recs[3].expert_ids)
    write_records(str(d / "v2.rrsc"), schema, [random_record(schema, "s1", 12, 9)])
    p = _cli(["inspect", str(d)])
    assert p.returncode == 1 and "'s1' is in two streams" in p.stdout
    assert "v0.rrsc" in p.stdout and "v2.rrsc" in p.stdout


def test_inspect_reports_incomplete_and_index_disagreement(tmp_path, schema):
    from routereplay.sidecar import SidecarReader
    recs = [random_record(schema, f"r{i}", 12 + i, i) for i in range(3)]
    sc = tmp_path / "s.rrsc"
    write_records(str(sc), schema, recs)
    data = sc.read_bytes()
    cut = SidecarReader(data).scan()[2].offset
    (tmp_path / "cut.rrsc").write_bytes(data[:cut])                # cut at a frame boundary
    p = _cli(["inspect", str(tmp_path / "cut.rrsc")])
    assert p.returncode == 1 and "not complete" in p.stdout and "recovered 2 records" in p.stdout


def test_export_of_a_corrupt_listed_sample_names_stream_and_sample(tmp_path, schema):
    from routereplay.sidecar import SidecarReader
    sc = tmp_path / "s.rrsc"
    write_records(str(sc), schema, [random_record(schema, f"r{i}", 12, i) for i in range(3)])
    data = bytearray(sc.read_bytes())
    fi = SidecarReader(bytes(data)).scan()[1]
    grid = fi.meta.grid                       # a byte of r1's routing section
    data[fi.offset + 24 + grid.head_len + grid.table_len + 7] ^= 0xFF
    sc.write_bytes(bytes(data))
    p = _cli(["export", str(sc), "--sample", "r1", "--out", str(tmp_path / "x.npy")])
    assert p.returncode == 1 and "is not in" not in p.stderr
    assert "s.rrsc" in p.stderr and "'r1'" in p.stderr and "offset" in p.stderr


def test_inspect_reports_routing_bits_apart_from_the_whole_file(tmp_path, schema):
    from routereplay.sidecar import SidecarReader
    sc = tmp_path / "s.rrsc"
    recs = [random_record(schema, f"s{i}", 40, i) for i in range(3)]
    write_records(str(sc), schema, recs)
    p = _cli(["inspect", str(sc), "--json"])
    out = json.loads(p.stdout)
    rows = sum(r.num_tokens for r in recs) * schema.num_moe_layers
    with SidecarReader(str(sc)) as r:
        routing = sum(r.record_bytes(x.sample_id).routing for x in recs)
    assert out["routing_bits_per_token_layer"] == 8 * routing / rows
    assert out["routing_bits_per_token_layer"] < out["bits_per_token_layer"]
