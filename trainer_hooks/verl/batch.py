"""A verl batch as routereplay's routing source and microbatch map (:func:`from_verl`).

What it reads, as verl 0.9's megatron worker holds it (``MegatronEngine.
forward_backward_batch``): a TensorDict after ``left_right_2_no_padding`` (``input_ids``
nested ``[b, j]``, ``routed_experts`` nested ``[b, j, L_all, K]``, ``uid`` and other
non-tensor columns) or a padded ``DataProto`` / TensorDict (``input_ids``,
``attention_mask`` ``[b, s]``, ``routed_experts`` int16 ``[b, s, L_all, K]`` with the
engine's N-1 rows after the left padding and a zero placeholder in the last real column);
and verl's micro-batches with the index lists ``rearrange_micro_batches`` returns (dynamic
batch size: they reorder samples), or the contiguous chunks of ``chunk_tensordict``.

Shapes: b samples, s padded columns, j jagged tokens, L_all decoder layers (dense layers'
slots are zero), K = top_k.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

from trainer_hooks.verl import check_verl_version

VERL_VERSION = check_verl_version()

from routereplay.errors import AlignmentError, ConfigError  # noqa: E402
from routereplay.memory_source import InMemorySource  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.token_layout import (Layout, host_array, jagged_parts,  # noqa: E402
                                      verl_thd_layout)
from trainer_hooks.core.microbatch import Microbatch  # noqa: E402
from trainer_hooks.verl.keys import KEY_FIELD, sample_keys  # noqa: E402

__all__ = ["VerlBatch", "from_verl", "keys_of", "field", "thd_args_of"]


def thd_args_of(tf_config: Any, engine_config: Any = None,
                local_cp_size: int | None = None) -> dict[str, Any]:
    """The THD packing verl 0.9's megatron engine gives the model for ``tf_config`` (and
    ``engine_config``, verl's ``McoreEngineConfig``: ``use_fused_kernels``; None: False),
    as keyword arguments of :func:`routereplay.align.verl_thd_layout`.

    - ``tp``, ``cp``: ``tensor_model_parallel_size``, ``context_parallel_size`` (or the
      micro-batch's ``local_cp_size`` with dynamic CP);
    - ``cp_layout``: "contiguous" for ``experimental_attention_variant == "dsv4_hybrid"``,
      else "zigzag" (verl's ``_context_parallel_layout``);
    - ``fp8``: ``tf_config.fp8`` in ("e4m3", "hybrid") (verl's ``use_fp8_padding``);
    - ``min_local_rows``: ``csa_window_size`` with dsv4_hybrid and
      ``engine_config.use_fused_kernels`` (verl's default: False): only verl's fused forward
      (``models/mcore/model_forward_fused.py``) pads the last sequence so; its plain forward
      (``model_forward.py``) does not.

    NOTE: verl's own replay (``router_replay_utils.set_router_replay_data``) pads with
    ``min_local_rows`` for dsv4_hybrid whether or not the fused kernels run; with the plain
    forward its replay buffer is then longer than the model's token rows (docs/verl.md,
    "Where verl and routereplay differ"). This follows the model's forward.
    """
    dsv4 = getattr(tf_config, "experimental_attention_variant", None) == "dsv4_hybrid"
    use_fused_kernels = bool(getattr(engine_config, "use_fused_kernels", False))
    return dict(tp=int(getattr(tf_config, "tensor_model_parallel_size", 1) or 1),
                cp=int(local_cp_size or getattr(tf_config, "context_parallel_size", 1) or 1),
                cp_layout="contiguous" if dsv4 else "zigzag",
                fp8=getattr(tf_config, "fp8", None) in ("e4m3", "hybrid"),
                min_local_rows=getattr(tf_config, "csa_window_size", None)
                if dsv4 and use_fused_kernels else None)


def field(data: Any, name: str, default: Any = None) -> Any:
    """Column ``name`` of a verl batch: a ``DataProto`` (``batch`` tensors, then
    ``non_tensor_batch`` arrays), a TensorDict (verl's ``tensordict_utils.get``: non-tensor
    stacks as lists) or a plain mapping; ``default`` when absent."""
    if hasattr(data, "non_tensor_batch") and hasattr(data, "batch"):     # DataProto
        if data.batch is not None and name in data.batch.keys():
            return data.batch[name]
        return data.non_tensor_batch.get(name, default)
    if type(data).__module__.startswith("tensordict"):
        from verl.utils import tensordict_utils as tu
        return tu.get(data, name, default)
    return data.get(name, default) if hasattr(data, "get") else default


def keys_of(data: Any) -> list[str]:
    """Each sample's record key: the :data:`~trainer_hooks.verl.keys.KEY_FIELD` column
    (``routereplay_id``) when the batch has it, else ``sample_keys(uid)``.

    Raises:
        ConfigError: neither column; AlignmentError: a key named twice.
    """
    ids = field(data, KEY_FIELD)
    if ids is None:
        uids = field(data, "uid")
        if uids is None:
            raise ConfigError(f"the verl batch has neither a {KEY_FIELD!r} nor a 'uid' "
                              "column: no sample can be named")
        return sample_keys(list(uids))
    ids = [str(x) for x in list(ids)]
    if len(set(ids)) != len(ids):
        dup, count = collections.Counter(ids).most_common(1)[0]
        raise AlignmentError(f"{KEY_FIELD}: sample key {dup!r} is given to "
                             f"{count} samples (one key per sample: sample_keys)")
    return ids


def _lengths(data: Any, what: str) -> list[int]:
    """Real tokens per sample: the nested input_ids' parts, else the attention mask's rows."""
    ids = field(data, "input_ids")
    if ids is not None and getattr(ids, "is_nested", False):
        import torch
        if ids.layout == torch.jagged:
            return [int(x) for x in ids.offsets().diff().tolist()]
        return [int(t.shape[0]) for t in ids.unbind()]            # strided nested
    mask = field(data, "attention_mask")
    if mask is None:
        raise ConfigError(f"{what}: needs nested input_ids or an attention_mask")
    return [int(x) for x in (mask != 0).sum(-1).tolist()]


@dataclasses.dataclass
class VerlBatch:
    """A verl batch for routereplay.

    Attributes:
        sample_ids: record key of each sample of the batch, in batch order.
        source: the batch's ``routed_experts`` as an InMemorySource (None when the batch
            carries none: the sidecar path, a source given separately).
        microbatches: microbatch key (0 .. n-1, verl's micro-batch order) -> Microbatch.
        index: per microbatch key, the batch rows of its samples (verl's index list).
    """

    sample_ids: list[str]
    source: InMemorySource | None
    microbatches: dict[int, Microbatch]
    index: dict[int, list[int]]


def from_verl(data: Any, schema: RoutingSchema, micro_batches: Sequence[Any] | None = None,
              indices: Sequence[Sequence[int]] | None = None, *, packed: bool = True,
              multiple: int = 1, thd: dict[str, Any] | None = None,
              layouts: Sequence[Layout] | None = None,
              with_routing: bool = True, check_tokens: bool = True) -> VerlBatch:
    """The routing source and microbatch map of a verl batch, in one call.

    Args:
        data: the batch (module doc): DataProto or TensorDict, padded or jagged.
        schema: the records' routing schema (``RoutingSchema.from_hf_config``).
        micro_batches: verl's micro-batches of ``data`` (TensorDicts), in the order the
            schedule runs them; None: the whole batch is one microbatch.
        indices: the index lists ``rearrange_micro_batches`` / ``prepare_micro_batches``
            returned (dynamic batch size): micro-batch k holds rows ``indices[k]`` of
            ``data``; None: contiguous chunks in order (``chunk_tensordict``).
        packed: THD (verl's ``use_remove_padding``): the micro-batch's samples packed in
            order, each segment padded to a multiple of ``multiple`` tokens. False: the
            padded ``[b, s]`` rows as they are (needs ``attention_mask``).
        thd: keyword arguments of ``routereplay.align.verl_thd_layout`` (verl's packing:
            per-sequence alignment ``tp * cp * (2 if zigzag)``, FP8, ``min_local_rows``;
            :func:`thd_args_of` reads them from verl's ``tf_config``); replaces
            ``multiple`` for jagged micro-batches.
        layouts: optional per-micro-batch layouts replacing the ones ``packed`` builds.
        with_routing: build the source from ``routed_experts`` (False: the sidecar path
            or R2; the source is given to the replayer's step instead).
        check_tokens: give each Microbatch its tokens (compared with the records' before
            replay); needs host (CPU) input ids.
    Returns:
        a :class:`VerlBatch`.
    Raises:
        ConfigError: no ``routed_experts`` with ``with_routing``; index lists that do not
            cover the batch once; a micro-batch count that does not match.
        AlignmentError: a micro-batch whose samples (uid, length) are not the rows its
            index list names (names the micro-batch and slot); what
            ``InMemorySource.from_batch`` refuses (names sample, position, layer).
    """
    ids = keys_of(data)
    b = len(ids)
    lengths = _lengths(data, "the batch")
    if len(lengths) != b:
        raise AlignmentError(f"the batch has {len(lengths)} sequences but {b} sample keys")
    source = None
    if with_routing:
        routed = field(data, "routed_experts")
        if routed is None:
            raise ConfigError("the verl batch has no 'routed_experts' (R3 needs the rollout's "
                              "routing: enable_rollout_routing_replay, or pass a sidecar "
                              "source and with_routing=False)")
        toks = field(data, "input_ids")
        if getattr(routed, "is_nested", False):
            source = InMemorySource.from_batch(routed, None, ids, schema, input_ids=toks
                                               if getattr(toks, "is_nested", False) else None)
        else:
            source = InMemorySource.from_batch(routed, field(data, "attention_mask"), ids,
                                               schema, input_ids=toks)
    mbs_in = [data] if micro_batches is None else list(micro_batches)
    if indices is None:
        index, a = [], 0
        for mb in mbs_in:
            n = len(_lengths(mb, "a micro-batch"))
            index.append(list(range(a, a + n)))
            a += n
    else:
        index = [[int(i) for i in idx] for idx in indices]
        if len(index) != len(mbs_in):
            raise ConfigError(f"{len(index)} index lists for {len(mbs_in)} micro-batches")
    flat = sorted(i for idx in index for i in idx)
    if flat != list(range(b)):
        raise ConfigError(f"the micro-batches' index lists do not name each of the batch's "
                          f"{b} samples once (got {len(flat)} entries)")
    uids = field(data, "uid")
    uids = None if uids is None else list(uids)
    mbs: dict[int, Microbatch] = {}
    for k, (mb, idx) in enumerate(zip(mbs_in, index)):
        mb_len = _lengths(mb, f"micro-batch {k}")
        _check_rows(k, idx, mb, mb_len, lengths, uids)
        sids = [ids[i] for i in idx]
        lay = layouts[k] if layouts is not None else \
            verl_thd_layout(mb_len, **thd) if thd is not None else None
        mbs[k] = _microbatch(k, mb, sids, mb_len, packed, multiple, lay, check_tokens)
    return VerlBatch(sample_ids=ids, source=source, microbatches=mbs,
                     index={k: idx for k, idx in enumerate(index)})


def _check_rows(k: int, idx: list[int], mb: Any, mb_len: list[int], lengths: list[int],
                uids: Any) -> None:
    """Micro-batch k holds the rows its index list names (same lengths, same uids)."""
    if len(mb_len) != len(idx):
        raise AlignmentError(f"micro-batch {k} holds {len(mb_len)} samples but its index "
                             f"list names {len(idx)}")
    mb_uids = field(mb, "uid") if uids is not None else None
    mb_uids = None if mb_uids is None else list(mb_uids)
    for slot, (i, n) in enumerate(zip(idx, mb_len)):
        if lengths[i] != n:
            raise AlignmentError(f"micro-batch {k} slot {slot}: {n} tokens, but batch row {i} "
                                 f"its index list names has {lengths[i]} (index lists of "
                                 "another batch, or a micro-batch reordered after them)")
        if mb_uids is not None and str(mb_uids[slot]) != str(uids[i]):
            raise AlignmentError(f"micro-batch {k} slot {slot}: uid {mb_uids[slot]!r}, "
                                 f"but batch row {i} is uid {uids[i]!r}")


def _microbatch(k: int, mb: Any, sids: list[str], mb_len: list[int], packed: bool,
                multiple: int, layout: Layout | None, check_tokens: bool) -> Microbatch:
    ids = field(mb, "input_ids")
    nested = ids is not None and getattr(ids, "is_nested", False)
    tokens = None
    if nested:
        if not packed and layout is None:
            raise ConfigError(f"micro-batch {k}: jagged input_ids are packed (THD): "
                              "packed=False needs the padded batch")
        if check_tokens:
            tokens = jagged_parts(ids, f"input_ids of micro-batch {k}")
        lay = layout or Layout.packed_from_lengths(mb_len, multiple=multiple)
        return Microbatch(sample_ids=tuple(sids), layout=lay,
                          tokens=None if tokens is None else list(tokens))
    mask = field(mb, "attention_mask")
    if mask is None:
        raise ConfigError(f"micro-batch {k}: a padded micro-batch needs its attention_mask")
    if layout is not None:
        if check_tokens and ids is not None and layout.packed:
            # NOTE: the padded rows' real tokens, packed in order as the layout packs them
            m = host_array(mask, f"attention_mask of micro-batch {k}") != 0
            ids = [row[r] for row, r in zip(host_array(ids, f"input_ids of micro-batch {k}"), m)]
        return Microbatch(sample_ids=tuple(sids), layout=layout,
                          tokens=ids if check_tokens else None)
    return Microbatch.from_attention_mask(sids, mask, input_ids=ids if check_tokens else None,
                                          packed=packed, multiple=multiple)

