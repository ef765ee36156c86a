"""Batch planning (harness): a rollout's records cut into this rank's microbatches.

Sample j of the global batch goes to data-parallel rank ``j % dp``; each rank's samples are
cut into microbatches of ``micro_batch_size`` and laid out right-padded, left-padded or
packed (THD, one row). Every rank gets the same number of microbatches of the same shape
(pipeline P2P needs fixed shapes): empty slots are zero-length samples (all padding), and
with VPP the count is rounded up to a multiple of pp.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from routereplay import align
from routereplay.errors import AlignmentError, ConfigError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from trainer_hooks.megatron import Microbatch
from trainer_hooks.megatron.harness.parallel import ParallelSpec

PADDINGS = ("right", "left", "packed")


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """One microbatch of this rank.

    Attributes:
        records: the record of each sample slot, None for an empty slot.
        sample_ids: id of each slot (``<empty m.i>`` for empty ones).
        layout: the token layout (routereplay.align.Layout).
        offsets: column of each slot's first token in its row (packed: in the one row).
    """

    records: tuple[RoutingRecord | None, ...]
    sample_ids: tuple[str, ...]
    layout: align.Layout
    offsets: tuple[int, ...]

    def microbatch(self) -> Microbatch:
        """The replayer's view of it."""
        return Microbatch(sample_ids=self.sample_ids, layout=self.layout)

    def row(self, j: int) -> int:
        """Row of slot j in the [b, s] batch tensors (0 for packed)."""
        return 0 if self.layout.packed else j


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """This rank's microbatches and the sequence length s they share (tokens)."""

    microbatches: tuple[MicrobatchPlan, ...]
    seq_len: int

    @property
    def rows_per_microbatch(self) -> int:
        """b of the [b, s] tensors: 1 packed, else the micro-batch size."""
        return 1 if self.microbatches[0].layout.packed else self.microbatches[0].layout.batch_size


@dataclasses.dataclass(frozen=True)
class MicrobatchTensors:
    """Model inputs of one microbatch, on the model's device.

    Attributes:
        tokens: int64 [b, s]; position_ids: int64 [b, s];
        attention_mask: bool [b, 1, s, s], True = masked (causal, padding masked out, packed
            samples attend only within themselves);
        response: float32 [b, s - 1], 1.0 where position p + 1 is a response token (the
            log-prob of token p + 1 sits at p).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    response: torch.Tensor


def check_records(records: Sequence[RoutingRecord], schema: RoutingSchema) -> None:
    """Records must carry token ids, a prompt length and engine log-probs, and the engine's
    row count (N - 1 - start rows for N tokens). Expert ids are checked by the routing source
    as each rank fetches its rows.

    Raises:
        AlignmentError / RecordError naming the sample.
    """
    for r in records:
        if r.token_ids is None or r.logprobs is None or r.prompt_len is None:
            raise AlignmentError(f"sample {r.sample_id!r}: the record holds no token ids, "
                                 "prompt length or engine log-probs to recompute")
        # the record's own checks, on its metadata (ids decoded with no layers here)
        dataclasses.replace(r, expert_ids=np.broadcast_to(
            np.arange(schema.top_k, dtype=schema.id_dtype),
            (r.num_tokens, schema.num_moe_layers, schema.top_k))).validate(schema)


def plan_microbatches(records: Sequence[RoutingRecord], spec: ParallelSpec, dp_rank: int,
                      micro_batch_size: int, padding: str) -> BatchPlan:
    """This data-parallel rank's microbatches (see the module doc).

    Raises:
        ConfigError: an unknown ``padding`` (right, left or packed).
    """
    if padding not in PADDINGS:
        raise ConfigError(f"padding must be right, left or packed, got {padding!r}")
    mbs = micro_batch_size
    dp = spec.dp
    per_rank = [list(records[d::dp]) for d in range(dp)]
    n_mb = max(1, max(-(-len(x) // mbs) for x in per_rank))
    if spec.vpp:
        # NOTE: megatron's interleaved schedule wants a multiple of pp microbatches.
        n_mb = -(-n_mb // spec.pp) * spec.pp
    mult = spec.tp if spec.sp else 1
    if padding == "packed":
        s = max(sum(len(r.token_ids) for r in per_rank[d][m * mbs:(m + 1) * mbs])
                for d in range(dp) for m in range(n_mb))
    else:
        s = max(len(r.token_ids) for r in records)
    s = -(-s // mult) * mult
    out = []
    for m in range(n_mb):
        grp: list[RoutingRecord | None] = list(per_rank[dp_rank][m * mbs:(m + 1) * mbs])
        lengths = [len(r.token_ids) for r in grp]
        if padding == "packed":
            lay = dataclasses.replace(align.Layout.packed_from_lengths(lengths), seq_len=s)
            offsets = list(lay.cu_seqlens_padded[:-1])
        else:
            grp += [None] * (mbs - len(grp))
            lengths += [0] * (mbs - len(lengths))
            lay = align.Layout(lengths=tuple(lengths), seq_len=s, padding=padding)
            offsets = [0 if padding == "right" else s - n for n in lengths]
        ids = tuple(r.sample_id if r is not None else f"<empty {m}.{i}>"
                    for i, r in enumerate(grp))
        out.append(MicrobatchPlan(records=tuple(grp), sample_ids=ids, layout=lay,
                                  offsets=tuple(offsets)))
    return BatchPlan(microbatches=tuple(out), seq_len=s)


def batch_tensors(plan: MicrobatchPlan, s: int, device: torch.device | str = "cpu"
                  ) -> MicrobatchTensors:
    """The model inputs of ``plan`` with sequence length ``s``, built on ``device``."""
    b = 1 if plan.layout.packed else plan.layout.batch_size
    tokens = torch.zeros((b, s), dtype=torch.long)
    pos = torch.zeros((b, s), dtype=torch.long)
    seg = torch.full((b, s), -1, dtype=torch.long)
    resp = torch.zeros((b, s - 1), dtype=torch.float32)
    for j, (r, a) in enumerate(zip(plan.records, plan.offsets)):
        if r is None:
            continue
        n = len(r.token_ids)
        row = plan.row(j)
        tokens[row, a:a + n] = torch.from_numpy(r.token_ids.astype(np.int64))
        pos[row, a:a + n] = torch.arange(n)
        seg[row, a:a + n] = j
        resp[row, a + r.prompt_len - 1:a + n - 1] = 1.0
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    mask = (causal | ~same)[:, None]
    # NOTE: built on the host from the plan (host data), copied once.
    return MicrobatchTensors(tokens=tokens.to(device), position_ids=pos.to(device),
                             attention_mask=mask.to(device), response=resp.to(device))
