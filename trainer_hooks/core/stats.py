"""What a step reports: its counters (:class:`ReplayStats`, as metrics for a logger) and the
handle :meth:`RouterReplayer.step` yields (:class:`ReplayStep`, with the R2 source)."""
from __future__ import annotations

import dataclasses

from routereplay.source import TokenRowSource
from trainer_hooks.core.errors import ReplayStateError


@dataclasses.dataclass
class ReplayStats:
    """Counters of one step (read them after :meth:`RouterReplayer.step` exits).

    Attributes:
        bytes_decoded: id bytes this rank fetched from the source (at the record's dtype,
            uint8/uint16): only its samples, token ranges and layers.
        bytes_held: replay id bytes currently held, loaded ahead or in flight
            ([N, L_local, K] int16 (int32 above 32767 experts) per (microbatch, chunk),
            padding rows included).
        peak_bytes_held: maximum of bytes_held during the step (prefetched rows included).
        replayed_rows / fallback_rows: (token, layer) rows that used recorded routing / the
            fallback (padding rows excluded), counted on first forward only.
        dropped_assignments: (token, expert) assignments removed by capacity-factor token
            dropping after replay (0 without a capacity factor).
        microbatches: (microbatch, model chunk) loads in the step.
        prefetched: loads of them that ran on the background thread.
        peak_microbatches_held: most (microbatch, model chunk) entries in flight at once
            (entered and not yet released; prefetched ones not counted).
        load_seconds: time spent fetching, aligning and validating rows, on the background
            thread or in ``microbatch()`` (seconds).
        wait_seconds: time ``microbatch()`` blocked its caller: waiting for, or doing, the
            load, and starting the host-to-device copy (seconds).
        select_seconds: time spent in the routers' replay selection (seconds).
        token_checked_samples: samples whose trainer tokens were compared with the
            records' token ids (microbatches given ``tokens``).
        recorded_rows: (token, layer) rows recorded for R2 (``step(..., record=True)``),
            padding rows excluded.
        sorted_order_samples: samples of the step whose rows the source holds in sorted
            column order (:func:`routereplay.source.sorted_order_samples`; the step also
            warns once).
    """

    bytes_decoded: int = 0
    bytes_held: int = 0
    peak_bytes_held: int = 0
    replayed_rows: int = 0
    fallback_rows: int = 0
    dropped_assignments: int = 0
    microbatches: int = 0
    prefetched: int = 0
    peak_microbatches_held: int = 0
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    select_seconds: float = 0.0
    token_checked_samples: int = 0
    recorded_rows: int = 0
    sorted_order_samples: int = 0

    @property
    def blocking_seconds(self) -> float:
        """Time the replayer kept the training loop's thread busy: wait + select (seconds)."""
        return self.wait_seconds + self.select_seconds

    def as_metrics(self, prefix: str = "routereplay/") -> dict[str, float]:
        """The step's counters as a flat ``{name: number}`` dict for a metrics logger
        (``wandb.log(stats.as_metrics(), step=...)``, TensorBoard ``add_scalar`` per item).

        Keys (after ``prefix``): ``replayed_fraction`` / ``fallback_fraction`` (of the
        (token, layer) rows, padding excluded; 0.0 when there were none),
        ``blocking_seconds`` and the counters above but ``bytes_held``, ``prefetched`` and
        ``peak_microbatches_held`` (units as there).
        """
        rows = self.replayed_rows + self.fallback_rows
        m = {"replayed_fraction": self.replayed_rows / rows if rows else 0.0,
             "fallback_fraction": self.fallback_rows / rows if rows else 0.0,
             "replayed_rows": self.replayed_rows, "fallback_rows": self.fallback_rows,
             "dropped_assignments": self.dropped_assignments,
             "bytes_decoded": self.bytes_decoded, "peak_bytes_held": self.peak_bytes_held,
             "blocking_seconds": self.blocking_seconds, "wait_seconds": self.wait_seconds,
             "select_seconds": self.select_seconds, "load_seconds": self.load_seconds,
             "microbatches": self.microbatches,
             "token_checked_samples": self.token_checked_samples,
             "recorded_rows": self.recorded_rows,
             "sorted_order_samples": self.sorted_order_samples}
        return {prefix + k: v for k, v in m.items()}


class ReplayStep:
    """What :meth:`RouterReplayer.step` yields.

    Attributes:
        stats: the step's :class:`ReplayStats` (final once the step has exited).
        recording: whether the step records routing (``record=True``).
    """

    def __init__(self, stats: ReplayStats, recording: bool):
        self.stats = stats
        self.recording = recording
        self._source: TokenRowSource | None = None

    def source(self) -> TokenRowSource:
        """R2: the routing every router used in the step, keyed by (sample, token position,
        MoE layer), as a routing source for a later ``step()`` (same rank).

        Raises:
            ReplayStateError: the step did not record, has not exited yet, or failed.
        """
        if not self.recording:
            raise ReplayStateError("this step did not record: use step(..., record=True)")
        if self._source is None:
            raise ReplayStateError("the recorded source exists once the recording step has "
                                   "exited without an error")
        return self._source
