"""Subprocess checks of the replayer's framework-facing side at world size 1 (prints
``RESULT {json}``): tensor-native input, coexistence with megatron's native RouterReplay
API, routers rebuilt after set-up, R2, sample and token checks, metrics.

usage: python tests/mcore_trainer_checks.py MODEL_DIR SIDECAR

SIDECAR holds HF-recorded routing of 3 samples (rows from position 0, token ids stored).
Every model has perturbed routers, so the trainer's own routing differs from the records
and "the recorded experts were used" is a real check.
"""
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

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.moe.router_replay import (RouterReplay,  # noqa: E402
                                                         RouterReplayAction)

from routereplay import align  # noqa: E402
from routereplay.errors import AlignmentError, UnknownSampleError  # noqa: E402
from routereplay.sidecar import SidecarReader  # noqa: E402
from routereplay.source import InMemorySource, TokenRowSource  # noqa: E402
from trainer_hooks.megatron import Microbatch, ReplayStateError, RouterReplayer  # noqa: E402
from trainer_hooks.megatron.harness import qwen3_moe as conv  # noqa: E402

model_dir, sidecar = sys.argv[1], sys.argv[2]
hf = conv.load_hf_config(model_dir)
reader = SidecarReader(sidecar)
schema = reader.schema
records = list(reader.records())
full_sd = conv.hf_to_megatron_state_dict(conv.load_hf_checkpoint(model_dir), hf)
cfg = conv.transformer_config(hf)
L, K = schema.num_moe_layers, schema.top_k
res = {}


def build(clear=True, seed=5):
    """A model with the tiny checkpoint's weights and perturbed routers; ``clear=False``
    keeps the RouterReplay instances of models built before in megatron's global list."""
    if clear:
        m = build_chunks(hf, cfg, ParallelSpec())[0]
    else:
        m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False), vocab_size=hf["vocab_size"],
            max_sequence_length=4096, position_embedding_type="rope",
            rotary_base=conv.rotary_base(hf), parallel_output=False)
    load_sharded([m], full_sd, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, mod in m.named_modules():
            if n.endswith("mlp.router"):
                mod.weight.add_(torch.randn(mod.weight.shape, generator=g) * 0.5)
    return m


def routers(m):
    return [mod for n, mod in m.named_modules() if n.endswith("mlp.router")]


def tensors(recs, offsets, s):
    """bshd inputs with sample j at columns [offsets[j], offsets[j] + n): tokens,
    position ids, the 4-D mask (True = masked) and the 2-D padding mask."""
    b = len(recs)
    tokens = torch.zeros((b, s), dtype=torch.long)
    pos = torch.zeros((b, s), dtype=torch.long)
    pad = torch.zeros((b, s), dtype=torch.long)
    for j, (r, a) in enumerate(zip(recs, offsets)):
        n = len(r.token_ids)
        tokens[j, a:a + n] = torch.from_numpy(r.token_ids.astype(np.int64))
        pos[j, a:a + n] = torch.arange(n)
        pad[j, a:a + n] = 1
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None]
    keep = pad.bool()[:, None, :] & pad.bool()[:, :, None]
    mask = (causal | ~keep)[:, None]
    return tokens, pos, mask, pad


def used_by_router(m):
    """Forward hooks recording each router's routing map (bool [N, E]) per call."""
    seen = {i: [] for i in range(L)}
    hooks = [r.register_forward_hook(lambda mod, i, o, li=li: seen[li].append(o[1].detach()))
             for li, r in enumerate(routers(m))]
    return seen, hooks


def experts_of(routing_map):
    """bool [N, E] -> sorted expert ids int64 [N, K]."""
    return torch.sort(torch.topk(routing_map.float(), K, -1).indices, -1).values.numpy()


