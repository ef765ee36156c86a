"""The embedded tiny MoE model of the demo: built locally, cached, no hub access.

A Qwen3-MoE (transformers ``Qwen3MoeForCausalLM``) with seeded random init:
4 decoder layers, layer 0 dense (``mlp_only_layers=[0]``), 16 experts, top-4,
head_dim 32, hidden 128, MoE intermediate 64 (the vLLM CPU kernels need head_dim >= 32
and MoE sizes that are multiples of 32), plus a byte-level BPE tokenizer trained locally.

NOTE: default init (std 0.02) makes routing flips nearly free (k3 KL ~1e-6), which is a
useless demo. Router weights ~N(0, 0.5) keep routing non-degenerate, expert weights
~N(0, 0.3) make the chosen experts visibly change the log-probs, and lm_head ~N(0, 0.2)
gives a peaked but not degenerate next-token distribution.

Needs torch, transformers and tokenizers (the ``engine`` extra); imported lazily.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

BUILD_VERSION = 2      # bump when the recipe below changes: the cache key includes it
VOCAB_SIZE = 512
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route each token to a few of many experts.",
    "Reinforcement learning with verifiable rewards samples rollouts from a policy.",
    "The trainer recomputes log probabilities and back-propagates the loss.",
    "Routing replay forces the trainer to use the experts the engine used.",
    "1 + 1 = 2, 2 + 2 = 4, 3 * 3 = 9. What is 12 + 30? The answer is 42.",
    "Hello world! This tokenizer was trained on a tiny corpus for a tiny model.",
    "Question: how many experts does each token use? Answer: four of sixteen.",
]


def default_cache_dir() -> str:
    """``$ROUTEREPLAY_CACHE`` or ``$XDG_CACHE_HOME/routereplay`` (default ~/.cache/routereplay)."""
    env = os.environ.get("ROUTEREPLAY_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "routereplay")


def tiny_model_path(cache_dir: str | None = None) -> str:
    """Folder of the cached tiny model (built on first use by :func:`ensure_tiny_model`)."""
    return os.path.join(cache_dir or default_cache_dir(), f"tiny-qwen3moe-v{BUILD_VERSION}")


def ensure_tiny_model(cache_dir: str | None = None) -> str:
    """Return the tiny model folder, building it once (atomically) if missing."""
    path = tiny_model_path(cache_dir)
    if os.path.exists(os.path.join(path, "routereplay_tiny.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=os.path.dirname(path))
    try:
        build_tiny_model(tmp)
        try:
            os.rename(tmp, path)
        except OSError:              # another process won the race
            if not os.path.exists(os.path.join(path, "routereplay_tiny.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tokenizer(out: str):
    """Train a byte-level BPE tokenizer with exactly VOCAB_SIZE entries and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    # NOTE: a random model can sample any id, so every id below VOCAB_SIZE must decode.
    n_extra = VOCAB_SIZE - len(fast)
    if n_extra > 0:
        fast.add_tokens([f"<|x{i}|>" for i in range(n_extra)])
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(out)
    return fast


def build_tiny_model(out: str, seed: int = 0) -> None:
    """Write the tiny Qwen3-MoE (fp32 safetensors), its tokenizer and a marker file to ``out``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fast = build_tokenizer(out)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[0],
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.0,
        bos_token_id=None, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "routereplay_tiny.json"), "w") as f:
        json.dump({"build_version": BUILD_VERSION, "seed": seed}, f)


def demo_prompts(n: int) -> list[str]:
    """``n`` deterministic prompts drawn from the tokenizer's corpus."""
    out = []
    for i in range(n):
        a, b = CORPUS[i % len(CORPUS)], CORPUS[(3 * i + 1) % len(CORPUS)]
        out.append(f"{a} {b.split('.')[0]} #{i}:")
    return out
