"""verl-style trainer step with rollout routing replay (R3) in megatron-core.

The rollout carries routing in the batch, next to ``input_ids``: ``routed_experts
[b, s, L, K]`` with the ``attention_mask`` (prompt left-padded, response right-padded).
Per RL step (one per policy version of examples/rollout_worker.py):

1. old log-probs: a forward-only pass replaying the rollout's experts;
2. the update: forward + backward replaying the same experts, then the optimizer step;
3. metrics: the replayer's counters (``stats.as_metrics()``) and the train-inference
   log-prob mismatch (k3 KL) for your logger, and the routing agreement with the rollout
   (share of replayed rows whose experts are the engine's; 1.0 when replay is exact).

examples/verl_native.py runs the same steps through verl 0.9's own data path
(``DataProto``, ``left_right_2_no_padding``, ``rearrange_micro_batches``) with
``trainer_hooks.verl`` (docs/verl.md).

    python examples/rollout_worker.py --model MODEL_DIR --out ROLLOUT     # vLLM
    python examples/verl_style.py --model MODEL_DIR --rollout ROLLOUT     # megatron-core
"""
import argparse
import glob
import json

import numpy as np
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from routereplay import InMemorySource, RoutingSchema
from trainer_hooks.megatron import Microbatch, RouterReplayer

from _tiny_megatron import model_inputs, tiny_megatron, token_logprobs

MICRO_BATCH = 2


def run(model, replayer, source, batch, mbs, *, train, loss_fn=None):
    """One pass over the batch's microbatches through megatron's schedule; returns the
    log-probs [b, s] (column c: log-prob of token c), the step's ReplayStats and the routing
    agreement (share of the replayed (token, MoE layer) rows whose experts are the
    rollout's)."""
    tokens, pos, mask = model_inputs(batch["input_ids"], batch["attention_mask"])
    logprobs = torch.zeros(tokens.shape)
    agree = [0, 0]

    def on_used(key, ci, li, tmap, used):           # a debugging hook: reads ids back
        for n in np.flatnonzero(tmap.sample >= 0):
            rec = source.record(mbs[key].sample_ids[tmap.sample[n]])
            p = int(tmap.position[n]) - rec.start
            if 0 <= p < rec.expert_ids.shape[0]:    # replayed (the last token: own)
                agree[0] += set(used[n].tolist()) == set(rec.expert_ids[p, li].tolist())
                agree[1] += 1
    replayer.on_used = on_used

    def forward_step(data_iterator, chunk):
        k = next(data_iterator)
        rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
        with replayer.microbatch(k, chunk):              # routing of microbatch k
            logits = chunk(tokens[rows], pos[rows], attention_mask=mask[rows])

        def loss_func(out):
            lp = token_logprobs(out, tokens[rows])
            logprobs[rows] = lp.detach()
            loss = loss_fn(lp, rows) if loss_fn else lp.sum() * 0
            return loss, {"loss": loss.detach()}
        return logits, loss_func

    with replayer.step(source, mbs) as step, torch.set_grad_enabled(train):
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(len(mbs))),
            model=[model], num_microbatches=len(mbs), seq_length=tokens.shape[1],
            micro_batch_size=MICRO_BATCH, forward_only=not train)
    replayer.on_used = None
    return logprobs, step.stats, agree[0] / max(agree[1], 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rollout", required=True, help="folder of examples/rollout_worker.py")
    a = ap.parse_args()
    model, hf = tiny_megatron(a.model)
    schema = RoutingSchema.from_hf_config(hf)
    replayer = RouterReplayer(model, schema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    for path in sorted(glob.glob(f"{a.rollout}/batch-*.npz")):          # one RL step each
        batch = dict(np.load(path, allow_pickle=False))
        uids = [str(u) for u in batch["uids"]]
        # the batch's routing as a routing source: vLLM's layer axis (num_hidden_layers,
        # dense layers zero) is reduced to the MoE layers by the schema; the last real token
        # of each row has no routing and takes the trainer's own
        source = InMemorySource.from_batch(batch["routed_experts"], batch["attention_mask"],
                                           uids, schema, input_ids=batch["input_ids"])
        # the microbatches as the trainer feeds them (here: the padded rows as they are);
        # input_ids are compared with the rollout's tokens before anything is replayed
        mbs = [Microbatch.from_attention_mask(uids[i:i + MICRO_BATCH],
                                              batch["attention_mask"][i:i + MICRO_BATCH],
                                              input_ids=batch["input_ids"][i:i + MICRO_BATCH])
               for i in range(0, len(uids), MICRO_BATCH)]

        old_lp, st_old, agree_old = run(model, replayer, source, batch, mbs, train=False)
        resp = torch.from_numpy(batch["response_mask"]).bool()
        delta = (old_lp - torch.from_numpy(batch["rollout_log_probs"]))[resp]
        k3 = float((delta.exp() - 1 - delta).mean())

        adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(uids))])[:, None]

        def policy_loss(lp, rows):                     # a toy on-policy PG loss
            m = resp[rows].float()
            ratio = torch.exp(lp - old_lp[rows])
            return -(ratio * adv[rows] * m).sum() / resp.sum()
        opt.zero_grad()
        _, st_upd, agree_upd = run(model, replayer, source, batch, mbs, train=True,
                                   loss_fn=policy_loss)
        opt.step()
        print(json.dumps({"step": path.rsplit("batch-", 1)[1][:-4], "k3_kl": k3,
                          "max_abs_dlogp": float(delta.abs().max()),
                          "old_logprob/routing_agreement": agree_old,
                          "update/routing_agreement": agree_upd,
                          **{f"old_logprob/{k}": v for k, v in st_old.as_metrics().items()},
                          **{f"update/{k}": v for k, v in st_upd.as_metrics().items()}}),
              flush=True)


if __name__ == "__main__":
    main()
