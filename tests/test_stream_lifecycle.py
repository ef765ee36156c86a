"""Stream lifecycle across processes: a writer never destroys an existing stream.

A second writer on a path that holds a stream, a new writer on a closed stream, and a
restarted vLLM front end whose pid repeats (a container's entrypoint gives the API server
pid 1 on every start: run here in fresh pid namespaces with ``unshare``) must leave every
acknowledged record readable (issue 27 items 1-2; DESIGN.md failure kind 23)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from routereplay import RoutingRecord, RoutingSchema, SidecarReader, SidecarWriter
from routereplay.errors import StreamExistsError
from tests.conftest import REPO

SCHEMA = RoutingSchema(4, (0, 1, 2, 3), 2, 8)

# A writer process: writes N records "<tag>-<i>" to PATH (flushing), says "flushed", then
# waits for a line on stdin before closing (or is killed).
WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from routereplay import RoutingRecord, RoutingSchema, SidecarWriter
    path, tag, n, replace = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    more = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    w = SidecarWriter(path, RoutingSchema(4, (0, 1, 2, 3), 2, 8), replace=replace)
    def write(i):
        ids = np.zeros((5, 4, 2), np.uint8)
        ids[..., 1] = 1 + i % 7
        w.write(RoutingRecord(f"{tag}-{i}", ids))
    for i in range(n):
        write(i)
    w.flush()
    print("flushed", flush=True)
    sys.stdin.readline()
    for i in range(n, n + more):      # written and closed before the follower looks again
        write(i)
    w.close()
    print("closed", flush=True)
""")


def _start(path, tag, n, replace=False, more=0):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag, str(n),
                          "1" if replace else "0", str(more)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p


def _wait_flushed(p):
    line = p.stdout.readline()
    if line.strip() != "flushed":
        p.kill()
        raise AssertionError(f"writer did not start: {line!r} {p.stderr.read()[-2000:]}")


def _finish(p, timeout=30):
    out, err = p.communicate("\n", timeout=timeout)
    return p.returncode, out, err


def test_a_second_writer_process_never_truncates_a_live_or_closed_stream(tmp_path):
    """Writer A holds 60 flushed records; writer B (another process) opens the same path:
    B is refused with StreamExistsError and A's stream stays whole, live and after close;
    a third writer on the closed stream is refused too. Before: B truncated the path and
    the reader reported a complete stream holding only B's records."""
    path = tmp_path / "step.rrsc"
    a = _start(path, "a", 60)
    _wait_flushed(a)
    size = path.stat().st_size
    b = _start(path, "b", 60)
    rc_b, _, err_b = _finish(b)
    assert rc_b == 1 and "StreamExistsError" in err_b and "exists" in err_b, err_b
    assert path.stat().st_size == size                 # not truncated while A is live
    rc_a, out_a, err_a = _finish(a)
    assert rc_a == 0 and "closed" in out_a, err_a
    c = _start(path, "c", 1)
    rc_c, _, err_c = _finish(c)
    assert rc_c == 1 and "StreamExistsError" in err_c, err_c
    r = SidecarReader(str(path))
    assert r.complete and not r.errors
    assert r.sample_ids() == [f"a-{i}" for i in range(60)]
    assert int(r.read("a-59").expert_ids[0, 0, 1]) == 1 + 59 % 7


def test_in_process_writer_refuses_any_existing_path_and_touches_nothing(tmp_path):
    old = tmp_path / "old.rrsc"
    with SidecarWriter(str(old), SCHEMA) as w:
        w.write(RoutingRecord("keep", np.array([[[0, 1]] * 4] * 3, np.uint8)))
    before = old.read_bytes()
    with pytest.raises(StreamExistsError, match="exists: a writer never overwrites") as e:
        SidecarWriter(str(old), SCHEMA)
    assert isinstance(e.value, FileExistsError) and e.value.path == str(old)
    assert old.read_bytes() == before
    other = tmp_path / "notes.txt"                     # any file, not only streams
    other.write_text("x")
    with pytest.raises(StreamExistsError):
        SidecarWriter(str(other), SCHEMA)
    assert other.read_text() == "x"
    with pytest.raises(StreamExistsError):             # fsspec URLs: checked before opening
        import fsspec
        with fsspec.open("memory://lifecycle/x.rrsc", "wb") as f:
            f.write(before)
        SidecarWriter("memory://lifecycle/x.rrsc", SCHEMA)
    with fsspec.open("memory://lifecycle/x.rrsc", "rb") as f:
        assert f.read() == before


