"""Layout checks (harness, used by the tests through ``recompute --check-record``).

On the unperturbed model a RECORD pass (the trainer's own routing) is replayed: ids and
log-probs must be exactly equal. Then the routers are perturbed: replay must still select
the recorded experts, in the forward and in the activation-recompute forward of a training
step (:class:`RecomputeCheck` compares what the routers hand the experts with what the
first forward used), and the routers must get gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.megatron import RouterReplayer
from trainer_hooks.megatron.harness.collect import assemble, gather, router_grad_norms
from trainer_hooks.megatron.harness.passes import PassResult, Session, run_pass
from trainer_hooks.megatron.harness.perturb import perturb_routers


@dataclasses.dataclass
class Comparison:
    """One pass against the RECORD pass (rank 0).

    Attributes:
        ids_equal: every router used exactly the recorded experts, in order.
        max_abs_dlogp: largest |log-prob difference| (nats); lp_exact: it is 0.
        set_agreement: mean over records of the share of (token, layer) rows whose expert
            sets agree.
    """

    ids_equal: bool
    max_abs_dlogp: float
    lp_exact: bool
    set_agreement: float


class RecomputeCheck:
    """Counts router rows whose output routing map (what the experts receive) differs from
    the experts the microbatch's first forward used, in activation-recompute forwards.
    Reads the replayer through its public ``router_call`` view only."""

    def __init__(self, replayer: RouterReplayer):
        self.replayer = replayer
        self.checked = 0
        self.differing = 0
        self._hooks: list = []

    def _hook(self, router, inp, out):
        call = self.replayer.router_call(router)
        if call is None or not call.recompute or call.used is None:
            return
        want = torch.zeros_like(out[1]).scatter(1, call.used, True)
        self.checked += int(call.used.shape[0])
        self.differing += int((want != out[1]).any(-1).sum())

    def __enter__(self) -> "RecomputeCheck":
        for layers in self.replayer.layers:
            for router, _ in layers:
                self._hooks.append(router.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def record_checks(sess: Session, records: Sequence[RoutingRecord], schema: RoutingSchema,
                  seed: int) -> dict[str, Any]:
    """Run the checks of the module doc; the router weights are restored at the end.

    Returns:
        on rank 0: {record_replay, perturbed_own, perturbed_replay, perturbed_train:
        Comparison as dict, recompute_rows_checked / recompute_rows_differing: per rank,
        router_grad_norms, train_stats: per rank}; an empty dict on other ranks.
    """
    import torch.distributed as dist
    rec = run_pass(sess, None)                                   # RECORD (own routing)
    parts = gather(rec.part)
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload = [assemble(parts, records, schema)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    lp0, used0 = payload[0]
    # recorded routing of every token position (the last one included)
    recorded = {r.sample_id: dataclasses.replace(
        r, expert_ids=used0[r.sample_id].astype(schema.id_dtype), start=0) for r in records}

    def compare(res: PassResult) -> dict[str, Any] | None:
        pr = gather(res.part)
        if dist.get_rank() != 0:
            return None
        lp1, used1 = assemble(pr, records, schema)
        dl = max(float(np.max(np.abs(lp1[s] - lp0[s]))) for s in lp0)
        agree = float(np.mean([(np.sort(used1[s], -1) == np.sort(used0[s], -1)).all(-1).mean()
                               for s in used0]))
        return dataclasses.asdict(Comparison(
            ids_equal=all(np.array_equal(used1[s], used0[s]) for s in used0),
            max_abs_dlogp=dl, lp_exact=dl == 0.0, set_agreement=agree))

    rep = sess.replayer
    out: dict[str, Any] = {"record_replay": compare(run_pass(sess, recorded))}
    saved = [router.weight.detach().clone() for ls in rep.layers for router, _ in ls]
    perturb_routers(rep, 0.5, seed + 100)
    out["perturbed_own"] = compare(run_pass(sess, None))
    out["perturbed_replay"] = compare(run_pass(sess, recorded))
    with RecomputeCheck(rep) as check:
        train = run_pass(sess, recorded, train=True)
    out["perturbed_train"] = compare(train)
    out["recompute_rows_checked"] = gather(check.checked)
    out["recompute_rows_differing"] = gather(check.differing)
    out["router_grad_norms"] = router_grad_norms(rep, schema, sess.spec.sp)
    out["train_stats"] = gather(dataclasses.asdict(train.stats))
    with torch.no_grad():               # the unperturbed routers for what follows
        for w, (router, _) in zip(saved, [t for ls in rep.layers for t in ls]):
            router.weight.copy_(w)
    return out if dist.get_rank() == 0 else {}
