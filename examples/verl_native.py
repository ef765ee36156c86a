"""verl-native R3: routereplay inside verl 0.9's real data path (DataProto,
``left_right_2_no_padding``, ``rearrange_micro_batches``) through ``trainer_hooks.verl``.

Each rollout batch of examples/rollout_worker.py becomes a verl ``DataProto`` (prompt
left-padded, response right-padded, ``routed_experts`` int16 ``[b, s, L_all, K]``), goes
through verl's own ``left_right_2_no_padding`` (jagged tensors) and dynamic-batch
``rearrange_micro_batches`` (which reorders samples), and is replayed by
``VerlReplayer`` with the glue of docs/verl.md: ``rr.step(data, micro_batches, indices,
forward_only=...)`` around megatron's schedule, ``rr.microbatch(batch, model)`` around the
model call. It prints per step the routing agreement with the rollout (share of replayed
(token, MoE layer) rows whose experts are the engine's), the replayed share and the
log-prob mismatch against vLLM's, for the old-log-prob pass and the update.

    python examples/rollout_worker.py --model MODEL_DIR --out ROLLOUT                 # vLLM
    PYTHONPATH=.venv/verl-0.9.1 python examples/verl_native.py --model MODEL_DIR --rollout ROLLOUT

THD runs on CPU as one packed row with a block-diagonal causal mask (megatron's local
attention has no ``PackedSeqParams``); the routers see verl's THD token order.
"""
import argparse
import glob
import json

import numpy as np
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from verl.protocol import DataProto
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding

from routereplay import RoutingSchema
from trainer_hooks.verl import KEY_FIELD, VerlReplayer

from _tiny_megatron import tiny_megatron


def verl_dataproto(batch):
    """The rollout batch as verl's trainer holds it (``response_mask`` over the response
    columns, the routing rows after the left padding)."""
    resp_cols = np.flatnonzero(batch["response_mask"].any(0))
    p = int(resp_cols[0])
    am = batch["attention_mask"].astype(np.int64)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dict(
        input_ids=batch["input_ids"].astype(np.int64), attention_mask=am,
        position_ids=np.clip(am.cumsum(-1) - 1, 0, None),
        prompts=batch["input_ids"][:, :p].astype(np.int64),
        responses=batch["input_ids"][:, p:].astype(np.int64),
        response_mask=batch["response_mask"][:, p:].astype(np.int64),
        routed_experts=batch["routed_experts"].astype(np.int16)).items()}
    uids = np.array([str(u) for u in batch["uids"]], object)
    # the rollout's sample ids are the record keys (routereplay_id); verl's uid column too
    return DataProto.from_dict(tensors=t, non_tensors={"uid": uids, KEY_FIELD: uids})


def packed(mb):
    ids = mb["input_ids"]
    off = ids.offsets()
    tok = ids.values().long()[None]
    n = tok.shape[1]
    seg = torch.repeat_interleave(torch.arange(len(off) - 1), off.diff())
    pos = (torch.arange(n) - off[:-1].long()[seg])[None]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) | (seg[:, None] != seg[None, :])
    return tok, pos, mask[None, None]


def run(model, rr, td, mbs, idx, *, train, loss_of=None):
    """One verl forward_backward_batch: returns {batch row: log-probs of its positions}, the
    routing agreement with the rollout and the step's metrics."""
    lps, agree = {}, [0, 0]

    def on_used(key, ci, li, tmap, used):
        mb = rr.batch.microbatches[key]
        for n in np.flatnonzero(tmap.sample >= 0):
            rec = rr.batch.source.record(mb.sample_ids[tmap.sample[n]])
            p = int(tmap.position[n]) - rec.start
            if 0 <= p < rec.expert_ids.shape[0]:      # a replayed row (the last token: own)
                agree[0] += set(used[n].tolist()) == set(rec.expert_ids[p, li].tolist())
                agree[1] += 1

    def forward_step(it, chunk):
        k, mb = next(it)
        tok, pos, mask = packed(mb)
        with rr.microbatch(mb, chunk):                       # docs/verl.md, line 7
            out = chunk(tok, pos, attention_mask=mask)

        def loss_func(o):
            lp = torch.log_softmax(o[0, :-1].float(), -1).gather(-1, tok[0, 1:, None])[:, 0]
            off = mb["input_ids"].offsets().tolist()
            for slot, i in enumerate(idx[k]):
                lps[i] = torch.nn.functional.pad(lp[off[slot]:off[slot + 1] - 1], (1, 0))
            loss = loss_of(lps, idx[k]) * len(mbs) if loss_of else lp.sum() * 0
            return loss, {"loss": loss.detach()}
        return out, loss_func

    rr.replayer.on_used = on_used
    with rr.step(td, mbs, idx, forward_only=not train) as st, torch.set_grad_enabled(train):
        get_forward_backward_func()(                        # verl's call, as it is
            forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))),
            model=[model], num_microbatches=len(mbs), seq_length=1, micro_batch_size=1,
            forward_only=not train)
    rr.replayer.on_used = None
    return lps, agree[0] / max(agree[1], 1), st.stats.as_metrics()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rollout", required=True, help="folder of examples/rollout_worker.py")
    ap.add_argument("--max-token-len", type=int, default=96,
                    help="verl's max_token_len_per_gpu (dynamic batch size)")
    a = ap.parse_args()
    model, hf = tiny_megatron(a.model)
    rr = VerlReplayer([model], RoutingSchema.from_hf_config(hf), mode="R3")   # lines 1-5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for path in sorted(glob.glob(f"{a.rollout}/batch-*.npz")):          # one RL step each
        batch = dict(np.load(path, allow_pickle=False))
        td = left_right_2_no_padding(verl_dataproto(batch).to_tensordict())
        mbs, idx = rearrange_micro_batches(td, max_token_len=a.max_token_len)
        old, agree_old, m_old = run(model, rr, td, mbs, idx, train=False)
        cols = [np.flatnonzero(m)[0] for m in batch["attention_mask"]]
        resp = batch["response_mask"].astype(bool)
        delta = np.concatenate([
            old[i].numpy()[resp[i, cols[i]:cols[i] + len(old[i])]]
            - batch["rollout_log_probs"][i, cols[i]:cols[i] + len(old[i])][
                resp[i, cols[i]:cols[i] + len(old[i])]] for i in old])
        adv = {i: 1.0 if i % 2 else -1.0 for i in old}

        def pg_loss(lps, rows):                               # a toy on-policy PG loss
            loss = 0.0
            for i in rows:
                m = torch.from_numpy(resp[i, cols[i]:cols[i] + len(lps[i])])
                loss = loss - (torch.exp(lps[i] - old[i]) * adv[i] * m).sum()
            return loss / float(resp.sum())
        opt.zero_grad()
        _, agree_upd, m_upd = run(model, rr, td, mbs, idx, train=True, loss_of=pg_loss)
        opt.step()
        print(json.dumps({"step": path.rsplit("batch-", 1)[1][:-4], "microbatches": idx,
                          "routing_agreement/old_logprob": agree_old,
                          "routing_agreement/update": agree_upd,
                          "max_abs_dlogp_vs_rollout": float(np.abs(delta).max()),
                          "old_logprob/replayed_fraction":
                              m_old["routereplay/replayed_fraction"],
                          "update/replayed_fraction": m_upd["routereplay/replayed_fraction"]}),
              flush=True)


if __name__ == "__main__":
    main()
