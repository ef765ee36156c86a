"""Recompute rollout log-probs in megatron-core, with and without routing replay, under any
parallel layout that runs on CPU.

Run as a module (it applies the CPU shim and starts gloo processes):

    python -m trainer_hooks.megatron.recompute --model HF_DIR --sidecar S.rrsc --out R.json \
        [--parallel tp=2,sp|ep=2|pp=2,vpp=2|...] [--micro-batch-size 2] \
        [--padding right|left|packed] [--router-perturb EPS] [--router-select-noise EPS]

Reads the sidecar's token ids, engine log-probs and metadata on every rank (routing is
decoded lazily by each rank's RouterReplayer: its samples, token ranges and layers only),
splits the global batch over data-parallel ranks and microbatches, and runs through
megatron-core's own ``forward_backward_func`` (1F1B or interleaved with VPP):

1. no replay (the trainer's own routing), forward only;
2. replay (the engine's routing, per-token fallback where a row has none), forward only;
3. one training step with replay (forward + backward with full activation recompute): the
   router still gets gradients, and the recompute forward follows the replayed experts.

Rank 0 gathers per-token log-probs and the experts every router used, and writes the
mismatch metrics (routereplay.verify.summarize) of conditions 1 and 2 to the output JSON,
which has the same shape whatever the layout. ``--check-record`` adds the layout checks
used by the tests (RECORD pass -> exact replay, perturbed routers, recompute path).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch

from routereplay import align, metrics, verify
from routereplay.errors import AlignmentError, RecordError, RouteReplayError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from trainer_hooks.megatron.parallel import ParallelSpec, launch


def check_records(records: Sequence[RoutingRecord], schema: RoutingSchema) -> None:
    """Records must carry token ids, a prompt length and engine log-probs, and the engine's
    row count (N - 1 - start rows for N tokens). Expert ids are checked per microbatch by
    the replayer (routereplay.align.check_rows) as each rank decodes its rows.

    Raises:
        AlignmentError / RecordError naming the sample.
    """
    for r in records:
        if r.token_ids is None or r.logprobs is None or r.prompt_len is None:
            raise AlignmentError(f"sample {r.sample_id!r}: the record holds no token ids, "
                                 "prompt length or engine log-probs to recompute")
        # the record's own checks, on its metadata (ids decoded with no layers here)
        dataclasses.replace(r, expert_ids=np.broadcast_to(np.arange(schema.top_k, dtype=schema.id_dtype),
                                           (r.num_tokens, schema.num_moe_layers, schema.top_k))
                    ).validate(schema)


@dataclasses.dataclass
class Options:
    model_dir: str
    sidecar: str
    spec: ParallelSpec
    out: str
    micro_batch_size: int = 2
    padding: str = "right"             # right | left | packed
    recompute: bool = True
    router_perturb: float = 0.0
    router_select_noise: float = 0.0
    seed: int = 0
    raw: str | None = None
    limit: int | None = None
    check_record: bool = False


def plan_microbatches(records: Sequence[RoutingRecord], spec: ParallelSpec, dp_rank: int,
                      mbs: int, padding: str) -> tuple[list[dict[str, Any]], int]:
    """This DP rank's microbatches: sample j of the global batch goes to DP rank j % dp.

    Every rank gets the same number of microbatches of the same shape (pipeline P2P needs
    fixed shapes); empty slots are zero-length samples (all padding), and with VPP the
    count is rounded up to a multiple of pp.
    Returns:
        (list of {"sample_ids", "layout", "offsets"}, sequence length s).
    """
    dp = spec.dp
    per_rank = [list(records[d::dp]) for d in range(dp)]
    n_mb = max(1, max(-(-len(x) // mbs) for x in per_rank))
    if spec.vpp:
        # NOTE: megatron's interleaved schedule wants a multiple of pp microbatches.
        n_mb = -(-n_mb // spec.pp) * spec.pp
    mult = spec.tp if spec.sp else 1
    if padding == "packed":
        s = max(sum(len(r.token_ids) for r in per_rank[d][m * mbs:(m + 1) * mbs])
                for d in range(dp) for m in range(n_mb))
    else:
        s = max(len(r.token_ids) for r in records)
    s = -(-s // mult) * mult
    mine = per_rank[dp_rank]
    out = []
    for m in range(n_mb):
        grp = mine[m * mbs:(m + 1) * mbs]
        lengths = [len(r.token_ids) for r in grp]
        if padding == "packed":
            lay = align.Layout.packed_from_lengths(lengths)
            lay = dataclasses.replace(lay, seq_len=s)
            offsets = list(lay.cu_seqlens_padded[:-1])
        else:
            grp = grp + [None] * (mbs - len(grp))
            lengths = lengths + [0] * (mbs - len(lengths))
            lay = align.Layout(lengths=tuple(lengths), seq_len=s, padding=padding)
            offsets = [0 if padding == "right" else s - n for n in lengths]
        out.append({"records": grp, "layout": lay, "offsets": offsets,
                    "sample_ids": tuple(r.sample_id if r is not None else f"<empty {m}.{i}>"
                                        for i, r in enumerate(grp))})
    return out, s


def batch_tensors(plan: dict[str, Any], s: int) -> dict[str, torch.Tensor]:
    """tokens [b, s], position_ids [b, s], attention_mask [b or 1, 1, s, s] (True = masked):
    causal, padding masked out; packed samples attend only within themselves."""
    lay: align.Layout = plan["layout"]
    b = 1 if lay.packed else lay.batch_size
    tokens = torch.zeros((b, s), dtype=torch.long)
    pos = torch.zeros((b, s), dtype=torch.long)
    seg = torch.full((b, s), -1, dtype=torch.long)
    for j, (r, a) in enumerate(zip(plan["records"], plan["offsets"])):
        if r is None:
            continue
        n = len(r.token_ids)
        row = 0 if lay.packed else j
        tokens[row, a:a + n] = torch.from_numpy(r.token_ids.astype(np.int64))
        pos[row, a:a + n] = torch.arange(n)
        seg[row, a:a + n] = j
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    mask = causal | ~same
    return {"tokens": tokens, "position_ids": pos, "attention_mask": mask[:, None]}


class _Collector:
    """Per-rank store of used experts (from RouterReplayer.on_used) and log-probs."""

    def __init__(self, replayer, plans):
        self.replayer, self.plans = replayer, plans
        self.used: list[tuple[str, np.ndarray, int, np.ndarray]] = []
        self.lp: dict[str, np.ndarray] = {}

    def on_used(self, key, ci, li, tmap, idx):
        lpos = self.replayer.record_layers[ci][li]
        ids = self.plans[key]["sample_ids"]
        real = tmap.sample >= 0
        smp, pos, rows = tmap.sample[real], tmap.position[real], idx.numpy()[real]
        for j in np.unique(smp):
            sel = smp == j
            if self.plans[key]["records"][j] is not None:
                self.used.append((ids[j], pos[sel], lpos, rows[sel]))

    def on_lp(self, key, lp_row_major):
        plan = self.plans[key]
        lay = plan["layout"]
        for j, (r, a) in enumerate(zip(plan["records"], plan["offsets"])):
            if r is None:
                continue
            row = lp_row_major[0 if lay.packed else j]
            self.lp[r.sample_id] = row[a:a + len(r.token_ids) - 1].double().numpy()


def _gather(obj: Any) -> list[Any] | None:
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _assemble(parts: list, records: Sequence[RoutingRecord], schema: RoutingSchema):
    """Rank 0: per-record lp float64 [len - 1] and used int64 [len, L, K] (-1 = unseen)."""
    lp = {r.sample_id: None for r in records}
    used = {r.sample_id: np.full((len(r.token_ids), schema.num_moe_layers, schema.top_k), -1,
                                 np.int64) for r in records}
    for part in parts:
        for sid, v in part["lp"].items():
            lp[sid] = v
        for sid, pos, lpos, rows in part["used"]:
            used[sid][pos, lpos] = rows
    missing = [s for s, v in lp.items() if v is None]
    if missing:
        raise AlignmentError(f"no log-probs came back for samples {missing[:5]}")
    return lp, used


def _run_condition(o: Options, ctx: dict[str, Any], source: Any, *, train: bool = False):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    replayer, chunks, plans, s = ctx["replayer"], ctx["chunks"], ctx["plans"], ctx["s"]
    col = _Collector(replayer, plans)
    replayer.on_used = col.on_used
    tensors = [batch_tensors(p, s) for p in plans]
    resp_total = ctx["resp_total"]

    def loss_func(key, out):
        t = tensors[key]["tokens"]
        lp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, t[:, 1:, None]).squeeze(-1)
        col.on_lp(key, lp.detach())
        resp = torch.zeros_like(lp)
        plan = plans[key]
        for j, (r, a) in enumerate(zip(plan["records"], plan["offsets"])):
            if r is not None:
                row = 0 if plan["layout"].packed else j
                resp[row, a + r.prompt_len - 1:a + len(r.token_ids) - 1] = 1.0
        # forward_backward_func divides by num_microbatches: undo it, normalise globally.
        loss = -(lp * resp).sum() / resp_total * len(plans)
        return loss, {"loss": loss.detach()}

    def forward_step(it, chunk):
        key = next(it)
        t = tensors[key]
        with replayer.microbatch(key, chunk):
            out = chunk(t["tokens"], t["position_ids"], attention_mask=t["attention_mask"])
        return out, functools.partial(loss_func, key)

    fb = get_forward_backward_func()
    its = [iter(range(len(plans))) for _ in chunks]
    mbs = {k: _as_mb(p) for k, p in enumerate(plans)}
    b = 1 if plans[0]["layout"].packed else o.micro_batch_size
    t0 = time.perf_counter()
    with replayer.step(source, mbs):
        kw = dict(forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
                  model=chunks, num_microbatches=len(plans), seq_length=s, micro_batch_size=b,
                  forward_only=not train)
        if train:
            for c in chunks:
                c.zero_grad(set_to_none=True)
            fb(**kw)
        else:
            with torch.no_grad():
                fb(**kw)
    stats = dataclasses.asdict(replayer.stats)
    replayer.on_used = None
    return {"lp": col.lp, "used": col.used, "stats": stats, "seconds": time.perf_counter() - t0}


def _as_mb(plan):
    from trainer_hooks.megatron.replayer import Microbatch
    return Microbatch(sample_ids=plan["sample_ids"], layout=plan["layout"])


def _router_grad_norms(ctx: dict[str, Any], schema: RoutingSchema) -> list[float]:
    """Norm of each MoE router's weight gradient, summed over the ranks that share the
    router (TP with sequence parallel and DP hold partial sums): one per MoE layer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    grads = {}
    for ci, layers in enumerate(ctx["replayer"].layers):
        for router, lid in layers:
            g = router.weight.grad
            grads[lid] = torch.zeros_like(router.weight) if g is None else g.detach().clone()
    for lid in sorted(grads):
        if ctx["spec"].sp:
            dist.all_reduce(grads[lid], group=ps.get_tensor_model_parallel_group())
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(grads[lid], group=ps.get_data_parallel_group())
    parts = _gather({lid: float(g.norm()) for lid, g in grads.items()})
    if parts is None:
        return []
    merged: dict[int, float] = {}
    for p in parts:
        merged.update(p)
    return [merged[lid] for lid in schema.moe_layer_ids]


