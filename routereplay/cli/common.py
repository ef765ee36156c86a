"""What the commands share: the usage error, text safe for a terminal, progress bars,
optional packages, and opening the sidecar arguments."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable

from routereplay.errors import ConfigError


class UsageError(ConfigError):
    """A bad option or option combination (exit status 2)."""


def progress(it: Iterable, a: argparse.Namespace, **kw: Any) -> Iterable:
    """``it`` wrapped in a tqdm bar on a terminal, unless --no-progress or tqdm is absent."""
    if getattr(a, "no_progress", False):
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, disable=None, file=sys.stderr, **kw)


def require(*modules: str) -> None:
    """Check, before any long step, that optional packages are installed.

    Raises:
        ModuleNotFoundError: the first one missing (main() prints one line naming the
            extra that provides it).
    """
    import importlib.util
    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ModuleNotFoundError(f"No module named {m!r}", name=m)


def printable(text: str) -> str:
    """``text`` with control characters and lone surrogates escaped, continuation lines
    indented: nothing read from a file can fake a line of ours (an ``error:`` line)."""
    out = "".join(c if c.isprintable() or c == "\n" else
                  c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text)
    return out.replace("\n", "\n  ")


def open_streams(paths: list[str], a: argparse.Namespace | None = None):
    """A reader for the sidecar arguments: one stream, or several (files, folders, globs)
    read as one; ``--no-floors`` (``a.no_floors``) for trusted streams of earlier writers."""
    from routereplay.sidecar import open_sidecar
    return open_sidecar(paths if len(paths) > 1 else paths[0],
                        floors=not getattr(a, "no_floors", False))
