"""Routing delivery for a DeepSeek-V3-sized RL step, per trainer rank, simulated here (issue 19).

What it does, end to end, with the product's own code:

1. Generates the routing of one RL step for a DeepSeek-V3-shaped schema (61 decoder layers,
   ``first_k_dense_replace=3`` -> 58 MoE layers, 256 routed experts, top-8; built with
   ``RoutingSchema.from_hf_config``): ``--samples`` rollouts (default 512) whose lengths
   follow a log-normal law (median ``--median-len``) clipped to ``[--min-len, --max-len]``
   (default 1K-32K tokens). Generation is seeded and streaming: one record at a time,
   vectorised numpy, never the whole step in memory. Per MoE layer a row repeats the
   previous token's row with probability ``--repeat``, else eight distinct ids are drawn
   from a Zipf(``--skew``) expert popularity shuffled per layer (the trace family of
   ``tests/traces.py``, drawn faster: rejection of rows with a repeated id instead
   of Gumbel top-k). Uniform routing (``--skew 0 --repeat 0``) is the ceiling: 63.8 bits
   per (token, MoE layer).
2. Writes every record through ``SidecarWriter`` into ``--streams`` streams, as the
   engine's DP replicas would (each record to the replica that served it, records in
   finishing order): in format version 3 for each ``--v3`` section geometry (token block
   B x layer group G; the writer's default codec), and in format version 2
   (read only since 0.3.0: written by the 0.2 encoder in tests/crafted.py, groups of
   ``--layer-group`` MoE layers) for comparison.
3. Plans the trainer step as megatron-based RL frameworks do (verl, slime): samples are
   balanced over the DP ranks by token count (longest first, to the least loaded rank),
   then packed per DP rank into THD microbatches of at most ``--mb-tokens`` tokens
   (first-fit decreasing). A sample longer than ``--mb-tokens`` gets a microbatch of its
   own (slime's dynamic batch size does the same; verl instead requires max tokens per
   microbatch >= the longest sample, which is this case with ``--mb-tokens`` >= max len).
   Each sample's packed segment is padded to a multiple of 2*CP*TP (CP with SP).
4. For each simulated rank (DP, CP, TP, PP coordinate) it runs what the product's
   ``RouterReplayer`` runs when a microbatch is entered, for every (microbatch, VPP chunk) in
   the rank's interleaved-1F1B forward order: ``align.token_map(Layout, Shard)``, one
   ``source.fetch(sample_id, moe_layers, runs)`` per sample with all of its token runs (the
   ``RoutingSource`` protocol), ``align.gather_rows`` and ``align.check_rows``, and the
   int16 tensor the replayer holds. It measures bytes read from storage and read requests
   (a wrapper around the file object), bytes decoded (the ids the codec output), the
   decode time (wall time in ``fetch``) and the transient memory of each load
   (``tracemalloc``: numpy and zstd output buffers are traced; zstd's internal window is
   not). Peak bytes held = the most, over the rank's interleaved-1F1B schedule, of the
   replay data held for microbatches in flight (loaded up to ``--prefetch`` forwards ahead,
   released at their backward) plus the transient of the load in progress; given twice:
   for the reader (in-flight ids at the record's dtype + the fetches' transient: what the
   format decides) and for the replayer as it is today (its int16 tensors + the whole
   load's transient, int64 gather included).

Ranks: a rank is (DP, CP, TP, PP) and holds every VPP chunk of its PP stage; all PP stages
are simulated for each sampled (DP, CP, TP) coordinate (``--coords``; default: (0,0,0),
(DP-1, CP-1, TP-1) and two more drawn with the seed), or every rank with ``--all-ranks``.
EP does not change what a rank's routers see (megatron routes the rank's own tokens before
the token dispatcher), so it enters only the world size and the EP-doubling row.

The naive scheme (every rank receives the whole step's routing as int32 [T, 61, 8], as
engines return it today) is computed from the step's sizes; its decode time is the
measured base64 decode rate of ``routereplay.wire`` scaled to the whole step.

    .venv/bin/python benchmarks/scale.py                 # default size, about 6 minutes here
    .venv/bin/python benchmarks/scale.py --quick         # seconds (what the test runs)
    .venv/bin/python benchmarks/scale.py --samples 64 --max-len 8192 --layout tp=2,pp=4,vpp=2,cp=2,dp=2,ep=4
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import tempfile
import time
import tracemalloc
import zlib
from typing import Any, Callable, Iterator, Sequence

import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routereplay import align, codec as _codec, wire  # noqa: E402
from routereplay.record import RoutingRecord  # noqa: E402
from routereplay.schema import RoutingSchema, schema_layers_for  # noqa: E402
from routereplay.sidecar import SidecarReader, SidecarWriter  # noqa: E402
from routereplay.sidecar.layout import KIND_INDEX, KIND_RECORD, encode_frame, encode_trailer  # noqa: E402
from tests.crafted import v2_header, v2_payload  # noqa: E402

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "first_k_dense_replace": 3,
               "moe_layer_freq": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "scoring_func": "sigmoid"}
VOCAB = 129280                     # DeepSeek-V3 vocabulary (token ids are random below it)
# Megatron-LM's DeepSeek-V3 layout for PP=16 x VPP=2: embedding + 1 layer, 30 stages of 2
# layers, MTP + loss (megatron's --pipeline-model-parallel-layout syntax).
DSV3_LAYOUT_PP16_VPP2 = "Et|(tt|)*30mL"


# --------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The generated RL step (sizes in tokens)."""

    samples: int = 512
    min_len: int = 1024
    max_len: int = 32768
    median_len: int = 4096
    sigma: float = 1.0             # log-normal shape of the length law
    skew: float = 0.5              # Zipf exponent of per-layer expert popularity
    repeat: float = 0.05           # P(row == previous token's row), per layer
    prompt_len: int = 1024         # prompt tokens (at most len - 1)
    streams: int = 8               # engine DP replicas, one sidecar stream each
    layer_group: int = 4           # format-2 writer's MoE layers per section
    seed: int = 0
    len_scale: float = 1.0         # multiply every length (sequence-length doubling row)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Megatron layout of the trainer (EP with expert-TP = 1, as DeepSeek-V3 recipes use)."""

    tp: int = 8
    ep: int = 64
    pp: int = 16
    vpp: int = 2
    cp: int = 2
    dp: int = 4
    sp: bool = True
    mb_tokens: int = 8192
    pp_layout: str | None = None      # megatron layout string; None: default for the sizes

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def check(self) -> None:
        if min(self.tp, self.ep, self.pp, self.vpp, self.cp, self.dp, self.mb_tokens) < 1:
            raise SystemExit(f"layout {self}: every size must be >= 1")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise SystemExit(f"EP={self.ep} must divide TP*CP*DP={self.tp * self.cp * self.dp} "
                             "(megatron folds expert parallelism over those ranks, expert TP=1)")

    @property
    def pad_multiple(self) -> int:
        """Packed segments are padded to this many tokens (megatron: 2*CP, times TP with SP)."""
        m = 2 * self.cp if self.cp > 1 else 1
        return m * self.tp if self.sp and self.tp > 1 else m

    def label(self) -> str:
        return (f"TP={self.tp} EP={self.ep} PP={self.pp} VPP={self.vpp} CP={self.cp} "
                f"DP={self.dp} SP={'on' if self.sp else 'off'} mb={self.mb_tokens}")


