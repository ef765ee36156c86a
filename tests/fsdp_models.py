"""Tiny transformers MoE models of each family trainer_hooks.fsdp supports, their routing
schemas, and crafted records of a perturbed copy's own routing (tests only)."""
from __future__ import annotations

import numpy as np
import torch

from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema

E, K, L = 8, 2, 3
_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny(family: str, seed: int = 0):
    """(model float32 in train mode, schema) of a random tiny ``family`` model."""
    import transformers as T
    torch.manual_seed(seed)
    dense = ()
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(**_COMMON, moe_intermediate_size=16, num_experts=E,
                               num_experts_per_tok=K, head_dim=8, norm_topk_prob=True)
        m = T.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(**_COMMON, moe_intermediate_size=16, num_experts=E,
                               num_experts_per_tok=K, shared_expert_intermediate_size=16)
        m = T.Qwen2MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = T.MixtralConfig(**_COMMON, num_local_experts=E, num_experts_per_tok=K)
        m = T.MixtralForCausalLM(cfg)
    elif family == "qwen3_next":                 # linear attention on layers 0 and 2
        cfg = T.Qwen3NextConfig(**_COMMON, head_dim=8, num_experts=E, num_experts_per_tok=K,
                                moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                linear_num_value_heads=4, linear_num_key_heads=2,
                                linear_key_head_dim=8, linear_value_head_dim=8,
                                layer_types=["linear_attention", "full_attention",
                                             "linear_attention"])
        m = T.Qwen3NextForCausalLM(cfg)
    elif family == "gpt_oss":
        kw = dict(_COMMON, intermediate_size=16)
        cfg = T.GptOssConfig(**kw, head_dim=8, num_local_experts=E, num_experts_per_tok=K,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"], sliding_window=8)
        m = T.GptOssForCausalLM(cfg)
    elif family in ("deepseek_v3", "glm4_moe"):
        kw = dict(_COMMON, moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=K,
                  n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                  norm_topk_prob=True, routed_scaling_factor=2.5)
        if family == "deepseek_v3":
            kw["num_key_value_heads"] = kw["num_attention_heads"]   # MLA: no GQA
            cfg = T.DeepseekV3Config(**kw, q_lora_rank=None, kv_lora_rank=16,
                                     qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4)
            m = T.DeepseekV3ForCausalLM(cfg)
        else:
            cfg = T.Glm4MoeConfig(**kw, head_dim=8)
            m = T.Glm4MoeForCausalLM(cfg)
        dense = (0,)
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for mod in m.modules():
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.1)
    else:
        raise ValueError(family)
    with torch.no_grad():                       # a spread of router scores, not ties
        for n, p in m.named_parameters():
            if n.endswith(("gate.weight", "router.weight")) and p.shape[0] == E:
                p.normal_(0, 1.0)
    m.float().train()
    moe = tuple(i for i in range(L) if i not in dense)
    return m, RoutingSchema(num_hidden_layers=L, moe_layer_ids=moe, top_k=K, num_experts=E,
                            score_function="sigmoid" if dense else "softmax")


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen3_next",
            "gpt_oss")


def routers(model):
    from trainer_hooks.fsdp.routers import find_routers
    return [r for r, _ in find_routers(model)]


def capture(model):
    """Forward hooks on every router appending its top-k ids (int64 [N, K]) per call;
    returns (calls list, remove())."""
    calls: list[torch.Tensor] = []
    hs = [r.register_forward_hook(lambda mod, a, out: calls.append(out[2].detach().clone()))
          for r in routers(model)]
    return calls, lambda: [h.remove() for h in hs]


def capture_layers(model):
    """Like :func:`capture`, one list per router (layer order): the calls of a layer in
    order (forward, then its recompute in backward). Returns (lists, remove())."""
    per = [[] for _ in routers(model)]
    hs = [r.register_forward_hook(lambda mod, a, out, i=i: per[i].append(out[2].detach().clone()))
          for i, r in enumerate(routers(model))]
    return per, lambda: [h.remove() for h in hs]


