"""Subprocess checks: verl 0.9.1's own router replay against trainer_hooks.verl, on the same
verl batches, on the tiny Qwen3-MoE in megatron-core (CPU, gloo, world size 1, full
activation recompute, perturbed routers). Prints ``RESULT {json}``.

usage: python tests/verl_checks.py MODEL_DIR    (verl importable: PYTHONPATH=.venv/verl-0.9.1)

Batches are verl ``DataProto``s as the agent loop builds them (n samples per uid, prompts
left-padded, responses right-padded, ``routed_experts`` int16 [b, s, L_all, K] with the
engine's N-1 rows after the left padding and a zero last row), converted by verl's
``left_right_2_no_padding`` and cut by verl's ``rearrange_micro_batches`` (dynamic batch
size, which reorders samples). verl's side runs the replay lines of its
``MegatronEngine.forward_step`` (transformer_impl.py, verl 0.9.1) with its own
``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data``,
``set_model_router_replay_action`` and its ``apply_router_replay_patch()``; routereplay's
side the glue of docs/verl.md. THD runs here as one packed row with a block-diagonal
causal mask (megatron's local attention has no ``PackedSeqParams`` on CPU); the routers
see the THD token order.

CPU substitutions (here only, never in the product): ``router_replay_utils.device_name``
is "cpu" (verl picks "cuda" when no accelerator is found).
"""
import functools
import json
import os
import sys

import numpy as np
import torch

from trainer_hooks.megatron.harness.parallel import (ParallelSpec, build_chunks, config_overrides,
                                                     free_port, init, load_sharded)

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(free_port()))
init(ParallelSpec(), 0, 1)

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils.megatron import router_replay_utils as rru  # noqa: E402
from verl.utils.megatron.router_replay_patch import (RouterReplay, RouterReplayAction,  # noqa: E402
                                                     apply_router_replay_patch)
from verl.utils.seqlen_balancing import rearrange_micro_batches, restore_dynamic_batch  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from routereplay.errors import AlignmentError  # noqa: E402
from routereplay.memory_source import InMemorySource  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from trainer_hooks.megatron.harness import qwen3_moe as conv  # noqa: E402
from trainer_hooks.verl import VerlReplayer  # noqa: E402

rru.device_name = "cpu"                 # CPU substitution (module doc)
apply_router_replay_patch()             # verl's patch, before the model is built

model_dir = sys.argv[1]
hf = conv.load_hf_config(model_dir)
schema = RoutingSchema.from_hf_config(hf)
cfg = conv.transformer_config(hf, **config_overrides(ParallelSpec(), recompute=True))
model = build_chunks(hf, cfg, ParallelSpec())[0]
load_sharded([model], conv.hf_to_megatron_state_dict(conv.load_hf_checkpoint(model_dir), hf),
             cfg)
routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
assert all(type(r.router_replay).__module__.startswith("verl") for r in routers)
res = {"verl_patch_router_replay": type(routers[0].router_replay).__module__}


def perturb(seed, eps=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * eps)


perturb(5)
weights = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def reset():
    model.load_state_dict(weights, strict=False)


def make_batch(seed, n_prompts, n, P=12, R=10, empty=()):
    """A DataProto as verl's agent loop leaves it (module doc); samples in ``empty`` have
    no response token."""
    rng = np.random.default_rng(seed)
    b, s, L, K, E = n_prompts * n, P + R, schema.num_hidden_layers, schema.top_k, \
        schema.num_experts
    am = np.zeros((b, s), np.int64)
    ids = np.zeros((b, s), np.int64)
    routed = np.zeros((b, s, L, K), np.int16)
    resp_mask = np.zeros((b, R), np.int64)
    for j in range(b):
        p, r = int(rng.integers(2, P + 1)), int(rng.integers(1, R + 1))
        r = 0 if j in empty else r
        am[j, P - p:P + r] = 1
        ids[j, P - p:P + r] = rng.integers(3, hf["vocab_size"], p + r)
        resp_mask[j, :r] = 1
        rows = np.argsort(rng.random((p + r - 1, L, E)), -1)[..., :K]
        rows[:, [i for i in range(L) if i not in schema.moe_layer_ids]] = 0
        routed[j, P - p:P + r - 1] = rows                 # the engine's N-1 rows
    uids = np.array([f"p{seed}-{i}" for i in range(n_prompts) for _ in range(n)], object)
    t = {k: torch.from_numpy(v) for k, v in dict(
        input_ids=ids, attention_mask=am, position_ids=np.clip(am.cumsum(-1) - 1, 0, None),
        responses=ids[:, P:], prompts=ids[:, :P], response_mask=resp_mask,
        routed_experts=routed).items()}
    return DataProto.from_dict(tensors=t, non_tensors={"uid": uids}), routed, am


