"""CPU/gloo shim: megatron-core's MoE GPTModel forward/backward on a CPU-only torch.

Harness, not product: shared/recipes/megatron_cpu documents each failure it works around.
It only replaces attributes in this process (nothing on disk), does nothing when CUDA is
available, and :func:`remove_cpu_shim` restores every replaced attribute. Because it
patches ``torch.cuda`` process-wide, run it in processes of their own.
"""
from __future__ import annotations

import contextlib
from typing import Any

_saved: list[tuple[Any, str, Any]] = []


def _set(obj: Any, name: str, value: Any) -> None:
    _saved.append((obj, name, getattr(obj, name, _MISSING)))
    setattr(obj, name, value)


class _Missing:
    pass


_MISSING = _Missing()


class _FakeStream:
    """Stand-in for torch.cuda.Stream / Event on CPU: every operation is a no-op."""

    def __init__(self, *a, **k): pass
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _FakeStream()
    def record(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def __eq__(self, other): return isinstance(other, _FakeStream)
    def __hash__(self): return 0


class _CpuTorch:
    """``torch`` stand-in for megatron modules that hard-code device="cuda" in tensor
    factories (pipeline schedules, the default causal mask): rewrites it to "cpu"."""

    _FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange"}

    def __getattr__(self, name):
        import torch
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*a, **k):
                if str(k.get("device", "")).startswith("cuda"):
                    k["device"] = "cpu"
                return attr(*a, **k)
            return factory
        return attr


def apply_cpu_shim() -> bool:
    """Patch torch.cuda and a few megatron-core attributes so MoE GPTModel runs on CPU.

    Returns False (and does nothing) when CUDA is available or the shim is already on.
    Call after ``torch.distributed`` init or before, but before building the model.
    """
    import torch
    if torch.cuda.is_available() or _saved:
        return False
    stream = _FakeStream()
    # router.py moves logits to torch.cuda.current_device().
    _set(torch.cuda, "current_device", lambda: "cpu")
    # alltoall token dispatcher creates streams and events.
    _set(torch.cuda, "Stream", _FakeStream)
    _set(torch.cuda, "Event", _FakeStream)
    _set(torch.cuda, "current_stream", lambda *a, **k: stream)
    _set(torch.cuda, "default_stream", lambda *a, **k: stream)
    _set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _set(torch.cuda, "synchronize", lambda *a, **k: None)
    _set(torch.cuda, "is_current_stream_capturing", lambda: False)

    # CUDA RNG tracker (attention dropout, activation recompute): use the CPU generator.
    from megatron.core.tensor_parallel import random as mr
    _set(mr.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    _set(mr, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mr, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))

    # alltoall dispatcher: split sizes must become numpy for gloo even on CPU tensors.
    from megatron.core.transformer.moe import moe_utils as mu
    from megatron.core.transformer.moe import token_dispatcher as td

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    _set(mu, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _set(td, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    if not hasattr(mu, "te_general_gemm"):     # 0.16.x references it without TE (mcore_fixes)
        _set(mu, "te_general_gemm", None)

    # Sequence parallel with the local spec: build plain torch norms tagged sequence_parallel.
    from megatron.core.transformer import torch_norm as tn
    orig_new = tn.WrappedTorchNorm.__new__

    def wrapped_norm_new(cls, config, hidden_size, eps=1e-5, **kw):
        if not config.sequence_parallel:
            return orig_new(cls, config, hidden_size, eps, **kw)
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        m = norm_cls(normalized_shape=hidden_size, eps=eps)
        for prm in m.parameters():
            setattr(prm, "sequence_parallel", True)
        return m

    _set(tn.WrappedTorchNorm, "__new__", wrapped_norm_new)

    import megatron.core.pipeline_parallel.schedules as sch
    import megatron.core.transformer.utils as tu
    _set(sch, "torch", _CpuTorch())
    _set(tu, "torch", _CpuTorch())
    return True


def remove_cpu_shim() -> None:
    """Undo :func:`apply_cpu_shim` (restores every replaced attribute)."""
    while _saved:
        obj, name, old = _saved.pop()
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
