"""The replayer's share of a CPU training step on verl's data path (trainer_hooks.verl).

    PYTHONPATH=.venv/verl-0.9.1 .venv/bin/python benchmarks/verl_overhead.py
        [--batch 64] [--seq 2048] [--max-token-len 4096] [--hidden 256] [--experts 32]
        [--top-k 4] [--iters 3] [--no-recompute]

The batch is a verl ``DataProto`` as the agent loop leaves it: ``--batch`` samples padded to
``--seq`` columns (prompt left-padded, response right-padded, mixed lengths), ``uid``
shared by groups of 4 samples, ``routed_experts`` int16 ``[b, s, L_all, K]``. Each step
runs verl's own ``left_right_2_no_padding`` and dynamic-batch ``rearrange_micro_batches``
(``--max-token-len``), then megatron-core's ``forward_backward_func`` (world size 1, gloo,
a Qwen3-MoE-shaped GPTModel with random weights: 4 layers, 1 dense + 3 MoE, full
activation recompute unless --no-recompute) over verl's micro-batches, each one packed
row (THD order, block-diagonal causal mask). The routing replayed is the model's own,
recorded once in the first (warm-up) step, so expert loads are the model's.

Conditions, interleaved step by step (median of --iters after one warm-up):
- plain: verl's data path and the schedule, no replayer;
- replay (tensor path): the same with docs/verl.md's glue, ``VerlReplayer.step(data,
  micro_batches, indices)`` around the schedule and ``microbatch(batch, model)`` around
  the model call: ``from_verl`` reads the batch's int16 tensor into records (ids checked),
  maps verl's micro-batches, checks their tokens, and the routers replay.

The replayer's time per step, measured in the same run: ``step()`` entry (from_verl and
the replayer's step checks, on the training thread) + its blocking time inside the
schedule (``ReplayStats.blocking_seconds``: waiting for loads, the routers' selection) +
``step()`` exit. share = that / the replay step's wall time. "vs plain" is the end-to-end
ratio of the medians; it carries this shared machine's run-to-run noise.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.replay_overhead import bench_model  # noqa: E402  (the same model shape)


def verl_batch(a: argparse.Namespace, schema, vocab: int, rng: np.random.Generator):
    """A DataProto as verl's agent loop builds it (module doc); routing filled later."""
    from verl.protocol import DataProto
    b, s, half = a.batch, a.seq, a.seq // 2
    am = np.zeros((b, s), np.int64)
    ids = np.zeros((b, s), np.int64)
    resp = np.zeros((b, s - half), np.int64)
    for j in range(b):
        p, r = int(rng.integers(half // 2, half + 1)), int(rng.integers(half // 2, s - half + 1))
        am[j, half - p:half + r] = 1
        ids[j, half - p:half + r] = rng.integers(3, vocab, p + r)
        resp[j, :r] = 1
    uids = np.array([f"g{j // 4}" for j in range(b)], object)
    t = {k: torch.from_numpy(v) for k, v in dict(
        input_ids=ids, attention_mask=am, position_ids=np.clip(am.cumsum(-1) - 1, 0, None),
        responses=ids[:, half:], prompts=ids[:, :half], response_mask=resp,
        routed_experts=np.zeros((b, s, schema.num_hidden_layers, schema.top_k),
                                np.int16)).items()}
    return DataProto.from_dict(tensors=t, non_tensors={"uid": uids})


def packed(mb):
    """One packed row of a jagged micro-batch, block-diagonal causal mask, response rows."""
    ids = mb["input_ids"]
    off = ids.offsets()
    tok = ids.values().long()[None]
    n = tok.shape[1]
    seg = torch.repeat_interleave(torch.arange(len(off) - 1), off.diff())
    pos = (torch.arange(n) - off[:-1].long()[seg])[None]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) | (seg[:, None] != seg[None, :])
    resp = torch.zeros(n, dtype=torch.bool)
    for j, r in enumerate(mb["response_mask"].sum(-1).tolist()):
        resp[int(off[j + 1]) - r:int(off[j + 1])] = True
    return tok, pos, mask[None, None], resp


def bench(rank: int, a: argparse.Namespace) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    from trainer_hooks.megatron import MCORE_VERSION
    from trainer_hooks.verl import VERL_VERSION, VerlReplayer, sample_keys
    from trainer_hooks.verl.batch import from_verl

    hf, schema, model = bench_model(a)
    dp = verl_batch(a, schema, hf["vocab_size"], np.random.default_rng(0))
    keys = sample_keys(dp.non_tensor_batch["uid"])
    fb = get_forward_backward_func()
    rr = VerlReplayer([model], schema, mode="R3")
    moe = list(schema.moe_layer_ids)

    def step(replay: bool) -> dict[str, float]:
        td = left_right_2_no_padding(dp.to_tensordict())          # verl's worker, per step
        mbs, idx = rearrange_micro_batches(td, max_token_len=a.max_token_len)
        n_resp = float(td["response_mask"].sum())
        inside = [0.0]

        def fwd(it, chunk):
            mb = next(it)
            tok, pos, mask, resp = packed(mb)

            def call():
                return chunk(tok, pos, attention_mask=mask)
            if replay:
                with rr.microbatch(mb, chunk):
                    out = call()
            else:
                out = call()

            def loss(o):
                lp = torch.log_softmax(o[0, :-1].float(), -1).gather(-1, tok[0, 1:, None])[:, 0]
                return -(lp * resp[1:]).sum() / n_resp, {}
            return out, loss

        model.zero_grad(set_to_none=True)
        kw = dict(forward_step_func=fwd, data_iterator=iter(mbs), model=[model],
                  num_microbatches=len(mbs), seq_length=1, micro_batch_size=1,
                  forward_only=False)
        t0 = time.perf_counter()
        if not replay:
            fb(**kw)
            return {"wall": time.perf_counter() - t0, "mbs": len(mbs)}
        cm = rr.step(td, mbs, idx, forward_only=False)
        st = cm.__enter__()
        t1 = time.perf_counter()
        try:
            fb(**kw)
        finally:
            t2 = time.perf_counter()
            cm.__exit__(None, None, None)
        t3 = time.perf_counter()
        blk = st.stats.blocking_seconds
        return {"wall": t3 - t0, "enter": t1 - t0, "blocking": blk, "exit": t3 - t2,
                "replayer": (t1 - t0) + blk + (t3 - t2), "mbs": len(mbs),
                "replayed": st.stats.as_metrics()["routereplay/replayed_fraction"]}

    # the routing to replay: the model's own, recorded once (a source-less step: every
    # row takes the own top-k) into routed_experts as verl lays it out (the engine's N-1
    # rows after the left padding, the last real row a zero placeholder)
    routed, am = dp.batch["routed_experts"], dp.batch["attention_mask"]
    first, lens = am.argmax(-1), am.sum(-1)
    td0 = left_right_2_no_padding(dp.to_tensordict())
    mbs0, idx0 = rearrange_micro_batches(td0, max_token_len=a.max_token_len)
    vb = from_verl(td0, schema, mbs0, idx0, with_routing=False)

    def on_used(key, ci, li, tmap, used):
        for n in np.flatnonzero(tmap.sample >= 0):
            j = idx0[key][tmap.sample[n]]
            routed[j, int(first[j]) + int(tmap.position[n]), moe[li]] = used[n].to(torch.int16)

    def fwd0(it, chunk):
        k, mb = next(it)
        tok, pos, mask, _ = packed(mb)
        with rr.replayer.microbatch(k, chunk):
            out = chunk(tok, pos, attention_mask=mask)
        return out, lambda o: (o.float().mean(), {})
    rr.replayer.on_used = on_used
    with torch.no_grad(), rr.replayer.step(None, vb.microbatches):
        fb(forward_step_func=fwd0, data_iterator=iter(list(enumerate(mbs0))), model=[model],
           num_microbatches=len(mbs0), seq_length=1, micro_batch_size=1, forward_only=True)
    rr.replayer.on_used = None
    for j in range(a.batch):
        routed[j, int(first[j]) + int(lens[j]) - 1] = 0
    step(False)
    step(True)
    res: dict[str, list[dict[str, float]]] = {"plain": [], "replay (tensor path)": []}
    for _ in range(a.iters):
        res["plain"].append(step(False))
        res["replay (tensor path)"].append(step(True))

    def med(c, k):
        return statistics.median(x[k] for x in res[c])
    base = med("plain", "wall")
    tokens = int(lens.sum())
    print(f"verl {VERL_VERSION}, megatron-core {MCORE_VERSION}: hidden {a.hidden}, 4 layers (3 MoE, "
          f"{a.experts} experts, top-{a.top_k}), batch {a.batch} x {a.seq} columns "
          f"({tokens} real tokens, {len(keys)} samples, uid groups of 4), "
          f"{res['plain'][0]['mbs']} dynamic micro-batches (max_token_len "
          f"{a.max_token_len}), recompute {'full' if a.recompute else 'off'}; median of "
          f"{a.iters}")
    print(f"{'condition':<22}{'step s':>9}{'vs plain':>10}{'enter ms':>10}{'blocking ms':>13}"
          f"{'exit ms':>9}{'replayer ms':>13}{'share':>9}{'replayed':>10}")
    for c in res:
        line = f"{c:<22}{med(c, 'wall'):>9.2f}{med(c, 'wall') / base:>10.4f}"
        if c != "plain":
            line += (f"{med(c, 'enter') * 1e3:>10.1f}{med(c, 'blocking') * 1e3:>13.1f}"
                     f"{med(c, 'exit') * 1e3:>9.1f}{med(c, 'replayer') * 1e3:>13.1f}"
                     f"{med(c, 'replayer') / med(c, 'wall'):>9.4f}{med(c, 'replayed'):>10.4f}")
        print(line)
    print("enter: VerlReplayer.step() entry (from_verl: int16 tensor -> checked records, "
          "micro-batch map, token lists; RouterReplayer step checks); blocking: inside the "
          "schedule (load waits + routers' selection); share = replayer ms / step s of the "
          "same steps; target <= 0.01.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--max-token-len", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-recompute", dest="recompute", action="store_false")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from trainer_hooks.megatron.harness.parallel import ParallelSpec, launch
    launch(ParallelSpec(), bench, a)


if __name__ == "__main__":
    main()