def _perturb_routers(ctx: dict[str, Any], eps: float, seed: int) -> None:
    # NOTE: seeded by the global layer id, so every rank holding a replica of a router
    # (TP, EP/DP) adds the same noise.
    with torch.no_grad():
        for layers in ctx["replayer"].layers:
            for router, lid in layers:
                g = torch.Generator().manual_seed(seed * 1000 + 7 + lid)
                router.weight.add_(torch.randn(router.weight.shape, generator=g) * eps)


def _worker(rank: int, o: Options) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from trainer_hooks.megatron import hf_qwen3_moe as conv
    from trainer_hooks.megatron.parallel import build_chunks, config_overrides, load_sharded
    from trainer_hooks.megatron.replayer import RouterReplayer, selection_noise

    hf = conv.load_hf_config(o.model_dir)
    schema = RoutingSchema.from_hf_config(hf)
    reader = SidecarReader(o.sidecar)
    schema.check_same(reader.schema, what=f"sidecar {os.path.basename(o.sidecar)}")
    ids = reader.sample_ids()
    reader.check()           # NOTE: sample_ids() lists readable records; none may be skipped
    if o.limit:
        ids = ids[:o.limit]
    if not ids:
        raise RecordError(f"sidecar {o.sidecar} holds no records")
    # token ids, log-probs and metadata only: routing is decoded lazily by the replayer;
    # rank 0 alone also decodes all routing (it measures agreement with the engine).
    records = [reader.read(sid, layers=None if rank == 0 else [], arrays=True) for sid in ids]
    check_records(records, schema)

    t0 = time.perf_counter()
    cfg = conv.transformer_config(hf, **config_overrides(o.spec, o.recompute))
    chunks = build_chunks(hf, cfg, o.spec)
    load_sharded(chunks, conv.hf_to_megatron_state_dict(conv.load_hf_checkpoint(o.model_dir), hf),
                 cfg)
    replayer = RouterReplayer(chunks, schema)
    plans, s = plan_microbatches(records, o.spec, ps.get_data_parallel_rank(),
                                 o.micro_batch_size, o.padding)
    resp_total = float(sum(len(r.token_ids) - r.prompt_len for r in records))
    ctx = dict(replayer=replayer, chunks=chunks, plans=plans, s=s, spec=o.spec,
               resp_total=resp_total)
    build_s = time.perf_counter() - t0

    result: dict[str, Any] = {"num_samples": len(records), "seq_len": s, "build_s": build_s,
                              "router_perturb": o.router_perturb,
                              "router_select_noise": o.router_select_noise,
                              "parallel": o.spec.describe(), "world_size": o.spec.world_size,
                              "padding": o.padding}
    checks: dict[str, Any] = {}
    if o.check_record:
        checks = _record_checks(o, ctx, records, schema)
    if o.router_perturb:
        _perturb_routers(ctx, o.router_perturb, o.seed)

    raw: dict[str, np.ndarray] = {}
    for name, source in (("no_replay", None), ("replay", reader)):
        with selection_noise(o.router_select_noise, o.seed + 11):
            res = _run_condition(o, ctx, source)
        parts = _gather({"lp": res["lp"], "used": res["used"]})
        stats = _gather(res["stats"])
        if rank == 0:
            lp, used = _assemble(parts, records, schema)
            result[name] = condition_metrics(records, lp, used)
            result[name]["forward_s"] = res["seconds"]
            result[name]["replay_stats"] = stats
            raw[f"{name}_lp"] = _pad_stack([lp[r.sample_id] for r in records], np.nan)
            raw[f"{name}_used"] = _pad_stack([np.sort(used[r.sample_id], -1) for r in records], -1)

    res = _run_condition(o, ctx, reader, train=True)
    norms = _router_grad_norms(ctx, schema)
    stats = _gather(res["stats"])
    losses = _gather(res["lp"])
    if rank == 0:
        result["replay_backward"] = {"router_grad_norms": norms, "replay_stats": stats,
                                     "seconds": res["seconds"]}
        result["replay_backward"]["loss"] = _loss(records, {k: v for p in losses for k, v in p.items()})
        if checks:
            result["checks"] = checks
        if o.raw:
            np.savez(o.raw, **raw)
        with open(o.out, "w") as f:
            json.dump(result, f)
    reader.close()
    if dist.get_world_size() > 1:
        dist.barrier()


