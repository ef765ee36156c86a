"""Routing replay for megatron-core: feed recorded routing into its MoE routers.

The product is :class:`RouterReplayer` (usage: trainer_hooks.megatron.replayer and
docs/megatron.md). Importing this package checks the megatron-core version
(trainer_hooks.megatron.version: 0.16.x-0.19.x) and raises ImportError on an unsupported
one. trainer_hooks.megatron.harness holds what proves the product on CPU (recompute driver,
parallel launch, CPU shim, HF checkpoint conversion); the product never imports it.
"""
from trainer_hooks.megatron.version import MCORE_VERSION
from routereplay.align import Layout, Shard  # noqa: E402
from trainer_hooks.megatron.config_checks import check_config  # noqa: E402
from trainer_hooks.core.errors import ReplayStateError, UnknownMicrobatchError  # noqa: E402
from trainer_hooks.core.microbatch import Microbatch  # noqa: E402
from trainer_hooks.megatron.replayer import RouterCall, RouterReplayer  # noqa: E402
from trainer_hooks.core.stats import ReplayStats, ReplayStep  # noqa: E402

__all__ = ["RouterReplayer", "Microbatch", "ReplayStats", "ReplayStep", "RouterCall", "Layout",
           "Shard", "check_config", "ReplayStateError", "UnknownMicrobatchError",
           "MCORE_VERSION"]
