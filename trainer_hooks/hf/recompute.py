"""The HF recompute behind ``routereplay verify --trainer hf``: each rollout sequence's
log-probs and used experts from the transformers reference model, with and without replay.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.hf.replay import token_logprobs


def default_device() -> str:
    """"cuda" when a CUDA device is available, else "cpu" (``verify --device`` default)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def recompute(model_dir: str, records: Sequence[RoutingRecord], schema: RoutingSchema, *,
              device: str | torch.device | None = None, progress: bool = True
              ) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{"no_replay" | "replay": per record (lp float64 [N - 1], used int64 [N, L_moe, K])}.

    The model runs in float32 on ``device`` (default :func:`default_device`), one sequence
    at a time (no padding to get wrong).
    """
    from transformers import AutoModelForCausalLM
    dev = torch.device(device or default_device())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    out: dict[str, list] = {"no_replay": [], "replay": []}
    it = records
    if progress:
        from tqdm import tqdm
        it = tqdm(records, desc=f"recompute (HF, fp32, {dev})", unit="sample")
    with torch.no_grad():
        for r in it:
            out["no_replay"].append(token_logprobs(model, r.token_ids, schema))
            out["replay"].append(token_logprobs(model, r.token_ids, schema, record=r))
    return out