def _loss(records, lp: dict[str, np.ndarray]) -> float:
    num = sum(float(-lp[r.sample_id][r.prompt_len - 1:].sum()) for r in records)
    return num / sum(len(r.token_ids) - r.prompt_len for r in records)


def _pad_stack(arrs: list[np.ndarray], fill) -> np.ndarray:
    n = max(a.shape[0] for a in arrs)
    out = np.full((len(arrs), n) + arrs[0].shape[1:], fill, dtype=arrs[0].dtype)
    for i, a in enumerate(arrs):
        out[i, :a.shape[0]] = a
    return out


def condition_metrics(records: Sequence[RoutingRecord], lp: dict[str, np.ndarray],
                      used: dict[str, np.ndarray]) -> dict[str, Any]:
    """Mismatch metrics of one pass.

    Args:
        lp: sample id -> trainer log-probs float64 [len - 1] (entry p-1 is token p).
        used: sample id -> experts the routers used, int64 [len, L, K] in router column
            order (sets compare order-free; the ordered agreement uses the column order).
    Returns:
        routereplay.verify.summarize's figures, plus routing_agreement_ordered.
    """
    out = verify.summarize(records, {"c": [(lp[r.sample_id], used[r.sample_id])
                                           for r in records]})["c"]
    eng = np.concatenate([r.expert_ids for r in records])
    ordered = np.concatenate([used[r.sample_id][r.start:r.start + r.num_tokens]
                              for r in records])
    out["routing_agreement_ordered"] = metrics.routing_agreement(
        eng, ordered)["routing_agreement_ordered"]
    return out


