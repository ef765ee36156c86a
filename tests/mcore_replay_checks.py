"""Subprocess checks of RouterReplayer at world size 1 (prints ``RESULT {json}``).

usage: python tests/mcore_replay_checks.py MODEL_DIR SIDECAR

SIDECAR holds HF-recorded routing whose rows start at position 6 (prompt rows 0..5 have
no routing). Scenarios, each on real megatron-core with the tiny model's weights:

- fallback "own": with perturbed routers, covered rows take the recorded experts, rows
  without routing take exactly the perturbed model's own top-k; no duplicate ids.
- fallback "dummy": rows without routing get distinct dummy ids.
- capacity factor 0.5: token dropping runs after replay, so experts downstream receive a
  subset of the replayed ids (counted in ReplayStats.dropped_assignments).
- refused configs: fused router, sinkhorn, replay disabled.
- bad ids in the source and a model call outside microbatch(): clear errors.
- MTP: the MTP layer's router keeps its own routing (never fed backbone routes).
"""
import dataclasses
import json
import os
import sys

import numpy as np
import torch

from trainer_hooks.megatron.harness.parallel import (ParallelSpec, build_chunks, free_port,
                                                     init, load_sharded, teardown)

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(free_port()))
init(ParallelSpec(), 0, 1)

from routereplay import align  # noqa: E402
from routereplay.errors import AlignmentError, RecordError, SchemaError  # noqa: E402
from routereplay.sidecar import SidecarReader  # noqa: E402
from trainer_hooks.megatron import RouterReplayer, check_config  # noqa: E402
from trainer_hooks.megatron.harness import qwen3_moe as conv  # noqa: E402
from trainer_hooks.megatron.harness.plan import batch_tensors, plan_microbatches  # noqa: E402

model_dir, sidecar = sys.argv[1], sys.argv[2]
hf = conv.load_hf_config(model_dir)
reader = SidecarReader(sidecar)
schema = reader.schema
records = list(reader.records())
full_sd = conv.hf_to_megatron_state_dict(conv.load_hf_checkpoint(model_dir), hf)
spec = ParallelSpec()
res = {}


def build(**over):
    cfg = conv.transformer_config(hf, **over)
    chunks = build_chunks(hf, cfg, spec)
    load_sharded(chunks, full_sd, cfg)
    return cfg, chunks[0]


