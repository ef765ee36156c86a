"""The record-key convention for verl batches (no verl import: the rollout side uses it too).

verl's ``uid`` is the GRPO group id: ``ray_trainer`` gives each prompt one
(``uuid4``) and ``DataProto.repeat(n, interleave=True)`` copies it to the prompt's n
samples, so it does not name a sample. The key of sample i of group ``uid`` (i = 0 .. n-1,
its place among the group's copies right after the repeat) is ``f"{uid}/{i}"``: the
convention the vLLM capture writes for the n completions of one ``n > 1`` request
(docs/vllm.md, "Sample identity"). Retries and aborts add vLLM's tails (``@<attempt>``,
``!aborted``) after it; prefill/decode legs add ``#prefill`` / ``#decode``
(routereplay.disaggregation.leg_key).
"""
from __future__ import annotations

from typing import Iterable

from routereplay.errors import AlignmentError

KEY_FIELD = "routereplay_id"
"""Non-tensor column of a verl batch holding each sample's record key (``sample_keys``):
set once after the repeat, it travels with the rows through verl's reorders (balance_batch),
unions, mini-batch splits and DP dispatch."""

MICROBATCH_FIELD = "routereplay_microbatch"
"""Non-tensor field :meth:`trainer_hooks.verl.VerlReplayer.step` sets on each of verl's
micro-batch TensorDicts: the key ``forward_step`` replays it under."""


def sample_keys(uids: Iterable[object]) -> list[str]:
    """Record keys ``f"{uid}/{i}"`` of a batch's samples, i counting the earlier samples
    with the same uid (so the n copies of a group made by ``repeat(n, interleave=True)``
    get ``/0 .. /n-1``).

    Call it where the indices are the rollout's (right after verl's ``repeat``, before
    ``balance_batch`` reorders rows) and store the result as the :data:`KEY_FIELD` column;
    on a reordered batch the keys are unique but do not name the rollout's sample index.

    Args:
        uids: one group id per sample (strings or objects with a ``str``).
    Returns:
        one key per sample, in batch order.
    Raises:
        AlignmentError: a uid that is empty or holds ``/`` or ``#`` (the key separators).
    """
    seen: dict[str, int] = {}
    out = []
    for j, u in enumerate(uids):
        u = str(u)
        if not u or "/" in u or "#" in u:
            raise AlignmentError(f"sample #{j}: uid {u!r} cannot name a record (empty, or "
                                 "holds '/' or '#', the key separators)")
        i = seen.get(u, 0)
        seen[u] = i + 1
        out.append(f"{u}/{i}")
    return out
