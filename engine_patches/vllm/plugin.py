"""vLLM plugin: stream every finished request's routing into sidecar streams, one closed,
indexed stream per weight version (the capture API).

Registered as the ``vllm.general_plugins`` entry point ``routereplay`` (pyproject.toml), so
vLLM loads it in every process it starts (API server, engine core, workers); and as the
``vllm.endpoint_plugins`` entry point ``routereplay`` (:mod:`engine_patches.vllm.endpoints`:
HTTP routes for ``vllm serve``, loaded only when ``VLLM_PLUGINS`` names it). This module
imports nothing of vLLM or of routereplay's vLLM code: :func:`register` does nothing (and
logs nothing) unless ``ROUTEREPLAY_SIDECAR`` is set; on an unsupported vLLM it logs one line
(version found, versions supported) and does nothing.

With ``ROUTEREPLAY_SIDECAR`` set and the engine started with
``--enable-return-routed-experts`` (``LLM(enable_return_routed_experts=True)``), every
finished request of offline ``LLM``, ``AsyncLLM`` and the OpenAI-compatible server is
written as one record (dense layers stripped, token ids, sampled-token log-probs when
requested, weight-version spans over all rows, ``routed_experts_prompt_start`` honoured).

Environment:

- ``ROUTEREPLAY_SIDECAR``: where streams go: a file path or fsspec URL, or a folder (path
  ending in ``/`` or an existing folder): ``vllm-<pid>.rrsc`` per front-end process
  (``vllm serve --api-server-count N`` has N). Stream n > 0 of a process is
  ``<stem>.<n:04d>.rrsc``.
- ``ROUTEREPLAY_RESPONSE=reference`` (opt-in): ``CompletionOutput.routed_experts`` becomes a
  :class:`SidecarRef` string ``routereplay:<stream>#<sample id>``, handed out only after
  the record's frame is written and flushed to the OS (readable at once by a reader on the
  same file system); served responses carry that small reference instead of the base64
  array. Default: vLLM's outputs and responses are unchanged.
- ``ROUTEREPLAY_CODEC``: routing codec of the streams (default: the writer's, ``xl-zstd``).

Stream lifecycle (one closed, indexed stream per policy version): every weight-version
change in this process (``LLM.update_weight_version``, ``finish_weight_update(weight_version=)``,
``AsyncLLM.update_weight_version``, the server's ``/update_weight_version``, routereplay's
``WeightSync`` and ``after_weight_update``) closes the open stream (index and trailer
written) and the next record opens a new one labelled with the new version; a record whose
final weight version this process has not seen (set through another API server) does the
same. :func:`rotate` closes it on request; :func:`streams` lists them.

Identity (the caller's): a record's key is the caller's sample id: ``SamplingParams
(extra_args={"routereplay_sample_id": uid})`` (offline ``LLM``; the server takes it as
``vllm_xargs``), else the request id (``AsyncLLM.generate(request_id=...)``; the server's
``request_id`` field); ``<uid>/<i>`` for each completion of an ``n > 1`` request. An
explicit ``"routereplay_attempt": N`` (N > 0) keys it ``<uid>@N``; an aborted completion is
stored under ``<key>!aborted`` (a retry reusing the uid is stored under the uid itself). A
key already written to the open stream is never renamed: the record is not written, and an
error naming both requests is logged and counted (``stats()["duplicates"]``).

A request whose routing is missing or malformed is never written as zeros: it is logged as
an error naming the request and counted (:func:`stats`); no failure of ours reaches vLLM's
output loop.
"""
from __future__ import annotations

import logging
import os
from typing import Any

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
            from routereplay.errors import ConfigError
            raise ConfigError(f"not a routereplay sidecar reference: {ref[:80]!r}")
        stream, _, sid = ref[len(SidecarRef.PREFIX):].partition("#")
        return stream, sid


def _check_label(label: Any) -> None:
    """:func:`routereplay.weight_versions.check_version_label`, as a ConfigError."""
    from routereplay.errors import ConfigError
    from routereplay.weight_versions import check_version_label
    try:
        check_version_label(label)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _streamer():
    import sys
    cap = sys.modules.get("engine_patches.vllm.capture")
    return None if cap is None else cap.STREAMER