def parse_layout(s: str, base: Parallel = Parallel()) -> Parallel:
    """'tp=2,pp=4,...' over ``base``."""
    kw: dict[str, Any] = {}
    for part in filter(None, s.split(",")):
        k, _, v = part.partition("=")
        k = k.strip().lower().replace("-", "_")
        if k not in {f.name for f in dataclasses.fields(Parallel)}:
            raise SystemExit(f"--layout: unknown key {k!r}")
        kw[k] = (v.lower() in ("1", "on", "true", "yes")) if k == "sp" else \
            (v if k == "pp_layout" else int(v))
    return dataclasses.replace(base, **kw)


def stage_layers(par: Parallel, num_layers: int) -> list[list[int]]:
    """Decoder-layer ids of each virtual pipeline stage (index = vpp_chunk * PP + pp_rank,
    megatron's interleaved order).

    Uses ``par.pp_layout`` (megatron's --pipeline-model-parallel-layout syntax: E, t, m, L,
    '|', '(..)*n', 'x*n'), else Megatron-LM's DeepSeek-V3 layout when it fits, else an even
    split (earlier stages take the remainder).
    """
    stages = par.pp * par.vpp
    layout = par.pp_layout
    if layout is None and num_layers == 1 + 2 * (stages - 2):
        layout = f"Et|(tt|)*{stages - 2}mL"
    if layout is None:
        per = np.array_split(np.arange(num_layers), stages)
        return [p.tolist() for p in per]
    s = layout.replace(",", "")
    for pat in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):     # megatron parse_str_to_list
        s = re.sub(pat, lambda m: m.group(1) * int(m.group(2)), s)
    parts = s.split("|")
    if len(parts) != stages:
        raise SystemExit(f"pipeline layout {layout!r} has {len(parts)} stages, need PP*VPP={stages}")
    out, n = [], 0
    for p in parts:
        k = p.count("t")
        out.append(list(range(n, n + k)))
        n += k
    if n != num_layers:
        raise SystemExit(f"pipeline layout {layout!r} holds {n} decoder layers, model has {num_layers}")
    return out


# --------------------------------------------------------------------------- generation


class RoutingGenerator:
    """Seeded synthetic routing, one record at a time (vectorised numpy).

    Per MoE layer l: ids come from a 65536-entry table quantising a Zipf(skew) popularity
    over a per-layer permutation of the experts; rows with a repeated id are redrawn; a row
    repeats the previous token's row with probability ``repeat``.
    """

    def __init__(self, schema: RoutingSchema, skew: float, repeat: float, seed: int):
        self.schema, self.repeat = schema, repeat
        e, nl = schema.num_experts, schema.num_moe_layers
        rng = np.random.default_rng([seed, 1])
        pop = 1.0 / np.arange(1, e + 1) ** skew
        self.table = np.empty((nl, 65536), schema.id_dtype)
        for lyr in range(nl):
            c = np.cumsum(pop[rng.permutation(e)])
            c /= c[-1]
            self.table[lyr] = np.minimum(np.searchsorted(c, (np.arange(65536) + 0.5) / 65536,
                                                         side="right"), e - 1)
        k = schema.top_k
        self._pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]

    def ids(self, rng: np.random.Generator, t: int) -> np.ndarray:
        """uint8 [t, L_moe, K]."""
        nl, k = self.schema.num_moe_layers, self.schema.top_k
        u = rng.integers(0, 65536, (nl, t, k), dtype=np.uint16)
        x = np.empty((nl, t, k), self.schema.id_dtype)
        for lyr in range(nl):
            np.take(self.table[lyr], u[lyr], out=x[lyr])
            todo = np.arange(t)
            while len(todo):
                y = x[lyr, todo]
                dup = np.zeros(len(todo), bool)
                for i, j in self._pairs:
                    dup |= y[:, i] == y[:, j]
                todo = todo[dup]
                if len(todo):
                    x[lyr, todo] = self.table[lyr][rng.integers(0, 65536, (len(todo), k),
                                                                dtype=np.uint16)]
        fresh = rng.random((nl, t)) >= self.repeat
        fresh[:, 0] = True
        src = np.maximum.accumulate(np.where(fresh, np.arange(t)[None, :], 0), axis=1)
        x = np.take_along_axis(x, src[:, :, None], axis=1)
        return np.ascontiguousarray(x.transpose(1, 0, 2))


def sample_lengths(spec: StepSpec) -> np.ndarray:
    """Tokens per sample (prompt + response), int64 [samples]."""
    rng = np.random.default_rng([spec.seed, 0])
    n = rng.lognormal(np.log(spec.median_len), spec.sigma, spec.samples)
    n = np.clip(np.round(n), spec.min_len, spec.max_len) * spec.len_scale
    return n.astype(np.int64)


