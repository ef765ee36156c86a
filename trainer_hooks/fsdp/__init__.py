"""Routing replay for FSDP2 (and plain PyTorch) trainers of transformers 5 MoE models.

The product is :class:`FSDPReplayer` (usage: trainer_hooks.fsdp.replayer and docs/fsdp.md),
with the face of trainer_hooks.megatron's RouterReplayer: ``step(source, microbatches)``
and ``microbatch(key)`` around the trainer's own forward. Importing checks the installed
transformers version (5.x) and raises ImportError on another. It imports neither
megatron-core nor trainer_hooks.megatron: the engine-neutral parts (Microbatch, the
loader, the stats, the errors) come from trainer_hooks.core.
"""
from trainer_hooks.hf import TRANSFORMERS_VERSION
from routereplay.align import Layout  # noqa: E402
from trainer_hooks.fsdp.routers import SUPPORTED_ROUTERS, UnsupportedRouterError  # noqa: E402
from trainer_hooks.fsdp.replayer import FSDPReplayer, ulysses_layout  # noqa: E402
from trainer_hooks.core.errors import ReplayStateError, UnknownMicrobatchError  # noqa: E402
from trainer_hooks.core.microbatch import Microbatch  # noqa: E402
from trainer_hooks.core.stats import ReplayStats, ReplayStep  # noqa: E402

__all__ = ["FSDPReplayer", "Microbatch", "Layout", "ReplayStats", "ReplayStep",
           "ReplayStateError", "UnknownMicrobatchError", "UnsupportedRouterError",
           "SUPPORTED_ROUTERS", "TRANSFORMERS_VERSION", "ulysses_layout"]
