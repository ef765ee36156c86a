"""One pass of the recompute (harness): this rank's microbatches through megatron-core's
own ``forward_backward_func`` (1F1B, or interleaved with VPP) under a RouterReplayer step,
forward-only or as a training step, collecting log-probs and used experts.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch

from trainer_hooks.megatron import ReplayStats, RouterReplayer
from trainer_hooks.megatron.harness.collect import Collector, RankPart
from trainer_hooks.megatron.harness.parallel import ParallelSpec
from trainer_hooks.megatron.harness.plan import BatchPlan, MicrobatchTensors, batch_tensors


@dataclasses.dataclass
class Session:
    """Everything a pass needs on one rank.

    Attributes:
        replayer: the RouterReplayer of ``chunks``.
        chunks: this rank's model chunks (one, or vpp).
        plan: this rank's microbatches.
        spec: the parallel layout.
        response_tokens: response tokens of the whole global batch (the loss normaliser).
        tensors: model inputs of each microbatch, on the model's device.
    """

    replayer: RouterReplayer
    chunks: list
    plan: BatchPlan
    spec: ParallelSpec
    response_tokens: float
    tensors: list[MicrobatchTensors] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.tensors:
            dev = next(self.chunks[0].parameters()).device
            self.tensors = [batch_tensors(mb, self.plan.seq_len, dev)
                            for mb in self.plan.microbatches]


@dataclasses.dataclass
class PassResult:
    """One pass on one rank: what it collected, the replayer's counters, wall time (s)."""

    part: RankPart
    stats: ReplayStats
    seconds: float


def run_pass(sess: Session, source: Any, *, train: bool = False) -> PassResult:
    """Run every microbatch of ``sess.plan`` with replay from ``source`` (None: the
    trainer's own routing); ``train``: forward + backward (gradients left in the model),
    else forward only under ``torch.no_grad()``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    replayer, plan = sess.replayer, sess.plan
    col = Collector(replayer, plan)
    replayer.on_used = col.on_used
    n_mb = len(plan.microbatches)

    def loss_func(key, out):
        t = sess.tensors[key]
        lp = torch.log_softmax(out[:, :-1].float(), -1).gather(
            -1, t.tokens[:, 1:, None]).squeeze(-1)
        col.on_logprobs(key, lp)
        # forward_backward_func divides by num_microbatches: undo it, normalise globally.
        loss = -(lp * t.response).sum() / sess.response_tokens * n_mb
        return loss, {"loss": loss.detach()}

    def forward_step(it, chunk):
        key = next(it)
        t = sess.tensors[key]
        with replayer.microbatch(key, chunk):
            out = chunk(t.tokens, t.position_ids, attention_mask=t.attention_mask)
        return out, functools.partial(loss_func, key)

    fb = get_forward_backward_func()
    its = [iter(range(n_mb)) for _ in sess.chunks]
    t0 = time.perf_counter()
    try:
        with replayer.step(source, [mb.microbatch() for mb in plan.microbatches]):
            kw = dict(forward_step_func=forward_step,
                      data_iterator=its if len(sess.chunks) > 1 else its[0],
                      model=sess.chunks, num_microbatches=n_mb, seq_length=plan.seq_len,
                      micro_batch_size=plan.rows_per_microbatch, forward_only=not train)
            if train:
                for c in sess.chunks:
                    c.zero_grad(set_to_none=True)
                fb(**kw)
            else:
                with torch.no_grad():
                    fb(**kw)
    finally:
        replayer.on_used = None
    return PassResult(part=col.part, stats=dataclasses.replace(replayer.stats),
                      seconds=time.perf_counter() - t0)
