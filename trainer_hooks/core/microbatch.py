"""A microbatch's routing: the trainer's description of it (:class:`Microbatch`), the
step-entry check of the keyed map of them, and what the replayer holds for one
(microbatch, model chunk) once loaded (:class:`Loaded`) and in flight (:class:`Held`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.disaggregation import check_request_key
from routereplay.errors import AlignmentError, ConfigError, UnknownSampleError
from routereplay.source import RoutingSource


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One microbatch of the global batch: which records, laid out how.

    Attributes:
        sample_ids: record id of each sample, in batch order (sample j of the layout).
        layout: the trainer's token layout of the microbatch (routereplay.align.Layout).
        tokens: optional host token ids of the microbatch, compared with the records'
            token ids before replay (:func:`routereplay.align.check_tokens`), in any form
            :func:`routereplay.align.tokens_by_sample` takes; kept as one int64 array per
            sample.
    Raises:
        AlignmentError: sample ids that are a string or do not match the layout's sample
            count; tokens that do not match the layout.
    """

    sample_ids: tuple[str, ...]
    layout: align.Layout
    tokens: tuple[np.ndarray, ...] | None = dataclasses.field(default=None, compare=False,
                                                                repr=False)

    def __post_init__(self):
        if isinstance(self.sample_ids, (str, bytes)):
            raise AlignmentError("Microbatch.sample_ids must be a sequence of ids, not a string")
        object.__setattr__(self, "sample_ids", tuple(str(x) for x in self.sample_ids))
        if len(self.sample_ids) != self.layout.batch_size:
            raise AlignmentError(f"microbatch names {len(self.sample_ids)} samples but its "
                                 f"layout has {self.layout.batch_size}")
        if self.tokens is not None:
            object.__setattr__(self, "tokens",
                               tuple(align.tokens_by_sample(self.layout, self.tokens)))

    @classmethod
    def from_attention_mask(cls, sample_ids: Sequence[str], attention_mask: Any, *,
                            input_ids: Any = None, packed: bool = False,
                            multiple: int = 1) -> "Microbatch":
        """A microbatch of a padded batch (verl's bshd layout: left-padded prompt,
        right-padded response), laid out as the trainer feeds it: as is (bshd) or with the
        padding removed and the rows packed (THD, ``packed=True``, segments padded to a
        multiple of ``multiple``); see :meth:`routereplay.align.Layout.from_attention_mask`.

        Args:
            sample_ids: record id of each row.
            attention_mask: host [b, s] 0/1 or bool.
            input_ids: optional host int [b, s]; checked against the records' token ids.
        """
        if isinstance(sample_ids, (str, bytes)):
            raise AlignmentError("Microbatch.from_attention_mask: sample_ids must be a "
                                 "sequence of ids (one per row), not a string")
        layout = align.Layout.from_attention_mask(attention_mask, packed=packed,
                                                  multiple=multiple)
        tokens = None
        if input_ids is not None:
            ids = align.host_array(input_ids, "input_ids")
            mask = align.host_array(attention_mask, "attention_mask")
            if ids.shape != mask.shape:
                raise AlignmentError(f"input_ids {tuple(ids.shape)} and attention_mask "
                                     f"{tuple(mask.shape)} differ in shape")
            # NOTE: bshd: the batch itself, so that the check covers where each sample
            # sits; packed: the rows' tokens in order (the layout packs them as the mask says)
            tokens = [row[m != 0] for row, m in zip(ids, mask)] if packed else ids
        return cls(sample_ids=tuple(sample_ids), layout=layout, tokens=tokens)


def check_step_samples(mbs: Mapping[Any, Microbatch], source: RoutingSource) -> list[str]:
    """Every sample of the step with tokens in its layout is in ``source``, and no
    sample id is named twice (checked at step entry, before any compute). Returns
    those sample ids, in step order.

    Raises:
        ConfigError (a value not a Microbatch), AlignmentError (a sample id named twice),
        UnknownSampleError (missing from the source), RecordError (a P/D leg key).
    """
    seen: dict[str, tuple[Any, int]] = {}
    missing: list[tuple[str, Any]] = []
    for key, mb in mbs.items():
        if not isinstance(mb, Microbatch):
            raise ConfigError(f"microbatch {key!r}: expected a Microbatch, got "
                              f"{type(mb).__name__}")
        for j, (sid, n) in enumerate(zip(mb.sample_ids, mb.layout.lengths)):
            if n == 0:
                continue                     # an empty slot: nothing is fetched
            if sid in seen:
                k0, j0 = seen[sid]
                raise AlignmentError(f"sample {sid!r} is named twice in the step: "
                                     f"microbatch {k0!r} slot {j0} and microbatch "
                                     f"{key!r} slot {j} (one forward per sample and step)")
            seen[sid] = (key, j)
            check_request_key(sid)           # NOTE: a P/D leg is not a whole request
            if sid not in source:
                missing.append((sid, key))
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        named = ", ".join(f"{sid!r} (microbatch {key!r})" for sid, key in missing[:8])
        raise UnknownSampleError(f"{len(missing)} sample(s) of the step are not in the "
                                 f"routing source: {named}{more}", missing[0][0])
    return list(seen)


@dataclasses.dataclass
class Loaded:
    """Host side of one (microbatch, chunk), as the loader leaves it."""

    ids: torch.Tensor                  # int16/int32 [N, L_local, K] (pinned for CUDA), -1 = none
    tmap: align.TokenMap
    own_layers: tuple[bool, ...]       # per local layer: some row takes the own top-k
    replayed: tuple[int, ...]          # per local layer: real rows with recorded routing
    fallback: tuple[int, ...]          # per local layer: real rows without

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()


@dataclasses.dataclass
class Held:
    """One (microbatch, chunk) in flight: entered and not yet released."""

    loaded: Loaded
    ids: torch.Tensor                  # the loaded ids on the model's device
    used: dict[int, torch.Tensor]      # local layer -> int64 [N, K] selected in forward
    backward: bool = False


class BackwardTag(torch.autograd.Function):
    """Identity on a tensor whose backward calls ``cb()`` first: how a replayer learns that
    a microbatch's backward has reached a point (its last MoE layer, its output), without a
    host-device sync. ``BackwardTag.apply(x, cb)`` -> ``x`` (a view, same shape and dtype).
    """

    @staticmethod
    def forward(ctx, x, cb):
        ctx.cb = cb
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.cb()
        return g, None
