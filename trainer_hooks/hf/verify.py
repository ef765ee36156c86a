"""Recompute a sidecar's rollouts with the HF reference model, with and without replay."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.hf.replay import token_logprobs


def recompute(model_dir: str, records: Sequence[RoutingRecord], schema: RoutingSchema, *,
              progress: bool = True) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{"no_replay" | "replay": per record (lp float64 [N - 1], used int64 [N, L, k])}.

    The model runs in float32, one sequence at a time (no padding to get wrong).
    """
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, list] = {"no_replay": [], "replay": []}
    it = records
    if progress:
        from tqdm import tqdm
        it = tqdm(records, desc="recompute (HF, fp32)", unit="sample")
    with torch.no_grad():
        for r in it:
            out["no_replay"].append(token_logprobs(model, r.token_ids, schema))
            out["replay"].append(token_logprobs(model, r.token_ids, schema, record=r))
    return out