def want_rows(tmap, recs):
    """Sorted recorded ids [N, L, K] for the token map (-1 where no routing)."""
    out = np.full((tmap.num_rows, L, K), -1)
    for r in range(tmap.num_rows):
        j, p = tmap.sample[r], tmap.position[r]
        if j >= 0 and recs[j].start <= p < recs[j].start + recs[j].num_tokens:
            out[r] = np.sort(recs[j].expert_ids[p - recs[j].start].astype(np.int64), -1)
    return out


def replayed_ok(seen, tmap, recs, call=0):
    """Every row with routing selected exactly the recorded experts, in every layer."""
    want = want_rows(tmap, recs)
    have = want[..., 0] >= 0
    return all(bool((experts_of(seen[li][call])[have[:, li]] == want[have[:, li], li]).all())
               for li in range(L))


# -- tensor-native input: verl's bshd batch (left-padded prompt + right-padded response) ----
recs3 = records[:3]
s = max(len(r.token_ids) for r in recs3) + 6
offsets = [3, 0, 6]
tokens, pos, mask4, pad = tensors(recs3, offsets, s)
routed = torch.zeros((3, s, schema.num_hidden_layers, K), dtype=torch.int16)
for j, (r, a) in enumerate(zip(recs3, offsets)):
    routed[j, a:a + r.num_tokens][:, list(schema.moe_layer_ids)] = torch.from_numpy(
        r.expert_ids.astype(np.int16))
uids = [r.sample_id for r in recs3]
batch_src = InMemorySource.from_batch(routed, pad, uids, schema, input_ids=tokens)
mb = Microbatch.from_attention_mask(uids, pad, input_ids=tokens)
model = build()
rep = RouterReplayer(model, schema)
seen, hooks = used_by_router(model)
with rep.step(batch_src, {0: mb}) as st, torch.no_grad(), rep.microbatch(0, model):
    model(tokens, pos, attention_mask=mask4)
for h in hooks:
    h.remove()
tmap = align.token_map(mb.layout)
own_seen, hooks = used_by_router(model)
with torch.no_grad():
    model(tokens, pos, attention_mask=mask4)            # no step: the model's own routing
for h in hooks:
    h.remove()
res["batch"] = {"padding": mb.layout.padding, "offsets": list(mb.layout.offsets),
                "replayed": replayed_ok(seen, tmap, recs3),
                "own_differs": not replayed_ok(own_seen, tmap, recs3),
                "metrics": st.stats.as_metrics(),
                "token_checked": st.stats.token_checked_samples}

# megatron-style per-layer lists (what RouterReplay.set_replay_data takes) for the same
# microbatch, replayed through the replayer
lists = []
rows = want_rows(tmap, recs3)
for li in range(L):
    x = np.full((tmap.num_rows, K), -1, np.int64)
    for r in range(tmap.num_rows):
        j, p = tmap.sample[r], tmap.position[r]
        if j >= 0 and p < recs3[j].num_tokens:
            x[r] = recs3[j].expert_ids[p, li]
    lists.append(torch.from_numpy(x))
row_src = TokenRowSource(schema)
row_src.add_layer_lists(uids, mb.layout, lists, list(range(L)), tokens=mb.tokens)
seen, hooks = used_by_router(model)
with rep.step(row_src, {0: mb}) as st, torch.no_grad(), rep.microbatch(0, model):
    model(tokens, pos, attention_mask=mask4)
for h in hooks:
    h.remove()
res["layer_lists"] = {"replayed": replayed_ok(seen, tmap, recs3),
                      "replayed_rows": st.stats.replayed_rows,
                      "fallback_rows": st.stats.fallback_rows}

# -- checks before any compute: unknown and duplicated sample ids -----------------------------
calls = []
hk = routers(model)[0].register_forward_hook(lambda *a: calls.append(1))
errs = {}
for name, mbs in (("unknown", {0: mb, 1: Microbatch(("nope", "nada"), align.Layout(
        lengths=(4, 0), seq_len=s))}),
                  ("duplicate", {0: mb, 1: Microbatch((uids[1],), align.Layout(
                      lengths=(5,), seq_len=s))})):
    try:
        with rep.step(reader, mbs), torch.no_grad():
            with rep.microbatch(0, model):
                model(tokens, pos, attention_mask=mask4)
        errs[name] = "accepted"
    except (UnknownSampleError, AlignmentError) as e:
        errs[name] = f"{type(e).__name__}: {e}"