def _record_checks(o: Options, ctx: dict[str, Any], records, schema) -> dict[str, Any]:
    """RECORD pass of the unperturbed model -> replay of what it recorded (must be exactly
    equal: ids and log-probs), then perturbed routers: replay must still select the recorded
    experts (also in the activation-recompute forward of a training step), and the routers
    must get gradients. Returns the checks gathered on rank 0 (empty dict elsewhere)."""
    rec = _run_condition(o, ctx, None)                           # RECORD (own routing)
    parts = _gather({"lp": rec["lp"], "used": rec["used"]})
    import torch.distributed as dist
    payload = [None]
    if dist.get_rank() == 0:
        lp0, used0 = _assemble(parts, records, schema)
        payload = [{"lp": lp0, "used": used0}]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    lp0, used0 = payload[0]["lp"], payload[0]["used"]
    # Recorded routing of every token position (the last one included).
    recorded = {r.sample_id: dataclasses.replace(
        r, expert_ids=used0[r.sample_id].astype(schema.id_dtype), start=0) for r in records}

    def compare(res):
        pr = _gather({"lp": res["lp"], "used": res["used"]})
        if dist.get_rank() != 0:
            return None
        lp1, used1 = _assemble(pr, records, schema)
        eq = all(np.array_equal(used1[s], used0[s]) for s in used0)
        dl = max(float(np.max(np.abs(lp1[s] - lp0[s]))) for s in lp0)
        agree = float(np.mean([(np.sort(used1[s], -1) == np.sort(used0[s], -1)).all(-1).mean()
                               for s in used0]))
        return {"ids_equal": eq, "max_abs_dlogp": dl, "lp_exact": dl == 0.0,
                "set_agreement": agree}

    out: dict[str, Any] = {}
    out["record_replay"] = compare(_run_condition(o, ctx, recorded))
    saved = [router.weight.detach().clone() for ls in ctx["replayer"].layers for router, _ in ls]
    _perturb_routers(ctx, 0.5, o.seed + 100)
    out["perturbed_own"] = compare(_run_condition(o, ctx, None))
    out["perturbed_replay"] = compare(_run_condition(o, ctx, recorded))
    mism = _RecomputeCheck(ctx)
    with mism:
        train = _run_condition(o, ctx, recorded, train=True)
    out["perturbed_train"] = compare(train)
    out["recompute_rows_checked"] = _gather(mism.checked)
    out["recompute_rows_differing"] = _gather(mism.differing)
    out["router_grad_norms"] = _router_grad_norms(ctx, schema)
    out["train_stats"] = _gather(train["stats"])
    # restore the unperturbed routers for the conditions that follow
    with torch.no_grad():
        for w, (router, _) in zip(saved, [t for ls in ctx["replayer"].layers for t in ls]):
            router.weight.copy_(w)
    return out if dist.get_rank() == 0 else {}


