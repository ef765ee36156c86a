"""routereplay: carry MoE routing from the rollout engine to the trainer and replay it.

Core package: engine- and trainer-independent (numpy and zstandard only).
"""
from routereplay.errors import (AlignmentError, RecordError, RouteReplayError, SchemaError,
                                SidecarError)
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader, SidecarWriter

__version__ = "0.1.0"
__all__ = ["RoutingSchema", "RoutingRecord", "WeightVersionSpan", "SidecarWriter",
           "SidecarReader", "RouteReplayError", "SchemaError", "RecordError", "SidecarError",
           "AlignmentError"]
