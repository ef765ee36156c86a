"""Replay overhead: megatron-core forward + backward with replay against without, one run.

    .venv/bin/python benchmarks/replay_overhead.py [--hidden 256] [--seq 512] [--mbs 2]
        [--microbatches 4] [--experts 32] [--top-k 4] [--iters 12] [--no-recompute]

World size 1 on CPU (gloo), megatron's own forward_backward_func, a Qwen3-MoE-shaped
GPTModel with random weights (4 layers: 1 dense + 3 MoE, SequentialMLP experts, full
activation recompute unless --no-recompute). The routing to replay is the model's own
(recorded once, so expert loads are realistic), written to an in-memory sidecar.

Conditions, interleaved iteration by iteration (median of --iters after one warm-up):
- plain: no replayer at all (megatron's native routing);
- replay (sidecar): RouterReplayer fetching each microbatch's rows from the sidecar
  (the default codec, xl-zstd), aligning and validating them on its prefetch thread
  (2 microbatches ahead), and forcing them in forward and recompute;
- replay (sidecar, no prefetch): the same with prefetch=0 (each microbatch loaded when
  it is entered, on the training thread);
- replay (in memory): from already-decoded records (an InMemorySource: no decode cost).

Per replay condition it also prints the replayer's blocking time (what it keeps the
training thread busy: ``microbatch()`` waiting for or doing the load, plus the routers'
selection), per step, per microbatch entry, and per million (token, MoE layer) rows, and
its load time (fetch + align + validate, on whichever thread ran it).
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_model(a: argparse.Namespace):
    """The benchmarks' Qwen3-MoE-shaped GPTModel (module doc): 4 layers, layer 0 dense,
    ``a.hidden``, ``a.experts``, ``a.top_k``, full recompute unless ``not a.recompute``;
    random weights (seed 0). Returns (hf config dict, RoutingSchema, GPTModel)."""
    from routereplay.schema import RoutingSchema
    from trainer_hooks.megatron.harness import qwen3_moe as conv
    from trainer_hooks.megatron.harness.parallel import (ParallelSpec, build_chunks,
                                                         config_overrides)

    torch.manual_seed(0)
    hf = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [0],
          "decoder_sparse_step": 1, "hidden_size": a.hidden, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": a.hidden // 4, "intermediate_size": 2 * a.hidden,
          "moe_intermediate_size": a.hidden // 2, "num_experts": a.experts,
          "num_experts_per_tok": a.top_k, "norm_topk_prob": True, "vocab_size": 1024,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    schema = RoutingSchema.from_hf_config(hf)
    cfg = conv.transformer_config(hf, **config_overrides(ParallelSpec(), a.recompute))
    model = build_chunks(hf, cfg, ParallelSpec())[0]
    return hf, schema, model


def bench(rank: int, a: argparse.Namespace) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from routereplay import align
    from routereplay.record import RoutingRecord
    from routereplay.sidecar import SidecarReader, write_records
    from routereplay.source import InMemorySource
    from trainer_hooks.megatron import Microbatch, RouterReplayer

    hf, schema, model = bench_model(a)
    s, b, m = a.seq, a.mbs, a.microbatches
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 1024, (b, s), generator=g) for _ in range(m)]
    pos = torch.arange(s)[None].expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    lay = align.Layout(lengths=(s,) * b, seq_len=s)
    mbs = {k: Microbatch(sample_ids=tuple(f"m{k}s{j}" for j in range(b)), layout=lay)
           for k in range(m)}
    fb = get_forward_backward_func()
    replayer = RouterReplayer(model, schema)
    eager = RouterReplayer(model, schema, prefetch=0)

    def loss_func(key, out):
        lp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, tokens[key][:, 1:, None])
        return -lp.mean(), {}

    spent: dict[str, list] = {}
    waits: dict[str, list[list[float]]] = {}      # per step: wait of each microbatch entry

    def step(rep=None, source=None, name: str | None = None):
        entry: list[float] = []

        def fwd(it, chunk):
            key = next(it)
            if rep is not None:
                w0 = rep.stats.wait_seconds
                with rep.microbatch(key, chunk):
                    entry.append(rep.stats.wait_seconds - w0)
                    out = chunk(tokens[key], pos, attention_mask=mask)
            else:
                out = chunk(tokens[key], pos, attention_mask=mask)
            return out, lambda o, key=key: loss_func(key, o)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        kw = dict(forward_step_func=fwd, data_iterator=iter(range(m)), model=[model],
                  num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False)
        if rep is not None:
            with rep.step(source, mbs):
                fb(**kw)
            if name:
                spent.setdefault(name, []).append(dataclasses.replace(rep.stats))
                waits.setdefault(name, []).append(entry)
        else:
            fb(**kw)
        return time.perf_counter() - t0

    # record the model's own routing once (no source: every row takes the own top-k)
    rec: dict[str, np.ndarray] = {}

    def on_used(key, ci, li, tmap, idx):
        arr = idx.numpy().reshape(s, b, -1)
        for j in range(b):
            rec.setdefault(f"m{key}s{j}", np.zeros((s, schema.num_moe_layers, schema.top_k),
                                                   schema.id_dtype))[:, li] = arr[:, j]
    replayer.on_used = on_used
    step(replayer, None)
    replayer.on_used = None
    records = [RoutingRecord(sample_id=k, expert_ids=v) for k, v in rec.items()]
    buf = io.BytesIO(write_records(None, schema, records, background=False).getvalue())
    reader = SidecarReader(buf)
    mem = InMemorySource(records, schema)

    conds = {"plain": lambda: step(),
             "replay (sidecar)": lambda: step(replayer, reader, "replay (sidecar)"),
             "replay (sidecar, no prefetch)": lambda: step(eager, reader,
                                                           "replay (sidecar, no prefetch)"),
             "replay (in memory)": lambda: step(replayer, mem, "replay (in memory)")}
    times: dict[str, list[float]] = {c: [] for c in conds}
    for it in range(a.iters + 1):
        for c, f in conds.items():
            dt = f()
            if it:
                times[c].append(dt)
    base = statistics.median(times["plain"])
    rows = s * b * m
    mrows = rows * schema.num_moe_layers / 1e6            # million (token, MoE layer) rows
    from trainer_hooks.megatron import MCORE_VERSION
    print(f"megatron-core {MCORE_VERSION}: hidden {a.hidden}, 4 layers (3 MoE, "
          f"{a.experts} experts, top-{a.top_k}), {m} microbatches x {b} x {s} tokens, "
          f"recompute {'full' if a.recompute else 'off'}; median of {a.iters}")
    print(f"{'condition':<31}{'fwd+bwd ms':>11}{'vs plain':>9}{'min ms':>9}"
          f"{'blocking ms':>12}{'share':>8}{'ms/M rows':>10}{'1st wait':>9}{'wait':>7}"
          f"{'load ms':>9}")
    for c, v in times.items():
        med = statistics.median(v)
        line = f"{c:<31}{med * 1e3:>11.1f}{med / base:>9.4f}{min(v) * 1e3:>9.1f}"
        if c in spent:
            st = spent[c]
            blk = statistics.median(x.blocking_seconds for x in st)
            first = statistics.median(w[0] for w in waits[c])
            later = statistics.median(x for w in waits[c] for x in w[1:])
            load = statistics.median(x.load_seconds for x in st)
            line += (f"{blk * 1e3:>12.2f}{blk / med:>8.4f}{blk * 1e3 / mrows:>10.1f}"
                     f"{first * 1e3:>9.3f}{later * 1e3:>7.3f}{load * 1e3:>9.2f}")
        print(line)
    print("blocking ms: time the replayer kept the training thread busy per step "
          "(microbatch() waiting for or doing the load + routers' replay selection); share = "
          "that / fwd+bwd; ms/M rows: blocking ms per million (token, MoE layer) rows; "
          "1st wait / wait: ms microbatch() blocked on entering the step's first microbatch "
          "(loaded from step() entry on) / each later one (median); load ms: fetch + align + "
          "validate per step, on the prefetch thread where it runs. The 'vs plain' ratio is "
          "the end-to-end figure but carries this machine's run-to-run noise.")
    print(f"({rows} token rows, {rows * schema.num_moe_layers} (token, MoE layer) rows per "
          f"step; sidecar {len(buf.getvalue())} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--no-recompute", dest="recompute", action="store_false")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from trainer_hooks.megatron.harness.parallel import ParallelSpec, launch
    launch(ParallelSpec(), bench, a)


if __name__ == "__main__":
    main()
