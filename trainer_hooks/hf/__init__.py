"""Reference routing replay for Hugging Face transformers MoE models (no Megatron).

For users who train with FSDP, TRL or plain PyTorch, and as a cross-check of the Megatron
path. Supported: transformers 5.x, whose MoE blocks route through a ``*TopKRouter`` module
returning ``(router_logits, top_k_weights, top_k_index)`` (Qwen2-MoE, Qwen3-MoE, Mixtral).
Importing checks the installed version and raises ImportError on another.
"""
from __future__ import annotations

from importlib import metadata

SUPPORTED = ((5, 0), (6, 0))


def transformers_version() -> str:
    """Installed transformers version; ImportError if absent or unsupported."""
    try:
        v = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        raise ImportError("trainer_hooks.hf needs transformers: pip install 'transformers>=5'") from None
    mm = tuple(int(x) for x in v.split("+")[0].split(".")[:2] if x.isdigit())
    if not (SUPPORTED[0] <= mm < SUPPORTED[1]):
        raise ImportError(f"transformers {v} is not supported by trainer_hooks.hf: need 5.x "
                          "(MoE blocks with a TopKRouter returning logits, weights, indices)")
    return v


TRANSFORMERS_VERSION = transformers_version()
