"""Workarounds for megatron-core bugs the harness meets (process-wide, reversible).

- megatron-core 0.16.1 without Transformer Engine: ``moe_utils.router_gating_linear``
  (``moe_router_dtype="fp32"`` or ``"fp64"``) tests ``te_general_gemm is not None``, but the
  name is only bound when the TE import succeeds, so a model without TE raises
  ``NameError: name 'te_general_gemm' is not defined`` in its first router call (on CUDA;
  measured on an H200). Binding the name to None selects megatron's own ``torch.mm`` path.
  megatron's files are not edited.
"""
from __future__ import annotations

from typing import Callable


def bind_te_general_gemm() -> Callable[[], None] | None:
    """Bind ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` where the
    module lacks the name (0.16.x without Transformer Engine).

    Returns:
        a function that removes the binding again, or None when nothing was needed.
    """
    from megatron.core.transformer.moe import moe_utils as mu
    if hasattr(mu, "te_general_gemm"):
        return None
    mu.te_general_gemm = None

    def undo() -> None:
        if hasattr(mu, "te_general_gemm") and mu.te_general_gemm is None:
            del mu.te_general_gemm
    return undo