def packed(mb):
    """Model inputs of a jagged micro-batch: one packed row (THD order), block-diagonal
    causal mask; and where its response tokens are."""
    ids = mb["input_ids"]
    off = ids.offsets().tolist()
    tok = ids.values().long()[None]
    t = tok.shape[1]
    seg = torch.repeat_interleave(torch.arange(len(off) - 1), ids.offsets().diff())
    pos = (torch.arange(t) - ids.offsets()[:-1].long()[seg])[None]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    mask = causal | (seg[:, None] != seg[None, :])
    resp = torch.zeros(t, dtype=torch.bool)
    r = mb["response_mask"].sum(-1).tolist()
    for j in range(len(off) - 1):
        resp[off[j + 1] - r[j]:off[j + 1]] = True
    first = torch.zeros(t, dtype=torch.bool)
    first[off[:-1]] = True
    return tok, pos, mask[None, None], resp, first


class Capture:
    """Routing map of every router call (forward and recompute), in call order."""

    def __init__(self):
        self.calls = {i: [] for i in range(len(routers))}
        self.hooks = [r.register_forward_hook(functools.partial(self._hook, i))
                      for i, r in enumerate(routers)]

    def _hook(self, i, mod, inp, out):
        # NOTE: the activation-recompute forward runs inside autograd's backward
        self.calls[i].append((torch._C._current_graph_task_id() != -1, out[1].detach().clone()))

    def close(self):
        for h in self.hooks:
            h.remove()


def run(mbs, forward_step_body, train, n_resp):
    """megatron's forward_backward_func over ``mbs``; returns log-probs per micro-batch,
    the router calls and the gradients."""
    lps = {}
    cap = Capture()

    def forward_step(it, chunk):
        k, mb = next(it)
        tok, pos, mask, resp, first = packed(mb)
        out = forward_step_body(mb, chunk, lambda: chunk(tok, pos, attention_mask=mask))

        def loss_func(o):
            lp = torch.log_softmax(o[0, :-1].float(), -1).gather(-1, tok[0, 1:, None])[:, 0]
            lp = torch.nn.functional.pad(lp, (1, 0)).masked_fill(first, 0.0)
            lps[k] = lp.detach()
            loss = -(lp * resp).sum() / n_resp * len(mbs)
            return loss, {"loss": loss.detach()}
        return out, loss_func

    model.zero_grad(set_to_none=True)
    kw = dict(forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))),
              model=[model], num_microbatches=len(mbs), seq_length=1, micro_batch_size=1,
              forward_only=not train)
    try:
        with torch.set_grad_enabled(train):
            get_forward_backward_func()(**kw)
    finally:
        cap.close()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lps, cap.calls, grads


def verl_body(mode):
    """The replay lines of verl 0.9.1 MegatronEngine.forward_step, as they are."""
    def body(batch, chunk, call):
        if rru.RouterReplayHelper.is_replay_backward_action(cfg, 0, model=chunk):
            rru.set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_FORWARD)
        if rru.RouterReplayHelper.is_replay_forward_action(cfg, 0, model=chunk):
            layers_topk_idx = batch["routed_experts"]
            replay_mask = None
            if mode == "R3":
                layers_topk_idx = rru.align_r3_router_replay_data(layers_topk_idx,
                                                                  batch["input_ids"])
                replay_mask = rru.build_r3_replay_mask(batch["input_ids"], batch["response_mask"])
            rru.set_router_replay_data(layers_topk_idx, None, cfg, 0, replay_mask=replay_mask,
                                       model=chunk)
        out = call()
        if record_list is not None:
            rru.merge_router_topk_indices(None, batch["input_ids"], record_list, cfg, 0,
                                          model=chunk)
        if rru.RouterReplayHelper.is_replay_forward_action(cfg, 0, model=chunk):
            rru.set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_BACKWARD)
        return out
    return body


