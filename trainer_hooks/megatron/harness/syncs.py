"""Counting host-device synchronisations of a training step (harness: tests, benchmarks).

- :class:`ReadBacks` (any device, CPU included): a TorchDispatchMode that counts ops which
  read a tensor value back to Python (``.item()``, ``bool()``, ``int()`` on a tensor:
  ``aten._local_scalar_dense`` and the other ``data_dependent_output`` ops) or whose output
  shape depends on tensor values (``nonzero``, ``masked_select``, ``unique``, boolean-mask
  indexing: ``dynamic_output_shape`` ops). On a GPU each of them waits for the device.
  A ``.cpu()`` of a CPU tensor is no op at all, so on a CPU machine copies to the host are
  not seen; on a GPU :func:`cuda_syncs` sees them.
- :func:`cuda_syncs` (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")`` for the block,
  counting the warnings it raises (every synchronising CUDA call torch makes).
"""
from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ReadBacks(TorchDispatchMode):
    """Counts value read-backs and data-dependent shapes per op name (``counts``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (torch.Tag.data_dependent_output in func.tags
                or torch.Tag.dynamic_output_shape in func.tags
                or (func is torch.ops.aten.index.Tensor and any(
                    i is not None and i.dtype == torch.bool for i in args[1]))):
            self.counts[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def cuda_syncs() -> Iterator[list]:
    """Yields a list that receives the message of every synchronising CUDA call torch makes
    in the block (``torch.cuda.set_sync_debug_mode``)."""
    seen: list[str] = []
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(old)
    seen.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())