def test_replace_is_explicit_atomic_and_loses_nothing_when_killed(tmp_path):
    """replace=True writes a .partial sibling and renames it over the old stream on close:
    readers see the old stream until then; a replacing writer killed before close leaves
    the old stream as it was and its own records recoverable in the .partial file."""
    path = tmp_path / "step.rrsc"
    with SidecarWriter(str(path), SCHEMA) as w:
        w.write(RoutingRecord("old", np.array([[[0, 1]] * 4] * 3, np.uint8)))
    old = path.read_bytes()
    killed = _start(path, "new", 5, replace=True)
    _wait_flushed(killed)
    assert path.read_bytes() == old
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert path.read_bytes() == old
    partial = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1
    torn = SidecarReader(str(partial[0]))
    assert not torn.complete and torn.sample_ids() == [f"new-{i}" for i in range(5)]
    done = _start(path, "again", 4, replace=True)
    _wait_flushed(done)
    assert path.read_bytes() == old                      # still the old one while writing
    rc, _, err = _finish(done)
    assert rc == 0, err
    r = SidecarReader(str(path))
    assert r.complete and r.sample_ids() == [f"again-{i}" for i in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["step.rrsc", partial[0].name])


def test_replace_never_renames_over_a_special_file_or_folder(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for dest in (fifo, tmp_path):
        with pytest.raises(StreamExistsError, match="exists and is (not a regular file|a "
                                                    "folder)"):
            SidecarWriter(str(dest), SCHEMA, replace=True)
    assert fifo.is_fifo() and not [p for p in tmp_path.iterdir() if p.name != "pipe"]


# A restarted vLLM front end: the plugin's Streamer in a process whose pid is 1 (a fresh pid
# namespace, as a container's API server), writing TAG records to DEST, then closed.
FRONT_END = textwrap.dedent("""
    import os, sys
    import numpy as np
    from engine_patches.vllm.capture import Streamer
    from routereplay import RoutingRecord, RoutingSchema
    dest, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    st = Streamer(dest, schema=RoutingSchema(4, (0, 1, 2, 3), 2, 8), weight_version="v0")
    for i in range(n):
        ids = np.zeros((5, 4, 2), np.uint8)
        ids[..., 1] = 1 + i
        st._writer().write(RoutingRecord(f"{tag}-{i}", ids))
        st.records += 1
        if i == 0:
            st.rotate("v1")                  # a weight update: the next stream, .0001
    st.close()
    print(os.getpid(), [s.path for s in st.streams()])
""")


def _front_end(dest, tag, n):
    cmd = [sys.executable, "-c", FRONT_END, str(dest), tag, str(n)]
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *cmd], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare (root)")
@pytest.mark.parametrize("dest", ["folder", "file"])
def test_a_restarted_front_end_with_the_same_pid_keeps_the_earlier_runs_streams(tmp_path, dest):
    """Two runs of the plugin, each as pid 1, into one folder (or one file path): every
    record of both runs stays readable. Before: the second run reopened vllm-1.rrsc (or
    the file path) and its .0001 stream for writing, and 3 records became 1."""
    target = tmp_path if dest == "folder" else tmp_path / "run.rrsc"
    first = _front_end(target, "first", 3)
    second = _front_end(target, "second", 1)
    assert first.startswith("1 ") and second.startswith("1 ")      # the pid repeats
    seen = {}
    for p in sorted(tmp_path.iterdir()):
        r = SidecarReader(str(p))
        assert r.complete and not r.errors, p
        for s in r.sample_ids():
            seen[s] = int(r.read(s).expert_ids[0, 0, 1])
    assert seen == {"first-0": 1, "first-1": 2, "first-2": 3, "second-0": 1}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3, names                  # first: 2 streams (a rotation), second: 1
    if dest == "file":
        assert "run.rrsc" in names and "run.0001.rrsc" in names
        assert any(n.startswith("run-") and n.endswith("-1-" + n.split("-")[-1]) for n in names)
    else:
        assert all(n.startswith("vllm-") and "-1-" in n for n in names)


def test_a_huge_version_label_never_stops_the_plugin_writing(tmp_path, caplog):
    """A 2 MiB weight-version label (set through the engine's own API; our routes refuse
    it) is left out of the stream header with an error logged: every record is written.
    Before: every stream's header exceeded the readers' limit, and each record of that
    version was refused and dropped (10 of 10)."""
    from engine_patches.vllm.capture import Streamer
    st = Streamer(str(tmp_path) + "/", schema=SCHEMA, weight_version="v0")
    st.rotate("x" * (2 << 20))
    for i in range(10):
        ids = np.zeros((5, 4, 2), np.uint8)
        ids[..., 1] = 1 + i % 7
        st._writer().write(RoutingRecord(f"s{i}", ids))
        st.records += 1
    st.close()
    (path,) = list(tmp_path.iterdir())
    r = SidecarReader(str(path))
    assert r.complete and len(r.sample_ids()) == 10
    assert "weight_version" not in r.header["extra"]
    assert "weight_version is 2097152 characters long" in caplog.text