class _RecomputeCheck:
    """Counts router rows whose output routing map (what the experts receive) differs from
    the experts the microbatch's first forward used, in activation-recompute forwards."""

    def __init__(self, ctx):
        self.replayer = ctx["replayer"]
        self.checked = 0
        self.differing = 0
        self.hooks = []

    def _hook(self, router, inp, out):
        rep = self.replayer
        _, ci, li = router.router_replay._rr_slot
        if rep._fwd[ci] is not None or not torch.is_grad_enabled():
            return
        key = rep._bwd[ci]
        idx = rep._held[(key, ci)].used[li]
        want = torch.zeros_like(out[1]).scatter(1, idx, True)
        self.checked += int(idx.shape[0])
        self.differing += int((want != out[1]).any(-1).sum())

    def __enter__(self):
        for layers in self.replayer.layers:
            for router, _ in layers:
                self.hooks.append(router.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def run(model_dir: str, sidecar: str, out: str, *, parallel: str | None = None, **kw: Any) -> dict:
    """Run the recompute under ``parallel`` (see module doc) and return the JSON result."""
    o = Options(model_dir=model_dir, sidecar=sidecar, out=out, spec=ParallelSpec.parse(parallel),
                **kw)
    if o.padding not in ("right", "left", "packed"):
        raise AlignmentError(f"padding must be right, left or packed, got {o.padding!r}")
    launch(o.spec, _worker, o)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sidecar", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--parallel", default="", help="layout, e.g. tp=2,sp | ep=2 | pp=2,vpp=2")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--padding", default="right", choices=("right", "left", "packed"))
    p.add_argument("--no-recompute", action="store_true",
                   help="no activation recompute in the training step")
    p.add_argument("--router-perturb", type=float, default=0.0)
    p.add_argument("--router-select-noise", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", help="also save per-token log-probs and used experts (.npz)")
    p.add_argument("--limit", type=int, help="only the first N records")
    p.add_argument("--check-record", action="store_true",
                   help="add the RECORD -> replay exactness and perturbed-router checks")
    a = p.parse_args(argv)
    if a.micro_batch_size < 1:
        p.error("--micro-batch-size must be >= 1")
    try:
        run(a.model, a.sidecar, a.out, parallel=a.parallel, micro_batch_size=a.micro_batch_size,
            padding=a.padding, recompute=not a.no_recompute, router_perturb=a.router_perturb,
            router_select_noise=a.router_select_noise, seed=a.seed, raw=a.raw, limit=a.limit,
            check_record=a.check_record)
    except (RouteReplayError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
