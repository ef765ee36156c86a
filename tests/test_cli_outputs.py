"""Issue 27 items 5 and 6: the command line's outputs onto special files, and layer ranges.

Outputs: a FIFO or a character device is written straight through (nothing renamed over
it); a folder, a block device, a socket or a symbolic link is refused with exit status 2,
naming the option and the path. No test writes to the system's /dev/null directly: a
version that renames over its output would replace it; its own device node (mknod, root)
and a link to /dev/null stand in for it.
"""
import io
import json
import os
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from routereplay import SidecarReader
from routereplay.sidecar import write_records
from tests.conftest import REPO, random_record, run_py

ARGS = ["--num-experts", "16", "--top-k", "4", "--moe-layers", "1-3"]


def _cli(args, timeout=60):
    return run_py(["-m", "routereplay.cli", *map(str, args)], timeout=timeout)


def _inputs(tmp_path, schema):
    """(an .npy input, a sidecar holding sample 'a', the ids of 'a')."""
    rec = random_record(schema, "a", 20, 1)
    np.save(tmp_path / "in.npy", rec.expert_ids)
    sc = tmp_path / "s.rrsc"
    write_records(str(sc), schema, [rec])
    return tmp_path / "in.npy", sc, rec.expert_ids


def _through_fifo(tmp_path, args):
    """Run the CLI with its output on a FIFO that a second process (cat) reads; returns
    (the CLI's result, the bytes the reader got)."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = tmp_path / "got"
    with open(got, "wb") as sink:
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
        try:
            p = _cli([*args, fifo])
            reader.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass                            # the FIFO was renamed over: nobody writes it
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    os.remove(fifo)
    data = got.read_bytes()
    os.remove(got)
    return p, data


def test_outputs_onto_a_fifo_are_written_through_it(tmp_path, schema):
    npy, sc, ids = _inputs(tmp_path, schema)
    p, data = _through_fifo(tmp_path, ["convert", "--from", "npy", npy, *ARGS, "--out"])
    assert p.returncode == 0, p.stderr
    r = SidecarReader(data)
    assert r.complete and r.sample_ids() == ["in"]
    assert np.array_equal(r.read("in").expert_ids, ids)
    assert f"wrote 1 records, {len(ids)} tokens, {len(data)} bytes" in p.stdout
    p, data = _through_fifo(tmp_path, ["export", sc, "--sample", "a", "--out"])
    assert p.returncode == 0, p.stderr
    assert np.array_equal(np.load(io.BytesIO(data), allow_pickle=False), ids)
    assert sorted(os.listdir(tmp_path)) == ["in.npy", "s.rrsc"]        # no temporary file


def test_stdout_as_output_gets_the_stream_alone(tmp_path, schema):
    """--out a link to /dev/stdout (itself a link to the pipe): the stream on the pipe,
    the summary on stderr. NOTE: not /dev/stdout itself: a version that renames over its
    output would replace the system's link; this one replaces ours."""
    npy, sc, ids = _inputs(tmp_path, schema)
    out = tmp_path / "stdout"
    out.symlink_to("/dev/stdout")
    p = subprocess.run([sys.executable, "-m", "routereplay.cli", "convert", "--from", "npy",
                        str(npy), *ARGS, "--out", str(out)], cwd=REPO,
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert SidecarReader(p.stdout).sample_ids() == ["in"]
    assert b"wrote 1 records" in p.stderr
    p = subprocess.run([sys.executable, "-m", "routereplay.cli", "export", str(sc), "--sample",
                        "a", "--out", str(out)], cwd=REPO, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert np.array_equal(np.load(io.BytesIO(p.stdout), allow_pickle=False), ids)
    assert os.readlink(out) == "/dev/stdout"


def _written_through(tmp_path, schema, out, node_ok):
    """convert and export onto ``out`` succeed and leave it as it was (``node_ok``)."""
    npy, sc, _ = _inputs(tmp_path, schema)
    for args in (["convert", "--from", "npy", npy, *ARGS, "--out", out],
                 ["export", sc, "--sample", "a", "--out", out]):
        p = _cli(args)
        assert p.returncode == 0, (args, p.stderr)
        assert node_ok(), args
    return sorted(os.listdir(tmp_path))


def test_a_link_to_dev_null_writes_through_to_it(tmp_path, schema):
    null = os.stat("/dev/null")
    link = tmp_path / "null-link"                 # NOTE: a version that renames over its
    link.symlink_to("/dev/null")                  # output replaces this link, not /dev/null

    def same():
        st = os.stat("/dev/null")
        return (os.path.islink(link) and os.readlink(link) == "/dev/null"
                and stat.S_ISCHR(st.st_mode) and (st.st_rdev, st.st_ino) == (null.st_rdev,
                                                                             null.st_ino))
    assert _written_through(tmp_path, schema, link, same) == ["in.npy", "null-link", "s.rrsc"]


@pytest.mark.skipif(os.geteuid() != 0, reason="os.mknod of device nodes needs root")
def test_device_nodes_null_written_through_block_refused(tmp_path, schema):
    dev = tmp_path / "null-node"                  # our own node of the null device (1, 3)
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))

    def same():
        st = os.lstat(dev)
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert _written_through(tmp_path, schema, dev, same) == ["in.npy", "null-node", "s.rrsc"]
    # NOTE: a loop device number no machine has: never a real disk, even if written
    blk = tmp_path / "blk"
    os.mknod(blk, stat.S_IFBLK | 0o600, os.makedev(7, 1 << 19))
    for args in (["convert", "--from", "npy", tmp_path / "in.npy", *ARGS, "--out", blk],
                 ["export", tmp_path / "s.rrsc", "--sample", "a", "--out", blk]):
        p = _cli(args)
        assert p.returncode == 2 and f"--out {blk} is a block device" in p.stderr, p.stderr
        assert stat.S_ISBLK(os.lstat(blk).st_mode)


