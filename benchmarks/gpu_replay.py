"""Routing replay on a GPU: correctness, host-device syncs, blocking time, step time, memory.

    python benchmarks/gpu_replay.py                   # one CUDA GPU, under 5 minutes on an H200
    python benchmarks/gpu_replay.py --cpu             # dry run on CPU (tiny shape, seconds)
    python benchmarks/gpu_replay.py --layers 4 --experts 64 --seq 2048   # shrink

World size 1 (NCCL on CUDA, gloo on CPU), megatron-core's own ``forward_backward_func``, a
Qwen3-30B-A3B-shaped slice built by the harness (default: hidden 2048, 32 heads / 4 KV
heads, head_dim 128, 8 layers of which layer 0 dense, 128 experts top-8, moe_intermediate
768, bf16, 4 microbatches x 1 x 4096 tokens, full activation recompute), random weights.

1. RECORD: a forward-only pass with the model's own routing, recorded through
   ``RouterReplayer.on_used`` and written to an in-memory sidecar (default codec).
2. Every router's weights get N(0, perturb^2) noise; a forward-only pass without replay
   and one with replay from the sidecar: routing agreement with the record (the share of
   (token, MoE layer) rows whose expert sets equal the recorded ones).
3. One training step with replay: router gradient norms (each must be > 0).
4. Syncs: one training step per condition with ``torch.cuda.set_sync_debug_mode("warn")``
   (CUDA) and under harness.syncs.ReadBacks (value read-backs and data-dependent shapes,
   any device); the replayed steps must add none.
5. Timing: plain / replay (sidecar) / replay (in memory) training steps, interleaved,
   median of ``--iters`` after one warm-up; the replayer's time from ``ReplayStats``
   (``microbatch()`` blocking, router selection, and the loading done on its prefetch
   thread) and peak GPU memory per step.

Without Transformer Engine, megatron-core 0.16.1 raises ``NameError: te_general_gemm`` in
``router_gating_linear`` with ``moe_router_dtype="fp32"``; the harness binds the name to
None first (harness.mcore_fixes; megatron's files are not edited). With TE installed
(``--te auto``, the default) the model uses TE's layer spec.
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


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _hf_config(a: argparse.Namespace) -> dict:
    return {"model_type": "qwen3_moe", "num_hidden_layers": a.layers, "mlp_only_layers": [0],
            "decoder_sparse_step": 1, "hidden_size": a.hidden, "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "intermediate_size": a.ffn, "moe_intermediate_size": a.moe_ffn,
            "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True,
            "vocab_size": a.vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": False}


def bench(a: argparse.Namespace) -> list[str]:
    """Run the benchmark in this (initialised) process; returns the report lines."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from routereplay import align
    from routereplay.record import RoutingRecord
    from routereplay.schema import RoutingSchema
    from routereplay.sidecar import SidecarReader, write_records
    from routereplay.source import InMemorySource
    from trainer_hooks.megatron import MCORE_VERSION, Microbatch, RouterReplayer
    from trainer_hooks.megatron.harness import qwen3_moe as conv
    from trainer_hooks.megatron.harness.mcore_fixes import bind_te_general_gemm
    from trainer_hooks.megatron.harness.parallel import ParallelSpec, build_chunks, config_overrides
    from trainer_hooks.megatron.harness.perturb import perturb_routers
    from trainer_hooks.megatron.harness.syncs import ReadBacks, cuda_syncs

    cuda = not a.cpu
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda and not a.fp32 else torch.float32
    use_te = cuda and (a.te == "on" or (a.te == "auto" and _has_te()))
    bound = bind_te_general_gemm()
    torch.manual_seed(a.seed)
    hf = _hf_config(a)
    schema = RoutingSchema.from_hf_config(hf)
    over = config_overrides(ParallelSpec(), True)
    over.update(params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                use_cpu_initialization=not cuda)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(a.seed)
    cfg = conv.transformer_config(hf, **over)
    t0 = time.perf_counter()
    model = build_chunks(hf, cfg, ParallelSpec(), max_sequence_length=a.seq, use_te=use_te)[0]
    build_s = time.perf_counter() - t0
    s, b, m = a.seq, a.mbs, a.microbatches
    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = [torch.randint(0, a.vocab, (b, s), generator=g).to(dev) for _ in range(m)]
    pos = torch.arange(s, device=dev)[None].expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), 1)[None, None]
    lay = align.Layout(lengths=(s,) * b, seq_len=s)
    mbs = {k: Microbatch(sample_ids=tuple(f"m{k}s{j}" for j in range(b)), layout=lay)
           for k in range(m)}
    fb = get_forward_backward_func()
    rep = RouterReplayer(model, schema, prefetch=a.prefetch)
    L, K = schema.num_moe_layers, schema.top_k

    def sync():
        if cuda:
            torch.cuda.synchronize()

    entry_waits: list[float] = []                 # microbatch() blocking per entry

    def run(source=None, *, replay=True, train=True, on_used=None, timed=True):
        """One step (all microbatches); returns (seconds, peak bytes, (ReplayStats, waits
        per microbatch entry) | None). ``timed=False``: no device synchronisation around
        the step (when counting the step's own syncs)."""
        entry_waits.clear()
        def loss_func(key, out):
            lp = torch.log_softmax(out[:, :-1].float(), -1).gather(
                -1, tokens[key][:, 1:, None])
            return -lp.mean(), {"loss": lp.detach().mean()}

        def fwd(it, chunk):
            key = next(it)
            if replay:
                w0 = rep.stats.wait_seconds
                with rep.microbatch(key, chunk):
                    entry_waits.append(rep.stats.wait_seconds - w0)
                    out = chunk(tokens[key], pos, attention_mask=mask)
            else:
                out = chunk(tokens[key], pos, attention_mask=mask)
            return out, lambda o, key=key: loss_func(key, o)
        kw = dict(forward_step_func=fwd, data_iterator=iter(range(m)), model=[model],
                  num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=not train)
        model.zero_grad(set_to_none=True)
        if timed:
            sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with torch.set_grad_enabled(train):
            if replay:
                rep.on_used = on_used
                try:
                    with rep.step(source, mbs):
                        fb(**kw)
                finally:
                    rep.on_used = None
            else:
                fb(**kw)
        if timed:
            sync()
        dt = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return dt, peak, ((dataclasses.replace(rep.stats), list(entry_waits)) if replay
                          else None)

    # 1. RECORD the model's own routing (forward only)
    rec = {f"m{k}s{j}": np.zeros((s, L, K), schema.id_dtype) for k in range(m) for j in range(b)}

    def record(key, ci, li, tmap, idx):
        arr = idx.numpy().reshape(s, b, K)
        for j in range(b):
            rec[f"m{key}s{j}"][:, li] = arr[:, j]
    run(None, train=False, on_used=record)
    records = [RoutingRecord(sample_id=k, expert_ids=v) for k, v in rec.items()]
    t = time.perf_counter()
    blob = write_records(None, schema, records, background=False).getvalue()
    encode_s = time.perf_counter() - t
    reader = SidecarReader(io.BytesIO(blob))
    mem = InMemorySource(records, schema)

    # 2. perturbed routers: agreement without and with replay
    perturb_routers(rep, a.perturb, a.seed + 7)

    def agreement(source) -> float:
        same = []

        def check(key, ci, li, tmap, idx):
            got = np.sort(idx.numpy().reshape(s, b, K), -1)
            for j in range(b):
                want = np.sort(rec[f"m{key}s{j}"][:, li].astype(np.int64), -1)
                same.append((got[:, j] == want).all(-1))
        run(source, train=False, on_used=check)
        return float(np.concatenate(same).mean())
    agree_own, agree_replay = agreement(None), agreement(reader)

    # 3. router gradients of a replayed training step
    run(reader)
    grads = [float(r.weight.grad.float().norm()) if r.weight.grad is not None else 0.0
             for r, _ in rep.layers[0]]

    # 4. syncs per step
    conds = {"plain": dict(replay=False), "replay (sidecar)": dict(source=reader),
             "replay (in memory)": dict(source=mem)}
    syncs: dict[str, tuple[int | None, int]] = {}
    for c, kw in conds.items():
        run(**kw)                                   # warm (allocator, kernels)
        with ReadBacks() as rb:
            if cuda:
                with cuda_syncs() as seen:
                    run(**kw, timed=False)
                n_cuda = len(seen)
            else:
                run(**kw, timed=False)
                n_cuda = None
        sync()
        syncs[c] = (n_cuda, rb.total)

    # 5. interleaved timing
    times = {c: [] for c in conds}
    peaks = {c: [] for c in conds}
    stats = {c: [] for c in conds}
    for it in range(a.iters + 1):
        for c, kw in conds.items():
            dt, peak, st = run(**kw)
            if it:
                times[c].append(dt)
                peaks[c].append(peak)
                if st is not None:
                    stats[c].append(st)
    if bound is not None:
        bound()

    base = statistics.median(times["plain"])
    rows = s * b * m * L
    lines = [
        f"megatron-core {MCORE_VERSION}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU (dry run)'}, "
        f"{'Transformer Engine spec' if use_te else 'local spec (no TE)'}, {dtype}"
        + (", te_general_gemm bound to None (megatron-core 0.16 without TE)" if bound else ""),
        f"model: hidden {a.hidden}, {a.heads} heads / {a.kv_heads} KV heads x {a.head_dim}, "
        f"{a.layers} layers (layer 0 dense), {a.experts} experts top-{a.top_k}, moe_ffn "
        f"{a.moe_ffn}, vocab {a.vocab}; {m} microbatches x {b} x {s} tokens, full recompute; "
        f"build {build_s:.1f} s",
        f"sidecar: {len(blob)} bytes for {rows} (token, MoE layer) rows "
        f"({8 * len(blob) / rows:.2f} bits/row), encoded in {encode_s:.2f} s; "
        f"prefetch {a.prefetch}",
        "",
        f"routing agreement with the record after router perturbation {a.perturb:g}: "
        f"without replay {agree_own:.4f}, with replay {agree_replay:.4f}",
        "router grad norms (replayed step): " + ", ".join(f"{x:.3g}" for x in grads),
        "",
        f"{'condition':<20}{'fwd+bwd ms':>11}{'vs plain':>9}{'syncs':>7}{'read-backs':>11}"
        f"{'blocked ms':>11}{'mb wait':>10}{'select ms':>10}{'load ms':>9}{'block %':>8}"
        f"{'peak GiB':>9}",
    ]
    for c in conds:
        med = statistics.median(times[c])
        n_cuda, n_rb = syncs[c]
        line = (f"{c:<20}{med * 1e3:>11.1f}{med / base:>9.4f}"
                f"{'-' if n_cuda is None else n_cuda:>7}{n_rb:>11}")
        if stats[c]:
            wait = statistics.median(x.wait_seconds for x, _ in stats[c])
            sel = statistics.median(x.select_seconds for x, _ in stats[c])
            load = statistics.median(x.load_seconds for x, _ in stats[c])
            later = statistics.median(w for _, ws in stats[c] for w in ws[1:])
            line += (f"{wait * 1e3:>11.2f}{later * 1e3:>10.3f}{sel * 1e3:>10.2f}"
                     f"{load * 1e3:>9.2f}{100 * (wait + sel) / med:>8.3f}")
        else:
            line += f"{'-':>11}{'-':>10}{'-':>10}{'-':>9}{'-':>8}"
        line += f"{statistics.median(peaks[c]) / 2**30:>9.2f}" if cuda else f"{'-':>9}"
        lines.append(line)
    lines += [
        "",
        f"median of {a.iters} interleaved iterations after a warm-up. syncs: synchronising "
        "CUDA calls in one step (torch.cuda.set_sync_debug_mode); read-backs: ops reading a "
        "tensor value back or with data-dependent shapes in one step (harness.syncs."
        "ReadBacks); blocked: microbatch() blocking the training thread per step (waiting "
        "for or doing a load, starting the copy); mb wait: ms it blocked per entry after the "
        "step's first (median); select: routers' replay selection per step; "
        "load: fetch + align + validate per step on the prefetch thread; block %: "
        "(blocked + select) / fwd+bwd.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true",
                    help="dry run on CPU with a tiny shape (the CPU shim, gloo, fp32)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (layer 0 dense)")
    ap.add_argument("--ffn", type=int, default=6144, help="dense layer 0's intermediate size")
    ap.add_argument("--moe-ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--perturb", type=float, default=0.02, help="router weight noise std")
    ap.add_argument("--te", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 on the GPU")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cpu:
        for k, v in dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=4, ffn=128,
                         moe_ffn=32, experts=8, top_k=2, vocab=256, seq=64, microbatches=4,
                         iters=2).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: run with --cpu for the dry run")
    from trainer_hooks.megatron.harness.parallel import ParallelSpec, free_port, init, teardown
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if a.cpu:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    else:
        torch.cuda.set_device(0)
    init(ParallelSpec(), 0, 1, backend="gloo" if a.cpu else "nccl")
    try:
        print("\n".join(bench(a)), flush=True)
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
