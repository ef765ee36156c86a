"""Bytes per (token, MoE layer) row: sidecar vs zstd on uint8 vs the engines' wire formats.

    .venv/bin/python benchmarks/sidecar_size.py [--tokens 4096] [--records 8]

Synthetic traces: per layer, a row repeats the previous token's row with probability r,
else an ordered top-k is drawn without replacement from a Zipf-skewed expert popularity.
The sidecar column is a whole routing-only stream (header, frame metadata, index).
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import zstandard

from routereplay import wire
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import write_records


def synthetic(rng, t, layers, e, k, repeat, skew=1.0):
    pop = 1.0 / np.arange(1, e + 1) ** skew
    ids = np.empty((t, layers, k), dtype=np.int64)
    for lyr in range(layers):
        perm = rng.permutation(e)
        p = pop[perm] / pop.sum()
        for i in range(t):
            if i and rng.random() < repeat:
                ids[i, lyr] = ids[i - 1, lyr]
            else:
                ids[i, lyr] = rng.choice(e, size=k, replace=False, p=p)
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--records", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'trace':<22}{'uniform bound':>14}{'raw u8':>8}{'zstd-3':>8}{'zstd-19':>9}"
          f"{'sidecar':>9}{'vLLM b64':>10}{'SGLang b64':>12}   (bytes per token-layer)")
    for e, k in ((8, 2), (64, 6), (128, 8), (256, 8)):
        for rep in (0.0, 0.5):
            schema = RoutingSchema(a.layers, tuple(range(a.layers)), k, e)
            recs, arrays = [], []
            for j in range(a.records):
                ids = synthetic(rng, a.tokens, a.layers, e, k, rep).astype(schema.id_dtype)
                arrays.append(ids)
                recs.append(RoutingRecord(sample_id=f"s{j}", ids=ids))
            rows = a.records * a.tokens * a.layers
            raw = b"".join(x.tobytes() for x in arrays)
            z3 = len(zstandard.ZstdCompressor(level=3).compress(raw))
            z19 = len(zstandard.ZstdCompressor(level=19).compress(raw))
            side = len(write_records(None, schema, recs, background=False).getvalue())
            vb = sum(len(wire.vllm_b64_npy(x)) for x in arrays)
            sb = sum(len(wire.sglang_b64_int32(x)) for x in arrays)
            bound = math.log2(math.perm(e, k)) / 8
            print(f"E={e:<3} k={k} r={rep:<4}      {bound:>14.3f}{len(raw)/rows:>8.3f}"
                  f"{z3/rows:>8.3f}{z19/rows:>9.3f}{side/rows:>9.3f}{vb/rows:>10.3f}{sb/rows:>12.3f}")


if __name__ == "__main__":
    main()
