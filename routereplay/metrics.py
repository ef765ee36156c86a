"""Log-prob mismatch and routing-agreement metrics of routing replay.

Definitions, used exactly so that figures compare across runs and with the R3 paper
(arXiv 2510.11370):

- ``delta_t = logp_trainer(t) - logp_engine(t)`` for each generated token t.
- k3 KL = mean over tokens of ``exp(delta) - 1 - delta`` (Schulman's k3 estimator of
  KL(engine || trainer) from samples drawn by the engine).
- mean and max ``|delta|``; extreme-token fraction = share of tokens with |delta| > ln 2.
- routing agreement = share of (token, MoE layer) rows carrying engine routing where the
  trainer's experts form the same set as the engine's (order ignored); ``_ordered`` also
  compares the column order.
"""
from __future__ import annotations

import math

import numpy as np

from routereplay.errors import AlignmentError, ConfigError

EXTREME_THRESHOLD = math.log(2.0)


def logprob_metrics(delta: np.ndarray) -> dict[str, float]:
    """Metrics of ``delta: float [N]`` (trainer minus engine log-probs, nats).

    Returns:
        dict with k3_kl, mean_abs_dlogp, max_abs_dlogp, extreme_token_fraction, num_tokens.
        An empty delta gives NaN metrics and num_tokens 0.
    """
    try:
        d = np.asarray(delta, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ConfigError(f"delta must be numbers, got {str(delta)[:80]}") from None
    if d.size == 0:
        nan = float("nan")
        return {"k3_kl": nan, "mean_abs_dlogp": nan, "max_abs_dlogp": nan,
                "extreme_token_fraction": nan, "num_tokens": 0}
    a = np.abs(d)
    return {
        "k3_kl": float(np.mean(np.expm1(d) - d)),
        "mean_abs_dlogp": float(a.mean()),
        "max_abs_dlogp": float(a.max()),
        "extreme_token_fraction": float((a > EXTREME_THRESHOLD).mean()),
        "num_tokens": int(d.size),
    }


def routing_agreement(engine_ids: np.ndarray, trainer_ids: np.ndarray,
                      mask: np.ndarray | None = None) -> dict[str, float]:
    """Agreement of expert choices, per (token, MoE layer) row.

    Args:
        engine_ids: int [N, L, K], the engine's experts.
        trainer_ids: int [N, L, K], the experts the trainer actually used.
        mask: bool [N] or [N, L], rows that carry engine routing (default all).
    Returns:
        dict with routing_agreement (as sets), routing_agreement_ordered, num_rows,
        and per_layer (list of set agreement per layer).
    Raises:
        AlignmentError (a ValueError): the arrays differ in shape or are not [N, L, K].
        ConfigError (a ValueError): not integer arrays.
    """
    try:
        e = np.asarray(engine_ids).astype(np.int64)
        t = np.asarray(trainer_ids).astype(np.int64)
    except (TypeError, ValueError):
        raise ConfigError("engine and trainer ids must be integer arrays [N, L, K]") from None
    if e.shape != t.shape or e.ndim != 3:
        raise AlignmentError(f"engine ids {e.shape} and trainer ids {t.shape} differ in shape "
                             "(or are not [N, L, K])")
    same_set = (np.sort(e, -1) == np.sort(t, -1)).all(-1)
    same_ord = (e == t).all(-1)
    m = np.ones(same_set.shape, dtype=bool) if mask is None else np.broadcast_to(
        mask if np.ndim(mask) == 2 else np.asarray(mask)[:, None], same_set.shape)
    n = int(m.sum())
    per_layer = [float(same_set[:, i][m[:, i]].mean()) if m[:, i].any() else float("nan")
                 for i in range(same_set.shape[1])]
    return {
        "routing_agreement": float(same_set[m].mean()) if n else float("nan"),
        "routing_agreement_ordered": float(same_ord[m].mean()) if n else float("nan"),
        "num_rows": n,
        "per_layer": per_layer,
    }