def test_replace_keeps_the_old_stream_when_the_with_block_raises_and_refuses_links(tmp_path):
    """(Newcomer review) a `with SidecarWriter(p, replace=True)` block left by an exception
    closes the new stream under its .partial name and leaves p as it was; a symbolic link
    at p is refused (renamed over, the link would become a file, its target unchanged); a
    fsspec URL is replaced by a move on close, not written over in place."""
    import fsspec
    path = tmp_path / "step.rrsc"
    ids = np.array([[[0, 1]] * 4] * 3, np.uint8)
    with SidecarWriter(str(path), SCHEMA) as w:
        w.write(RoutingRecord("old", ids))
    old = path.read_bytes()
    with pytest.raises(RuntimeError, match="caller"):
        with SidecarWriter(str(path), SCHEMA, replace=True) as w:
            w.write(RoutingRecord("new", ids))
            raise RuntimeError("the caller failed")
    assert path.read_bytes() == old
    (partial,) = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert SidecarReader(str(partial)).sample_ids() == ["new"]
    link = tmp_path / "link.rrsc"
    link.symlink_to(path)
    for kw in ({}, {"replace": True}):
        with pytest.raises(StreamExistsError, match="is a symbolic link"):
            SidecarWriter(str(link), SCHEMA, **kw)
    assert link.is_symlink() and path.read_bytes() == old
    with pytest.raises(StreamExistsError, match="is a folder"):
        SidecarWriter(str(tmp_path), SCHEMA)
    url = "memory://lifecycle-replace/s.rrsc"
    with fsspec.open(url, "wb") as f:
        f.write(old)
    w = SidecarWriter(url, SCHEMA, replace=True)
    w.write(RoutingRecord("new", ids))
    w.flush()
    with fsspec.open(url, "rb") as f:
        assert f.read() == old                       # not written over while the writer runs
    w.close()
    assert SidecarReader(url).sample_ids() == ["new"]
    fs = fsspec.filesystem("memory")
    assert [p for p in fs.ls("/lifecycle-replace", detail=False) if "partial" in p] == []


def test_replace_refuses_a_live_stream_of_another_writer_process(tmp_path):
    """(Attacker review) writer A holds 20 flushed records and is still running; writer B
    with replace=True is refused (A's advisory lock), at open and, had A opened later, at
    close; once A has closed, the replace goes through. Before: B renamed over A's file, A
    went on writing to an unlinked file, and A's 30 acknowledged records were lost."""
    path = tmp_path / "live.rrsc"
    a = _start(path, "a", 20)
    _wait_flushed(a)
    with pytest.raises(StreamExistsError, match="is a live stream"):
        SidecarWriter(str(path), SCHEMA, replace=True)
    ids = np.array([[[0, 1]] * 4] * 3, np.uint8)
    other = tmp_path / "other.rrsc"
    with SidecarWriter(str(other), SCHEMA) as w:
        w.write(RoutingRecord("x", ids))
    b = SidecarWriter(str(other), SCHEMA, replace=True)   # other is closed: allowed at open
    b.write(RoutingRecord("y", ids))
    holder = open(other, "rb")                            # a writer takes other's lock now
    import fcntl
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
    with pytest.raises(StreamExistsError, match="live stream .*the new stream is .*partial"):
        b.close()
    holder.close()
    assert SidecarReader(str(other)).sample_ids() == ["x"]
    rc, _, err = _finish(a)
    assert rc == 0, err
    with SidecarWriter(str(path), SCHEMA, replace=True) as w:
        w.write(RoutingRecord("z", ids))
    assert SidecarReader(str(path)).sample_ids() == ["z"]


def test_a_folder_planted_before_close_is_a_library_error_and_keeps_the_partial(tmp_path):
    path = tmp_path / "s.rrsc"
    ids = np.array([[[0, 1]] * 4] * 3, np.uint8)
    w = SidecarWriter(str(path), SCHEMA, replace=True)
    w.write(RoutingRecord("new", ids))
    path.mkdir()
    with pytest.raises(StreamExistsError, match="no longer a regular file: not replaced"):
        w.close()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert SidecarReader(str(partial)).sample_ids() == ["new"]


@pytest.mark.parametrize("multi", [False, True])
def test_a_follower_keeps_the_records_it_found_when_the_writer_closes_between_polls(
        tmp_path, multi):
    """Attacker review of issue 29: a follower had scanned r-0, r-1 of a live stream; the
    writer process wrote r-2 and closed (index + trailer) before the next refresh. The
    refresh rebuilt the id map from the index and the scan's cross-check then kept only the
    frames it scanned in that pass: r-0 and r-1 were listed but 'not in sidecar'."""
    from routereplay.sidecar import MultiSidecarReader
    path = tmp_path / "s.rrsc"
    p = _start(path, "r", 2, more=1)
    _wait_flushed(p)
    reader = MultiSidecarReader([str(path)]) if multi else SidecarReader(str(path))
    assert sorted(reader.sample_ids()) == ["r-0", "r-1"]
    assert _finish(p)[0] == 0
    reader.refresh()
    assert sorted(reader.sample_ids()) == ["r-0", "r-1", "r-2"]
    for i in range(3):
        rec = reader.read(f"r-{i}")
        assert rec.num_tokens == 5 and int(rec.expert_ids[0, 0, 1]) == 1 + i
    if not multi:
        assert reader.complete and reader.errors == []
