"""Error types of routereplay.

Every error raised on bad input derives from :class:`RouteReplayError`, so callers
(and the fuzz tests) can tell our diagnostics from bugs.
"""
from __future__ import annotations


class RouteReplayError(Exception):
    """Base class of every error routereplay raises on bad input or bad state."""


class SchemaError(RouteReplayError, ValueError):
    """A model config or schema is unusable (no MoE layers, bad top_k, ...)."""


class RecordError(RouteReplayError, ValueError):
    """A routing record is inconsistent: wrong shape, id out of range, duplicate ids.

    The message names the sample id, the token position and the MoE layer where known.
    """


class SidecarError(RouteReplayError):
    """A sidecar stream cannot be read: wrong magic or version, corrupt frame.

    ``offset`` is the byte offset of the offending frame (None for header errors).
    """

    def __init__(self, message: str, offset: int | None = None, sample_id: str | None = None):
        super().__init__(message)
        self.offset = offset
        self.sample_id = sample_id


class AlignmentError(RouteReplayError, ValueError):
    """Routing rows do not line up with the trainer's tokens (count or schema mismatch)."""
