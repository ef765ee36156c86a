"""Error types of routereplay.

Every error raised on bad input or bad state derives from :class:`RouteReplayError`, so
callers (and the fuzz tests) can tell our diagnostics from bugs. Where a builtin exception
was raised before (``KeyError`` for an unknown sample, ``ValueError`` for a bad argument),
the subclass also derives from that builtin, so ``except KeyError`` keeps working.
"""
from __future__ import annotations


class RouteReplayError(Exception):
    """Base class of every error routereplay raises on bad input or bad state."""


class ConfigError(RouteReplayError, ValueError):
    """A bad argument or option value (unknown codec, mode, layout option ...)."""


class SchemaError(RouteReplayError, ValueError):
    """A model config or schema is unusable (no MoE layers, bad top_k, ...)."""


class RecordError(RouteReplayError, ValueError):
    """A routing record is inconsistent: wrong shape, id out of range, duplicate ids.

    The message names the sample id, the token position and the MoE layer where known.
    """


class SidecarError(RouteReplayError):
    """A sidecar stream cannot be read: wrong magic or version, corrupt frame.

    Attributes:
        offset: byte offset of the offending frame (None for header errors).
        sample_id: the record concerned, where known.
        torn: the stream ends inside this frame (a killed writer), rather than holding a
            corrupt one.
    """

    def __init__(self, message: str, offset: int | None = None, sample_id: str | None = None,
                 torn: bool = False):
        super().__init__(message)
        self.offset = offset
        self.sample_id = sample_id
        self.torn = torn


class StreamExistsError(SidecarError, FileExistsError):
    """A writer's destination already exists: a writer never truncates, reopens or
    replaces a stream (or any file) unless told to (``SidecarWriter(replace=True)``).

    Attributes:
        path: the destination that exists.
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class UnknownSampleError(RouteReplayError, KeyError):
    """A sample id is not in a routing source (sidecar, in-memory records, batch).

    Attributes:
        sample_id: the id asked for.
    """

    def __init__(self, message: str, sample_id: str | None = None):
        super().__init__(message)
        self.sample_id = sample_id

    def __str__(self) -> str:          # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class AlignmentError(RouteReplayError, ValueError):
    """Routing rows do not line up with the trainer's tokens (count or schema mismatch)."""


class WeightSyncError(RouteReplayError):
    """A weight-sync step failed (vLLM or SGLang); the message names the step and says
    whether the engine was resumed or left paused."""
