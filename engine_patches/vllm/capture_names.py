"""The names the vLLM routing capture shares with its callers: the environment variables,
the ``SamplingParams.extra_args`` keys of a request's identity, and :class:`SidecarRef`,
the reference a request's routing is handed out as. Imports nothing (of vLLM or of
routereplay) at import time; below both
:mod:`engine_patches.vllm.plugin` (registration, the public face) and
:mod:`engine_patches.vllm.capture` (the patches)."""
from __future__ import annotations

import logging

ENV_SIDECAR = "ROUTEREPLAY_SIDECAR"
ENV_RESPONSE = "ROUTEREPLAY_RESPONSE"
ENV_CODEC = "ROUTEREPLAY_CODEC"
SAMPLE_ID_ARG = "routereplay_sample_id"
ATTEMPT_ARG = "routereplay_attempt"

log = logging.getLogger("routereplay.vllm")


class SidecarRef(str):
    """``routereplay:<stream>#<sample id>``: where a request's routing was written."""

    PREFIX = "routereplay:"

    @classmethod
    def make(cls, stream: str, sample_id: str) -> "SidecarRef":
        return cls(f"{cls.PREFIX}{stream}#{sample_id}")

    @staticmethod
    def parse(ref: str) -> tuple[str, str]:
        """(stream, sample id) of a reference string (split at the first ``#``: sample ids
        may contain ``#``, stream paths may not).

        Raises:
            ConfigError (a ValueError): not a routereplay reference.
        """
        if not ref.startswith(SidecarRef.PREFIX) or "#" not in ref:
            from routereplay.errors import ConfigError     # NOTE: lazy: see plugin.register
            raise ConfigError(f"not a routereplay sidecar reference: {ref[:80]!r}")
        stream, _, sid = ref[len(SidecarRef.PREFIX):].partition("#")
        return stream, sid
