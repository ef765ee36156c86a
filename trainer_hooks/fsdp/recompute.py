"""The recompute behind ``routereplay verify --trainer fsdp``: the rollout's records run
through the training replayer (:class:`FSDPReplayer`) as a trainer runs them: padded
microbatches (left-padded, with an attention mask), keyed, with token identity checked
against the records, every router reached, fallback counted; then the same batches
without replay. The log-probs follow each record's sampling transform as in
trainer_hooks.hf.recompute (the reference path of ``--trainer hf``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from routereplay import verify
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.core.microbatch import Microbatch
from trainer_hooks.fsdp import routers as _routers
from trainer_hooks.fsdp.replayer import FSDPReplayer
from trainer_hooks.hf.recompute import default_device, transformed_logprobs

__all__ = ["recompute", "padded_batch"]


def padded_batch(records: Sequence[RoutingRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int64 [b, s], attention_mask int64 [b, s]) of the records' token ids,
    left-padded (the prompt side, as verl's rollout batches) to the longest."""
    s = max(len(r.token_ids) for r in records)
    ids = np.zeros((len(records), s), np.int64)
    mask = np.zeros((len(records), s), np.int64)
    for j, r in enumerate(records):
        n = len(r.token_ids)
        ids[j, s - n:] = r.token_ids
        mask[j, s - n:] = 1
    return ids, mask


def _forward(model, rep: FSDPReplayer | None, key: Any, x, am):
    rs = [r for r, _ in _routers.find_routers(model)]
    per = [[] for _ in rs]
    hs = [r.register_forward_hook(lambda m, a, o, i=i: per[i].append(o[2]))
          for i, r in enumerate(rs)]
    try:
        if rep is None:
            logits = model(input_ids=x, attention_mask=am, use_cache=False).logits
        else:
            with rep.microbatch(key):
                logits = model(input_ids=x, attention_mask=am, use_cache=False).logits
    finally:
        for h in hs:
            h.remove()
    b, s = x.shape
    used = torch.stack([p[0] for p in per], 1).reshape(b, s, len(rs), -1)
    return logits.float(), used


def recompute(model_dir: str, records: Sequence[RoutingRecord], schema: RoutingSchema, *,
              device: str | torch.device | None = None, batch_size: int = 4,
              progress: bool = True) -> dict[str, Any]:
    """{"no_replay" | "replay": per record (lp float64 [N - 1], used int64 [N, L_moe, K])}
    plus "stats": the replay steps' summed ``as_metrics()``.

    The model runs in float32 on ``device`` (default cuda when available), ``batch_size``
    records per left-padded microbatch; all microbatches of the run form one replay step
    (the records are the routing source, keyed by sample id).

    Raises:
        AlignmentError: a record whose tokens differ from the batch's, or whose engine
            log-probs cannot be reproduced (routereplay.verify.sampling_transform).
    """
    from transformers import AutoModelForCausalLM
    verify.sampling_notes(records)               # NOTE: refuses before the model loads
    dev = torch.device(device or default_device())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    rep = FSDPReplayer(model, schema)
    groups = [list(records[i:i + batch_size]) for i in range(0, len(records), batch_size)]
    batches = {}
    for k, g in enumerate(groups):
        ids, mask = padded_batch(g)
        batches[k] = (Microbatch.from_attention_mask([r.sample_id for r in g], mask,
                                                     input_ids=ids),
                      torch.as_tensor(ids, device=dev), torch.as_tensor(mask, device=dev))
    out: dict[str, Any] = {"no_replay": [], "replay": []}
    source = {r.sample_id: r for r in records}
    it: Any = range(len(groups))
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"recompute (FSDPReplayer, fp32, {dev})", unit="microbatch")
    results: dict[int, list] = {k: [] for k in batches}
    with torch.no_grad():
        for k in batches:                              # the model's own routing
            _, x, am = batches[k]
            results[k].append(_forward(model, None, k, x, am))
        with rep.step(source, {k: v[0] for k, v in batches.items()}) as step:
            for k in it:
                _, x, am = batches[k]
                results[k].append(_forward(model, rep, k, x, am))
    for k, g in enumerate(groups):
        _, x, _ = batches[k]
        s = x.shape[1]
        for cond, (logits, used) in zip(("no_replay", "replay"), results[k]):
            for j, r in enumerate(g):
                n = len(r.token_ids)
                a = s - n
                transform = verify.sampling_transform(r) or verify.Transform()
                lp = transformed_logprobs(logits[j, a:s - 1], x[j, a + 1:], transform)
                out[cond].append((lp.double().cpu().numpy(), used[j, a:].cpu().numpy()))
    out["stats"] = step.stats.as_metrics()
    return out
