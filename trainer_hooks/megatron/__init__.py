"""routereplay for megatron-core: feed recorded routing into its RouterReplay.

Importing this package checks the megatron-core version (0.16.x-0.19.x) and raises
ImportError on an unsupported one.
"""
from trainer_hooks.megatron.compat import MCORE_VERSION, apply_cpu_shim, remove_cpu_shim

__all__ = ["MCORE_VERSION", "apply_cpu_shim", "remove_cpu_shim"]
