"""Old module names kept for one release (see each alias module's docstring)."""
from __future__ import annotations

import importlib
import sys
import warnings


def alias_module(old: str, new: str) -> None:
    """Make ``import old`` give module ``new`` (with a DeprecationWarning naming both)."""
    warnings.warn(f"{old} is deprecated: import {new}", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