def perturbed_records(model, seqs, seed=1, scale=1.0):
    """RoutingRecords of a router-perturbed copy's own routing for each token sequence
    (rows 0 .. n-2, as an engine records), with token ids. Returns {sample_id: record}."""
    import copy
    other = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(other):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * scale)
    out = {}
    for i, s in enumerate(seqs):
        calls, rm = capture(other)
        with torch.no_grad():
            other(torch.as_tensor(s)[None])
        rm()
        ids = torch.stack(calls, 1).numpy()               # [n, L_moe, K]
        n = len(s)
        out[f"s{i}"] = RoutingRecord(f"s{i}", ids[:n - 1].astype(np.uint8), start=0,
                                     prompt_len=n // 2, token_ids=np.asarray(s, np.int32))
    return out


# -- world size 2 on gloo with fully_shard (one launch: python -m tests.fsdp_models) --------
def padded(seqs, sides, s=14):
    """input_ids / attention_mask int64 [b, s], each row padded on its side ('left',
    'right' or 'mixed': 2 pad columns in front, the rest behind)."""
    ids = np.zeros((len(seqs), s), np.int64)
    mask = np.zeros((len(seqs), s), np.int64)
    for j, (q, side) in enumerate(zip(seqs, sides)):
        a = {"left": s - len(q), "right": 0, "mixed": 2}[side]
        ids[j, a:a + len(q)] = q
        mask[j, a:a + len(q)] = 1
    return ids, mask


def dist_seqs():
    """The 8 token sequences of the world-size-2 run (4 per rank)."""
    rng = np.random.default_rng(11)
    return [rng.integers(3, 120, n) for n in (9, 12, 7, 11, 10, 8, 13, 6)]


def _agreement(calls, tmaps, recs, sids):
    """Share of (row, layer, k) of rows with recorded routing whose used id equals the
    record's; and the rows compared."""
    same = total = 0
    for used, (tm, ids) in zip(calls, zip(tmaps, sids)):
        for r, (j, p) in enumerate(zip(tm.sample, tm.position)):
            if j < 0:
                continue
            rec = recs[ids[j]]
            if p - rec.start >= rec.num_tokens:
                continue
            same += int((used[r] == torch.as_tensor(rec.expert_ids[p - rec.start]).long()).sum())
            total += used[r].numel()
    return (same / total if total else float("nan")), total


def _worker(rank, world, port, sidecar, out):
    import json
    import os
    import sys

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from routereplay.sidecar import SidecarReader
    from trainer_hooks.fsdp import FSDPReplayer, Microbatch
    from trainer_hooks.fsdp.replayer import hf_token_map, ulysses_layout
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    res: dict = {}
    seqs = dist_seqs()
    with SidecarReader(sidecar) as rd:
        recs = {r.sample_id: r for r in rd.records()}
    mine = [f"s{i}" for i in range(4 * rank, 4 * rank + 4)]
    q = [seqs[int(s[1:])] for s in mine]
    # microbatch 0: padded (mixed sides), microbatch 1: packed with position_ids
    ids0, m0 = padded(q[:2], ["left", "mixed"])
    flat = np.concatenate(q[2:])
    pos = np.concatenate([np.arange(len(x)) for x in q[2:]])
    from routereplay.align import Layout
    cu = (0, len(q[2]), len(q[2]) + len(q[3]))
    mbs = {0: Microbatch.from_attention_mask(mine[:2], m0, input_ids=ids0),
           1: Microbatch(mine[2:], Layout(lengths=[len(q[2]), len(q[3])],
                                          cu_seqlens_padded=cu), tokens=[q[2], q[3]])}
    # NOTE: use_cache=False as verl's FSDP actor passes (a cache would grow in a recompute)
    inputs = {0: dict(input_ids=torch.as_tensor(ids0), attention_mask=torch.as_tensor(m0),
                      use_cache=False),
              1: dict(input_ids=torch.as_tensor(flat)[None], use_cache=False,
                      position_ids=torch.as_tensor(pos)[None])}
    masks = {0: torch.as_tensor(m0).float(), 1: torch.ones(1, len(flat))}

    def build(ckpt):
        model, schema = tiny("qwen3_moe")
        if ckpt == "hf_non_reentrant":                 # verl's FSDP workers' way
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        elif ckpt == "reentrant":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)
            layers = model.model.layers
            for i in range(len(layers)):
                layers[i] = checkpoint_wrapper(layers[i],
                                               checkpoint_impl=CheckpointImpl.REENTRANT)
            model.model.embed_tokens.register_forward_hook(
                lambda m, a, o: o.requires_grad_(True))   # reentrant needs a grad input
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, schema

    def train(model, rep, source, mb_map):
        calls, rm = capture_layers(model)
        with rep.step(source, mb_map) as st:
            for k in mb_map:
                with rep.microbatch(k):
                    logits = model(**inputs[k]).logits
                (logits.float().logsumexp(-1) * masks[k]).sum().backward()   # accumulates
        rm()
        return st, calls

    tmaps = [hf_token_map(mbs[k].layout) for k in (0, 1)]
    for ckpt in ("hf_non_reentrant", "reentrant"):
        model, schema = build(ckpt)
        rep = FSDPReplayer(model, schema)
        with SidecarReader(sidecar) as rd:
            st, calls = train(model, rep, rd, mbs)
        # per layer: microbatch 0's forward and recompute, then microbatch 1's
        first = [torch.stack([c[0] for c in calls], 1), torch.stack([c[2] for c in calls], 1)]
        again = [torch.stack([c[1] for c in calls], 1), torch.stack([c[3] for c in calls], 1)]
        agree, rows = _agreement(first, tmaps, recs, [mbs[0].sample_ids, mbs[1].sample_ids])
        grads = [float(r.weight.grad.full_tensor().norm()) for r in routers(model)]
        res[ckpt] = dict(
            calls=[len(c) for c in calls], agreement=agree, compared=rows,
            recompute_equal=all(torch.equal(a, b) for a, b in zip(first, again)),
            router_grads=grads, stats=st.stats.as_metrics(),
            bytes_decoded=st.stats.bytes_decoded,
            own_bytes=sum(recs[s].expert_ids.nbytes for s in mine),
            all_bytes=sum(r.expert_ids.nbytes for r in recs.values()),
            patched_left=any("forward" in r.__dict__ for r in routers(model)))
        if ckpt == "hf_non_reentrant":
            # the same replayed step on an unsharded copy, grads averaged over the ranks
            ref, _ = tiny("qwen3_moe")
            ref.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            rep_ref = FSDPReplayer(ref, schema)
            with SidecarReader(sidecar) as rd:
                train(ref, rep_ref, rd, mbs)
            diffs = []
            for a, b in zip(routers(ref), routers(model)):
                g = a.weight.grad.clone()
                dist.all_reduce(g)
                g /= world
                diffs.append(float((g - b.weight.grad.full_tensor()).abs().max()))
            res["grad_vs_unsharded_max_abs"] = max(diffs)
            # host-device read-backs: a plain step against a replayed one (same model)
            from trainer_hooks.megatron.harness.syncs import ReadBacks
            import contextlib
            counts = {}
            for mode in ("plain", "replay", "replay2"):
                model.zero_grad(set_to_none=True)
                rb = ReadBacks()
                with SidecarReader(sidecar) as rd:
                    ctx = rep.step(rd, mbs) if mode != "plain" else contextlib.nullcontext()
                    with ctx, rb:
                        for k in mbs:
                            with rep.microbatch(k) if mode != "plain" else \
                                    contextlib.nullcontext():
                                logits = model(**inputs[k]).logits
                            (logits.float().logsumexp(-1) * masks[k]).sum().backward()
                counts[mode] = dict(rb.counts)
            res["readbacks"] = counts
            # R2: record the trainer's own routing in a no-grad pass, move the policy,
            # replay the recording in the update
            with torch.no_grad():
                calls, rm = capture(model)
                with rep.step(None, mbs, record=True) as st_r:
                    for k in mbs:
                        with rep.microbatch(k):
                            model(**inputs[k])
                rm()
                rec_first = [torch.stack(calls[0:3], 1), torch.stack(calls[3:6], 1)]
                for r in routers(model):
                    r.weight.mul_(-1.0)
            model.zero_grad(set_to_none=True)
            st2, calls = train(model, rep, st_r.source(), mbs)
            used = [torch.stack([c[0] for c in calls], 1), torch.stack([c[2] for c in calls], 1)]
            real = [torch.as_tensor(t.sample >= 0) for t in tmaps]
            res["r2"] = dict(
                equal=all(torch.equal(a[m], b[m]) for a, b, m in zip(rec_first, used, real)),
                recorded_rows=st_r.stats.recorded_rows, replayed_rows=st2.stats.replayed_rows,
                fallback_rows=st2.stats.fallback_rows)
            # Ulysses: both ranks hold slices of one packed microbatch (rank 0's samples),
            # split by verl's own ulysses_pad_and_slice_inputs
            sys.path.append(os.path.join(os.path.dirname(os.path.dirname(
                os.path.abspath(__file__))), ".venv", "verl-0.9.1"))
            try:
                from verl.utils import ulysses as U
                U.set_ulysses_sequence_parallel_group(dist.group.WORLD)
                sq = [seqs[i] for i in range(4)]
                full = torch.as_tensor(np.concatenate(sq))[None]
                fpos = torch.as_tensor(np.concatenate([np.arange(len(x)) for x in sq]))[None]
                x, p, pad = U.ulysses_pad_and_slice_inputs(full, fpos, sp_size=world)
                lay = ulysses_layout([len(x_) for x_ in sq], world)
                mb = Microbatch([f"s{i}" for i in range(4)], lay,
                                tokens=[np.asarray(x_) for x_ in sq])
                rep_u = FSDPReplayer(model, schema, ulysses=(rank, world))
                calls, rm = capture(model)
                with torch.no_grad(), SidecarReader(sidecar) as rd, \
                        rep_u.step(rd, {0: mb}) as st_u:
                    with rep_u.microbatch(0):
                        # NOTE: attention runs on the slice alone (verl's all-to-all needs
                        # flash attention); the routers see exactly the rank's slice rows
                        model(input_ids=x, position_ids=p)
                rm()
                tm = hf_token_map(lay, (rank, world))
                agree_u, rows_u = _agreement([torch.stack(calls, 1)], [tm], recs,
                                             [mb.sample_ids])
                res["ulysses"] = dict(agreement=agree_u, compared=rows_u, rows=int(x.shape[1]),
                                      pad=int(pad), tmap_rows=tm.num_rows,
                                      tokens_match=bool(torch.equal(
                                          x[0][torch.as_tensor(tm.sample >= 0)],
                                          full[0][rank * x.shape[1]:][
                                              :int((tm.sample >= 0).sum())])),
                                      fallback=st_u.stats.fallback_rows)
            except ImportError as e:
                res["ulysses"] = {"error": f"verl not importable: {e}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def write_dist_sidecar(path):
    """The records of the world-size-2 run (a router-perturbed copy's routing of
    :func:`dist_seqs`), written as a sidecar at ``path``."""
    from routereplay.sidecar import write_records
    model, schema = tiny("qwen3_moe")
    recs = perturbed_records(model, dist_seqs())
    write_records(str(path), schema, list(recs.values()))


if __name__ == "__main__":
    import socket
    import sys

    import torch.multiprocessing as mp
    sidecar, out = sys.argv[1], sys.argv[2]
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    mp.spawn(_worker, args=(2, port, sidecar, out), nprocs=2, join=True)
