"""Reference routing replay for Hugging Face transformers MoE models (no Megatron).

The reference of ``routereplay verify --trainer hf`` and a cross-check of the Megatron path:
whole-batch forced ids, no microbatch keying or token checks. To train (FSDP2, TRL, plain
PyTorch) use trainer_hooks.fsdp (``verify --trainer fsdp``; docs/fsdp.md).
Supported: transformers 5.x, whose MoE blocks route through a ``*TopKRouter`` module
returning ``(router_logits, top_k_weights, top_k_index)`` (Qwen2-MoE, Qwen3-MoE, Mixtral).
Importing checks the installed version and raises ImportError on another.
"""
from __future__ import annotations

from routereplay.version_gate import require

SUPPORTED = ">=5,<6"


def transformers_version() -> str:
    """Installed transformers version; ImportError if absent or unsupported (5.x: MoE
    blocks with a TopKRouter returning logits, weights, indices)."""
    return require(("transformers",), SUPPORTED, what="trainer_hooks.hf",
                   hint="pip install 'routereplay[verify]'")


TRANSFORMERS_VERSION = transformers_version()

from trainer_hooks.hf.replay import hf_replay, replay_ids, token_logprobs  # noqa: E402

__all__ = ["hf_replay", "replay_ids", "token_logprobs", "TRANSFORMERS_VERSION", "SUPPORTED"]
