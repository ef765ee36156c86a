"""routereplay: carry MoE routing from the rollout engine to the trainer and replay it.

Core package: engine- and trainer-independent (numpy, zstandard; torch optional). docs/ARCHITECTURE.md maps the parts and the data flow.

Shape legend (used by every docstring in routereplay, engine_patches and trainer_hooks):

==========  ================================================================================
T           routing rows of a record: token positions ``start .. start + T - 1``
            (``T = N - 1 - start``: the last sampled token is never fed through the model)
N           tokens of a sequence (prompt + generated); in alignment, router rows of a rank
L           decoder layers of the model (``num_hidden_layers``), dense and MoE
L_moe       MoE layers of the model (``RoutingSchema.moe_layer_ids``): a record's layer axis
L_g         MoE layers of one routing section of a sidecar record (a layer group)
L_local     MoE layers a trainer rank or model chunk holds (pipeline stage, VPP chunk)
K           experts per token per MoE layer (``top_k``)
E           logical routed experts per MoE layer (``num_experts``); shared experts excluded
==========  ================================================================================

Expert ids are logical ids in ``[0, E)`` (before any EPLB mapping), stored as uint8 up to
256 experts and uint16 above (vLLM 0.32 ``CompletionOutput.routed_experts``); positions on
the MoE-layer axis are called ``moe_layers``, decoder-layer indices ``layer_ids``.
"""
from routereplay.errors import (AlignmentError, ConfigError, RecordError, RouteReplayError,
                                SchemaError, SidecarError, UnknownSampleError,
                                WeightSyncError)
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar import MultiSidecarReader, SidecarReader, SidecarWriter, open_sidecar
from routereplay.source import InMemorySource, NoRouting, RoutingSource

__version__ = "0.3.0"
__all__ = ["RoutingSchema", "RoutingRecord", "WeightVersionSpan", "SidecarWriter",
           "SidecarReader", "MultiSidecarReader", "open_sidecar", "RoutingSource", "InMemorySource", "NoRouting",
           "RouteReplayError", "ConfigError", "SchemaError", "RecordError", "SidecarError",
           "UnknownSampleError", "AlignmentError", "WeightSyncError"]
