"""vLLM plugin: stream every finished request's routing into sidecar streams, one closed,
indexed stream per weight version (the capture API).

Registered as the ``vllm.general_plugins`` entry point ``routereplay`` (pyproject.toml),
loaded in every process vLLM starts, and as the ``vllm.endpoint_plugins`` entry point
(:mod:`engine_patches.vllm.endpoints`: HTTP routes for ``vllm serve``, loaded only when
``VLLM_PLUGINS`` names it). This module imports nothing of vLLM: :func:`register` does
nothing unless ``ROUTEREPLAY_SIDECAR`` is set (see :func:`register`).

With ``ROUTEREPLAY_SIDECAR`` set and ``--enable-return-routed-experts``
(``LLM(enable_return_routed_experts=True)``), every finished request of ``LLM``,
``AsyncLLM`` and the OpenAI-compatible server is written as one record (dense layers
stripped, token ids, sampled-token log-probs when requested, weight-version spans,
``routed_experts_prompt_start`` honoured).

Environment:

- ``ROUTEREPLAY_SIDECAR``: a file path or fsspec URL, or a folder (path ending in ``/`` or
  an existing folder: one uniquely named stream per front-end process,
  :func:`engine_patches.vllm.capture.unique_stream_stem`). Stream n > 0 of a process is
  ``<stem>.<n:04d>.rrsc``.
- ``ROUTEREPLAY_RESPONSE=reference`` (opt-in): ``CompletionOutput.routed_experts`` (and the
  served response) becomes a :class:`SidecarRef` string ``routereplay:<stream>#<sample
  id>``, handed out only once the record's frame is flushed to the OS. Default: vLLM's
  outputs are unchanged.
- ``ROUTEREPLAY_CODEC``: routing codec of the streams (default: the writer's, ``xl-zstd``).

Stream lifecycle: every weight-version change in this process (``update_weight_version``,
``finish_weight_update(weight_version=)``, the server's ``/update_weight_version``,
routereplay's weight sync) closes the open stream and the next record opens one labelled
with the new version; so does a record whose final weight version this process has not
seen (set through another API server). :func:`rotate` closes it on request.

Identity (the caller's): a record's key is the caller's sample id: ``SamplingParams
(extra_args={"routereplay_sample_id": uid})`` (the server takes it as ``vllm_xargs``),
else the request id; ``<uid>/<i>`` for each completion of an ``n > 1`` request; then
:func:`engine_patches.vllm.records.sample_key` (``"routereplay_attempt": N`` -> ``<uid>@N``,
aborted -> ``<key>!aborted``). A key already written to the open stream is never renamed:
the record is not written, and an error naming both requests is logged and counted
(``stats()["duplicates"]``).

A request whose routing is missing or malformed is never written as zeros: it is logged as
an error naming the request and counted (:func:`stats`); no failure of ours reaches vLLM's
output loop.
"""
from __future__ import annotations

import os
from typing import Any

# NOTE: SidecarRef is re-exported: engine_patches.vllm.plugin.SidecarRef is its public name
from engine_patches.vllm.capture_names import (ENV_CODEC, ENV_RESPONSE, ENV_SIDECAR,  # noqa: F401
                                              SidecarRef, log)


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
            writer's, ``xl-zstd``.
        schema: the model's RoutingSchema, for an engine built before this call (otherwise
            taken from the next engine's config).
        weight_version: label of the first stream until its first record, whose engine
            weight version (vLLM's is ``default`` until set) opens that version's stream:
            set the first version on the engine (``WeightSync(llm, initial_version=v)``).
    Raises:
        ImportError: unsupported vLLM (names the version found and the versions supported).
        RouteReplayError: a bad destination (at start-up, never later).
        ConfigError: a bad ``weight_version`` (as :func:`rotate`); an unknown codec, or one
            removed in 0.3.0 (the message names the release that converts its streams).

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
    """Close the open stream (index and trailer written) and start a new one with the next
    record, labelled ``weight_version`` (default: the current label). Returns the closed
    stream's path, or None when nothing was written since the last rotation or capture is
    not installed.

    Raises:
        ConfigError: ``weight_version`` is not a label of 1 to 256 printable ASCII
            characters (:func:`routereplay.weight_versions.check_version_label`), checked
            before anything is closed.
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
