"""Model set-up for the examples: what your framework already has (a megatron-core GPT
model with ``moe_enable_routing_replay=True``), here the built-in tiny Qwen3-MoE on CPU
through routereplay's test harness (CPU shim of torch.cuda, gloo, HF -> megatron weights).
Nothing in it is needed on a GPU trainer."""
import os

import numpy as np
import torch

from trainer_hooks.megatron.harness import qwen3_moe
from trainer_hooks.megatron.harness.parallel import (ParallelSpec, build_chunks, free_port,
                                                     init, load_sharded)


def tiny_megatron(model_dir: str):
    """(model, HF config) at world size 1; routers as in the checkpoint."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init(ParallelSpec(), 0, 1)
    hf = qwen3_moe.load_hf_config(model_dir)
    cfg = qwen3_moe.transformer_config(hf)          # moe_enable_routing_replay=True
    model = build_chunks(hf, cfg, ParallelSpec())[0]
    load_sharded([model], qwen3_moe.hf_to_megatron_state_dict(
        qwen3_moe.load_hf_checkpoint(model_dir), hf), cfg)
    return model, hf


def model_inputs(input_ids: np.ndarray, attention_mask: np.ndarray):
    """megatron inputs of a padded [b, s] batch: tokens, position ids (from each row's first
    real token) and the 4-D attention mask (True = masked: causal, and padding)."""
    pad = torch.from_numpy(attention_mask).bool()
    pos = (pad.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.triu(torch.ones(pad.shape[1], pad.shape[1], dtype=torch.bool), 1)
    mask = causal[None] | ~(pad[:, None, :] & pad[:, :, None])
    return torch.from_numpy(input_ids).long(), pos, mask[:, None]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [b, s]: log-prob of token c at column c (0 at column 0)."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def packed_inputs(seqs: list[list[int]], multiple: int = 1):
    """megatron inputs of sequences packed back to back in one row (THD order, each
    segment padded to a multiple of ``multiple``): tokens and position ids [1, t], and
    the block-diagonal causal mask [1, 1, t, t] (True = masked). NOTE: CPU stand-in for
    ``PackedSeqParams`` (the local attention has none); the routers see the same token
    order."""
    lens = [-(-len(q) // multiple) * multiple for q in seqs]
    t = sum(lens)
    tokens = torch.zeros((1, t), dtype=torch.long)
    pos = torch.zeros((1, t), dtype=torch.long)
    seg = torch.full((t,), -1)
    a = 0
    for j, (q, n) in enumerate(zip(seqs, lens)):
        tokens[0, a:a + len(q)] = torch.tensor(q)
        pos[0, a:a + len(q)] = torch.arange(len(q))
        seg[a:a + len(q)] = j
        a += n
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    mask = causal | ~((seg[:, None] == seg[None, :]) & (seg[None, :] >= 0))
    return tokens, pos, mask[None, None]
