"""Reader and CLI work on crafted input, against issue 16's targets.

    .venv/bin/python benchmarks/robustness.py [--quick] [--cases NAME,...] [--tiny]

For each crafted input (tests/crafted.py, plus two `convert` inputs), a fresh
process reads it the way a trainer or `routereplay inspect` would (open, scan, every
record, every sample id read; our errors caught) and reports:

- CPU seconds of that read (process time, the build of the input not included);
- peak memory: the growth of the process's peak RSS over its RSS before the read, and the
  tracemalloc peak (Python and numpy allocations) of a second, traced run;
- the targets: peak memory <= 64 MiB + 4 x (the largest valid record the schema and the
  file size allow: routereplay.sidecar.limits.largest_record_bytes), CPU <= 1 s per MiB
  of input. For inputs of a few KiB the CPU target is below a millisecond: the fixed cost
  of a read (opening, parsing a header, a numpy call) is then what is measured.

The `inspect` rows run the command line itself (`python -m routereplay inspect`), so they
include the interpreter's start-up (about 0.3-1 s of CPU and 40-60 MiB here).
Timings are noisy: the 2 cores are shared with other work.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from routereplay.errors import RouteReplayError  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar.limits import largest_record_bytes  # noqa: E402
from tests import crafted  # noqa: E402

MiB = 1 << 20
# NOTE: a mid-size MoE shape (Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8)
SCHEMA = RoutingSchema(num_hidden_layers=48, moe_layer_ids=tuple(range(48)), top_k=8,
                       num_experts=128)


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" to clear_refs). NOTE: ru_maxrss
    would also count the parent's peak, which a child inherits across fork and exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def read_all(path: str) -> str:
    """What a consumer does with a stream; returns how it ended."""
    from routereplay.sidecar import SidecarReader
    try:
        with SidecarReader(path) as r:
            n = sum(1 for _ in r.records(strict=False))
            for sid in r.sample_ids():
                try:
                    r.read(sid)
                except RouteReplayError:
                    pass
            return f"{n} records, {len(r.errors)} errors"
    except RouteReplayError as e:
        return f"refused: {str(e)[:70]}"


def convert_all(path: str) -> str:
    from routereplay.convert import iter_records
    try:
        return f"{sum(1 for _ in iter_records('vllm', path, SCHEMA_SMALL))} records"
    except RouteReplayError as e:
        return f"refused: {str(e)[:70]}"


SCHEMA_SMALL = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4,
                             num_experts=16)


def child(kind: str, path: str) -> None:
    """Measure one read in this (fresh) process; print JSON."""
    fn = read_all if kind == "read" else convert_all
    _reset_peak_rss()
    before = _status("VmRSS")
    t = time.process_time()
    outcome = fn(path)
    cpu = time.process_time() - t
    rss_peak = _status("VmHWM") - before
    tracemalloc.start()
    fn(path)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"cpu": cpu, "rss": max(rss_peak, 0), "traced": traced,
                      "outcome": outcome}))


def npz_bomb(path: str, nbytes: int) -> None:
    """An .npz whose one member expands to ``nbytes`` of zeros (issue 16 item 9)."""
    t = nbytes // (4 * 4)
    like = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (t, 4, 4), (0, 0, 0))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("a.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, np.lib.format.header_data_from_array_1_0(like))
            block = bytes(MiB)
            for _ in range(nbytes // MiB):
                f.write(block)


# Issue 27 item 9: tiny sections, written by the writer (a one-token x one-layer grid; one-row
# records; version-2 one-row records in one-layer groups, by tests/crafted.py's 0.2
# encoder) for each writer codec, and the same grid assembled directly (what the writer wrote
# before the section floors), E=65536 too
SCHEMA_WIDE = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(0, 1, 2, 3), top_k=8,
                            num_experts=65536)
TINY_GRID = dict(token_block=1, layer_group=1, one_section_bytes=0, min_section_bytes=0)
TINY_CODECS = ("xl-zstd", "ctx-zstd", "raw-lm")
TINY_CASES = ([f"tiny grid, writer: {c}" for c in TINY_CODECS]
              + ["tiny grid, writer: xl-zstd E=65536"]
              + [f"one-row records, writer: {c}" for c in TINY_CODECS]
              + ["v2 one-row records, layer group 1: ctx-zstd"]
              + [f"tiny grid, assembled: {c}" for c in TINY_CODECS]
              + ["tiny grid, assembled: xl-zstd E=65536"])


def _tiny_records(schema: RoutingSchema, n: int, rows: int):
    from routereplay.record import RoutingRecord
    rng = np.random.default_rng(0)
    for i in range(n):
        ids = np.argsort(rng.random((rows, schema.num_moe_layers, schema.num_experts)), -1)
        yield RoutingRecord(sample_id=f"r{i}",
                            expert_ids=ids[..., :schema.top_k].astype(schema.id_dtype))


def tiny(name: str, quick: bool) -> bytes:
    """A TINY_CASES stream of about 0.25 MiB (0.06 with ``quick``)."""
    from routereplay import codec as _codec
    from routereplay.sidecar import SidecarWriter
    from routereplay.sidecar import payload as _payload
    from routereplay.sidecar import record_meta as _meta
    wide = name.endswith("E=65536")
    codec = name.split(": ")[1].split()[0]
    schema = SCHEMA_WIDE if wide else SCHEMA
    target = (1 if quick else 4) * MiB // 16
    if name.startswith("tiny grid, assembled"):
        cid = crafted.CODECS_V3.index(codec)
        out, size = [], 0
        for rec in _tiny_records(schema, 10 ** 6, 8):
            ids, t, nl = rec.expert_ids, 8, schema.num_moe_layers
            secs = [(cid, _codec.encode(np.ascontiguousarray(ids[b:b + 1, g:g + 1]), codec,
                                        schema.num_experts))
                    for g in range(nl) for b in range(t)]
            out.append(_payload.assemble(_meta.encode_meta(rec.sample_id, t, 1, 1), secs))
            size += len(out[-1])
            if size >= target:
                return crafted.stream(schema, out)
    rows = 1 if "one-row" in name else 8
    if name.startswith("v2"):
        recs, size = [], 0
        for rec in _tiny_records(schema, 10 ** 6, rows):
            recs.append(rec)
            size += 24 + len(crafted.v2_payload(rec, schema, codec, layer_group=1))
            if size >= target:
                return crafted.v2_stream(schema, recs, codec=codec, layer_group=1)
    kw = TINY_GRID if "grid" in name else {}
    w = SidecarWriter(None, schema, codec=codec, background=False, **kw)
    for rec in _tiny_records(schema, 10 ** 6, rows):
        w.write(rec)
        if w.bytes_written >= target:
            break
    w.close()
    return w.getvalue()


def build(name: str, tmp: str, quick: bool) -> tuple[str, str, str]:
    """(kind, path, schema name) of a crafted input written under ``tmp``."""
    path = os.path.join(tmp, name.replace(" ", "_").replace(",", "").replace(":", ""))
    if name in TINY_CASES:
        with open(path, "wb") as f:
            f.write(tiny(name, quick))
        return "read", path, "wide" if name.endswith("E=65536") else "big"
    if name == "convert: .npz member bomb":
        npz_bomb(path + ".npz", (64 if quick else 256) * MiB)     # 2^24 rows at most
        return "convert", path + ".npz", "small"
    if name == "convert: .npy of -1 ids":
        np.save(path + ".npy", np.full((312_500, 4, 4), -1, np.int32))     # 20 MB
        return "convert", path + ".npy", "small"
    kw = {}
    if quick and name in ("resync over forged magics",):
        kw = {"nbytes": 8 * MiB}
    data = crafted.CASES[name](SCHEMA, **kw)
    with open(path, "wb") as f:
        f.write(data)
    return "read", path, "big"


def run_child(kind: str, path: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", kind, path], capture_output=True,
                       text=True, timeout=1800, cwd=ROOT)
    if p.returncode != 0:
        return {"cpu": float("nan"), "rss": 0, "traced": 0,
                "outcome": f"FAILED: {p.stderr.strip()[-200:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_cli(path: str) -> dict:
    """`routereplay inspect` in a fresh interpreter: its CPU and peak RSS (VmHWM, read by a
    wrapper that resets the peak it inherits before running the command line)."""
    code = ("import runpy, sys; open('/proc/self/clear_refs', 'w').write('5')\n"
            "sys.argv = ['routereplay', 'inspect', sys.argv[1]]\n"
            "try:\n    runpy.run_module('routereplay', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print('HWM', int(hwm.split()[1]) * 1024, rc, file=sys.stderr)\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                       timeout=1800, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    hwm = [ln for ln in p.stderr.splitlines() if ln.startswith("HWM ")]
    rss, rc = (int(hwm[-1].split()[1]), hwm[-1].split()[2]) if hwm else (0, "?")
    return {"cpu": cpu, "rss": rss, "traced": None, "outcome": f"exit {rc} (RSS: whole process)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller resync and npz inputs")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--tiny", action="store_true", help="only the tiny-section cases (issue 27)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    names = list(crafted.CASES) + ["convert: .npz member bomb", "convert: .npy of -1 ids"] \
        + TINY_CASES
    if a.cases:
        names = [n for n in names if n in a.cases.split(",")]
    if a.tiny:
        names = TINY_CASES
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            kind, path, sch = build(name, tmp, a.quick)
            size = os.path.getsize(path)
            schema = {"big": SCHEMA, "wide": SCHEMA_WIDE}.get(sch, SCHEMA_SMALL)
            bound = 64 * MiB + 4 * largest_record_bytes(schema, size)
            res = run_child(kind, path)
            rows.append((name, size, res, bound))
            if kind == "read" and name in ("ctx-zstd bomb", "resync over forged magics",
                                           "many tiny records"):
                rows.append((f"  `routereplay inspect` on it", size, run_cli(path), bound))
    print(f"schema: {SCHEMA.num_moe_layers} MoE layers, top-{SCHEMA.top_k} of "
          f"{SCHEMA.num_experts} experts (convert rows: 3 layers, top-4 of 16)")
    hdr = (f"{'case':<40}{'input':>11}{'CPU s':>8}{'s/MiB':>7}{'target s':>10}{'RSS MiB':>9}"
           f"{'traced MiB':>11}{'mem target MiB':>15}  outcome")
    print(hdr)
    print("-" * len(hdr))
    for name, size, r, bound in rows:
        target = size / MiB
        traced = "" if r["traced"] is None else f"{r['traced'] / MiB:.1f}"
        cpu_ok = r["cpu"] <= max(target, 0.0) or r["cpu"] <= 0.05
        mem_ok = max(r["rss"], r["traced"] or 0) <= bound
        print(f"{name:<40}{size / MiB:>9.3f}Mi{r['cpu']:>8.3f}{r['cpu'] / target:>7.2f}{target:>10.4f}"
              f"{r['rss'] / MiB:>9.1f}{traced:>11}{min(bound / MiB, 1e9):>15.0f}  "
              f"{'' if cpu_ok else '[CPU over] '}{'' if mem_ok else '[MEM over] '}"
              f"{r['outcome']}")
    print("CPU target: 1 s per MiB of input (rows marked only when over it and over 50 ms); "
          "memory target: 64 MiB + 4 x largest_record_bytes(schema, input size).")


if __name__ == "__main__":
    main()
