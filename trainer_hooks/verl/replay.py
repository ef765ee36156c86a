"""routereplay's replay in verl's megatron engine: :class:`VerlReplayer`.

Where its calls go in verl 0.9 (``verl/workers/engine/megatron/transformer_impl.py``,
``MegatronEngine``; docs/verl.md counts the lines):

- ``__init__`` / after ``_build_megatron_module``: ``self.rr = VerlReplayer(self.module,
  schema, mode=...)`` (the model chunks verl gives ``forward_backward_func``);
- ``forward_backward_batch``, around verl's ``forward_backward_func(...)`` call, after
  ``prepare_micro_batches``: ``with self.rr.step(data, micro_batches, indices,
  forward_only=forward_only):``;
- ``forward_step``, around the model call (``forward_fn(...)``): ``with
  self.rr.microbatch(batch, model):``.

The microbatch key reaches ``forward_step`` on verl's own micro-batch: ``step`` writes it
into each micro-batch TensorDict as the non-tensor field ``routereplay_microbatch``
(verl's ``tensordict_utils.assign_non_tensor``, the way verl itself tags
``num_micro_batch``); verl's schedule code (``make_batch_generator``, megatron's
``forward_backward_func``) is not edited.

R2 in verl's terms (``router_replay.mode=R2``: record in the old-log-prob pass, replay in
the update): with ``mode="R2"``, a forward-only step (``compute_log_prob``) is
``RouterReplayer.step(None, mbs, record=True)`` and keeps the recording; every training
step after it (each mini-batch of each PPO epoch, ``train_mini_batch``) replays that
recording, whatever micro-batches verl cuts. The recording is replaced by the next
forward-only step; :meth:`VerlReplayer.clear_recording` drops it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

from trainer_hooks.verl import check_verl_version

VERL_VERSION = check_verl_version()

from routereplay.errors import ConfigError  # noqa: E402
from routereplay.schema import RoutingSchema  # noqa: E402
from routereplay.source import TokenRowSource  # noqa: E402
from routereplay.token_layout import Layout, Shard  # noqa: E402
from trainer_hooks.megatron import ReplayStateError, RouterReplayer  # noqa: E402
from trainer_hooks.megatron.replayer import _current_shard  # noqa: E402
from trainer_hooks.core.stats import ReplayStep  # noqa: E402
from trainer_hooks.verl.batch import VerlBatch, field, from_verl  # noqa: E402
from trainer_hooks.verl.keys import KEY_FIELD, MICROBATCH_FIELD  # noqa: E402

__all__ = ["VerlReplayer"]

MODES = ("R3", "R2")


class VerlReplayer:
    """routereplay's :class:`RouterReplayer` fed from verl's batches and micro-batches.

    Args:
        model: the model chunks verl's engine runs (``self.module``; a list with VPP).
        schema: the routing schema (``RoutingSchema.from_hf_config(hf_config)``).
        mode: "R3" (replay the rollout's routing: ``routed_experts`` in the batch, or a
            sidecar source given to :meth:`step`) or "R2" (record the trainer's own routing
            in the forward-only pass, replay it in the update).
        packed: verl's THD path (``use_remove_padding=True``, verl's default for megatron);
            False: the padded rows as the model gets them.
        multiple: THD per-sequence alignment (``tp * cp * (2 if zigzag CP)``, 1 without
            TP/CP).
        thd: verl's THD packing, keyword arguments of ``routereplay.align.verl_thd_layout``
            (``trainer_hooks.verl.batch.thd_args_of(tf_config, engine_config)``: alignment,
            FP8 padding of the last sequence, ``min_local_rows``, CP layout); replaces
            ``multiple``. With ``cp_layout="contiguous"`` each step's shard takes that CP
            layout.
        **replayer_kwargs: passed to :class:`RouterReplayer` (``fallback``, ``prefetch``,
            ``min_coverage``, ...).
    Raises:
        ConfigError: an unknown mode. What RouterReplayer refuses (SchemaError ...).

    Attributes:
        replayer: the RouterReplayer.
        batch: the :class:`VerlBatch` of the current or last step.
        recorded: R2: the routing recorded by the last forward-only step (None before).
    """

    def __init__(self, model: Any, schema: RoutingSchema, *, mode: str = "R3",
                 packed: bool = True, multiple: int = 1, thd: dict[str, Any] | None = None,
                 **replayer_kwargs: Any):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.packed = packed
        self.multiple = multiple
        self.thd = None if thd is None else dict(thd)
        self.replayer = RouterReplayer(model, schema, **replayer_kwargs)
        self.schema = schema
        self.batch: VerlBatch | None = None
        self.recorded: TokenRowSource | None = None

    @property
    def stats(self):
        """The :class:`ReplayStats` of the current or last step (``as_metrics()``)."""
        return self.replayer.stats

    def clear_recording(self) -> None:
        """Drop the R2 recording (e.g. after the last PPO epoch of the step)."""
        self.recorded = None

    @contextlib.contextmanager
    def step(self, data: Any, micro_batches: Sequence[Any] | None = None,
             indices: Sequence[Sequence[int]] | None = None, *, forward_only: bool,
             source: Any = None, record: bool | None = None,
             layouts: Sequence[Layout] | None = None,
             shard: Shard | None = None) -> Iterator[ReplayStep]:
        """Replay for one of verl's ``forward_backward_batch`` calls.

        Args:
            data: the batch the call got (TensorDict after ``left_right_2_no_padding``, or
                a padded DataProto / TensorDict); see trainer_hooks.verl.batch.
            micro_batches, indices: what ``prepare_micro_batches`` returned (index lists
                with dynamic batch size, None without); each micro-batch is tagged with its
                key (``routereplay_microbatch``).
            forward_only: verl's flag (log-prob pass) or the update.
            source: R3 from streams (the sidecar path): a routing source keyed like the
                batch (``routereplay_id`` / ``sample_keys``), e.g. ``open_sidecar(paths)``;
                default: the batch's ``routed_experts``.
            record: R2 only: record (default: ``forward_only``) or replay the recording.
            layouts: optional per-micro-batch layouts (see :func:`from_verl`).
            shard: this rank's CP/SP place (default: megatron's parallel_state, with the
                ``thd`` CP layout).
        Yields:
            the RouterReplayer's :class:`ReplayStep` (``stats``).
        Raises:
            ConfigError: R2 replay before any recording; R2 on a batch without the
                ``routereplay_id`` column; ``record`` with mode R3; micro-batches of verl's
                dynamic context parallelism (``local_cp_size``). What
                :func:`from_verl` and :meth:`RouterReplayer.step` refuse.
        """
        if record is not None and self.mode != "R2":
            raise ConfigError("record= is for mode='R2' (R3 replays the rollout's routing)")
        r2_record = self.mode == "R2" and (forward_only if record is None else record)
        if self.mode == "R2" and not r2_record and self.recorded is None:
            raise ConfigError("R2: a training step before any forward-only (recording) step: "
                              "run compute_log_prob first (verl's R2 order), or use mode='R3'")
        if self.mode == "R2" and field(data, KEY_FIELD) is None:
            # NOTE: keys derived per call (sample_keys of uid) name other samples in a
            # mini-batch holding part of a group; the recording must be keyed for good
            raise ConfigError(f"R2 replays a recording across mini-batches: the batch needs "
                              f"the {KEY_FIELD!r} column (trainer_hooks.verl.sample_keys, set "
                              "once after verl's repeat; docs/verl.md)")
        mbs_in = [data] if micro_batches is None else list(micro_batches)
        if any(field(mb, "local_cp_size") is not None for mb in mbs_in):
            # NOTE: RouterReplayer takes one Shard per step; dynamic CP gives each
            # micro-batch its own CP group (docs/verl.md "Limits")
            raise ConfigError("verl's dynamic context parallelism (micro-batches with "
                              "local_cp_size) is not supported: the replayer splits every "
                              "micro-batch of a step with one CP size")
        with_routing = self.mode == "R3" and source is None
        self.batch = vb = from_verl(data, self.schema, micro_batches, indices,
                                    packed=self.packed, multiple=self.multiple,
                                    thd=self.thd, layouts=layouts, with_routing=with_routing)
        for k, mb in enumerate(mbs_in):
            _tag(mb, k)
        if self.mode == "R3":
            src = vb.source if source is None else source
        else:
            src = None if r2_record else self.recorded
        if shard is None and (self.thd or {}).get("cp_layout", "zigzag") != "zigzag":
            shard = dataclasses.replace(_current_shard(self.replayer.config),
                                        cp_layout=self.thd["cp_layout"])
        with self.replayer.step(src, vb.microbatches, shard, record=r2_record) as st:
            yield st
        if r2_record:
            self.recorded = st.source()

    def microbatch(self, batch: Any, model: Any = None) -> contextlib.AbstractContextManager:
        """Context for the model call of one of verl's micro-batches in ``forward_step``.

        Args:
            batch: the micro-batch ``forward_step`` took from its iterator (tagged by
                :meth:`step`; ``batch.to(device)`` keeps the tag).
            model: the model chunk ``forward_step`` got (VPP: required).
        Raises:
            ReplayStateError: a micro-batch without the tag (not one of this step's).
        """
        return self.replayer.microbatch(_key(batch), model)


def _tag(mb: Any, k: int) -> None:
    if type(mb).__module__.startswith("tensordict"):
        from verl.utils import tensordict_utils as tu
        tu.assign_non_tensor(mb, **{MICROBATCH_FIELD: k})
    elif hasattr(mb, "meta_info"):                                  # DataProto
        mb.meta_info[MICROBATCH_FIELD] = k
    else:
        mb[MICROBATCH_FIELD] = k


def _key(mb: Any) -> int:
    if type(mb).__module__.startswith("tensordict"):
        from verl.utils import tensordict_utils as tu
        k = tu.get_non_tensor_data(mb, MICROBATCH_FIELD, None)
    elif hasattr(mb, "meta_info"):
        k = mb.meta_info.get(MICROBATCH_FIELD)
    else:
        k = mb.get(MICROBATCH_FIELD) if hasattr(mb, "get") else None
    if k is None:
        raise ReplayStateError(f"this micro-batch has no {MICROBATCH_FIELD!r} tag: it is not "
                               "one of the micro-batches given to VerlReplayer.step")
    return int(k)
