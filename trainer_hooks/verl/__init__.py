"""routereplay inside verl's megatron worker (verl 0.9.x): from the batch as verl's
``MegatronEngine.forward_backward_batch`` holds it to the replayer's routing source and
microbatch map in one call, and the microbatch key carried to ``forward_step`` on verl's
own micro-batch (docs/verl.md).

    from trainer_hooks.verl import VerlReplayer
    rr = VerlReplayer(self.module, schema, mode="R3")                    # engine init
    with rr.step(data, micro_batches, indices, forward_only=forward_only):
        losses_reduced = forward_backward_func(...)                      # verl's call
    with rr.microbatch(batch, model):                                    # in forward_step
        output = forward_fn(model, input_ids, ...)

Supported: verl >= 0.9, < 0.10 (``verl.utils.megatron.router_replay_utils`` layout,
``left_right_2_no_padding`` jagged batches, ``rearrange_micro_batches`` index lists).
Importing this package imports neither verl nor megatron-core; the modules that read verl's
batches (``batch``, ``replay``) check the verl version when they are imported and raise
ImportError on an unsupported one (:func:`check_verl_version`).
"""
from __future__ import annotations

from typing import Any

SUPPORTED_SPEC = ">=0.9,<0.10"
DISTS = ("verl",)

_LAZY = {
    "VerlReplayer": "trainer_hooks.verl.replay",
    "VerlBatch": "trainer_hooks.verl.batch",
    "from_verl": "trainer_hooks.verl.batch",
    "sample_keys": "trainer_hooks.verl.keys",
    "keys_of": "trainer_hooks.verl.batch",
    "KEY_FIELD": "trainer_hooks.verl.keys",
    "MICROBATCH_FIELD": "trainer_hooks.verl.keys",
}
__all__ = sorted(_LAZY) + ["VERL_VERSION", "check_verl_version"]


def check_verl_version(version: str | None = None) -> str:
    """The installed verl version (or ``version``), checked against :data:`SUPPORTED_SPEC`.

    Raises:
        ImportError: no verl, or an unsupported one; the message names the version found
            and the versions supported.
    """
    from routereplay.version_gate import require
    return require(DISTS, SUPPORTED_SPEC, what="trainer_hooks.verl (verl's megatron engine "
                   "batches: routed_experts, left_right_2_no_padding, rearrange_micro_batches)",
                   hint="pip install 'routereplay[verl]'", version=version)


def __getattr__(name: str) -> Any:
    from routereplay.version_gate import lazy_module_getattr
    return lazy_module_getattr(__name__, _LAZY, "VERL_VERSION", check_verl_version)(name)
