"""The lock that makes a sidecar reader thread-safe.

A reader's methods share one file position, its scan state and its caches, so a trainer's
prefetch thread and its caller may share a reader only if its calls take turns.
"""
from __future__ import annotations

import functools


def serialized(fn):
    """Decorate a method to run holding ``self._lock`` (a ``threading.RLock``)."""
    @functools.wraps(fn)
    def wrapper(self, *a, **k):
        with self._lock:
            return fn(self, *a, **k)
    return wrapper
