"""``routereplay verify``: log-prob mismatch and routing agreement, with and without replay.

The trainer side (HF reference or Megatron) recomputes every sequence twice and hands over,
per sample and condition, its log-probs and the experts it used; this module turns them
into the metrics of routereplay.metrics, per sample and overall, with routing agreement
split into prompt rows (token positions < prompt_len) and response rows, and per layer.
Log-prob metrics are over response tokens (the engine reports log-probs only for them).

Like with like: a record's ``sampling`` (routereplay.record.SamplingInfo) says what its
log-probs are; :func:`sampling_transform` gives what the trainer applies to its logits
before the log-softmax so that its log-probs mean the same (docs/metrics.md "Sampling"),
or refuses where that cannot be reproduced.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from routereplay import metrics
from routereplay.errors import AlignmentError, RecordError
from routereplay.record import RoutingRecord

CONDITIONS = ("no_replay", "replay")
GREEDY_TEMPERATURE = 1e-5         # below it the engines sample greedily: vLLM's _SAMPLING_EPS


@dataclasses.dataclass(frozen=True)
class Transform:
    """What a trainer applies to its logits [N, V] before the log-softmax, in this order
    (vLLM 0.32's sampler: ``apply_temperature``, then the min_p processor, then
    ``apply_top_k_top_p``):

    1. divide by ``temperature``;
    2. min_p > 0: drop tokens whose probability is below ``min_p`` x the largest;
    3. top_k > 0: keep tokens whose logit is at least the k-th largest (ties kept);
    4. top_p < 1: sort ascending, drop tokens whose cumulative probability (of the
       distribution after 3) is at most 1 - top_p, the largest always kept;

    dropped tokens get logit -inf, so the log-softmax renormalises over the kept ones.
    ``Transform()`` is the identity (the full-vocabulary log-softmax).
    """

    temperature: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def identity(self) -> bool:
        return self == Transform()

    def describe(self) -> str:
        """e.g. "temperature 0.7, top_k 20, top_p 0.9" ("full-vocabulary log-softmax")."""
        parts = [f"{name} {getattr(self, name):g}" for name, off in
                 (("temperature", 1.0), ("min_p", 0.0), ("top_k", 0), ("top_p", 1.0))
                 if getattr(self, name) != off]
        return ", ".join(parts) if parts else "full-vocabulary log-softmax"


def sampling_transform(record: RoutingRecord) -> Transform | None:
    """The :class:`Transform` that makes the trainer's log-probs mean what ``record``'s
    engine log-probs mean, from ``record.sampling``; None when the record has no sampling
    parameters (the caller compares the full-vocabulary log-softmax and says so).

    Modes: ``raw_logprobs`` -> identity; ``temperature_logprobs`` -> temperature only;
    ``processed_logprobs`` -> temperature, min_p, top_k, top_p. A temperature below 1e-5
    is greedy: no scaling, and no truncation (vLLM sets top_p 1, top_k 0, min_p 0 then).

    Raises:
        AlignmentError: naming the sample and why, where the engine's values cannot be
            reproduced: logits instead of log-probs (``raw_logits``, ``processed_logits``),
            an unknown mode, or other logit transforms in the recorded values
            (``sampling.processors``: penalties, logit bias, grammar masks).
    """
    smp = record.sampling
    if smp is None:
        return None
    sid, mode = record.sample_id, smp.logprobs_mode
    if mode in ("raw_logits", "processed_logits"):
        raise AlignmentError(
            f"sample {sid!r}: the engine recorded logits, not log-probs (logprobs_mode "
            f"{mode!r}): a log-prob mismatch cannot be measured against them; record with "
            "logprobs_mode='raw_logprobs' (vLLM's default)")
    if mode not in ("raw_logprobs", "temperature_logprobs", "processed_logprobs"):
        raise AlignmentError(f"sample {sid!r}: log-prob mode {mode!r} is not one verify can "
                             "reproduce (raw_logprobs, temperature_logprobs, "
                             "processed_logprobs)")
    if smp.processors:
        raise AlignmentError(
            f"sample {sid!r}: the engine's log-probs ({mode}) include logit transforms "
            f"verify does not reproduce: {', '.join(smp.processors)}; the difference would "
            "read as mismatch (vLLM: sample with logprobs_mode='raw_logprobs', where they "
            "are taken before any logit transform; SGLang applies them before both of its "
            "log-prob paths: sample without them to verify)")
    if mode == "raw_logprobs" or smp.temperature < GREEDY_TEMPERATURE:
        return Transform()
    if mode == "temperature_logprobs":
        return Transform(temperature=smp.temperature)
    return Transform(temperature=smp.temperature, min_p=smp.min_p, top_k=smp.top_k,
                     top_p=smp.top_p)


def sampling_notes(records: Sequence[RoutingRecord]) -> dict[str, Any]:
    """What was compared: {"unknown": samples without sampling parameters, "compared":
    {Transform.describe(): samples}}.

    Raises:
        AlignmentError: see :func:`sampling_transform` (the first record refused).
    """
    unknown, compared = 0, {}
    for r in records:
        t = sampling_transform(r)
        if t is None:
            unknown += 1
        else:
            compared[t.describe()] = compared.get(t.describe(), 0) + 1
    return {"unknown": unknown, "compared": compared}


def check_full_vocabulary(records: Sequence[RoutingRecord], trainer: str) -> None:
    """Refuse records whose comparison needs a sampling transform, for a ``trainer`` that
    computes the full-vocabulary log-softmax only (the megatron harness).

    Raises:
        AlignmentError: naming the first such sample, its transform and what to do.
    """
    for r in records:
        t = sampling_transform(r)
        if t is not None and not t.identity:
            raise AlignmentError(
                f"sample {r.sample_id!r}: the engine's log-probs are under {t.describe()} "
                f"({r.sampling.logprobs_mode}), and the {trainer} recompute takes the "
                "full-vocabulary log-softmax only: comparing them would read sampling as "
                "mismatch; use --trainer hf, which applies the same transform")


def sampling_line(notes: Mapping[str, Any], num_samples: int) -> str:
    """The report's line on sampling parameters."""
    parts = [f"{n} as {d}" for d, n in notes.get("compared", {}).items()]
    if notes.get("unknown"):
        parts.append(f"{notes['unknown']} with unknown sampling parameters (compared as a "
                     "full-vocabulary log-softmax: temperature or top-k/top-p in the engine's "
                     "log-probs would read as mismatch)")
    return f"sampling ({num_samples} samples): " + "; ".join(parts)