hk.remove()
errs["router_calls"] = len(calls)
# trainer tokens that do not match the sidecar's: shifted by one column in row 1
bad_tokens = tokens.clone()
bad_tokens[1, 1:] = tokens[1, :-1]
try:
    with rep.step(reader, {0: Microbatch.from_attention_mask(uids, pad, input_ids=bad_tokens)}
                  ), torch.no_grad(), rep.microbatch(0, model):
        model(bad_tokens, pos, attention_mask=mask4)
    errs["tokens"] = "accepted"
except AlignmentError as e:
    errs["tokens"] = str(e)
res["errors"] = errs

# -- coexistence with megatron's native API: model B in the same process --------------------
model_b = build(clear=False, seed=9)
inst_a = [r.router_replay for r in routers(model)]
inst_b = [r.router_replay for r in routers(model_b)]
assert RouterReplay.global_router_replay_instances[-2 * L:] == inst_a + inst_b
n = tmap.num_rows
native = [torch.from_numpy((np.arange(n)[:, None] * 5 + np.arange(K) + li) % schema.num_experts)
          for li in range(L)]
# NOTE: set_replay_data takes one tensor per instance in megatron's global list
RouterReplay.set_replay_data(native + native)
RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
orig_cls = RouterReplay.__dict__["get_replay_topk"]
before = [(i.router_replay_action, i.target_topk_idx, len(i.replay_backward_list))
          for i in inst_a + inst_b]
want_native = [np.sort(t.numpy(), -1) for t in native]


def native_ok(m):
    seen, hooks = used_by_router(m)
    with torch.no_grad():
        m(tokens, pos, attention_mask=mask4)
    for h in hooks:
        h.remove()
    return all(bool((experts_of(seen[li][0]) == want_native[li]).all()) for li in range(L))


co = {"b_native_before": native_ok(model_b)}
seen, hooks = used_by_router(model)
with rep.step(batch_src, {0: mb}), torch.no_grad():
    co["class_untouched_in_step"] = RouterReplay.__dict__["get_replay_topk"] is orig_cls
    co["b_native_in_step"] = native_ok(model_b)
    with rep.microbatch(0, model):
        model(tokens, pos, attention_mask=mask4)
for h in hooks:
    h.remove()
co["a_replayed"] = replayed_ok(seen, tmap, recs3)
after = [(i.router_replay_action, i.target_topk_idx, len(i.replay_backward_list))
         for i in inst_a + inst_b]
co["state_restored"] = all(x[0] == y[0] and x[1] is y[1] and x[2] == y[2]
                           for x, y in zip(before, after))
co["actions_after"] = sorted({str(a[0]) for a in after})
co["b_native_after"] = native_ok(model_b)
co["a_native_after"] = native_ok(model)
co["no_instance_attr_left"] = not any("get_replay_topk" in i.__dict__ for i in inst_a)
RouterReplay.clear_global_router_replay_action()
RouterReplay.clear_global_indices()
res["coexist"] = co

# -- replay bound to routers no longer in the model (issue 16 item 1) ------------------------
rb = {}
fresh = build(clear=False, seed=11)
model.decoder = fresh.decoder                  # a freshly built decoder after set-up
seen, hooks = used_by_router(model)
with rep.step(batch_src, {0: mb}) as st, torch.no_grad(), rep.microbatch(0, model):
    model(tokens, pos, attention_mask=mask4)
for h in hooks:
    h.remove()
rb["rebuilt_before_step"] = {"replayed": replayed_ok(seen, tmap, recs3),
                             "replayed_rows": st.stats.replayed_rows}
