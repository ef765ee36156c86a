"""EPLB replica refresh on vLLM's own EPLB code with a simulated placement (prints RESULT json).

usage: python tests/vllm_eplb_check.py WORLD OUT.json

WORLD gloo processes are the EP ranks of one MoE model (2 MoE layers, 8 logical experts,
4 redundant: 12 physical slots, 12 / WORLD per rank). The current placement comes from
vLLM's DefaultEplbPolicy on a skewed expert load; a weight update is simulated the way vLLM
loads weights (every slot gets the new weights of its *initial* logical expert,
EplbState.build_initial_global_physical_to_logical_map); then
engine_patches.vllm.eplb.refresh_replicas moves them with vLLM's
rearrange_expert_weights_inplace and its gloo EPLB communicator. Every slot must end with
the new weights of the logical expert the current map assigns to it.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

L, N_LOGICAL, N_PHYS = 2, 8, 12


def new_weights(layer: int, logical: int, shape, salt: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * layer + logical)
    return torch.randn(shape, generator=g) + salt


class _NoStream:
    def synchronize(self):
        pass


def worker(rank: int, world: int, port: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        # NOTE: the gloo communicator syncs the accelerator stream before its P2P ops;
        # with no accelerator there is nothing to wait for (test-process-only stand-in).
        torch.accelerator.current_stream = lambda *a, **k: _NoStream()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from vllm.distributed.eplb.eplb_communicator import TorchDistGlooStagedEplbCommunicator
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from engine_patches.vllm.eplb import initial_map, refresh_replicas

    load = torch.tensor([[50, 1, 1, 30, 1, 1, 9, 2], [3, 3, 40, 1, 1, 20, 1, 6]], dtype=torch.float)
    cur = DefaultEplbPolicy.rebalance_experts(load, N_PHYS, 1, 1, world)
    cur = torch.as_tensor(cur, dtype=torch.int64)
    init = initial_map(L, N_LOGICAL, N_PHYS)
    local = N_PHYS // world
    shapes = [(4, 3), (3, 2)]                        # two weight tensors per layer (w13, w2)
    # the update as vLLM applies it: slot p <- new weights of logical init[p]
    weights = [[torch.stack([new_weights(l, int(init[l, rank * local + i]), s, w)
                             for i in range(local)]) for w, s in enumerate(shapes)]
               for l in range(L)]
    wrong_before = sum(int(not torch.equal(weights[l][0][i],
                                           new_weights(l, int(cur[l, rank * local + i]),
                                                       shapes[0], 0)))
                       for l in range(L) for i in range(local))
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = TorchDistGlooStagedEplbCommunicator(dist.group.WORLD)
    n = refresh_replicas(cur, weights, buffers, dist.group.WORLD, comm, N_LOGICAL)
    ok = all(torch.equal(weights[l][w][i], new_weights(l, int(cur[l, rank * local + i]), s, w))
             for l in range(L) for w, s in enumerate(shapes) for i in range(local))
    res = {"rank": rank, "layers_refreshed": n, "slots_wrong_before": wrong_before,
           "all_slots_right_after": ok, "current_map": cur.tolist(),
           "initial_map": init.tolist()}
    objs = [None] * world
    dist.all_gather_object(objs, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(objs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    world, out = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out), nprocs=world, join=True)
    print("RESULT " + open(out).read())