record_list = None


def verl_pass(mbs, mode, train, n_resp, record=False):
    global record_list
    RouterReplay.set_global_router_replay_action(
        RouterReplayAction.RECORD if record else RouterReplayAction.REPLAY_FORWARD)
    record_list = [] if record else None
    try:
        out = run(mbs, verl_body(mode), train, n_resp)
    finally:
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()
    rec, record_list = record_list, None
    return out, rec


def rr_body(rr):
    def body(batch, chunk, call):
        with rr.microbatch(batch, chunk):
            return call()
    return body


def rr_pass(rr, td, mbs, idx, train, n_resp, forward_only=None):
    with rr.step(td, mbs, idx, forward_only=not train if forward_only is None else
                 forward_only) as st:
        out = run(mbs, rr_body(rr), train, n_resp)
    return out, st.stats


def compare(a, b):
    """(router calls compared, calls whose expert choices differ, max |dlogp|,
    max |dgrad|, grads compared)."""
    (lpa, ca, ga), (lpb, cb, gb) = a, b
    n = diff = 0
    for i in ca:
        assert len(ca[i]) == len(cb[i]), (i, len(ca[i]), len(cb[i]))
        for (ra, x), (rb, y) in zip(ca[i], cb[i]):
            n += 1
            diff += int(ra != rb or not torch.equal(x, y))
    dlp = max(float((lpa[k] - lpb[k]).abs().max()) for k in lpa)
    dg = max((float((ga[k] - gb[k]).abs().max()) for k in ga), default=0.0)
    assert set(ga) == set(gb)
    return n, diff, dlp, dg, len(ga)


def replayed_agreement(calls, mbs, td_routed, idx):
    """Share of replayed router rows whose experts are the batch's recorded ones."""
    hit = tot = 0
    moe = list(schema.moe_layer_ids)
    for li, layer in enumerate(moe):
        fwd = [m for rec, m in calls[li] if not rec]
        assert len(fwd) == len(mbs)
        for k, mb in enumerate(mbs):
            rmap = fwd[k]                                   # first forward of micro-batch k
            off = mb["input_ids"].offsets().tolist()
            for slot, i in enumerate(idx[k]):
                rows = td_routed[i]                         # [n, L_all, K], last = placeholder
                for p in range(rows.shape[0] - 1):
                    want = torch.zeros(schema.num_experts, dtype=torch.bool)
                    want[rows[p, layer].long()] = True
                    tot += 1
                    hit += int(torch.equal(rmap[off[slot] + p], want))
    return hit / tot


def recompute_same(calls):
    """(recompute calls, those whose experts equal the preceding forward's of the same
    micro-batch): 1F1B at pp=1 runs F0 R0 F1 R1 ..."""
    n = same = 0
    for li in calls:
        last = None
        for rec, m in calls[li]:
            if rec:
                n += 1
                same += int(last is not None and torch.equal(m, last))
            else:
                last = m
    return n, same


# --- R3: one batch, 6 prompts x n=3, mixed padding, dynamic batch size ---------------------
dp, routed, am = make_batch(1, 6, 3)
td = left_right_2_no_padding(dp.to_tensordict())
n_resp = float(td["response_mask"].sum())
mbs, idx = rearrange_micro_batches(td, max_token_len=60)
res["r3_microbatches"] = idx
res["r3_reordered"] = [i for k in idx for i in k] != list(range(len(td)))
routed_parts = list(td["routed_experts"].unbind())
rr = VerlReplayer([model], schema, mode="R3")
verl_runs = {}
for train in (False, True):
    reset()
    (va, _) = verl_pass(mbs, "R3", train, n_resp)
    verl_runs[train] = va
    reset()
    (vb, stats) = rr_pass(rr, td, mbs, idx, train, n_resp)
    n, diff, dlp, dg, ng = compare(va, vb)
    tag = "train" if train else "old_logprob"
    res[f"r3_{tag}"] = dict(router_calls=n, differing_calls=diff, max_abs_dlogp=dlp,
                            max_abs_dgrad=dg, grads=ng,
                            verl_replayed_agreement=replayed_agreement(va[1], mbs,
                                                                       routed_parts, idx),
                            rr_replayed_agreement=replayed_agreement(vb[1], mbs,
                                                                     routed_parts, idx),
                            recompute_calls_same=[recompute_same(va[1]), recompute_same(vb[1])],
                            replayed_fraction=stats.as_metrics()["routereplay/replayed_fraction"])

