"""Recompute rollout log-probs in megatron-core, with and without routing replay.

Run as a module in its own process (it applies the CPU shim and starts a gloo process
group of world size 1):

    python -m trainer_hooks.megatron.recompute --model HF_DIR --sidecar S.rrsc --out R.json \
        [--router-perturb EPS] [--router-select-noise EPS] [--seed 0]

Reads every record of the sidecar (token ids, engine log-probs, routing), checks the
sidecar's schema against the model's, builds a right-padded batch, and runs three passes:
no replay (the trainer's own routing), replay (the engine's routing forced through
megatron's RouterReplay, per-token fallback on rows without routing), and one backward
with replay to show the router still gets gradients. Writes the mismatch metrics
(routereplay.metrics) of both conditions to the output JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch

from routereplay import metrics, verify
from routereplay.errors import AlignmentError, RecordError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process() -> None:
    """gloo process group of world size 1 and megatron's model-parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from trainer_hooks.megatron.compat import apply_cpu_shim
    apply_cpu_shim()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()


def check_records(records: Sequence[RoutingRecord], schema: RoutingSchema) -> None:
    """Validate records for recomputation: schema, ids, and the row count against tokens.

    Raises:
        RecordError / AlignmentError naming the sample.
    """
    for r in records:
        if r.token_ids is None or r.logprobs is None or r.prompt_len is None:
            raise AlignmentError(f"sample {r.sample_id!r}: the record holds no token ids, "
                                 "prompt length or engine log-probs to recompute")
        r.validate(schema)


