"""Run vLLM's Model Runner V2 on a machine without CUDA: Triton kernels in the interpreter.

vLLM 0.32 captures routed experts only in Model Runner V2, which it picks by default
wherever Triton is available (``VllmConfig.use_v2_model_runner``; it refuses routed-experts
capture on the V1 runner with a clear error). The CPU build of vLLM disables Triton unless
``triton.backends`` has a "cpu" entry (``vllm/triton_utils/importing.py``, evaluated once at
import). This module registers a stand-in "cpu" backend and sets ``TRITON_INTERPRET=1`` so
every ``@triton.jit`` kernel runs in Triton's numpy interpreter; vLLM then picks Model Runner
V2 by itself. It must run before vLLM is imported, in every engine process: :func:`install`
here, :func:`engine_env` for spawned engine processes (``_site/sitecustomize.py``).

Nothing is done on a machine with CUDA. Nothing of Triton or vLLM is edited on disk;
:func:`uninstall` removes the stand-in backend.
"""
from __future__ import annotations

import os

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def _has_cuda() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch: nothing to shim for
        return True


class _CpuInterpreterDriver:
    """Stand-in Triton driver: reports active so vLLM keeps Triton enabled on CPU."""

    @staticmethod
    def is_active() -> bool:
        return True


def install() -> bool:
    """Register the interpreter backend if there is no CUDA. Returns True if installed.

    Must run before ``import vllm``. Idempotent.
    """
    if _has_cuda():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.backends as tb
    if "cpu" not in tb.backends:
        tb.backends["cpu"] = tb.Backend(compiler=object, driver=_CpuInterpreterDriver)
    return True


def uninstall() -> None:
    """Remove the stand-in backend registered by :func:`install`."""
    try:
        import triton.backends as tb
    except ImportError:
        return
    b = tb.backends.get("cpu")
    if b is not None and b.driver is _CpuInterpreterDriver:
        del tb.backends["cpu"]


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that will start a vLLM engine on this machine: only what
    the machine needs.

    Without CUDA: the ``_site`` folder on PYTHONPATH (its sitecustomize calls
    :func:`install` at interpreter start-up, so engine-core and worker processes get the
    shim too) and ``TRITON_INTERPRET=1``. With CUDA: ``base`` (or this environment)
    unchanged; vLLM 0.32 picks Model Runner V2 by itself.
    """
    env = dict(os.environ if base is None else base)
    if not _has_cuda():
        pp = env.get("PYTHONPATH", "")
        if SITE_DIR not in pp.split(os.pathsep):
            env["PYTHONPATH"] = SITE_DIR + (os.pathsep + pp if pp else "")
        env.setdefault("TRITON_INTERPRET", "1")
    return env
