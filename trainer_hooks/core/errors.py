"""The replayer's own errors: a wrong state of use and an unknown microbatch key."""
from __future__ import annotations

from routereplay.errors import RouteReplayError


class UnknownMicrobatchError(RouteReplayError, KeyError):
    """``microbatch(key)`` with a key that is not in the step's microbatches (a KeyError,
    as before)."""

    def __str__(self) -> str:          # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class ReplayStateError(RouteReplayError, RuntimeError):
    """The replayer is used in a state where replay would be wrong: a nested or repeated
    ``step()``, ``microbatch()`` outside a step or nested in one of the same chunk, a second
    forward of a microbatch whose backward is pending, two replayers on one model (a
    RuntimeError, as before)."""
