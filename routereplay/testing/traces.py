"""Synthetic routing traces with a known entropy rate (for tests and benchmarks).

Per layer, a row repeats the previous token's row with probability ``repeat``; otherwise an
ordered top-k is drawn without replacement from a Zipf(``skew``) expert popularity
(``skew = 0``: uniform) whose expert order is shuffled per layer. This is the trace family
of DESIGN.md "Sidecar streams"; its entropy rate is exact: the mean of
-log2 P(row | previous row) under the generator.
"""
from __future__ import annotations

import numpy as np


def routing_trace(rng: np.random.Generator, num_tokens: int, num_layers: int, num_experts: int,
                  top_k: int, repeat: float, skew: float = 1.0) -> tuple[np.ndarray, float]:
    """Returns (ids uint8|uint16 [T, L, top_k], entropy rate in bits per token-layer)."""
    t, e, k = num_tokens, num_experts, top_k
    pop = 1.0 / np.arange(1, e + 1) ** skew
    ids = np.empty((t, num_layers, k), dtype=np.int64)
    bits = 0.0
    for lyr in range(num_layers):
        p = pop[rng.permutation(e)]
        p /= p.sum()
        fresh = rng.random(t) >= repeat
        fresh[:1] = True
        # NOTE: Gumbel top-k = sampling k without replacement, in draw order
        g = np.log(p)[None, :] - np.log(-np.log(rng.random((int(fresh.sum()), e))))
        full = np.empty((t, k), dtype=np.int64)
        full[fresh] = np.argsort(-g, axis=1)[:, :k]
        x = full[np.maximum.accumulate(np.where(fresh, np.arange(t), 0))]
        ids[:, lyr] = x
        px = p[x]
        before = np.concatenate([np.zeros((t, 1)), np.cumsum(px, axis=1)[:, :-1]], axis=1)
        q = np.prod(px / (1.0 - before), axis=1)
        same = np.zeros(t, dtype=bool)
        same[1:] = (x[1:] == x[:-1]).all(axis=1)
        pr = np.where(same, repeat, 0.0) + (1.0 - repeat) * q
        pr[:1] = q[:1]
        bits -= float(np.log2(pr).sum())
    return ids.astype(np.uint8 if e <= 256 else np.uint16), bits / max(t * num_layers, 1)
