"""megatron-core version gate of trainer_hooks.megatron.

Supported: megatron-core 0.16.x to 0.19.x (``RouterReplay`` and
``TransformerConfig.moe_enable_routing_replay`` exist from 0.16.0; 0.17+ declares
Python>=3.12 but its cp311 wheel works when installed with
``--no-deps --ignore-requires-python``).
"""
from __future__ import annotations

from routereplay.version_gate import require

SUPPORTED = ">=0.16,<0.20"

MCORE_VERSION = require(("megatron-core",), SUPPORTED, what="trainer_hooks.megatron",
                        hint="pip install 'routereplay[megatron]'")

__all__ = ["MCORE_VERSION", "SUPPORTED"]
