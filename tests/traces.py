"""Synthetic routing traces with a known entropy rate (for tests and benchmarks).

Two families: :func:`routing_trace` (layers independent of each other) and
:class:`CrossLayerRouting` (a token's experts at one layer depend on its experts at the
layer before, as in trained models).

:func:`routing_trace`: per layer, a row repeats the previous token's row with probability
``repeat``; otherwise an ordered top-k is drawn without replacement from a Zipf(``skew``)
expert popularity (``skew = 0``: uniform) whose expert order is shuffled per layer. This
is the trace family of DESIGN.md "Sidecar streams"; its entropy rate is exact: the mean
of -log2 P(row | previous row) under the generator.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class CrossLayerRouting:
    """A routing source whose layers depend on each other (for tests and benchmarks).

    Trained MoE routers route a token at MoE layer l much like they routed it at layer
    l - 1 of the same token (why token-major zstd beats layer-major on real routing).
    This source models that: per layer, a Zipf(``skew``) expert popularity (expert order
    shuffled per layer) and, from layer 1 on, a successor map: each expert of layer l - 1
    prefers ``fanout`` experts of layer l, with weights 1, 1/2, 1/3, ...

    Row (t, l), in token-major order: with probability ``repeat`` (t > 0) it repeats row
    (t - 1, l) (same experts, same column order); otherwise an ordered top-k is drawn
    without replacement (Plackett-Luce) from the weights
    ``w = (1 - coupling) * pop_l + coupling * mean_j succ_l[up_j]``, where ``up`` is row
    (t, l - 1) of the same token (``w = pop_l`` at layer 0; each part normalized).

    Every row's parents (t - 1, l) and (t, l - 1) are observed, so the probability of a
    trace is the product of P(row | parents) = repeat * [row == previous row]
    + (1 - repeat) * PL(row; w), exactly; :meth:`sample` returns its -log2 per token-layer
    (the trace's ideal code length under the source, whose mean is the entropy rate).

    Build with :meth:`make`; the same source gives records of any length (a stream's
    records share the model's routing tables, as a real model's do).
    """

    num_experts: int
    top_k: int
    repeat: float
    coupling: float
    pop: np.ndarray            # float64 [L, E], each row sums to 1
    succ: np.ndarray           # float64 [L, E, E]: succ[l, u] row-normalized (l = 0 unused)

    @classmethod
    def make(cls, rng: np.random.Generator, num_layers: int, num_experts: int, top_k: int, *,
             repeat: float = 0.3, skew: float = 1.0, coupling: float = 0.8,
             fanout: int = 3) -> "CrossLayerRouting":
        """A source of ``num_layers`` MoE layers (tables drawn from ``rng``)."""
        e = num_experts
        # NOTE: coupling < 1 keeps every weight > 0 (popularity mixed in), so any ordered
        # top-k has a probability and the code length is finite.
        if not 1 <= top_k <= e or not 0 <= repeat < 1 or not 0 <= coupling < 1 or fanout < 1:
            raise ValueError("need 1 <= top_k <= num_experts, 0 <= repeat < 1, "
                             "0 <= coupling < 1, fanout >= 1")
        base = 1.0 / np.arange(1, e + 1) ** skew
        pop = np.stack([base[rng.permutation(e)] for _ in range(num_layers)])
        pop /= pop.sum(axis=1, keepdims=True)
        f = min(fanout, e)
        succ = np.zeros((num_layers, e, e))
        for lyr in range(1, num_layers):
            for u in range(e):
                succ[lyr, u, rng.permutation(e)[:f]] = 1.0 / np.arange(1, f + 1)
        succ /= np.maximum(succ.sum(axis=2, keepdims=True), 1e-300)
        return cls(e, top_k, repeat, coupling, pop, succ)

    @property
    def num_layers(self) -> int:
        return self.pop.shape[0]

    def sample(self, rng: np.random.Generator, num_tokens: int) -> tuple[np.ndarray, float]:
        """One record: (ids uint8|uint16 [T, L, top_k], its code length in bits per
        token-layer, :meth:`code_length` / (T * L))."""
        t, e, k = num_tokens, self.num_experts, self.top_k
        ids = np.empty((t, self.num_layers, k), dtype=np.int64)
        for lyr in range(self.num_layers):
            w = self._weights(ids, lyr)
            # NOTE: Gumbel top-k = sampling k without replacement, in draw order
            g = np.log(w) - np.log(-np.log(rng.random((t, e))))
            fresh = np.argsort(-g, axis=1)[:, :k]
            rep = rng.random(t) < self.repeat
            rep[:1] = False
            ids[:, lyr] = fresh[np.maximum.accumulate(np.where(rep, 0, np.arange(t)))]
        ids = ids.astype(np.uint8 if e <= 256 else np.uint16)
        return ids, self.code_length(ids) / max(t * self.num_layers, 1)

    def _weights(self, ids: np.ndarray, lyr: int) -> np.ndarray:
        """float64 [T, E]: the fresh-row weights of layer ``lyr`` given layer ``lyr - 1``."""
        w = np.broadcast_to(self.pop[lyr], (ids.shape[0], self.num_experts))
        if lyr:
            up = ids[:, lyr - 1].astype(np.int64)
            w = (1 - self.coupling) * w + self.coupling * self.succ[lyr][up].mean(axis=1)
        return w

    def code_length(self, ids: np.ndarray) -> float:
        """-log2 P(ids) in bits under this source, for ids int [T, L, top_k]: the sum over
        rows of -log2 P(row | previous token's row, same token's row one layer up)."""
        t = ids.shape[0]
        bits = 0.0
        for lyr in range(self.num_layers):
            x = ids[:, lyr].astype(np.int64)
            wx = np.take_along_axis(self._weights(ids, lyr), x, axis=1)
            before = np.concatenate([np.zeros((t, 1)), np.cumsum(wx, axis=1)[:, :-1]], axis=1)
            pl = np.prod(wx / (1.0 - before), axis=1)
            same = np.zeros(t, dtype=bool)
            same[1:] = (x[1:] == x[:-1]).all(axis=1)
            p = np.where(same, self.repeat, 0.0) + (1.0 - self.repeat) * pl
            p[:1] = pl[:1]
            bits -= float(np.log2(p).sum())
        return bits
