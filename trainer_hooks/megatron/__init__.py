"""Routing replay for megatron-core: feed recorded routing into its MoE routers.

The product is :class:`RouterReplayer` (see trainer_hooks.megatron.replayer and
docs/megatron.md)::

    from trainer_hooks.megatron import Layout, Microbatch, RouterReplayer

    replayer = RouterReplayer(model, schema)
    with replayer.step(source, {k: Microbatch(ids_k, Layout(...)) for k ...}) as step:
        forward_backward_func(...)     # forward_step wraps the model call in
                                       # `with replayer.microbatch(key, chunk):`
    log(step.stats.as_metrics())

Importing this package checks the megatron-core version (trainer_hooks.megatron.version:
0.16.x-0.19.x) and raises ImportError on an unsupported one. trainer_hooks.megatron.harness
holds what proves the product on CPU (recompute driver, parallel launch, CPU shim, HF
checkpoint conversion); the product never imports it.
"""
from trainer_hooks.megatron.version import MCORE_VERSION
from routereplay.align import Layout, Shard  # noqa: E402
from trainer_hooks.megatron.replayer import (Microbatch, ReplayStateError,  # noqa: E402
                                             ReplayStats, ReplayStep, RouterCall,
                                             RouterReplayer, UnknownMicrobatchError,
                                             check_config)

__all__ = ["RouterReplayer", "Microbatch", "ReplayStats", "ReplayStep", "RouterCall", "Layout",
           "Shard", "check_config", "ReplayStateError", "UnknownMicrobatchError",
           "MCORE_VERSION"]