def perturb(model, eps=0.5, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, m in model.named_modules():
            if n.endswith("mlp.router"):
                m.weight.add_(torch.randn(m.weight.shape, generator=g) * eps)


bplan = plan_microbatches(records, spec, 0, len(records), "right")
plan, s = bplan.microbatches[0], bplan.seq_len
t = batch_tensors(plan, s)
mb = {0: plan.microbatch()}


def forward(model, rep, source, *, grad=False):
    """One microbatch through ``model`` with replay from ``source``: returns used ids
    int64 [b, s, L, k] (the ids the routers selected) and router output maps
    bool [b, s, L, E]."""
    used, maps = {}, {}
    rep.on_used = lambda key, ci, li, tm, idx: used.__setitem__(li, idx.numpy())
    routers = [r for r, _ in rep.layers[0]]
    hooks = [r.register_forward_hook(lambda mod, i, o, li=li: maps.__setitem__(li, o[1].numpy()))
             for li, r in enumerate(routers)]
    try:
        with rep.step(source, mb), torch.set_grad_enabled(grad), rep.microbatch(0, model):
            model(t.tokens, t.position_ids, attention_mask=t.attention_mask)
    finally:
        for h in hooks:
            h.remove()
    b = t.tokens.shape[0]

    def bm(x):
        arr = np.stack([x[i] for i in range(len(routers))], 1)      # [s*b, L, .]
        return arr.reshape(s, b, len(routers), -1).transpose(1, 0, 2, 3)
    return bm(used), bm(maps), rep.stats


# -- fallback own / dummy --------------------------------------------------------------
cfg, model = build()
perturb(model)
rep = RouterReplayer(model, schema)
own, _, _ = forward(model, rep, None)
used, _, st = forward(model, rep, reader)
ok_cov, ok_fb, differs, fb_rows = True, True, 0, 0
for j, r in enumerate(records):
    cov = used[j, r.start:r.start + r.num_tokens]
    ok_cov &= bool((cov == r.expert_ids.astype(np.int64)).all())
    differs += int((np.sort(own[j, r.start:r.start + r.num_tokens], -1)
                    != np.sort(cov, -1)).any(-1).sum())
    # NOTE: positions before start precede every replayed row, so the model's own routing
    # there is the same as in the no-replay pass.
    ok_fb &= bool((used[j, :r.start] == own[j, :r.start]).all())
    fb_rows += r.start * schema.num_moe_layers
srt = np.sort(used, -1)
res["own"] = {"covered_equal": ok_cov, "fallback_equal_own": ok_fb,
              "covered_differs_from_own": differs, "fallback_rows_first": fb_rows,
              "stats_fallback_rows": st.fallback_rows, "stats_replayed_rows": st.replayed_rows,
              "duplicate_rows": int((srt[..., 1:] == srt[..., :-1]).any(-1).sum())}

rep_d = RouterReplayer(model, schema, fallback="dummy")
used_d, _, _ = forward(model, rep_d, reader)
r0 = records[0]
srt = np.sort(used_d, -1)
b = len(records)
k, e = schema.top_k, schema.num_experts
# the rows without routing take align.fill_dummy's ids for this microbatch, called as the
# replayer calls it (its sample ids, the routers' decoder layer ids; world size 1)
tm = align.token_map(mb[0].layout)
rows = np.full((tm.num_rows, 3, k), align.MISSING, np.int16)
for n, (j, p) in enumerate(zip(tm.sample, tm.position)):
    if j >= 0 and records[j].start <= p < records[j].start + records[j].num_tokens:
        rows[n] = records[j].expert_ids[p - records[j].start]
want = align.fill_dummy(rows, e, mb[0].sample_ids, [lid for _, lid in rep_d.layers[0]])
want = want.reshape(s, b, 3, k).transpose(1, 0, 2, 3)
dummy_ok = all((used_d[j, p, li] == want[j, p, li]).all()
               for j, r in enumerate(records) for p in range(r.start) for li in range(3))
res["dummy"] = {"fallback_rows_are_dummy": bool(dummy_ok),"covered_equal": bool((used_d[0, r0.start:r0.start + r0.num_tokens]
                                       == r0.expert_ids.astype(np.int64)).all()),
                "fallback_equal_own": bool((used_d[0, :r0.start] == own[0, :r0.start]).all()),
                "duplicate_rows": int((srt[..., 1:] == srt[..., :-1]).any(-1).sum())}

# -- capacity factor ---------------------------------------------------------------------
cfg, model = build(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
rep = RouterReplayer(model, schema)
used, maps, st = forward(model, rep, reader)
subset = True
for j, r in enumerate(records):
    for p in range(r.start, r.start + r.num_tokens):
        for li in range(schema.num_moe_layers):
            got = set(np.flatnonzero(maps[j, p, li]).tolist())
            subset &= got <= set(r.expert_ids[p - r.start, li].tolist())
res["capacity"] = {"dropped_assignments": st.dropped_assignments, "map_subset_of_replayed": subset,
                   "replayed_selected": bool(all((used[j, r.start:r.start + r.num_tokens]
                                                  == r.expert_ids.astype(np.int64)).all()
                                                 for j, r in enumerate(records)))}

# -- refused configs -----------------------------------------------------------------------
refused = {}
for name, over in (("fused", {"moe_router_fusion": True}),
                   ("sinkhorn", {"moe_router_load_balancing_type": "sinkhorn"}),
                   ("disabled", {"moe_enable_routing_replay": False})):
    c = conv.transformer_config(hf, **over) if name != "fused" else None
    if c is None:                     # TE-only flag: set after construction
        c = conv.transformer_config(hf)
        c.moe_router_fusion = True
    try:
        check_config(c, schema)
        refused[name] = "accepted"
    except SchemaError as e:
        refused[name] = str(e)
res["refused"] = refused

# -- bad ids, call outside microbatch --------------------------------------------------------
cfg, model = build()
rep = RouterReplayer(model, schema)
bad_ids = records[1].expert_ids.copy()
bad_ids[4, 2, 1] = bad_ids[4, 2, 0]
bad = {r.sample_id: r for r in records}
bad[records[1].sample_id] = dataclasses.replace(records[1], expert_ids=bad_ids)
try:
    forward(model, rep, bad)
    res["bad_ids"] = "accepted"
except RecordError as e:       # the in-memory source checks ids when it takes them
    res["bad_ids"] = str(e)
try:
    with rep.step(reader, mb), torch.no_grad():
        model(t.tokens, t.position_ids, attention_mask=t.attention_mask)
    res["outside"] = "accepted"
except AlignmentError as e:
    res["outside"] = str(e)

# -- misuse: nested microbatch(); a model call after a backward whose first layer's input
# needed no grad (frozen embeddings: no end tag fires) must still be refused
try:
    with rep.step(reader, mb), torch.no_grad(), rep.microbatch(0, model), rep.microbatch(0, model):
        pass
    res["nested"] = "accepted"
except RuntimeError as e:
    res["nested"] = str(e)
model.embedding.word_embeddings.weight.requires_grad_(False)
try:
    with rep.step(reader, mb):
        with rep.microbatch(0, model):
            out = model(t.tokens, t.position_ids, attention_mask=t.attention_mask)
        out.float().mean().backward()
        res["held_after_backward"] = len(rep.held)
        model(t.tokens, t.position_ids, attention_mask=t.attention_mask)
    res["after_backward_outside"] = "accepted"
except AlignmentError as e:
    res["after_backward_outside"] = str(e)
res["held_after_step"] = len(rep.held)

# -- errors of prefetched microbatches: raised when that microbatch is entered, naming it ---
# (sample ids are checked at step entry; a token mismatch is found while loading)
from trainer_hooks.megatron import Microbatch  # noqa: E402
cfg, model = build()
one_each = plan_microbatches(records, spec, 0, 1, "right")
m0, m1 = one_each.microbatches
t0 = batch_tensors(m0, one_each.seq_len)
bad_tokens = m1.records[0].token_ids.copy()
bad_tokens[3] += 1
bad_batch = np.zeros((1, m1.layout.seq_len), np.int64)     # right padding: row from column 0
bad_batch[0, :len(bad_tokens)] = bad_tokens
bad_mbs = {0: m0.microbatch(), 1: Microbatch(sample_ids=m1.sample_ids, layout=m1.layout,
                                             tokens=bad_batch)}
res["prefetch_errors"] = {}
for ahead in (0, 2):
    rp = RouterReplayer(model, schema, prefetch=ahead)
    entered = []
    try:
        with rp.step(reader, bad_mbs), torch.no_grad():
            for k in (0, 1):
                with rp.microbatch(k, model):
                    entered.append(k)
                    model(t0.tokens, t0.position_ids, attention_mask=t0.attention_mask)
        res["prefetch_errors"][ahead] = {"entered": entered, "error": "none"}
    except AlignmentError as e:
        res["prefetch_errors"][ahead] = {"entered": entered, "error": str(e),
                                         "prefetched": rp.stats.prefetched}

# -- host-device read-backs: a plain training step against a replayed one -------------------
import collections  # noqa: E402
import contextlib  # noqa: E402

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from trainer_hooks.megatron.harness.parallel import config_overrides  # noqa: E402
from trainer_hooks.megatron.harness.syncs import ReadBacks  # noqa: E402

cfg, model = build(**config_overrides(spec, True))       # full activation recompute
rep = RouterReplayer(model, schema)
one = plan_microbatches(records, spec, 0, 1, "right")     # 2 microbatches of 1 sample
tens = [batch_tensors(m, one.seq_len) for m in one.microbatches]
fb = get_forward_backward_func()


def train_step(replay: bool) -> collections.Counter:
    def fwd(it, chunk):
        k = next(it)
        x = tens[k]
        with rep.microbatch(k, chunk) if replay else contextlib.nullcontext():
            out = chunk(x.tokens, x.position_ids, attention_mask=x.attention_mask)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})
    model.zero_grad(set_to_none=True)
    kw = dict(forward_step_func=fwd, data_iterator=iter(range(2)), model=[model],
              num_microbatches=2, seq_length=one.seq_len, micro_batch_size=1,
              forward_only=False)
    mode = ReadBacks()
    with rep.step(reader, [m.microbatch() for m in one.microbatches]) if replay \
            else contextlib.nullcontext(), mode:
        fb(**kw)
    return mode.counts