def batch_tensors(records: Sequence[RoutingRecord], pad_id: int = 0):
    """Right-padded input ids [b, s], position ids [b, s], causal mask [1, 1, s, s] (True = masked)."""
    s = max(len(r.token_ids) for r in records)
    ids = torch.full((len(records), s), pad_id, dtype=torch.long)
    for j, r in enumerate(records):
        ids[j, :len(r.token_ids)] = torch.from_numpy(r.token_ids.astype(np.int64))
    pos = torch.arange(s).unsqueeze(0).expand(len(records), -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return ids, pos, mask


def token_logprobs(model, ids, pos, mask) -> torch.Tensor:
    """log p(token_p | tokens_<p) for p >= 1: float32 [b, s - 1] (column p-1 is token p)."""
    logits = model(ids, pos, attention_mask=mask)
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def condition_metrics(records: Sequence[RoutingRecord], lp: torch.Tensor,
                      used_sets: np.ndarray, used_ordered: np.ndarray) -> dict[str, Any]:
    """Mismatch metrics of one pass.

    Args:
        lp: trainer log-probs float [b, s-1] (column p-1 is token p).
        used_sets: experts from the routers' output routing maps, int [b, s, L, k] (the set
            agreement is measured on these).
        used_ordered: top-k ids in the router's column order, int [b, s, L, k].
    Returns:
        routereplay.verify.summarize's figures for this pass, plus routing_agreement_ordered.
    """
    out = verify.summarize(records, {"c": [(lp[j].detach().double().numpy(), used_sets[j])
                                           for j in range(len(records))]})["c"]
    eng = np.concatenate([r.ids for r in records])
    ordered = np.concatenate([used_ordered[j, r.start:r.start + r.num_tokens]
                              for j, r in enumerate(records)])
    out["routing_agreement_ordered"] = metrics.routing_agreement(
        eng, ordered)["routing_agreement_ordered"]
    return out


def run(model_dir: str, sidecar: str, *, router_perturb: float = 0.0,
        router_select_noise: float = 0.0, seed: int = 0, raw: str | None = None,
        limit: int | None = None) -> dict[str, Any]:
    """Recompute the sidecar's rollouts with ``model_dir`` in megatron-core; see module doc.

    router_perturb: std of noise added to the trainer's router weights (changes selection
    and gate values); router_select_noise: std of noise on the router scores used for the
    trainer's own top-k selection only (replay.selection_noise). ``raw``: also save, per
    condition, ``{cond}_lp`` float64 [b, s-1] and ``{cond}_used`` int64 [b, s, L, k] (the
    experts of the routers' output maps) to this .npz, for ``routereplay verify``.
    """
    init_single_process()
    from trainer_hooks.megatron import hf_qwen3_moe as conv
    from trainer_hooks.megatron.replay import (capture_routing_maps, replay_tensors, replaying,
                                               router_instances, routing_map_topk,
                                               selection_noise, used_topk)

    hf = conv.load_hf_config(model_dir)
    schema = RoutingSchema.from_hf_config(hf)
    with SidecarReader(sidecar) as reader:
        schema.check_same(reader.schema, what=f"sidecar {os.path.basename(sidecar)}")
        records = list(reader.records())
    if limit:
        records = records[:limit]
    if not records:
        raise RecordError(f"sidecar {sidecar} holds no records")
    check_records(records, schema)

    t0 = time.perf_counter()
    cfg = conv.transformer_config(hf)
    model = conv.build_gpt_model(hf, cfg)
    conv.load_into(model, conv.load_hf_checkpoint(model_dir), hf)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    if len(routers) != schema.num_moe_layers or len(router_instances()) != schema.num_moe_layers:
        raise AlignmentError(f"model has {len(routers)} MoE routers, schema {schema.num_moe_layers}")
    if router_perturb:
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for r in routers:
                r.weight.add_(torch.randn(r.weight.shape, generator=g) * router_perturb)
    build_s = time.perf_counter() - t0

    ids, pos, mask = batch_tensors(records)
    b, s = ids.shape
    replay_ids = replay_tensors(records, schema, s)
    result: dict[str, Any] = {"num_samples": b, "seq_len": s, "build_s": build_s,
                              "router_perturb": router_perturb,
                              "router_select_noise": router_select_noise}
    raw_arrays: dict[str, np.ndarray] = {}
    for name, per_layer in (("no_replay", None), ("replay", replay_ids)):
        t1 = time.perf_counter()
        with torch.no_grad(), replaying(per_layer), capture_routing_maps(model) as rts, \
                selection_noise(router_select_noise, seed + 11):
            lp = token_logprobs(model, ids, pos, mask)
            used = used_topk(s, b)
            used_sets = routing_map_topk(rts, s, b, schema.top_k)
        result[name] = condition_metrics(records, lp, used_sets, used)
        raw_arrays[f"{name}_lp"] = lp.double().numpy()
        raw_arrays[f"{name}_used"] = np.asarray(used_sets, dtype=np.int64)
        result[name]["forward_s"] = time.perf_counter() - t1

    # One backward with replay: the router must still receive gradients (the gate
    # weights are gathered from the current router scores at the forced ids).
    model.zero_grad(set_to_none=True)
    with replaying(replay_ids):
        lp = token_logprobs(model, ids, pos, mask)
        resp = torch.zeros_like(lp)
        for j, r in enumerate(records):
            resp[j, r.prompt_len - 1:len(r.token_ids) - 1] = 1.0
        loss = -(lp * resp).sum() / resp.sum()
        loss.backward()
    if raw:
        np.savez(raw, **raw_arrays)
    result["replay_backward"] = {
        "loss": float(loss.detach()),
        "router_grad_norms": [float(r.weight.grad.norm()) if r.weight.grad is not None else 0.0
                              for r in routers],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sidecar", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--router-perturb", type=float, default=0.0)
    p.add_argument("--router-select-noise", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", help="also save per-token log-probs and used experts (.npz)")
    p.add_argument("--limit", type=int, help="only the first N records")
    a = p.parse_args(argv)
    from routereplay.errors import RouteReplayError
    try:
        res = run(a.model, a.sidecar, router_perturb=a.router_perturb,
                  router_select_noise=a.router_select_noise, seed=a.seed, raw=a.raw,
                  limit=a.limit)
    except RouteReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