# no replay at all differs (the check has teeth): the perturbed model's own routing
reset()
own = run(mbs, lambda b, c, call: call(), False, n_resp)
res["own_routing_agreement"] = replayed_agreement(own[1], mbs, routed_parts, idx)

# tokens reordered against the records: micro-batch 0's rows reversed after verl cut it
# (its index list kept): routereplay refuses before any compute, naming micro-batch and slot
from verl.utils import tensordict_utils as tu  # noqa: E402
rev = tu.index_select_tensor_dict(mbs[0], torch.arange(len(idx[0]) - 1, -1, -1))
try:
    rr_pass(rr, td, [rev] + list(mbs[1:]), idx, False, n_resp)
    res["reorder_refused"] = None
except AlignmentError as e:
    res["reorder_refused"] = str(e)[:200]

# verl's dynamic CP micro-batches (local_cp_size) are refused up front, not split wrongly
dcp = [mb.clone() for mb in mbs]
tu.assign_non_tensor(dcp[0], local_cp_size=2)
try:
    rr_pass(rr, td, dcp, idx, False, n_resp)
    res["dynamic_cp_refused"] = None
except Exception as e:  # noqa: BLE001
    res["dynamic_cp_refused"] = f"{type(e).__name__}: {e}"[:160]

# the padded DataProto as verl's trainer holds it gives the same records as the jagged one
src_pad = InMemorySource.from_batch(dp.batch["routed_experts"], dp.batch["attention_mask"],
                                    rr.batch.sample_ids, schema,
                                    input_ids=dp.batch["input_ids"])
src_jag = rr.batch.source
res["padded_equals_jagged"] = all(
    np.array_equal(src_pad.record(s).expert_ids, src_jag.record(s).expert_ids)
    and np.array_equal(src_pad.record(s).token_ids, src_jag.record(s).token_ids)
    for s in rr.batch.sample_ids)
res["sample_ids"] = rr.batch.sample_ids[:4]

# --- the sidecar path: the engine's records in a stream keyed <uid>/<i> (routereplay_id),
# the batch without routed_experts; the same experts, log-probs and gradients as verl's R3
import tempfile  # noqa: E402
from routereplay.sidecar import open_sidecar, write_records  # noqa: E402
from trainer_hooks.verl import KEY_FIELD, sample_keys  # noqa: E402
keys = sample_keys(dp.non_tensor_batch["uid"])
stream = os.path.join(tempfile.mkdtemp(), "step.rrsc")
write_records(stream, schema, [src_pad.record(k) for k in keys])
dp_sc = DataProto.from_dict(tensors={k: v for k, v in dp.batch.items() if k != "routed_experts"},
                            non_tensors={"uid": dp.non_tensor_batch["uid"],
                                         KEY_FIELD: np.array(keys, object)})
td_sc = left_right_2_no_padding(dp_sc.to_tensordict())
mbs_sc, idx_sc = rearrange_micro_batches(td_sc, max_token_len=60)
assert idx_sc == idx
res["sidecar_bytes"] = os.path.getsize(stream)
res["tensor_bytes"] = int(dp.batch["routed_experts"].numel() * 2)
for train in (False, True):
    reset()
    with rr.step(td_sc, mbs_sc, idx_sc, forward_only=not train, source=open_sidecar(stream)):
        vs = run(mbs_sc, rr_body(rr), train, n_resp)
    n, diff, dlp, dg, ng = compare(verl_runs[train], vs)
    res[f"sidecar_{'train' if train else 'old_logprob'}"] = dict(
        router_calls=n, differing_calls=diff, max_abs_dlogp=dlp, max_abs_dgrad=dg, grads=ng)

