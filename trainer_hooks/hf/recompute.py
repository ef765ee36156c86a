"""The HF recompute behind ``routereplay verify --trainer hf``: each rollout sequence's
log-probs and used experts from the transformers reference model, with and without replay,
under the same sampling transform as the engine's log-probs (routereplay.verify.Transform).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from routereplay import verify
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.hf.replay import hf_replay, model_inputs


def default_device() -> str:
    """"cuda" when a CUDA device is available, else "cpu" (``verify --device`` default)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def transformed_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                         transform: verify.Transform) -> torch.Tensor:
    """log p(target) under ``transform`` of the distribution (routereplay.verify.Transform:
    temperature, min_p, top_k, top_p in vLLM 0.32's order and rules, float32 as vLLM's
    sampler).

    Args:
        logits: float [N, V]; targets: int64 [N], the token whose log-prob is taken.
    Returns:
        float32 [N]. NOTE: the target is always kept in the truncated set: the engine
        sampled it, so it was in the engine's; a trainer whose logits differ slightly (or
        tie) would otherwise drop it and give -inf (an infinite k3); its log-prob is then
        taken over the trainer's kept tokens plus the target.
    """
    x = logits.float()
    t = transform
    target_logit = None
    if t.min_p > 0 or 0 < t.top_k < x.shape[-1] or t.top_p < 1.0:
        target_logit = (x / t.temperature if t.temperature != 1.0 else x).gather(
            -1, targets[:, None])
    if t.temperature != 1.0:
        x = x / t.temperature
    if t.min_p > 0:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < t.min_p * p.amax(-1, keepdim=True), float("-inf"))
    if 0 < t.top_k < x.shape[-1]:
        kth = torch.topk(x, t.top_k, -1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if t.top_p < 1.0:
        srt, idx = x.sort(-1, descending=False)
        drop = torch.softmax(srt, -1).cumsum(-1) <= 1 - t.top_p
        drop[..., -1] = False                                   # the largest is always kept
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    if target_logit is not None:
        x = x.scatter(-1, targets[:, None], target_logit)
    return torch.log_softmax(x, -1).gather(-1, targets[:, None])[:, 0]


def sequence_logprobs(model: torch.nn.Module, r: RoutingRecord, schema: RoutingSchema, *,
                      replay: bool) -> tuple[np.ndarray, np.ndarray]:
    """One record's (lp float64 [N - 1], used int64 [N, L_moe, K]) as
    trainer_hooks.hf.replay.token_logprobs, the log-probs under the record's
    :func:`routereplay.verify.sampling_transform` (full vocabulary when unknown)."""
    transform = verify.sampling_transform(r) or verify.Transform()
    ids, forced = model_inputs(model, r.token_ids, schema, r if replay else None)
    with hf_replay(model, forced) as used:
        logits = model(ids).logits[0].float()
    lp = transformed_logprobs(logits[:-1], ids[0, 1:], transform)
    return lp.detach().double().cpu().numpy(), torch.stack(used, 1).cpu().numpy()


def recompute(model_dir: str, records: Sequence[RoutingRecord], schema: RoutingSchema, *,
              device: str | torch.device | None = None, progress: bool = True
              ) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{"no_replay" | "replay": per record (lp float64 [N - 1], used int64 [N, L_moe, K])}.

    The model runs in float32 on ``device`` (default :func:`default_device`), one sequence
    at a time (no padding to get wrong). Each record's log-probs follow its sampling
    transform (:func:`sequence_logprobs`).

    Raises:
        AlignmentError: a record whose engine log-probs cannot be reproduced
            (routereplay.verify.sampling_transform), before the model is loaded.
    """
    from transformers import AutoModelForCausalLM
    verify.sampling_notes(records)               # NOTE: refuses before the model loads
    dev = torch.device(device or default_device())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    out: dict[str, list] = {"no_replay": [], "replay": []}
    it = records
    if progress:
        from tqdm import tqdm
        it = tqdm(records, desc=f"recompute (HF, fp32, {dev})", unit="sample")
    with torch.no_grad():
        for r in it:
            out["no_replay"].append(sequence_logprobs(model, r, schema, replay=False))
            out["replay"].append(sequence_logprobs(model, r, schema, replay=True))
    return out
