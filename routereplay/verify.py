"""``routereplay verify``: log-prob mismatch and routing agreement, with and without replay.

The trainer side (HF reference or Megatron) recomputes every sequence twice and hands over,
per sample and condition, its log-probs and the experts it used; this module turns them
into the metrics of routereplay.metrics, per sample and overall, with routing agreement
split into prompt rows (token positions < prompt_len) and response rows, and per layer.
Log-prob metrics are over response tokens (the engine reports log-probs only for them).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from routereplay import metrics
from routereplay.errors import RecordError
from routereplay.record import RoutingRecord

CONDITIONS = ("no_replay", "replay")


def summarize(records: Sequence[RoutingRecord],
              passes: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]]) -> dict[str, Any]:
    """Metrics of each condition.

    Args:
        records: the rollout's records (token_ids, prompt_len, engine logprobs, ids).
        passes: condition -> per record (lp float [N - 1] with lp[p-1] = log p(token p),
            used int [N, L_moe, top_k]: the experts the trainer used at each position).
    Returns:
        {condition: {overall metrics, routing_agreement_prompt, routing_agreement_response,
        per_layer, per_sample: [...]}, "deltas": {condition: float [tokens]}}.
    """
    out: dict[str, Any] = {"num_samples": len(records), "deltas": {}}
    for cond, per in passes.items():
        deltas, eng, used, is_resp, per_sample = [], [], [], [], []
        for r, (lp, u) in zip(records, per):
            n, p = len(r.token_ids), r.prompt_len
            d = np.asarray(lp, np.float64)[p - 1:n - 1] - r.logprobs.astype(np.float64)
            rows = np.arange(r.start, r.start + r.num_tokens)
            resp = rows >= p
            ua = np.asarray(u)[rows]
            deltas.append(d)
            eng.append(r.expert_ids)
            used.append(ua)
            is_resp.append(resp)
            ag = metrics.routing_agreement(r.expert_ids, ua)
            per_sample.append({
                "sample_id": r.sample_id, **metrics.logprob_metrics(d),
                "routing_agreement": ag["routing_agreement"],
                "routing_agreement_prompt": metrics.routing_agreement(r.expert_ids, ua, ~resp)["routing_agreement"],
                "routing_agreement_response": metrics.routing_agreement(r.expert_ids, ua, resp)["routing_agreement"]})
        e, u, m = np.concatenate(eng), np.concatenate(used), np.concatenate(is_resp)
        res = metrics.logprob_metrics(np.concatenate(deltas))
        res.update(metrics.routing_agreement(e, u))
        res["routing_agreement_prompt"] = metrics.routing_agreement(e, u, ~m)["routing_agreement"]
        res["routing_agreement_response"] = metrics.routing_agreement(e, u, m)["routing_agreement"]
        res["per_sample"] = per_sample
        out[cond] = res
        out["deltas"][cond] = np.concatenate(deltas)
    return out


def summary_to_json(summary: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`summarize`'s result as JSON-able values (deltas as lists; NaN kept, so
    Python's json round-trips it: see :func:`json_safe` for strict JSON)."""
    out = dict(summary)
    out["deltas"] = {c: np.asarray(d, np.float64).tolist() for c, d in summary["deltas"].items()}
    return out


def load_summary(path: str) -> dict[str, Any]:
    """A summary written as JSON (:func:`summary_to_json`, e.g. by the megatron recompute:
    its conditions, ``num_samples`` and ``deltas``) back in :func:`summarize`'s form, for
    :func:`format_report` and :func:`plot`.

    Raises:
        RecordError: the file lacks ``num_samples``, ``deltas`` or a condition's metrics.
    """
    import json
    with open(path) as f:
        res = json.load(f)
    try:
        out: dict[str, Any] = {"num_samples": int(res["num_samples"]), "deltas": {}}
        for c, d in res["deltas"].items():
            out["deltas"][c] = np.asarray(d, np.float64)
            out[c] = res[c]
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"{path}: not a routing-replay summary ({e!r} missing or malformed)") \
            from None
    return out


def json_safe(obj: Any) -> Any:
    """NaN/inf (a sample without prompt or response rows) -> None, so the JSON is strict."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def format_report(summary: Mapping[str, Any], max_samples: int = 10) -> str:
    """The printed table: one row per condition, per-layer agreement, worst samples."""
    lines = [f"{'condition':<11}{'agree (all)':>12}{'prompt':>9}{'response':>10}{'k3 KL':>11}"
             f"{'mean |dlogp|':>14}{'max |dlogp|':>13}{'extreme':>9}"]
    for c in CONDITIONS:
        if c not in summary:
            continue
        m = summary[c]
        lines.append(f"{c.replace('_', ' '):<11}{m['routing_agreement']:>12.4f}"
                     f"{m['routing_agreement_prompt']:>9.4f}{m['routing_agreement_response']:>10.4f}"
                     f"{m['k3_kl']:>11.3e}{m['mean_abs_dlogp']:>14.3e}{m['max_abs_dlogp']:>13.3e}"
                     f"{m['extreme_token_fraction']:>9.4f}")
    for c in CONDITIONS:
        if c in summary:
            lines.append(f"per-layer agreement, {c.replace('_', ' ')}: "
                         + " ".join(f"{x:.4f}" for x in summary[c]["per_layer"]))
    if "no_replay" in summary:
        worst = sorted(summary["no_replay"]["per_sample"], key=lambda s: -s["k3_kl"])[:max_samples]
        lines.append(f"samples with the largest k3 KL without replay (of {summary['num_samples']}):")
        rep = {s["sample_id"]: s for s in summary.get("replay", {}).get("per_sample", [])}
        for s in worst:
            r = rep.get(s["sample_id"])
            lines.append(f"  {s['sample_id']}: k3 {s['k3_kl']:.3e} agree {s['routing_agreement']:.4f}"
                         + (f" -> replay k3 {r['k3_kl']:.3e} agree {r['routing_agreement']:.4f}"
                            if r else ""))
    return "\n".join(lines)


def plot(summary: Mapping[str, Any], path: str) -> None:
    """PNG: distribution of delta logp with and without replay; per-layer agreement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    allv = np.concatenate([summary["deltas"][c] for c in summary["deltas"]])
    lim = max(float(np.abs(allv).max()) if allv.size else 1.0, 1e-6)
    bins = np.linspace(-lim, lim, 81)
    for c in CONDITIONS:
        if c in summary["deltas"]:
            a.hist(summary["deltas"][c], bins=bins, histtype="step", log=True,
                   label=f"{c.replace('_', ' ')} (k3 {summary[c]['k3_kl']:.2e})")
    a.set_xlabel("delta logp = trainer - engine (nats)")
    a.set_ylabel("tokens")
    a.legend()
    width = 0.4
    for i, c in enumerate(c for c in CONDITIONS if c in summary):
        pl = summary[c]["per_layer"]
        b.bar(np.arange(len(pl)) + (i - 0.5) * width, pl, width, label=c.replace("_", " "))
    b.set_xlabel("MoE layer (position)")
    b.set_ylabel("routing agreement")
    b.set_ylim(0, 1.05)
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