# --- a sample without response tokens: verl's build_r3_replay_mask leaves all its rows
# native, routereplay replays its prompt rows (the engine routed them); the others agree
dp3, _, _ = make_batch(3, 3, 2, empty=(2,))
td3 = left_right_2_no_padding(dp3.to_tensordict())
mbs3, idx3 = rearrange_micro_batches(td3, max_token_len=200)
n_resp3 = float(td3["response_mask"].sum())
reset()
(v3, _) = verl_pass(mbs3, "R3", True, n_resp3)
reset()
(r3, _) = rr_pass(rr, td3, mbs3, idx3, True, n_resp3)
off3 = mbs3[0]["input_ids"].offsets().tolist()
slot = idx3[0].index(2)
rows_diff = {"empty_sample": 0, "other_samples": 0}
for li in v3[1]:
    fa = [m for rec, m in v3[1][li] if not rec][0]
    fb = [m for rec, m in r3[1][li] if not rec][0]
    d = (fa != fb).any(-1)
    inside = torch.zeros_like(d)
    inside[off3[slot]:off3[slot + 1]] = True
    rows_diff["empty_sample"] += int(d[inside].sum())
    rows_diff["other_samples"] += int(d[~inside].sum())
assert len(mbs3) == 1
dlp3 = (v3[0][0] - r3[0][0]).abs()
dg3 = max(float((v3[2][k] - r3[2][k]).abs().max()) for k in v3[2])
res["empty_response"] = dict(rows_differing=rows_diff,
                             empty_sample_tokens=off3[slot + 1] - off3[slot],
                             max_abs_dlogp_other_samples=float(dlp3[~inside].max()),
                             max_abs_dlogp_empty_sample=float(dlp3[inside].max()),
                             max_abs_dgrad=dg3)

# --- R2: record in the old-log-prob pass, replay in the update (other micro-batches) -------
dp2, _, _ = make_batch(2, 4, 2)
dp2.non_tensor_batch[KEY_FIELD] = np.array(sample_keys(dp2.non_tensor_batch["uid"]), object)
td2 = left_right_2_no_padding(dp2.to_tensordict())
td2.pop("routed_experts")
n_resp2 = float(td2["response_mask"].sum())
mbs_a, idx_a = rearrange_micro_batches(td2, max_token_len=50)
reset()
(_, rec) = verl_pass(mbs_a, "R2", False, n_resp2, record=True)
recorded = restore_dynamic_batch(rru.merge_nested_router_maps(rec), idx_a)
td2_upd = td2.clone()
td2_upd["routed_experts"] = recorded
mbs_b, idx_b = rearrange_micro_batches(td2_upd, max_token_len=35)
perturb(9)                                  # the policy moved between the two passes
moved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
(va2, _) = verl_pass(mbs_b, "R2", True, n_resp2)
rr2 = VerlReplayer([model], schema, mode="R2")
try:                                          # R2 without stored keys: refused up front
    rr2.step(left_right_2_no_padding(make_batch(2, 4, 2)[0].to_tensordict()),
             forward_only=True).__enter__()
    res["r2_without_keys_refused"] = None
except Exception as e:  # noqa: BLE001
    res["r2_without_keys_refused"] = f"{type(e).__name__}: {e}"[:160]
reset()
mbs_a2, _ = rearrange_micro_batches(td2, max_token_len=50)
rr_pass(rr2, td2, mbs_a2, idx_a, False, n_resp2)
model.load_state_dict(moved, strict=False)
td2_rr = td2.clone()
mbs_b2, idx_b2 = rearrange_micro_batches(td2_rr, max_token_len=35)
(vb2, st2) = rr_pass(rr2, td2_rr, mbs_b2, idx_b2, True, n_resp2)
n, diff, dlp, dg, ng = compare(va2, vb2)
res["r2_update"] = dict(router_calls=n, differing_calls=diff, max_abs_dlogp=dlp,
                        max_abs_dgrad=dg, grads=ng, record_microbatches=idx_a,
                        update_microbatches=idx_b,
                        replayed_fraction=st2.as_metrics()["routereplay/replayed_fraction"])
print("RESULT " + json.dumps(res))
