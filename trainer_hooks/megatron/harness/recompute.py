"""Recompute rollout log-probs in megatron-core, with and without routing replay, under any
parallel layout that runs on CPU (harness: the driver behind ``routereplay verify --trainer
megatron`` and the demo's trainer stage).

    python -m trainer_hooks.megatron.harness.recompute --model HF_DIR --sidecar S.rrsc \
        --out R.json [--parallel tp=2,sp|ep=2|pp=2,vpp=2|...] [--micro-batch-size 2] \
        [--padding right|left|packed] [--router-perturb EPS] [--router-select-noise EPS]

It applies the CPU shim and starts gloo processes. Every rank reads the sidecar's token
ids, engine log-probs and metadata (each rank's RouterReplayer fetches only its routing),
splits the global batch (harness.plan), and runs megatron-core's own
``forward_backward_func`` (harness.passes):

1. no replay (the trainer's own routing), forward only;
2. replay (the engine's routing, per-token fallback where a row has none), forward only;
3. one training step with replay (forward + backward with full activation recompute): the
   router still gets gradients, and the recompute forward follows the replayed experts.

Rank 0 gathers per-token log-probs and the experts every router used and computes the
metrics of conditions 1 and 2 (routereplay.verify.summarize) into the output JSON, with
the per-token deltas. ``--check-record`` adds the tests' layout checks (harness.checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from routereplay import verify
from routereplay.errors import ConfigError, RecordError, RouteReplayError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from trainer_hooks.megatron.harness.parallel import ParallelSpec, launch
from trainer_hooks.megatron.harness.plan import PADDINGS


@dataclasses.dataclass
class Options:
    """What to recompute, how (the command line's options)."""

    model_dir: str
    sidecar: str
    spec: ParallelSpec
    out: str
    micro_batch_size: int = 2
    padding: str = "right"             # right | left | packed
    recompute: bool = True             # full activation recompute in the training step
    router_perturb: float = 0.0
    router_select_noise: float = 0.0
    seed: int = 0
    limit: int | None = None
    check_record: bool = False


def _worker(rank: int, o: Options) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainer_hooks.megatron import RouterReplayer
    from trainer_hooks.megatron.harness import qwen3_moe as conv
    from trainer_hooks.megatron.harness.checks import record_checks
    from trainer_hooks.megatron.harness.collect import assemble, gather, router_grad_norms
    from trainer_hooks.megatron.harness.parallel import (build_chunks, config_overrides,
                                                         load_sharded)
    from trainer_hooks.megatron.harness.passes import Session, run_pass
    from trainer_hooks.megatron.harness.perturb import perturb_routers, selection_noise
    from trainer_hooks.megatron.harness.plan import check_records, plan_microbatches

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
    # token ids, log-probs and metadata only: routing is fetched lazily by the replayer;
    # rank 0 alone also decodes all routing (it measures agreement with the engine).
    records = [reader.read(sid, moe_layers=None if rank == 0 else [], arrays=True)
               for sid in ids]
    check_records(records, schema)
    # NOTE: passes.py takes the full-vocabulary log-softmax: records under a sampling
    # transform are refused (with the reason) rather than compared unlike with like
    verify.check_full_vocabulary(records, "megatron")

    t0 = time.perf_counter()
    cfg = conv.transformer_config(hf, **config_overrides(o.spec, o.recompute))
    chunks = build_chunks(hf, cfg, o.spec)
    load_sharded(chunks, conv.hf_to_megatron_state_dict(conv.load_hf_checkpoint(o.model_dir), hf),
                 cfg)
    plan = plan_microbatches(records, o.spec, ps.get_data_parallel_rank(), o.micro_batch_size,
                             o.padding)
    sess = Session(replayer=RouterReplayer(chunks, schema), chunks=chunks, plan=plan,
                   spec=o.spec,
                   response_tokens=float(sum(len(r.token_ids) - r.prompt_len for r in records)))
    build_s = time.perf_counter() - t0

    result: dict[str, Any] = {"num_samples": len(records), "seq_len": plan.seq_len,
                              "build_s": build_s, "router_perturb": o.router_perturb,
                              "router_select_noise": o.router_select_noise,
                              "parallel": o.spec.describe(), "world_size": o.spec.world_size,
                              "padding": o.padding}
    checks: dict[str, Any] = {}
    if o.check_record:
        checks = record_checks(sess, records, schema, o.seed)
    if o.router_perturb:
        perturb_routers(sess.replayer, o.router_perturb, o.seed)

    passes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name, source in (("no_replay", None), ("replay", reader)):
        with selection_noise(sess.replayer, o.router_select_noise, o.seed + 11):
            res = run_pass(sess, source)
        parts = gather(res.part)
        stats = gather(dataclasses.asdict(res.stats))
        if rank == 0:
            lp, used = assemble(parts, records, schema)
            passes[name] = [(lp[r.sample_id], used[r.sample_id]) for r in records]
            result[name] = {"forward_s": res.seconds, "replay_stats": stats}

    train = run_pass(sess, reader, train=True)
    norms = router_grad_norms(sess.replayer, schema, o.spec.sp)
    stats = gather(dataclasses.asdict(train.stats))
    parts = gather(train.part)
    if rank == 0:
        # NOTE: the metrics are computed here, once (the command line reads them back):
        # used experts stay in router column order, so the ordered agreement is right.
        summary = verify.summary_to_json(verify.summarize(records, passes))
        for name in passes:
            result[name].update(summary[name])
        result["deltas"] = summary["deltas"]
        result["sampling"] = summary["sampling"]
        lp = {k: v for p in parts for k, v in p.lp.items()}
        result["replay_backward"] = {"router_grad_norms": norms, "replay_stats": stats,
                                     "seconds": train.seconds, "loss": _loss(records, lp)}
        if checks:
            result["checks"] = checks
        with open(o.out, "w") as f:
            json.dump(result, f)
    reader.close()
    if dist.get_world_size() > 1:
        dist.barrier()


def _loss(records: Sequence[RoutingRecord], lp: dict[str, np.ndarray]) -> float:
    num = sum(float(-lp[r.sample_id][r.prompt_len - 1:].sum()) for r in records)
    return num / sum(len(r.token_ids) - r.prompt_len for r in records)


def run(model_dir: str, sidecar: str, out: str, *, parallel: str | None = None, **kw: Any) -> dict:
    """Run the recompute under ``parallel`` (see module doc) and return the JSON result."""
    o = Options(model_dir=model_dir, sidecar=sidecar, out=out, spec=ParallelSpec.parse(parallel),
                **kw)
    if o.padding not in PADDINGS:
        raise ConfigError(f"padding must be right, left or packed, got {o.padding!r}")
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
    p.add_argument("--padding", default="right", choices=PADDINGS)
    p.add_argument("--no-recompute", action="store_true",
                   help="no activation recompute in the training step")
    p.add_argument("--router-perturb", type=float, default=0.0)
    p.add_argument("--router-select-noise", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="only the first N records")
    p.add_argument("--check-record", action="store_true",
                   help="add the RECORD -> replay exactness and perturbed-router checks")
    a = p.parse_args(argv)
    if a.micro_batch_size < 1:
        p.error("--micro-batch-size must be >= 1")
    try:
        run(a.model, a.sidecar, a.out, parallel=a.parallel, micro_batch_size=a.micro_batch_size,
            padding=a.padding, recompute=not a.no_recompute, router_perturb=a.router_perturb,
            router_select_noise=a.router_select_noise, seed=a.seed, limit=a.limit,
            check_record=a.check_record)
    except (RouteReplayError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