def summarize(records: Sequence[RoutingRecord],
              passes: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]]) -> dict[str, Any]:
    """Metrics of each condition.

    Args:
        records: the rollout's records (token_ids, prompt_len, engine logprobs, ids).
        passes: condition -> per record (lp float [N - 1] with lp[p-1] = log p(token p),
            used int [N, L_moe, top_k]: the experts the trainer used at each position).
    Returns:
        {condition: {overall metrics, routing_agreement_prompt, routing_agreement_response,
        per_layer, per_sample: [...]}, "deltas": {condition: float [tokens]},
        "sampling": :func:`sampling_notes`}. The trainer's log-probs must already follow
        each record's :func:`sampling_transform`.
    Raises:
        AlignmentError: a record whose log-probs cannot be compared
            (:func:`sampling_transform`).
    """
    out: dict[str, Any] = {"num_samples": len(records), "deltas": {},
                           "sampling": sampling_notes(records)}
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
        if "sampling" in res:
            out["sampling"] = res["sampling"]
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
    if "sampling" in summary:
        lines.append(sampling_line(summary["sampling"], summary["num_samples"]))
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


def plot(summary: Mapping[str, Any], path: str, *, sidecar: str = "", model: str = "",
         layer_ids: Sequence[int] | None = None, trainer: str = "") -> None:
    """PNG at ``path`` showing what replay changed (needs matplotlib).

    Three panels, both conditions in each:

    1. CCDF of |delta logp| over response tokens, log-log: the share of tokens whose
       |delta| exceeds x, with a line at ln 2 (the extreme-token threshold); tokens with
       delta exactly 0 cannot sit on a log axis and are counted in the legend.
    2. 1 - routing agreement (sets) per MoE layer, labelled with its decoder-layer id
       (``layer_ids``, default the MoE-axis position), log scale.
    3. 1 - routing agreement over all, prompt and response rows, log scale.

    On the log scales a value of exactly 0 (replay, by construction) is drawn as a hollow
    marker on the bottom edge and labelled "0". The title names the sidecar, the model, the
    trainer and the counts (samples, response tokens, routing rows).
    """
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conds = [c for c in CONDITIONS if c in summary]
    colors = {"no_replay": "tab:red", "replay": "tab:blue"}
    label = {c: c.replace("_", " ") for c in conds}
    fig, (a, b, c3) = plt.subplots(1, 3, figsize=(16, 4.8),
                                   gridspec_kw={"width_ratios": [1.15, 1.5, 0.75]})

    # 1. CCDF of |delta logp|
    xs_all = np.concatenate([np.abs(summary["deltas"][c]) for c in conds]) if conds else \
        np.zeros(0)
    pos = xs_all[xs_all > 0]
    lo = float(pos.min()) if pos.size else 1e-8
    for c in conds:
        d = np.sort(np.abs(np.asarray(summary["deltas"][c], np.float64)))
        n, zeros = d.size, int((d == 0).sum())
        nz = d[d > 0]
        m = summary[c]
        lab = (f"{label[c]}: k3 KL {m['k3_kl']:.2e}, extreme {m['extreme_token_fraction']:.2%}"
               + (f", {zeros / n:.1%} exactly 0" if n and zeros else ""))
        if nz.size:
            ccdf = 1.0 - (zeros + np.arange(nz.size)) / n          # P(|delta| >= x)
            a.step(nz, ccdf, where="post", color=colors[c], label=lab)
        else:
            a.plot([], [], color=colors[c], label=lab + " (all 0)")
    a.axvline(np.log(2.0), color="0.3", ls="--", lw=1)
    a.text(np.log(2.0), 0.98, " ln 2", color="0.3", va="top", transform=a.get_xaxis_transform())
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlim(left=lo / 2, right=max(1.5, float(xs_all.max()) * 2 if xs_all.size else 1.5))
    nmax = max((np.asarray(summary["deltas"][c]).size for c in conds), default=1)
    a.set_ylim(0.5 / max(nmax, 1), 1.5)          # NOTE: set, so that no data still draws
    if not pos.size:
        a.text(0.5, 0.5, "every |delta logp| is exactly 0", ha="center",
               transform=a.transAxes, color="0.3")
    a.set_xlabel("|delta logp| = |trainer - engine| (nats), response tokens")
    a.set_ylabel("share of tokens with |delta| >= x")
    a.set_title("CCDF of |delta logp|")
    a.legend(fontsize=8, loc="lower left")
    a.grid(True, which="major", alpha=0.3)

    def floor_of(values: list[float]) -> float:
        pos_v = [v for v in values if v > 0 and np.isfinite(v)]
        return min(pos_v) / 10 if pos_v else 1e-4

    # 2. 1 - agreement per decoder layer
    per = {c: np.asarray(summary[c]["per_layer"], np.float64) for c in conds}
    nl = max((len(v) for v in per.values()), default=0)
    ids = list(layer_ids) if layer_ids is not None and len(layer_ids) == nl else list(range(nl))
    dis = {c: 1.0 - v for c, v in per.items()}
    floor = floor_of([x for v in dis.values() for x in v])
    x = np.arange(nl)
    width = 0.8 / max(len(conds), 1)
    for i, c in enumerate(conds):
        off = x + (i - (len(conds) - 1) / 2) * width
        v = dis[c]
        shown = np.where(v > 0, v, np.nan)
        b.bar(off, np.nan_to_num(shown, nan=0.0), width, color=colors[c],
              label=f"{label[c]} (all rows {1 - summary[c]['routing_agreement']:.2e})")
        zero = v == 0
        if zero.any():
            b.plot(off[zero], np.full(zero.sum(), floor * 1.2), marker="o", ls="none",
                   mfc="none", mec=colors[c], label=f"{label[c]}: 0 on {int(zero.sum())} layers")
    top = max([x for v in dis.values() for x in v if np.isfinite(x)] + [floor * 10])
    b.set_yscale("log")
    b.set_ylim(floor, top * 3)
    b.set_xticks(x)
    b.set_xticklabels([str(i) for i in ids], fontsize=8 if nl <= 48 else 6,
                      rotation=0 if nl <= 32 else 90)
    b.set_xlabel("decoder layer (MoE layers only)" if layer_ids is not None else
                 "MoE layer (position)")
    b.set_ylabel("1 - routing agreement (sets)")
    b.set_title("routing disagreement per layer")
    b.legend(fontsize=8, loc="upper right")
    b.grid(True, axis="y", which="major", alpha=0.3)

    # 3. prompt vs response
    groups = [("all", "routing_agreement"), ("prompt", "routing_agreement_prompt"),
              ("response", "routing_agreement_response")]
    vals = {c: np.array([1.0 - float(summary[c][k]) if summary[c][k] is not None else np.nan
                         for _, k in groups]) for c in conds}
    floor3 = floor_of([x for v in vals.values() for x in v])
    gx = np.arange(len(groups))
    for i, c in enumerate(conds):
        off = gx + (i - (len(conds) - 1) / 2) * width
        v = vals[c]
        c3.bar(off, np.where(v > 0, v, 0.0), width, color=colors[c], label=label[c])
        zero = v == 0
        for xo, yv, z in zip(off, v, zero):
            if z:
                c3.plot([xo], [floor3 * 1.2], marker="o", mfc="none", mec=colors[c])
                c3.text(xo, floor3 * 1.6, "0", ha="center", fontsize=8, color=colors[c])
            elif np.isfinite(yv):
                c3.text(xo, yv * 1.15, f"{yv:.1e}", ha="center", fontsize=7, color=colors[c])
    top3 = max([x for v in vals.values() for x in v if np.isfinite(x)] + [floor3 * 10])
    c3.set_yscale("log")
    c3.set_ylim(floor3, top3 * 4)
    c3.set_xticks(gx)
    c3.set_xticklabels([g for g, _ in groups])
    c3.set_ylabel("1 - routing agreement (sets)")
    c3.set_title("prompt vs response rows")
    c3.legend(fontsize=8, loc="upper right")

    cond0 = conds[0] if conds else None
    tokens = summary[cond0]["num_tokens"] if cond0 else 0
    rows = summary[cond0]["num_rows"] if cond0 else 0
    sc_name = os.path.basename(str(sidecar)) if sidecar else "?"
    model_name = os.path.basename(os.path.normpath(str(model))) if model else "?"
    fig.suptitle(f"routereplay verify: sidecar {sc_name}, model {model_name}"
                 + (f" ({trainer} trainer)" if trainer else "")
                 + f"; {summary['num_samples']} samples, {tokens} response tokens, "
                 f"{rows} routing rows", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
