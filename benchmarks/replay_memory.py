"""Sharded delivery: routing bytes each trainer rank decodes and holds, against the batch.

    .venv/bin/python benchmarks/replay_memory.py [--samples 16] [--tokens 256] [--mbs 2]

Builds a sidecar of synthetic rollouts for the built-in tiny Qwen3-MoE (3 MoE layers,
16 experts, top-4; routing drawn like the codec benchmark's traces), then runs one
megatron-core training step with replay (forward + backward, full activation recompute,
megatron's own forward_backward_func) under each layout with gloo processes, and reports
per rank, from RouterReplayer.stats:

- decoded: id bytes the rank decoded from the sidecar (uint8 ids: its samples, token
  ranges and MoE layers only);
- peak held: the most id bytes held for replay at once (int16 [tokens, local layers, k]
  per microbatch in flight, padding included);

against the whole global batch: as uint8 ids (what a rank would decode without sharding)
and as megatron's own ``RouterReplay.set_replay_data`` input (int64 [tokens, k] per MoE
layer for every microbatch of the step, the "copy everything to every rank" baseline).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routereplay.record import RoutingRecord  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.sidecar import write_records  # noqa: E402
from tests.traces import routing_trace  # noqa: E402

LAYOUTS = ["", "tp=2,sp", "pp=2", "ep=2"]


def make_sidecar(path: str, model: str, samples: int, tokens: int, seed: int = 0) -> int:
    """Synthetic rollouts (prompt = half) for ``model``; returns the routing rows."""
    schema = RoutingSchema.from_hf_config(model)
    rng = np.random.default_rng(seed)
    recs, rows = [], 0
    for i in range(samples):
        n = int(rng.integers(tokens // 2, tokens + 1))
        ids, _ = routing_trace(rng, n - 1, schema.num_moe_layers, schema.num_experts,
                               schema.top_k, repeat=0.3, skew=0.8)
        p = n // 2
        recs.append(RoutingRecord(sample_id=f"s{i}", expert_ids=ids.astype(schema.id_dtype), prompt_len=p,
                                  token_ids=rng.integers(3, 500, n).astype(np.int32),
                                  logprobs=-rng.random(n - p).astype(np.float32)))
        rows += n - 1
    write_records(path, schema, recs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    a = ap.parse_args()
    from routereplay.cli.demo.tiny_model import ensure_tiny_model
    model = ensure_tiny_model()
    schema = RoutingSchema.from_hf_config(model)
    tmp = tempfile.mkdtemp(prefix="rr-mem-")
    sc = os.path.join(tmp, "batch.rrsc")
    rows = make_sidecar(sc, model, a.samples, a.tokens)
    L, K = schema.num_moe_layers, schema.top_k
    whole_u8 = rows * L * K
    print(f"global batch: {a.samples} samples, {rows} routed tokens, {L} MoE layers, top-{K}; "
          f"micro-batch size {a.mbs}")
    print(f"whole batch as uint8 ids: {whole_u8} B")
    print()
    hdr = (f"{'layout':<31}{'rank':>5}{'decoded B':>11}{'decoded/batch':>15}"
           f"{'peak held B':>13}{'peak MBs held':>15}{'loads':>7}{'held/int64 batch':>18}")
    print(hdr)
    print("-" * len(hdr))
    for layout in LAYOUTS:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "trainer_hooks.megatron.harness.recompute", "--model", model,
               "--sidecar", sc, "--out", out, "--parallel", layout,
               "--micro-batch-size", str(a.mbs)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            print(p.stderr[-3000:])
            raise SystemExit(f"layout {layout!r} failed")
        with open(out) as f:
            res = json.load(f)
        s = res["seq_len"]
        # megatron's own replay input for the whole step, on every rank: int64 [s * mbs, k]
        # per MoE layer per microbatch (set_replay_data appends each microbatch).
        int64_batch = -(-a.samples // a.mbs) * s * a.mbs * L * K * 8
        for rank, st in enumerate(res["replay_backward"]["replay_stats"]):
            print(f"{res['parallel']:<31}{rank:>5}{st['bytes_decoded']:>11}"
                  f"{st['bytes_decoded'] / whole_u8:>15.3f}{st['peak_bytes_held']:>13}"
                  f"{st['peak_microbatches_held']:>15}{st['microbatches']:>7}"
                  f"{st['peak_bytes_held'] / int64_batch:>18.4f}")
    print()
    print("loads: (microbatch, model chunk) entries decoded during the step; peak MBs held: "
          "most of them held at once (in flight under the pipeline schedule).")


if __name__ == "__main__":
    main()