train_step(False)                                         # warm-up
plain, replayed = train_step(False), train_step(True)
grads = [float(r.weight.grad.norm()) for r, _ in rep.layers[0]]
res["readbacks"] = {"plain": dict(plain), "replay": dict(replayed),
                    "replayed_rows": rep.stats.replayed_rows,
                    "fallback_rows": rep.stats.fallback_rows, "router_grads": grads}

# -- MTP -------------------------------------------------------------------------------------
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,  # noqa: E402
                                                      get_gpt_mtp_block_spec)
from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: E402
RouterReplay.clear_global_router_replay_instances()
cfg = conv.transformer_config(hf, mtp_num_layers=1)
blk = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
mtp_model = GPTModel(config=cfg, transformer_layer_spec=blk, vocab_size=hf["vocab_size"],
                     max_sequence_length=256, position_embedding_type="rope",
                     rotary_base=conv.rotary_base(hf), parallel_output=False,
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, blk.layer_specs[-1],
                                                           use_transformer_engine=False))
rep = RouterReplayer(mtp_model, schema)
mtp_router = rep.mtp_routers[0]
seen = {}


def mtp_hook(mod, inp, out):
    logits = mod.gating(inp[0]).view(-1, schema.num_experts)
    own_idx = torch.topk(logits, schema.top_k, dim=-1).indices
    want = torch.zeros_like(out[1]).scatter(1, own_idx, True)
    seen["own_equal"] = bool((want == out[1]).all())
    seen["rows"] = int(out[1].shape[0])


h = mtp_router.register_forward_hook(mtp_hook)
with rep.step(reader, mb), torch.no_grad(), rep.microbatch(0, mtp_model):
    mtp_model(t.tokens, t.position_ids, attention_mask=t.attention_mask, labels=t.tokens)
h.remove()
res["mtp"] = {"num_mtp_routers": len(rep.mtp_routers),
              "backbone_layers": [lid for _, lid in rep.layers[0]],
              "mtp_layer_number": int(mtp_router.layer_number), **seen}
print("RESULT " + json.dumps(res), flush=True)
teardown()
