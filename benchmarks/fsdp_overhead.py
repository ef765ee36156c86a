"""The FSDP replayer's share of a training step (trainer_hooks.fsdp, issue 31's target: at
most 1 %).

One run, one process (``fully_shard`` over a world of 1: gloo on CPU, nccl with
``--device cuda``): a Qwen3-MoE of transformers built from a small config, trained for
``--steps`` update steps of ``--microbatches`` left-padded microbatches each (forward,
non-reentrant activation checkpointing, backward, gradient accumulation), alternately
without and with replay of sidecar records (random valid routing). Printed as a table:
step wall time plain and replayed, and the replayer's blocking time on the training
thread (``ReplayStats.blocking_seconds``: waiting for the loader plus the routers'
selection) as a share of the replayed step.

    python benchmarks/fsdp_overhead.py                 # CPU
    python benchmarks/fsdp_overhead.py --device cuda   # a lent GPU (bigger default shapes)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(args, dev):
    import transformers as T
    from routereplay.schema import RoutingSchema
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           moe_intermediate_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                           num_experts=args.experts, num_experts_per_tok=args.top_k,
                           norm_topk_prob=True, max_position_embeddings=4096)
    model = T.Qwen3MoeForCausalLM(cfg).float().to(dev).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    schema = RoutingSchema(num_hidden_layers=args.layers, moe_layer_ids=tuple(range(args.layers)),
                           top_k=args.top_k, num_experts=args.experts)
    return model, schema


def records(schema, lengths, seed=0):
    from routereplay.record import RoutingRecord
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = np.argsort(rng.random((n - 1, schema.num_moe_layers, schema.num_experts)),
                         -1)[..., :schema.top_k].astype(schema.id_dtype)
        toks = rng.integers(3, 4096, n).astype(np.int32)
        out.append(RoutingRecord(f"b{i}", ids, start=0, prompt_len=n // 2, token_ids=toks))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per mode (after 1 warm-up)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="samples per microbatch")
    p.add_argument("--seq", type=int, default=None, help="padded length (default 256 cpu, 2048 cuda)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 256 cpu, 1024 cuda)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=2, help="FSDPReplayer(prefetch=...)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.seq = args.seq or (2048 if cuda else 256)
    args.hidden = args.hidden or (1024 if cuda else 256)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from routereplay.sidecar import SidecarReader, write_records
    from trainer_hooks.fsdp import FSDPReplayer, Microbatch
    dev = torch.device(args.device)
    if cuda:
        torch.cuda.set_device(dev)
    store = tempfile.mktemp(prefix="rr-fsdp-bench-")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    model, schema = build(args, dev)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    rng = np.random.default_rng(1)
    n_mb, b, s = args.microbatches, args.batch, args.seq
    lengths = rng.integers(s // 2, s + 1, n_mb * b)
    recs = records(schema, lengths)
    tmp = tempfile.mkdtemp(prefix="rr-fsdp-bench-")
    sc = os.path.join(tmp, "b.rrsc")
    write_records(sc, schema, recs)
    mbs, batches = {}, {}
    for k in range(n_mb):
        ids = np.zeros((b, s), np.int64)
        mask = np.zeros((b, s), np.int64)
        for j in range(b):
            r = recs[k * b + j]
            n = len(r.token_ids)
            ids[j, s - n:] = r.token_ids
            mask[j, s - n:] = 1
        mbs[k] = Microbatch.from_attention_mask([recs[k * b + j].sample_id for j in range(b)],
                                                mask, input_ids=ids)
        batches[k] = (torch.as_tensor(ids, device=dev), torch.as_tensor(mask, device=dev))
    rep = FSDPReplayer(model, schema, prefetch=args.prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(replay: bool):
        import contextlib
        t0 = time.perf_counter()
        with SidecarReader(sc) as rd:
            with rep.step(rd, mbs) if replay else contextlib.nullcontext() as st:
                for k, (x, am) in batches.items():
                    with rep.microbatch(k) if replay else contextlib.nullcontext():
                        logits = model(input_ids=x, attention_mask=am, use_cache=False).logits
                    (logits.float().logsumexp(-1) * am).sum().div(am.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, (st.stats if replay else None)

    step(False), step(True)                                  # warm-up
    plain, replayed, shares, blocking, loads = [], [], [], [], []
    for _ in range(args.steps):
        plain.append(step(False)[0])
        t, stats = step(True)
        replayed.append(t)
        blocking.append(stats.blocking_seconds)
        loads.append(stats.load_seconds)
        shares.append(stats.blocking_seconds / t)
    dist.destroy_process_group()
    tokens = int(sum(lengths))
    rows = [("device", str(dev)), ("model", f"Qwen3-MoE h={args.hidden} L={args.layers} "
                                            f"E={args.experts} k={args.top_k}"),
            ("step", f"{n_mb} microbatches x {b} x {s} padded ({tokens} tokens), AC on"),
            ("plain step (s, median)", f"{statistics.median(plain):.4f}"),
            ("replayed step (s, median)", f"{statistics.median(replayed):.4f}"),
            ("replayer blocking (s, median)", f"{statistics.median(blocking):.5f}"),
            ("loader, background thread (s, median)", f"{statistics.median(loads):.5f}"),
            ("replayer share of the step (median)", f"{100 * statistics.median(shares):.3f} %"),
            ("replayer share (max of steps)", f"{100 * max(shares):.3f} %"),
            ("wall ratio replayed / plain (median)",
             f"{statistics.median(replayed) / statistics.median(plain):.4f}")]
    w = max(len(a) for a, _ in rows)
    print(f"{'quantity'.ljust(w)} | value")
    print(f"{'-' * w}-|-{'-' * 40}")
    for a, v in rows:
        print(f"{a.ljust(w)} | {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
