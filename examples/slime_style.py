"""slime-style trainer step: per-sample records, routing from the rollout's sidecar
streams (one closed, indexed stream per policy version), packed (THD) microbatches;
R3 (replay the rollout engine's routing) or R2 (record the trainer's own routing in the
old-log-prob pass and replay it in the update).

The framework carries each sample (uid, tokens, response length, rollout log-probs) in its
own data plane; the vLLM plugin wrote each sample's routing under the same uid. Per RL step
(one per policy version):

1. open the version's closed stream(s) as one source (one per API-server process or DP
   engine; ``open_sidecar`` reads a list of them as one): samples are read lazily, by uid;
2. old log-probs: forward-only; R3 replays the rollout's experts, R2 records the trainer's;
3. the update: forward + backward replaying them (R3: the stream; R2: the recording);
4. metrics for your logger: ``stats.as_metrics()`` and the k3 KL against the rollout.

    python examples/rollout_worker.py --model MODEL_DIR --out ROLLOUT     # vLLM
    python examples/slime_style.py --model MODEL_DIR --rollout ROLLOUT [--mode r2]
"""
import argparse
import json

import numpy as np
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from routereplay import RoutingSchema
from routereplay.sidecar import open_sidecar
from trainer_hooks.megatron import Layout, Microbatch, RouterReplayer

from _tiny_megatron import packed_inputs, tiny_megatron, token_logprobs

MICRO_BATCH = 2


def run(model, replayer, source, groups, mbs, *, train, record=False, loss_fn=None):
    """One pass over the packed microbatches; returns per-sample log-probs (position p:
    log-prob of token p) and the ReplayStep (stats; ``source()`` after ``record``)."""
    inputs = [packed_inputs([s["tokens"] for s in g]) for g in groups]
    logprobs = {}

    def forward_step(data_iterator, chunk):
        k = next(data_iterator)
        tokens, pos, mask = inputs[k]
        with replayer.microbatch(k, chunk):
            logits = chunk(tokens, pos, attention_mask=mask)

        def loss_func(out):
            lp = token_logprobs(out, tokens)[0]
            a, loss = 0, lp.sum() * 0
            for s in groups[k]:
                n = len(s["tokens"])
                logprobs[s["uid"]] = lp[a:a + n].detach()
                if loss_fn:
                    loss = loss + loss_fn(lp[a:a + n], s)
                a += n
            return loss, {"loss": loss.detach()}
        return logits, loss_func

    with replayer.step(source, mbs, record=record) as step, torch.set_grad_enabled(train):
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(len(mbs))),
            model=[model], num_microbatches=len(mbs), seq_length=inputs[0][0].shape[1],
            micro_batch_size=1, forward_only=not train)
    return logprobs, step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rollout", required=True, help="folder of examples/rollout_worker.py")
    ap.add_argument("--mode", choices=("r3", "r2"), default="r3")
    a = ap.parse_args()
    model, hf = tiny_megatron(a.model)
    schema = RoutingSchema.from_hf_config(hf)
    replayer = RouterReplayer(model, schema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with open(f"{a.rollout}/streams.json") as f:
        streams = json.load(f)                      # plugin.streams() of the rollout worker(s)
    versions = {}
    for info in streams:
        assert info["closed"], info                 # closed = indexed: opened without a scan
        versions.setdefault(info["weight_version"], []).append(info["path"])

    for version, paths in versions.items():         # one RL step per policy version
        with open(f"{a.rollout}/samples-{version}.json") as f:
            samples = json.load(f)                  # the framework's own per-sample data
        groups = [samples[i:i + MICRO_BATCH] for i in range(0, len(samples), MICRO_BATCH)]
        # packed microbatches (THD): each sample's tokens are positions 0..n-1 of its record;
        # tokens are compared with the ones the stream stores before anything is replayed
        mbs = [Microbatch(sample_ids=[s["uid"] for s in g],
                          layout=Layout.packed_from_lengths([len(s["tokens"]) for s in g]),
                          tokens=[np.array(s["tokens"]) for s in g]) for g in groups]
        with open_sidecar(paths) as stream:
            r3 = stream if a.mode == "r3" else None
            old_lp, old = run(model, replayer, r3, groups, mbs, train=False,
                              record=a.mode == "r2")
            source = stream if a.mode == "r3" else old.source()      # R2: the recording

            def policy_loss(lp, s):                  # a toy on-policy PG loss
                r = slice(len(s["tokens"]) - s["response_length"], None)
                ratio = torch.exp(lp[r] - old_lp[s["uid"]][r])
                adv = 1.0 if s["uid"].endswith(("1", "3")) else -1.0
                return -(ratio * adv).sum() / sum(x["response_length"] for x in samples)
            opt.zero_grad()
            _, upd = run(model, replayer, source, groups, mbs, train=True, loss_fn=policy_loss)
            opt.step()
        delta = torch.cat([old_lp[s["uid"]][-s["response_length"]:]
                           - torch.tensor(s["rollout_log_probs"]) for s in samples])
        print(json.dumps({"step": version, "mode": a.mode,
                          "k3_kl": float((delta.exp() - 1 - delta).mean()),
                          "max_abs_dlogp": float(delta.abs().max()),
                          **{f"old_logprob/{k}": v for k, v in old.stats.as_metrics().items()},
                          **{f"update/{k}": v for k, v in upd.stats.as_metrics().items()}}),
              flush=True)


if __name__ == "__main__":
    main()
