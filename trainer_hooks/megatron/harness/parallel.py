"""Parallel layouts for megatron-core (harness): spec, process launch (gloo), model chunks
and sharded loading of a HF checkpoint.

A layout is written like ``tp=2,sp`` / ``ep=2`` / ``ep=2,dispatcher=allgather`` /
``pp=2,vpp=2`` / ``dp=2``. World size = tp * pp * cp * dp; expert parallelism takes its
ranks from tp * cp * dp (expert tensor parallel size 1).

NOTE: context parallelism cannot run on CPU: megatron-core's local ``DotProductAttention``
asserts ``context_parallel_size == 1`` ("Context parallelism is only supported by
TEDotProductAttention") and Transformer Engine has no CPU build. ``cp=N`` is therefore
refused here with that reason; the CP token split itself (zig-zag) lives in
routereplay.align and is tested against megatron-core's own ``get_batch_on_this_cp_rank``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from typing import Any, Callable

import torch

from routereplay.errors import SchemaError


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """Model-parallel layout of one trainer run.

    Attributes:
        tp, pp, ep, cp, dp: tensor, pipeline, expert, context and data parallel sizes.
        vpp: virtual pipeline chunks per stage (None = no interleaving).
        sp: sequence parallel (needs tp > 1).
        dispatcher: megatron MoE token dispatcher, "alltoall" or "allgather".
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 0          # 0 = smallest that fits ep
    vpp: int | None = None
    sp: bool = False
    dispatcher: str = "alltoall"

    def __post_init__(self):
        for n in ("tp", "pp", "ep", "cp"):
            if getattr(self, n) < 1:
                raise SchemaError(f"parallel spec: {n} must be >= 1")
        if self.dp == 0:
            base = self.tp * self.cp
            object.__setattr__(self, "dp", max(1, -(-self.ep // base)))
        if (self.tp * self.cp * self.dp) % self.ep:
            raise SchemaError(f"parallel spec: ep={self.ep} must divide tp*cp*dp = "
                              f"{self.tp * self.cp * self.dp}")
        if self.sp and self.tp < 2:
            raise SchemaError("parallel spec: sp (sequence parallel) needs tp >= 2")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise SchemaError("parallel spec: vpp needs pp >= 2 and vpp >= 2")
        if self.dispatcher not in ("alltoall", "allgather"):
            raise SchemaError(f"parallel spec: dispatcher must be alltoall or allgather, "
                              f"got {self.dispatcher!r}")
        if self.cp > 1:
            raise SchemaError(
                "parallel spec: cp > 1 cannot run on CPU: megatron-core's local "
                "DotProductAttention asserts context_parallel_size == 1 (CP needs "
                "TEDotProductAttention) and Transformer Engine has no CPU build. The CP "
                "zig-zag token split is handled by routereplay.align and tested against "
                "megatron-core's get_batch_on_this_cp_rank.")

    def check_model(self, config: dict[str, Any]) -> None:
        """Refuse a layout the model cannot be split into (megatron-core would fail only in
        the trainer ranks, after a minutes-long rollout): ``tp`` must divide the attention
        and key-value heads, ``ep`` the routed experts, ``pp`` x ``vpp`` the decoder layers.

        Args:
            config: the HF ``config.json`` as a dict (``text_config`` nesting read).
        Raises:
            SchemaError: naming the size and the config key.
        """
        cfg = config.get("text_config", config)
        checks = [("tp", self.tp, "num_attention_heads"), ("tp", self.tp, "num_key_value_heads"),
                  ("ep", self.ep, "num_experts"), ("ep", self.ep, "num_local_experts"),
                  ("pp x vpp", self.pp * (self.vpp or 1), "num_hidden_layers")]
        for name, size, key in checks:
            n = cfg.get(key)
            if isinstance(n, int) and n % size:
                raise SchemaError(f"parallel spec: {name}={size} must divide the model's "
                                  f"{key} ({n})")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @classmethod
    def parse(cls, text: str | None) -> "ParallelSpec":
        """Parse ``"tp=2,sp"``, ``"pp=2,vpp=2"``, ``"ep=2,dispatcher=allgather"``; empty -> world 1.

        Raises:
            SchemaError: unknown key or bad value.
        """
        kw: dict[str, Any] = {}
        for part in (text or "").replace(" ", "").split(","):
            if not part:
                continue
            if part == "sp":
                kw["sp"] = True
                continue
            k, _, v = part.partition("=")
            if k == "dispatcher":
                kw[k] = v
            elif k in ("tp", "pp", "ep", "cp", "dp", "vpp") and v.isdigit():
                kw[k] = int(v)
            else:
                raise SchemaError(f"parallel spec {text!r}: cannot read {part!r} (keys: tp, pp, "
                                  "vpp, ep, cp, dp, sp, dispatcher)")
        return cls(**kw)

    def describe(self) -> str:
        s = [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "ep", "dp") if getattr(self, k) > 1]
        if self.vpp:
            s.append(f"vpp={self.vpp}")
        if self.sp:
            s.append("sp")
        if self.ep > 1:
            s.append(f"dispatcher={self.dispatcher}")
        return ",".join(s) or "world 1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, spec: ParallelSpec, fn: Callable, args: tuple):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from routereplay.errors import RouteReplayError
    init(spec, rank, world)
    try:
        fn(rank, *args)
    except (RouteReplayError, OSError, ValueError) as e:
        # NOTE: a clear one-line error (the parent sees only a non-zero exit code).
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    finally:
        teardown()


def launch(spec: ParallelSpec, fn: Callable, *args: Any) -> None:
    """Run ``fn(rank, *args)`` on every rank of ``spec`` (gloo on this machine).

    World size 1 runs in this process; larger worlds are spawned processes (torch
    multiprocessing); an exception on any rank is raised here.
    """
    world = spec.world_size
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        init(spec, 0, 1)
        try:
            fn(0, *args)
        finally:
            teardown()
        return
    import torch.multiprocessing as mp
    from routereplay.errors import RouteReplayError
    try:
        mp.spawn(_entry, args=(world, free_port(), spec, fn, args), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        raise RouteReplayError(f"a trainer rank failed ({e}); see the rank's error above") from None


def init(spec: ParallelSpec, rank: int, world: int, backend: str = "gloo") -> None:
    """CPU shim (without CUDA only), the process group (``backend``: gloo, or nccl on
    GPUs) and megatron's model-parallel state for ``spec``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from trainer_hooks.megatron.harness.cpu_shim import apply_cpu_shim
    apply_cpu_shim()
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp, context_parallel_size=spec.cp,
        expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=1)


def teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        # NOTE: also at world size 1: gloo groups left to interpreter exit can abort it
        # ("terminate called without an active exception", seen once in CI).
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def config_overrides(spec: ParallelSpec, recompute: bool) -> dict[str, Any]:
    """TransformerConfig fields for ``spec`` (and full activation recompute)."""
    kw: dict[str, Any] = dict(
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=1,
        context_parallel_size=spec.cp, sequence_parallel=spec.sp,
        moe_token_dispatcher_type=spec.dispatcher, pipeline_dtype=torch.float32)
    if spec.vpp:
        kw["virtual_pipeline_model_parallel_size"] = spec.vpp
    if spec.pp == 2:
        # NOTE: with pp=2 the pipeline ring's next and previous rank are the same peer.
        # _batched_p2p_ops posts send_prev before send_next on one side and recv_prev before
        # recv_next on the other, so under gloo (in-order matching per peer) an interleaved
        # (VPP) training step silently swaps activations and gradients of equal shape
        # (measured: wrong log-probs from the 3rd microbatch on, also without replay).
        # megatron's unbatched _p2p_ops orders both sides consistently.
        kw["batch_p2p_comm"] = False
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    return kw


def build_chunks(hf: dict[str, Any], config, spec: ParallelSpec, *,
                 max_sequence_length: int = 4096, use_te: bool = False) -> list:
    """GPTModel chunks of this rank (one, or ``vpp`` with interleaving) for the HF
    Qwen3-MoE config ``hf`` and its megatron ``config`` (qwen3_moe.transformer_config):
    megatron's local layer spec, or Transformer Engine's with ``use_te``.

    NOTE: megatron-core keeps RouterReplay instances in a class-level list; it is cleared
    first so it holds exactly this rank's routers.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from trainer_hooks.megatron.harness.qwen3_moe import rotary_base
    RouterReplay.clear_global_router_replay_instances()
    chunks = []
    for vp in (range(spec.vpp) if spec.vpp else [None]):
        if vp is None:
            pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
            block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
        else:
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                               vp_stage=vp)
        m = GPTModel(config=config, transformer_layer_spec=block, vocab_size=hf["vocab_size"],
                     max_sequence_length=max_sequence_length, position_embedding_type="rope",
                     rotary_base=rotary_base(hf),
                     share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
                     parallel_output=False, pre_process=pre, post_process=post,
                     **({"vp_stage": vp} if vp is not None else {}))
        chunks.append(m)
    return chunks


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def load_sharded(chunks: list, full: dict[str, torch.Tensor], config) -> None:
    """Copy a world-1 megatron state dict (qwen3_moe.hf_to_megatron_state_dict) into this
    rank's chunks: local layer i -> its global layer number, local expert i -> global expert
    ``ep_rank * num_local + i``, tensor-parallel weights cut along their partition dim (the
    SwiGLU fc1 [gate; up] is cut per half, megatron's layout).

    Raises:
        KeyError: a local parameter has no source or its shape cannot be a TP shard.
    """
    from megatron.core import parallel_state as ps
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    n_local = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    with torch.no_grad():
        for ch in chunks:
            glob = {i: int(layer.layer_number) - 1 for i, layer in enumerate(ch.decoder.layers)}
            for name, p in ch.named_parameters():
                src = _LAYER.sub(lambda m: f"decoder.layers.{glob[int(m.group(1))]}.", name)
                src = _EXPERT.sub(lambda m: f".local_experts.{ep_rank * n_local + int(m.group(1))}.",
                                  src)
                if src not in full:
                    raise KeyError(f"no source weight for {name} (looked for {src})")
                f = full[src]
                if f.shape != p.shape:
                    dims = [d for d in range(f.dim()) if f.shape[d] != p.shape[d]]
                    if len(dims) != 1 or f.shape[dims[0]] != p.shape[dims[0]] * tp:
                        raise KeyError(f"{name}: local shape {tuple(p.shape)} is not a tp={tp} "
                                       f"shard of {tuple(f.shape)}")
                    d = dims[0]
                    if name.endswith("mlp.linear_fc1.weight") and config.gated_linear_unit:
                        f = torch.cat([h.chunk(tp, d)[tp_rank] for h in f.chunk(2, d)], d)
                    else:
                        f = f.chunk(tp, d)[tp_rank]
                p.copy_(f.to(p.dtype))