def test_folders_sockets_and_links_are_refused(tmp_path, schema, capsys):
    """In-process (main(argv)): each refusal is a usage error before anything is read."""
    from routereplay.cli.main import main
    npy, sc, _ = _inputs(tmp_path, schema)
    target = tmp_path / "target.rrsc"
    target.write_bytes(b"keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "file-link").symlink_to(target)
    (tmp_path / "dangling-link").symlink_to(tmp_path / "nothing")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    refused = {"folder": "is a folder", "file-link": "is a symbolic link",
               "dangling-link": "is a symbolic link", "sock": "is a socket"}

    def run(args):
        rc = main([str(x) for x in args])
        return rc, capsys.readouterr().err
    try:
        for name, why in refused.items():
            out = tmp_path / name
            mode = os.lstat(out).st_mode
            for args in (["convert", "--from", "npy", npy, *ARGS, "--out", out],
                         ["export", sc, "--sample", "a", "--out", out]):
                rc, err = run(args)
                assert rc == 2 and f"--out {out} {why}" in err, (args, err)
                assert os.lstat(out).st_mode == mode, name                # not replaced
        assert target.read_bytes() == b"keep me"
        assert os.readlink(tmp_path / "file-link") == str(target)
        # verify and demo: refused before any long step (exit 2 without torch or vLLM)
        rc, err = run(["verify", sc, "--model", folder, "--json", folder])
        assert rc == 2 and f"--json {folder} is a folder" in err, err
        rc, err = run(["verify", sc, "--model", folder, "--plot", tmp_path / "file-link"])
        assert rc == 2 and "--plot" in err and "symbolic link" in err, err
        rc, err = run(["verify", sc, "--model", folder, "--json", sc])
        assert rc == 2 and "is the input" in err, err
        (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                        "num_hidden_layers": 2}))
        p = _cli(["demo", "--model", folder, "--json", tmp_path / "sock"])
        assert p.returncode == 2 and "--json" in p.stderr and "is a socket" in p.stderr
        assert "Traceback" not in p.stderr
    finally:
        sock.close()


def test_huge_layer_ranges_fail_fast_naming_the_option(tmp_path, schema):
    """--moe-layers 0-1000000000 was expanded before any check (2.2 GB at 0-20000000, then
    an error blaming extra_header); --num-layers N without --moe-layers likewise."""
    import resource
    npy, _, _ = _inputs(tmp_path, schema)
    base = ["-m", "routereplay.cli", "convert", "--from", "npy", str(npy), "--out",
            str(tmp_path / "o.rrsc"), "--num-experts", "16", "--top-k", "4"]

    def limited():                  # NOTE: 2 GiB of address space: a list of 10^9 ints fails
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    for extra, want in (
            (["--moe-layers", "0-1000000000"],
             "argument --moe-layers: layer list '0-1000000000': '0-1000000000' makes "
             "1000000001 layer ids, above the 524288 a sidecar header could list"),
            (["--moe-layers", "1-400000,500000-900000"], "'500000-900000' makes 800001"),
            (["--num-layers", "1000000000"], "--num-layers 1000000000 (every layer MoE)"),
            (["--moe-layers", "0-300000"], "300001 MoE layers take"),    # under the count,
    ):                                                                # over 1 MiB of JSON
        p = subprocess.run([sys.executable, *base, *extra], cwd=REPO, capture_output=True,
                           text=True, timeout=60, preexec_fn=limited)
        assert p.returncode == 2 and want in p.stderr, (extra, p.stderr)
        assert "Traceback" not in p.stderr and "extra_header" not in p.stderr
    assert not any(n.startswith("o.rrsc") for n in os.listdir(tmp_path))
    from routereplay.cli.main import build_parser
    from routereplay.convert import MAX_LAYER_IDS, schema_from_args
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["convert", "--from", "npy", "x", "--out", "y",
                                   "--moe-layers", "0-1000000000"])
    assert e.value.code == 2
    with pytest.raises(Exception, match="every layer MoE"):
        schema_from_args(None, 16, 4, None, 10**9)
    assert time.monotonic() - t0 < 2.0
    # the bound itself: MAX_LAYER_IDS ids parse (then the header JSON refuses them)
    assert len(build_parser().parse_args(["convert", "--from", "npy", "x", "--out", "y",
                                          "--moe-layers", f"0-{MAX_LAYER_IDS - 1}"]
                                         ).moe_layers) == MAX_LAYER_IDS


def test_a_config_stating_a_huge_layer_count_is_refused_before_expansion():
    """convert --config with num_hidden_layers=1e8 ran 13 s and reached 3.8 GB, then a
    MemoryError: the count is checked before any per-layer list is built."""
    import time

    from routereplay.errors import SchemaError
    from routereplay.schema import RoutingSchema
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match="num_hidden_layers=100000000, above the 65536"):
        RoutingSchema.from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 10 ** 8,
                                      "num_experts": 8, "num_experts_per_tok": 2})
    assert time.perf_counter() - t0 < 1.0