def sample_id(i: int) -> str:
    return f"rollout-{i:05d}"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A format-3 section grid: ``token_block`` rows (B) x ``layer_group`` MoE layers (G);
    records of at most ``one_section_bytes`` bytes of ids are one section (the writer's)."""

    token_block: int
    layer_group: int
    one_section_bytes: int = 64 << 10

    def __str__(self) -> str:
        one = "" if self.one_section_bytes == 64 << 10 else f",one<={self.one_section_bytes}"
        return f"B={self.token_block},G={self.layer_group}{one}"

    @classmethod
    def parse(cls, s: str) -> "Geometry":
        """'512:1' -> Geometry(512, 1); '512:1:0' also sets one_section_bytes."""
        try:
            parts = [int(x) for x in s.split(":")]
            geo = cls(*parts) if 2 <= len(parts) <= 3 else None
        except ValueError:
            geo = None
        if geo is None or geo.token_block < 1 or geo.layer_group < 1 or geo.one_section_bytes < 0:
            raise SystemExit(f"--v3 {s!r}: expected TOKEN_BLOCK:LAYER_GROUP[:ONE_SECTION_BYTES]")
        return geo

    def writer_kw(self) -> dict[str, int]:
        return {"token_block": self.token_block, "layer_group": self.layer_group,
                "one_section_bytes": self.one_section_bytes}

    def sections(self, schema: RoutingSchema, t: int) -> int:
        """Routing sections of a record of ``t`` rows."""
        if t * schema.num_moe_layers * schema.top_k * schema.id_dtype.itemsize \
                <= self.one_section_bytes:
            return 1
        return max(1, -(-t // self.token_block)) * -(-schema.num_moe_layers // self.layer_group)


V2 = "v2"


def v3_name(g: Geometry) -> str:
    return f"v3 {g}"


@dataclasses.dataclass
class Written:
    """Where the step's records went."""

    lengths: np.ndarray                    # tokens per sample
    stream_of: dict[str, int]              # sample id -> stream index
    v2_paths: list[str]
    v3_paths: dict[Geometry, list[str]]
    v2_bytes: int
    v3_bytes: dict[Geometry, int]
    v3_sections: dict[Geometry, int]
    routing_rows: int                      # sum of T over samples (token rows)
    gen_seconds: float
    write_seconds: float


class V2Writer:
    """A format-2 stream written record by record, as routereplay 0.2's writer did (format 2
    is read only since 0.3.0; its encoder is test support, tests/crafted.py): the baseline
    the format-3 geometries are compared with."""

    def __init__(self, path: str, schema: RoutingSchema, layer_group: int):
        self.f, self.schema, self.group = open(path, "wb"), schema, layer_group
        self.f.write(v2_header(schema, layer_group=layer_group))
        self.index: list[list] = []

    def write(self, rec: RoutingRecord) -> None:
        self.index.append([rec.sample_id, self.f.tell()])
        self.f.write(encode_frame(KIND_RECORD, v2_payload(rec, self.schema,
                                                          layer_group=self.group)))

    def close(self) -> None:
        pos = self.f.tell()
        self.f.write(encode_frame(KIND_INDEX, json.dumps({"records": self.index},
                                                         separators=(",", ":")).encode()))
        self.f.write(encode_trailer(pos))
        self.f.close()


def write_step(spec: StepSpec, schema: RoutingSchema, workdir: str,
               geometries: Sequence[Geometry]) -> Written:
    """Generate and write the step (streaming: one record in memory at a time, plus the
    writers' small queues)."""
    lengths = sample_lengths(spec)
    gen = RoutingGenerator(schema, spec.skew, spec.repeat, spec.seed)
    rng = np.random.default_rng([spec.seed, 2])
    order = np.argsort(lengths + rng.random(len(lengths)) * lengths.mean(), kind="stable")
    replica = rng.integers(0, spec.streams, len(lengths))
    v2_paths = [os.path.join(workdir, f"engine{s}.v2.rrsc") for s in range(spec.streams)]
    v2w = [V2Writer(p, schema, spec.layer_group) for p in v2_paths]
    v3_paths = {g: [os.path.join(workdir, f"engine{s}.v3.{i}.rrsc") for s in range(spec.streams)]
                for i, g in enumerate(geometries)}
    v3w = {g: [SidecarWriter(p, schema, max_queue=2, fsync="never",
                             extra_header={"engine": "synthetic", "replica": s}, **g.writer_kw())
               for s, p in enumerate(ps)] for g, ps in v3_paths.items()}
    n_sections = {g: 0 for g in geometries}
    stream_of: dict[str, int] = {}
    tgen = twrite = 0.0
    rows = 0
    for i in order:                      # finishing order: shorter rollouts finish first
        n = int(lengths[i])
        t0 = time.perf_counter()
        ids = gen.ids(rng, n - 1)
        pl = min(spec.prompt_len, n - 1)
        tok = rng.integers(0, VOCAB, n, dtype=np.int32)
        lp = -rng.exponential(0.5, n - pl).astype(np.float32)
        rec = RoutingRecord(sample_id(int(i)), ids, start=0, prompt_len=pl, token_ids=tok,
                            logprobs=lp, engine="synthetic")
        t1 = time.perf_counter()
        s = int(replica[i])
        v2w[s].write(rec)
        for g in geometries:
            v3w[g][s].write(rec)
            n_sections[g] += g.sections(schema, n - 1)
        twrite += time.perf_counter() - t1
        tgen += t1 - t0
        stream_of[rec.sample_id] = s
        rows += n - 1
    t1 = time.perf_counter()
    for w in v2w:
        w.close()
    for ws in v3w.values():
        for w in ws:
            w.close()
    twrite += time.perf_counter() - t1
    return Written(lengths=lengths, stream_of=stream_of, v2_paths=v2_paths, v3_paths=v3_paths,
                   v2_bytes=sum(os.path.getsize(p) for p in v2_paths),
                   v3_bytes={g: sum(os.path.getsize(p) for p in ps) for g, ps in v3_paths.items()},
                   v3_sections=n_sections,
                   routing_rows=rows, gen_seconds=tgen, write_seconds=twrite)


# --------------------------------------------------------------------------- trainer plan


@dataclasses.dataclass
class Plan:
    """Microbatches of each DP rank: lists of sample indices, and their THD layouts."""

    microbatches: list[list[list[int]]]          # [dp][mb] -> sample indices
    layouts: list[list[align.Layout]]


def plan_step(lengths: np.ndarray, par: Parallel) -> Plan:
    """Balance samples over DP ranks, pack each rank's into microbatches (module doc, 3)."""
    order = np.argsort(-lengths, kind="stable")
    load = [0] * par.dp
    per_dp: list[list[int]] = [[] for _ in range(par.dp)]
    for i in order:
        d = int(np.argmin(load))
        per_dp[d].append(int(i))
        load[d] += int(lengths[i])
    mbs_all, layouts_all = [], []
    for samples in per_dp:                       # already longest first
        bins: list[list[int]] = []
        fill: list[int] = []
        for i in samples:
            n = int(lengths[i])
            for b, used in enumerate(fill):
                if used + n <= par.mb_tokens:
                    bins[b].append(i)
                    fill[b] += n
                    break
            else:                                # also: a sample above the cap, alone
                bins.append([i])
                fill.append(n)
        mbs_all.append(bins)
        layouts_all.append([align.Layout.packed_from_lengths([int(lengths[i]) for i in b],
                                                             multiple=par.pad_multiple)
                            for b in bins])
    return Plan(mbs_all, layouts_all)


def forward_order_and_events(num_mb: int, par: Parallel, pp_rank: int
                             ) -> tuple[list[tuple[int, int]], list[tuple[str, tuple[int, int]]]]:
    """Megatron's interleaved 1F1B order on one PP rank: (microbatch, chunk) forwards and
    the F/B event sequence (microbatch groups of PP; warm-up (PP-rank-1)*2 + (VPP-1)*PP
    forwards with VPP, PP-rank-1 without)."""
    p, v = par.pp, par.vpp
    groups = [range(g, min(g + p, num_mb)) for g in range(0, num_mb, p)]
    fwd = [(m, c) for g in groups for c in range(v) for m in g]
    bwd = [(m, c) for g in groups for c in reversed(range(v)) for m in g]
    warm = (p - pp_rank - 1) * 2 + (v - 1) * p if v > 1 else p - pp_rank - 1
    warm = min(warm, len(fwd))
    ev = [("F", x) for x in fwd[:warm]]
    b = 0
    for f in fwd[warm:]:
        ev += [("F", f), ("B", bwd[b])]
        b += 1
    ev += [("B", x) for x in bwd[b:]]
    return fwd, ev


# --------------------------------------------------------------------------- measuring


class CountingFile:
    """A binary file object that counts bytes read and read requests (each read call is
    one ranged GET on an object store; a request that does not continue the previous
    one is also a seek)."""

    def __init__(self, f):
        self._f = f
        self.bytes = self.requests = self.seeks = 0
        self._end = -1

    def seek(self, off: int, whence: int = 0) -> int:
        return self._f.seek(off, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        pos = self._f.tell()
        b = self._f.read(n)
        self.bytes += len(b)
        self.requests += 1
        self.seeks += pos != self._end
        self._end = pos + len(b)
        return b

    def close(self) -> None:
        self._f.close()


@contextlib.contextmanager
def counting_decode() -> Iterator[list[int]]:
    """Count the id bytes ``routereplay.codec.decode`` outputs (both readers call it
    through the module attribute)."""
    box = [0]
    orig = _codec.decode

    def decode(*a, **kw):
        out = orig(*a, **kw)
        box[0] += out.nbytes
        return out
    _codec.decode = decode
    try:
        yield box
    finally:
        _codec.decode = orig


@dataclasses.dataclass
class RankResult:
    """What one rank read, decoded and held over one step (bytes, seconds)."""

    coord: tuple[int, int, int, int]          # (dp, cp, tp, pp)
    bytes_read: int = 0
    open_bytes: int = 0                       # header + index reads at open
    requests: int = 0
    bytes_decoded: int = 0
    share: int = 0                            # ids this rank needs (its layers x tokens), uint8
    fetch_seconds: float = 0.0                # wall time in fetch (noisy on shared cores)
    load_seconds: float = 0.0                 # fetch + token map + gather + check (wall)
    fetch_cpu: float = 0.0                    # process CPU time in fetch (steadier)
    load_cpu: float = 0.0
    peak_held: int = 0                        # held in flight + transient of a load
    peak_inflight_share: int = 0              # most in-flight (incl. prefetched) share
    peak_transient: int = 0
    peak_held_reader: int = 0                 # in-flight share + reader transient of a load
    peak_reader_transient: int = 0            # most traced memory during one load's fetches
    loads: int = 0
    empty_loads: int = 0                      # (microbatch, chunk) loads with no MoE layer
    digest: int = 0                           # CRC of every id fetched (cross-format check)


class RangedStoreFile:
    """An object-store file as fsspec presents it: ``fsspec.spec.AbstractBufferedFile`` (the
    base of s3fs, gcsfs, adlfs files) with ``cache_type`` and ``block_size``, whose every
    ranged GET (``_fetch_range``) is counted; backed by a local file."""

    def __new__(cls, path: str, cache_type: str, block_size: int | str = "default"):
        from fsspec.spec import AbstractBufferedFile

        class _Ranged(AbstractBufferedFile):
            def _fetch_range(self, start, end):
                self._local.seek(start)
                b = self._local.read(end - start)
                self.bytes += len(b)
                self.requests += 1
                return b

            def close(self):
                super().close()
                self._local.close()

        f = _Ranged(None, path, mode="rb", block_size=block_size, cache_type=cache_type,
                    size=os.path.getsize(path))
        f._local = open(path, "rb")
        f.bytes = f.requests = 0
        return f


STORAGES = ("file", "fsspec-readahead", "fsspec-none")


def open_readers(kind: str, paths: Sequence[str], storage: str = "file"
                 ) -> tuple[list[Any], list[Any]]:
    """One reader per stream over a byte-counting file (``storage``: a local/shared file,
    or an fsspec object-store file with its default readahead cache or none)."""
    if storage == "file":
        files: list[Any] = [CountingFile(open(p, "rb")) for p in paths]
    else:
        files = [RangedStoreFile(p, storage.split("-")[1]) for p in paths]
    readers = [SidecarReader(f) for f in files]
    return readers, files


def simulate_rank(kind: str, paths: Sequence[str], written: Written, plan: Plan, par: Parallel,
                  schema: RoutingSchema, stages: list[list[int]], coord: tuple[int, int, int, int],
                  prefetch: int, per_run: bool = False, storage: str = "file") -> RankResult:
    """Run the replayer's load path for every (microbatch, chunk) of one rank (module doc)."""
    dp, cp, tp, pp = coord
    res = RankResult(coord)
    shard = align.Shard(cp_size=par.cp, cp_rank=cp, tp_size=par.tp, tp_rank=tp,
                        sequence_parallel=par.sp)
    moe = set(schema.moe_layer_ids)
    chunk_lids = [[lid for lid in stages[c * par.pp + pp] if lid in moe] for c in range(par.vpp)]
    chunk_layers = [schema_layers_for(schema, lids) for lids in chunk_lids]
    k, item = schema.top_k, schema.id_dtype.itemsize
    readers, files = open_readers(kind, paths, storage)
    res.open_bytes = sum(f.bytes for f in files)
    mbs = plan.microbatches[dp]
    fwd, events = forward_order_and_events(len(mbs), par, pp)
    sizes: dict[tuple[int, int], tuple[int, int, int]] = {}      # held, share, transient
    crc = 0
    with counting_decode() as dec:
        for (m, c) in fwd:
            layout = plan.layouts[dp][m]
            sids = [sample_id(i) for i in mbs[m]]
            layers = chunk_layers[c]
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0, c0 = time.perf_counter(), time.process_time()
            tmap = align.token_map(layout, shard)
            fetched: dict[int, dict[tuple[int, int], tuple[np.ndarray, int]]] = {}
            share = 0
            reader_peak = 0
            for j, runs in tmap.ranges().items():
                src = readers[written.stream_of[sids[j]]]
                tracemalloc.reset_peak()
                tf, cf = time.perf_counter(), time.process_time()
                if per_run:       # the replayer on main today: read() once per token run
                    got = []
                    for lo, hi in runs:
                        r = src.read(sids[j], moe_layers=layers, tokens=(lo, hi), arrays=False)
                        got.append((r.expert_ids, r.start))
                else:
                    got = src.fetch(sids[j], layers, runs)
                res.fetch_seconds += time.perf_counter() - tf
                res.fetch_cpu += time.process_time() - cf
                reader_peak = max(reader_peak, tracemalloc.get_traced_memory()[1] - base)
                fetched[j] = dict(zip(runs, got))
                for ids, _ in got:
                    share += ids.shape[0] * len(layers) * k * item
                    crc = zlib.crc32(np.ascontiguousarray(ids).tobytes(), crc)
            tracemalloc.reset_peak()
            ids = align.gather_rows(tmap, lambda j, runs: [fetched[j][r] for r in runs],
                                    len(layers), k, align.replay_dtype(schema.num_experts))
            align.check_rows(ids, tmap, schema, chunk_lids[c], sids)
            held = ids                            # what RouterReplayer keeps ([N, L_local, K])
            res.load_seconds += time.perf_counter() - t0
            res.load_cpu += time.process_time() - c0
            transient = max(tracemalloc.get_traced_memory()[1] - base, reader_peak)
            sizes[(m, c)] = (held.nbytes, share, transient, reader_peak)
            res.share += share
            res.loads += 1
            res.empty_loads += not layers
            res.peak_transient = max(res.peak_transient, transient)
            res.peak_reader_transient = max(res.peak_reader_transient, reader_peak)
            del ids, held, fetched
        res.bytes_decoded = dec[0]
    res.digest = crc
    res.bytes_read = sum(f.bytes for f in files)
    res.requests = sum(f.requests for f in files)
    for r in readers:
        r.close()
    # the schedule: loads up to `prefetch` forwards ahead, release at backward
    held = share = 0
    loaded = 0
    pos = {x: i for i, x in enumerate(fwd)}
    live: set[tuple[int, int]] = set()
    for kind_ev, x in events:
        if kind_ev == "F":
            while loaded < len(fwd) and loaded <= pos[x] + prefetch:
                y = fwd[loaded]
                h, s, tr, rtr = sizes[y]
                res.peak_held = max(res.peak_held, held + tr)
                res.peak_held_reader = max(res.peak_held_reader, share + rtr)
                held += h
                share += s
                live.add(y)
                loaded += 1
                res.peak_held = max(res.peak_held, held)
                res.peak_held_reader = max(res.peak_held_reader, share)
                res.peak_inflight_share = max(res.peak_inflight_share, share)
        else:
            h, s, _, _ = sizes[x]
            held -= h
            share -= s
            live.discard(x)
    return res


def encode_rates(schema: RoutingSchema, geos: Sequence[Geometry], spec: StepSpec,
                 tokens: int = 8192) -> dict[str, float]:
    """Encode speed, MB/s of uint8 ids, of one ``tokens``-token record on one core (best of
    3): the 0.2 writer's format-2 payload (tests/crafted.py) and the format-3 payload for each geometry."""
    from routereplay.sidecar.payload import encode_record_payload
    rng = np.random.default_rng([spec.seed, 4])
    ids = RoutingGenerator(schema, spec.skew, spec.repeat, spec.seed).ids(rng, tokens)
    rec = RoutingRecord("speed", ids)
    fns = {V2: lambda: v2_payload(rec, schema, layer_group=spec.layer_group)}
    fns.update({v3_name(g): (lambda g=g: encode_record_payload(rec, schema, **g.writer_kw()))
                for g in geos})
    out = {}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = ids.nbytes / best / 1e6
    return out


def naive_decode_rate(schema: RoutingSchema, rows: int = 4096) -> float:
    """Measured bytes/s of decoding SGLang's base64 int32 routing (routereplay.wire), the
    engines' wire format: int32 [rows, num_hidden_layers, K] per sample."""
    rng = np.random.default_rng(0)
    full = rng.integers(0, schema.num_experts, (rows, schema.num_hidden_layers, schema.top_k),
                        dtype=np.int32)
    payload = wire.sglang_b64_int32(full)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = wire.decode_sglang_b64_int32(payload, schema.num_hidden_layers, schema.top_k)
        schema.strip_dense(out)
        best = min(best, time.perf_counter() - t0)
    return full.nbytes / best


# --------------------------------------------------------------------------- running


def pick_coords(par: Parallel, spec: str | None, all_ranks: bool, seed: int) -> list[tuple[int, int, int]]:
    if all_ranks:
        return [(d, c, t) for d in range(par.dp) for c in range(par.cp) for t in range(par.tp)]
    if spec:
        out = []
        for part in spec.split(";"):
            d, c, t = (int(x) for x in part.split(","))
            if not (0 <= d < par.dp and 0 <= c < par.cp and 0 <= t < par.tp):
                raise SystemExit(f"--coords {part}: outside DP={par.dp} CP={par.cp} TP={par.tp}")
            out.append((d, c, t))
        return out
    out = [(0, 0, 0), (par.dp - 1, par.cp - 1, par.tp - 1)]
    rng = np.random.default_rng([seed, 3])
    allc = [(d, c, t) for d in range(par.dp) for c in range(par.cp) for t in range(par.tp)]
    rng.shuffle(allc)
    for x in allc:
        if len(out) >= 4:
            break
        if x not in out:
            out.append(x)
    return out


@dataclasses.dataclass
class Scheme:
    name: str
    ranks: list[RankResult]
    stored_bytes: int                    # the whole step in this scheme


def run_layout(written: Written, par: Parallel, schema: RoutingSchema, coords, prefetch: int,
               kinds: Sequence[tuple[str, str, Sequence[str]]], per_run: bool = False,
               log: Callable[[str], None] = print, storage: str = "file"
               ) -> dict[str, list[RankResult]]:
    """Simulate every sampled rank for each (name, kind, paths) scheme."""
    par.check()
    stages = stage_layers(par, schema.num_hidden_layers)
    plan = plan_step(written.lengths, par)
    out: dict[str, list[RankResult]] = {name: [] for name, _, _ in kinds}
    for d, c, t in coords:
        for p in range(par.pp):
            for name, kind, paths in kinds:
                t0 = time.perf_counter()
                out[name].append(simulate_rank(kind, paths, written, plan, par, schema, stages,
                                               (d, c, t, p), prefetch,
                                               per_run=per_run and kind == "v2",
                                               storage=storage))
            log(f"    rank dp={d} cp={c} tp={t} pp={p}: "
                + ", ".join(f"{n} {out[n][-1].bytes_read / 1e6:.1f} MB read"
                            for n, _, _ in kinds)
                + f" ({time.perf_counter() - t0:.1f} s)")
    for name, _, _ in kinds:
        digests = {r.coord: r.digest for r in out[name]}
        ref = {r.coord: r.digest for r in out[kinds[0][0]]}
        if digests != ref:
            raise AssertionError(f"{name} fetched different ids than {kinds[0][0]}")
    return out


def fmt_bytes(n: float) -> str:
    for unit, d in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= d:
            return f"{n / d:.3g} {unit}"
    return f"{n:.0f} B"


def med_max(xs: Sequence[float]) -> tuple[float, float]:
    return (statistics.median(xs), max(xs)) if xs else (0.0, 0.0)


def naive_ranks(schema: RoutingSchema, written: Written, rate: float,
                rs: list[RankResult]) -> list[RankResult]:
    """The naive scheme for the same ranks: every rank receives, decodes and holds the whole
    step as int32 [T, num_hidden_layers, K] (one transfer), decoded at ``rate`` bytes/s."""
    b = written.routing_rows * schema.num_hidden_layers * schema.top_k * 4
    return [dataclasses.replace(RankResult(r.coord), bytes_read=b, requests=1, bytes_decoded=b,
                                share=r.share, peak_held=b, peak_held_reader=b,
                                peak_inflight_share=r.peak_inflight_share,
                                fetch_seconds=b / rate, load_seconds=b / rate,
                                fetch_cpu=b / rate, load_cpu=b / rate)
            for r in rs]


def rank_table(schemes: dict[str, list[RankResult]], stored: dict[str, int],
               raw_routing: int) -> list[str]:
    """Per-rank table: median and max over simulated ranks."""
    ratio = {n: stored[n] / raw_routing for n in schemes}         # stored/raw of the routing
    lines = ["| per rank (median / max over ranks) | " + " | ".join(schemes) + " |",
             "|---|" + "---|" * len(schemes)]

    def row(label: str, f: Callable[[str, RankResult], float], fmt=fmt_bytes):
        cells = []
        for n, rs in schemes.items():
            a, b = med_max([f(n, r) for r in rs])
            cells.append(f"{fmt(a)} / {fmt(b)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("share: its layers x its tokens (uint8 ids)", lambda n, r: r.share)
    row("bytes read from storage", lambda n, r: r.bytes_read)
    row("bytes read / its share of the stored step",
        lambda n, r: r.bytes_read / max(1.0, r.share * ratio[n]), fmt=lambda x: f"{x:.3g}")
    row("read requests", lambda n, r: r.requests, fmt=lambda x: f"{x:.0f}")
    row("bytes decoded (ids)", lambda n, r: r.bytes_decoded)
    row("bytes decoded / share", lambda n, r: r.bytes_decoded / max(1, r.share),
        fmt=lambda x: f"{x:.3g}")
    row("in-flight share: ids of microbatches in flight (target bound)",
        lambda n, r: r.peak_inflight_share)
    row("peak held, reader: in-flight ids + fetch transient", lambda n, r: r.peak_held_reader)
    row("  / in-flight share", lambda n, r: r.peak_held_reader / max(1, r.peak_inflight_share),
        fmt=lambda x: f"{x:.3g}")
    row("  largest fetch transient (one load)", lambda n, r: r.peak_reader_transient)
    row("peak held, replayer today: int16 in flight + load transient", lambda n, r: r.peak_held)
    row("  / in-flight share", lambda n, r: r.peak_held / max(1, r.peak_inflight_share),
        fmt=lambda x: f"{x:.3g}")
    row("decode CPU time, s (in fetch)", lambda n, r: r.fetch_cpu, fmt=lambda x: f"{x:.3f}")
    row("  wall time, s (shared cores: noisy)", lambda n, r: r.fetch_seconds,
        fmt=lambda x: f"{x:.3f}")
    row("load CPU time, s (+ token map, gather, check)", lambda n, r: r.load_cpu,
        fmt=lambda x: f"{x:.3f}")
    return lines


def choice_table(schemes: dict[str, list[RankResult]], stored: dict[str, int],
                 raw_routing: int) -> list[str]:
    """One line per scheme: storage against v2 and the per-rank ratios that set the targets
    (median / max over ranks)."""
    v2 = stored[V2]
    lines = ["| scheme | stored vs v2 | read / share | decoded / share | peak held (reader) / "
             "in-flight share | requests | decode CPU s |", "|---|---|---|---|---|---|---|"]
    for n, rs in schemes.items():
        ratio = stored[n] / raw_routing
        cells = [med_max([r.bytes_read / max(1.0, r.share * ratio) for r in rs]),
                 med_max([r.bytes_decoded / max(1, r.share) for r in rs]),
                 med_max([r.peak_held_reader / max(1, r.peak_inflight_share) for r in rs]),
                 med_max([r.requests for r in rs]), med_max([r.fetch_cpu for r in rs])]
        lines.append(f"| {n} | {stored[n] / v2:.4f} | " + " | ".join(
            f"{a:.3g} / {b:.3g}" for a, b in cells) + " |")
    return lines


def step_table(spec: StepSpec, schema: RoutingSchema, written: Written) -> list[str]:
    t = int(written.lengths.sum())
    rows = written.routing_rows
    cells = rows * schema.num_moe_layers
    naive = rows * schema.num_hidden_layers * schema.top_k * 4
    lines = [f"Step: {spec.samples} samples, {t} tokens (lengths {int(written.lengths.min())}-"
             f"{int(written.lengths.max())}, median {int(np.median(written.lengths))}, mean "
             f"{written.lengths.mean():.0f}), {rows} routing rows x {schema.num_moe_layers} MoE "
             f"layers x top-{schema.top_k} of {schema.num_experts}; {spec.streams} streams; "
             f"skew {spec.skew}, repeat {spec.repeat}",
             f"Generated in {written.gen_seconds:.1f} s, encoded and written in "
             f"{written.write_seconds:.1f} s (all formats, one process)", "",
             "| stored step | bytes | bytes per (token, MoE layer) | vs v2 |", "|---|---|---|---|",
             f"| naive: int32 [T, {schema.num_hidden_layers}, {schema.top_k}] (engines' arrays) | "
             f"{fmt_bytes(naive)} | {naive / cells:.2f} | {naive / written.v2_bytes:.1f}x |",
             f"| uint8 ids, MoE layers only | {fmt_bytes(cells * schema.top_k)} | "
             f"{schema.top_k:.2f} | {cells * schema.top_k / written.v2_bytes:.2f}x |",
             f"| sidecar format 2 (layer_group {spec.layer_group}) | {fmt_bytes(written.v2_bytes)} | "
             f"{written.v2_bytes / cells:.3f} | 1.00x |"]
    for g, b in written.v3_bytes.items():
        lines.append(f"| sidecar format 3 {g} ({written.v3_sections[g]} routing sections) | "
                     f"{fmt_bytes(b)} | {b / cells:.3f} | {b / written.v2_bytes:.4f}x |")
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int)
    ap.add_argument("--min-len", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--median-len", type=int)
    ap.add_argument("--skew", type=float)
    ap.add_argument("--repeat", type=float)
    ap.add_argument("--streams", type=int)
    ap.add_argument("--layer-group", type=int, help="v2 writer's MoE layers per section")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default="", help="e.g. tp=8,ep=64,pp=16,vpp=2,cp=2,dp=4,sp=on,"
                    "mb_tokens=8192[,pp_layout=...]")
    ap.add_argument("--v3", default="512:1", help="format-3 geometries TOKEN_BLOCK:LAYER_GROUP"
                    "[:ONE_SECTION_BYTES], "
                    "comma-separated ('' for none)")
    ap.add_argument("--coords", help="DP,CP,TP coordinates to simulate, ';'-separated")
    ap.add_argument("--all-ranks", action="store_true")
    ap.add_argument("--prefetch", type=int, default=2, help="microbatch loads ahead of forward")
    ap.add_argument("--per-run", action="store_true",
                    help="call read() once per token run (the replayer before issue 13) "
                    "instead of fetch() once per sample")
    ap.add_argument("--storage", choices=STORAGES, default="file",
                    help="count reads on a local/shared file (default), or GETs of an fsspec "
                    "object-store file with its default readahead cache or cache_type='none'")
    ap.add_argument("--growth", action="store_true",
                    help="also the doubling table (batch, sequence length, PP, EP)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for CI (seconds)")
    ap.add_argument("--workdir", help="where streams go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the streams")
    ap.add_argument("--json", help="write the numbers to this file")
    a = ap.parse_args(argv)

    spec, par = StepSpec(seed=a.seed), Parallel()
    if a.quick:
        spec = dataclasses.replace(spec, samples=24, min_len=64, max_len=2048, median_len=384,
                                   streams=3)
        par = Parallel(tp=2, ep=4, pp=4, vpp=2, cp=2, dp=2, mb_tokens=1024)
    over = {k: getattr(a, k) for k in ("samples", "min_len", "max_len", "median_len", "skew",
                                       "repeat", "streams", "layer_group")
            if getattr(a, k) is not None}
    spec = dataclasses.replace(spec, **over)
    par = parse_layout(a.layout, par)
    par.check()
    geos = [Geometry.parse(g) for g in a.v3.split(",") if g]
    schema = RoutingSchema.from_hf_config(DEEPSEEK_V3)
    coords = pick_coords(par, a.coords, a.all_ranks or a.quick, a.seed)
    workdir = a.workdir or tempfile.mkdtemp(prefix="rr-scale-")
    os.makedirs(workdir, exist_ok=True)
    t_start = time.perf_counter()
    report: dict[str, Any] = {}
    try:
        print(f"Schema: DeepSeek-V3 shape, {schema.num_hidden_layers} decoder layers, "
              f"{schema.num_moe_layers} MoE (first {schema.moe_layer_ids[0]} dense), "
              f"E={schema.num_experts}, K={schema.top_k}")
        print(f"Storage: {a.storage}; replayer calls: "
              f"{'read() per token run' if a.per_run else 'fetch() per sample'}")
        print(f"Trainer: {par.label()} -> {par.world} GPUs; simulating {len(coords)} (DP,CP,TP) "
              f"coordinates x {par.pp} PP stages = {len(coords) * par.pp} ranks; "
              f"prefetch {a.prefetch}")
        written = write_step(spec, schema, workdir, geos)
        kinds = [(V2, "v2", written.v2_paths)] + \
                [(v3_name(g), "v3", written.v3_paths[g]) for g in geos]
        tracemalloc.start()
        try:
            res = run_layout(written, par, schema, coords, a.prefetch, kinds, a.per_run,
                             log=lambda s: None if a.quick else print(s, flush=True),
                             storage=a.storage)
        finally:
            tracemalloc.stop()
        raw = written.routing_rows * schema.num_moe_layers * schema.top_k
        stored = {V2: written.v2_bytes}
        stored.update({v3_name(g): written.v3_bytes[g] for g in geos})
        rate = naive_decode_rate(schema)
        naive_b = written.routing_rows * schema.num_hidden_layers * schema.top_k * 4
        stored["naive int32"] = naive_b
        res = {"naive int32": naive_ranks(schema, written, rate, res[V2]), **res}
        plan = plan_step(written.lengths, par)
        n_mb = [len(m) for m in plan.microbatches]
        alone = sum(1 for mbs in plan.microbatches for m in mbs
                    if len(m) == 1 and written.lengths[m[0]] > par.mb_tokens)
        print()
        print("\n".join(step_table(spec, schema, written)))
        enc = encode_rates(schema, geos, spec)
        print("Encode speed, one 8192-token record, one core (MB/s of uint8 ids): "
              + ", ".join(f"{n} {v:.0f}" for n, v in enc.items()))
        print()
        print(f"Microbatches per DP rank: {min(n_mb)}-{max(n_mb)} ({alone} samples longer than "
              f"{par.mb_tokens} tokens, each alone in its microbatch)")
        print()
        print("\n".join(rank_table(res, stored, raw)))
        print()
        print("\n".join(choice_table(res, stored, raw)))
        v2 = res[V2]
        empty = [r for r in v2 if r.empty_loads]
        print()
        print(f"(microbatch, chunk) loads with no MoE layer (dense-only or loss-only chunks): "
              f"{sum(r.empty_loads for r in v2)} of {sum(r.loads for r in v2)} loads, on "
              f"{len(empty)} of {len(v2)} ranks; format 2 reads their whole frames, format 3 "
              "their heads only")
        report = {"spec": dataclasses.asdict(spec), "layout": dataclasses.asdict(par),
                  "tokens": int(written.lengths.sum()), "routing_rows": written.routing_rows,
                  "stored": stored, "raw_routing": raw, "naive_decode_rate": rate,
                  "encode_mb_s": enc,
                  "ranks": {n: [dataclasses.asdict(r) for r in rs] for n, rs in res.items()}}
        if a.growth:
            report["growth"] = growth(spec, par, schema, coords, a.prefetch, geos, workdir, res,
                                      written)
        print(f"\nTotal wall time {time.perf_counter() - t_start:.0f} s")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return report
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _medians(rs: list[RankResult]) -> dict[str, float]:
    return {k: statistics.median([getattr(r, k) for r in rs])
            for k in ("bytes_read", "bytes_decoded", "peak_held_reader", "fetch_cpu", "share")}


def growth(spec: StepSpec, par: Parallel, schema: RoutingSchema, coords, prefetch: int,
           geos: Sequence[Geometry], workdir: str, base_res: dict[str, list[RankResult]],
           base_written: Written) -> dict[str, Any]:
    """Medians over ranks when the batch, the sequence length, PP or EP doubles, over the
    base run (EP is doubled at DP x 2 against a DP x 2 base: EP must fold into TP*CP*DP)."""
    variants: list[tuple[str, StepSpec, Parallel, Parallel | None]] = [
        ("batch x2", dataclasses.replace(spec, samples=spec.samples * 2), par, None),
        ("seq len x2", dataclasses.replace(spec, len_scale=2.0), par, None),
        ("PP x2", spec, dataclasses.replace(par, pp=par.pp * 2), None),
        ("EP x2 (at DP x2)", spec, dataclasses.replace(par, ep=par.ep * 2, dp=par.dp * 2),
         dataclasses.replace(par, dp=par.dp * 2)),
    ]
    out: dict[str, Any] = {}
    print("\nGrowth (median per-rank value, variant / base):")
    hdr = ("| doubled | scheme | bytes read | bytes decoded | peak held (reader) | decode CPU "
           "time | naive bytes |")
    print(hdr)
    print("|---|---|---|---|---|---|---|")
    for label, sp2, par2, base_par in variants:
        coords2 = [(d, c, t) for d, c, t in coords]
        if sp2 is spec:
            written = base_written
        else:
            sub = os.path.join(workdir, label.split()[0].replace(" ", "_") + "x2")
            os.makedirs(sub, exist_ok=True)
            written = write_step(sp2, schema, sub, geos)
        kinds = [(V2, "v2", written.v2_paths)] + \
                [(v3_name(g), "v3", written.v3_paths[g]) for g in geos]
        tracemalloc.start()
        try:
            res = run_layout(written, par2, schema, coords2, prefetch, kinds, log=lambda s: None)
            base = base_res if base_par is None else \
                run_layout(written, base_par, schema, coords2, prefetch, kinds, log=lambda s: None)
        finally:
            tracemalloc.stop()
        naive2 = written.routing_rows / base_written.routing_rows
        for name in res:
            if name not in base:
                continue
            m2, m1 = _medians(res[name]), _medians(base[name])
            r = {k: m2[k] / m1[k] if m1[k] else float("nan") for k in m2}
            out[f"{label} / {name}"] = r
            print(f"| {label} | {name} | {r['bytes_read']:.2f}x | {r['bytes_decoded']:.2f}x | "
                  f"{r['peak_held_reader']:.2f}x | {r['fetch_cpu']:.2f}x | "
                  f"{naive2:.2f}x |")
    return out


if __name__ == "__main__":
    main()