def install(dest: str, *, reference: bool | None = None, codec: str | None = None,
            schema: Any = None, weight_version: str | None = None) -> None:
    """Stream finished requests' routing to ``dest`` in this process (see module doc).

    Args:
        dest: file path, fsspec URL, or folder.
        reference: hand out :class:`SidecarRef` references; None (default): as
            ``ROUTEREPLAY_RESPONSE`` says (``reference``), else not.
        codec: routing codec; None (default): ``ROUTEREPLAY_CODEC`` where set, else the
            writer's, ``xl-zstd``. (The framework review: a process that set the variable
            and called ``install()`` got ``xl-zstd`` streams, silently.)
        schema: the model's RoutingSchema, for an engine built before this call (otherwise
            taken from the next engine's config).
        weight_version: label of the first stream until its first record: records carry
            the engine's weight version (vLLM's is ``default`` until one is set), and a
            record of another version opens that version's stream. Set the first version
            on the engine (``llm.update_weight_version(v)``, or
            ``WeightSync(llm, initial_version=v)``) to have records labelled with it.
    Raises:
        ImportError: unsupported vLLM (names the version found and the versions supported).
        RouteReplayError: a bad destination or codec (at start-up, never later).
        ConfigError: a bad ``weight_version`` (as :func:`rotate`).

    Idempotent: a second call changes nothing.
    """
    if weight_version is not None:
        _check_label(weight_version)
    from engine_patches.vllm import capture
    if reference is None:
        reference = os.environ.get(ENV_RESPONSE, "") == "reference"
    capture.install(dest, reference=reference, codec=codec or os.environ.get(ENV_CODEC) or None,
                    schema=schema, weight_version=weight_version)


def installed() -> bool:
    """Whether capture is installed in this process."""
    return _streamer() is not None


def rotate(weight_version: str | None = None) -> str | None:
    """Close the open stream (index and trailer written: a reader opens it without a scan)
    and start a new one with the next record, labelled ``weight_version`` (default: the
    current label). Returns the closed stream's path, or None when nothing was written since
    the last rotation (no empty stream is made) or capture is not installed.

    Raises:
        ConfigError: ``weight_version`` is not a label of 1 to 256 printable ASCII
            characters (:func:`routereplay.weight_versions.check_version_label`; it goes
            into every later stream header), checked before anything is closed.
    """
    if weight_version is not None:
        _check_label(weight_version)
    st = _streamer()
    return None if st is None else st.rotate(weight_version)


def streams() -> list[Any]:
    """This process's streams in order: the closed ones, then the open one (if any), as
    ``StreamInfo(path, weight_version, records, closed)``."""
    st = _streamer()
    return [] if st is None else st.streams()


def stats() -> dict[str, Any]:
    """Counters of this process (written, missing, aborted, duplicates, errors), the open
    or last stream's path, the streams, and the seconds spent on the output path."""
    st = _streamer()
    return {} if st is None else st.stats()


def flush() -> None:
    """Make every record written so far readable (waits for the writer's queue)."""
    st = _streamer()
    if st is not None:
        st.flush()


def close() -> None:
    """Close the open stream (index and trailer written). Also runs at exit."""
    st = _streamer()
    if st is not None:
        st.close()


def uninstall() -> None:
    """Undo :func:`install` (the open stream is closed first)."""
    import sys
    cap = sys.modules.get("engine_patches.vllm.capture")
    if cap is not None:
        cap.uninstall()


def register() -> None:
    """vLLM ``general_plugins`` entry point: install when ``ROUTEREPLAY_SIDECAR`` is set.

    NOTE: everything is imported here, lazily: with the variable unset nothing of ours is
    imported and nothing is logged; on an unsupported vLLM one line says which version was
    found and which are supported (vLLM would log a traceback for an exception).
    """
    dest = os.environ.get(ENV_SIDECAR)
    if not dest:
        return
    from engine_patches.vllm import check_vllm_version
    try:
        check_vllm_version()
    except ImportError as e:
        log.error("routereplay: routing capture is off: %s", e)
        return
    install(dest)                   # NOTE: install reads ROUTEREPLAY_RESPONSE and _CODEC