other = build(clear=False, seed=13)
try:
    with rep.step(batch_src, {0: mb}), torch.no_grad():
        model.decoder = other.decoder          # rebuilt inside the step
        with rep.microbatch(0, model):
            model(tokens, pos, attention_mask=mask4)
    rb["rebuilt_in_step"] = "accepted"
except ReplayStateError as e:
    rb["rebuilt_in_step"] = str(e)
res["rebuilt"] = rb

# -- R2: record the trainer's own routing in the old-log-prob pass, replay it in the update --
model = build(seed=17)
rep = RouterReplayer(model, schema)
seen_rec, hooks = used_by_router(model)
with rep.step(None, {0: mb}, record=True) as r2, torch.no_grad(), rep.microbatch(0, model):
    model(tokens, pos, attention_mask=mask4)
for h in hooks:
    h.remove()
own = {li: experts_of(seen_rec[li][0]) for li in range(L)}
r2_src = r2.source()
# "update": the routers move (an optimizer step), and the microbatches are cut differently:
# one sample per microbatch, right-padded, with activation recompute in backward
with torch.no_grad():
    for r in routers(model):
        r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)))
ok, recompute_ok, grads = True, True, []
mbs2, tens2 = {}, {}
for j, r in enumerate(recs3):
    n = len(r.token_ids)
    t2, p2, m2, pad2 = tensors([r], [0], n)
    mbs2[j] = Microbatch.from_attention_mask([r.sample_id], pad2, input_ids=t2)
    tens2[j] = (t2, p2, m2)
model.zero_grad(set_to_none=True)
seen, hooks = used_by_router(model)
with rep.step(r2_src, mbs2) as upd:
    for j in range(3):
        t2, p2, m2 = tens2[j]
        with rep.microbatch(j, model):
            out = model(t2, p2, attention_mask=m2)
        out.float().mean().backward()
for h in hooks:
    h.remove()
moved = 0
for j, r in enumerate(recs3):
    # row p of this microbatch is (sample j, position p); in the recording pass it was
    # router row c * 3 + j with c = offsets[j] + p
    n = len(r.token_ids)
    rec_rows = (offsets[j] + np.arange(n)) * 3 + j
    t2, p2, m2 = tens2[j]
    now, hooks = used_by_router(model)
    with torch.no_grad():
        model(t2, p2, attention_mask=m2)                # the moved routers' own routing
    for h in hooks:
        h.remove()
    for li in range(L):
        ok &= bool((experts_of(seen[li][j]) == own[li][rec_rows]).all())
        moved += int((experts_of(now[li][0]) != own[li][rec_rows]).any(-1).sum())
grads = [float(r.weight.grad.norm()) for r in routers(model)]
res["r2"] = {"replayed_own": ok, "own_rows_moved": moved, "recorded_rows": r2.stats.recorded_rows,
             "update_replayed_rows": upd.stats.replayed_rows,
             "update_fallback_rows": upd.stats.fallback_rows,
             "token_checked": upd.stats.token_checked_samples,
             "router_grads": grads, "samples": sorted(r2_src.sample_ids())}
try:
    r2.source()
    with rep.step(None, {0: mb}) as plain:
        pass
    plain.source()
    res["r2"]["not_recording"] = "accepted"
except ReplayStateError as e:
    res["r2"]["not_recording"] = str(e)
# a token mismatch against the R2 recording
t_bad = tens2[0][0].clone()
t_bad[0, 4] += 1
try:
    bad_mb = Microbatch.from_attention_mask([recs3[0].sample_id], torch.ones_like(t_bad),
                                            input_ids=t_bad)
    with rep.step(r2_src, {0: bad_mb}), torch.no_grad(), rep.microbatch(0, model):
        model(t_bad, tens2[0][1], attention_mask=tens2[0][2])
    res["r2"]["token_mismatch"] = "accepted"
except AlignmentError as e:
    res["r2"]["token_mismatch"] = str(e)
print("RESULT " + json.dumps(res, default=str), flush=True)
teardown()
