"""Weight-version spans: from the engines' output-token spans to routing-row positions.

Both vLLM 0.32 (``CompletionOutput.weight_versions``) and SGLang 0.5.23
(``meta_info["weight_versions"]``) report spans over *output* token indexes. Routing rows
are indexed by token position (prompt included). Output token i is sampled by the forward
pass whose last routed row is token position ``prompt_len + i - 1``, so output span
[s, e) covers rows [P + s - 1, P + e - 1). Prompt rows [0, P - 1) are assigned explicitly
to the version of the first span: they were prefilled in that span's first pass.

NOTE: a prefix-cache hit can serve prompt rows computed under an older version if the
cache was not flushed at the update; routereplay's weight-sync paths always flush it.
"""
from __future__ import annotations

from typing import Sequence

from routereplay.record import WeightVersionSpan


def output_spans_to_rows(output_spans: Sequence[tuple[str, int, int]], prompt_len: int
                         ) -> list[WeightVersionSpan]:
    """[(version, s, e)] over output tokens -> spans over token positions of routing rows.

    Example: P=3, spans v1:[0, 2), v2:[2, 4) -> v1 rows [0, 4), v2 rows [4, 6).
    """
    out = []
    for i, (version, s, e) in enumerate(output_spans):
        a = 0 if i == 0 else prompt_len + int(s) - 1
        out.append(WeightVersionSpan(str(version), a, prompt_len + int(e) - 1))
    return out


MAX_VERSION_LABEL = 256
"""Longest weight-version label accepted from a caller (characters)."""


def check_version_label(label: object, *, what: str = "weight_version") -> str:
    """Validate a weight-version label before it reaches a stream header or a record.

    A label: 1 to :data:`MAX_VERSION_LABEL` characters of printable ASCII (``" "`` to
    ``"~"``). NOTE: a label of megabytes would push every later stream header past the
    readers' limit, and control characters would reach logs and file listings.

    Args:
        label: the caller's label (a ``str``).
        what: the name used in the error (a route's field, a parameter).
    Returns:
        the label, unchanged.
    Raises:
        ValueError: not a str, empty, longer than MAX_VERSION_LABEL, or holding other
            characters (naming the first bad position).
    """
    if not isinstance(label, str):
        raise ValueError(f"{what} must be a string, not {type(label).__name__}")
    if not label:
        raise ValueError(f"{what} must not be empty")
    if len(label) > MAX_VERSION_LABEL:
        raise ValueError(f"{what} is {len(label)} characters long, above the limit of "
                         f"{MAX_VERSION_LABEL}")
    for i, ch in enumerate(label):
        if not " " <= ch <= "~":
            raise ValueError(f"{what} holds {ch!r} at position {i}: only printable ASCII "
                             "(' ' to '~') is accepted")
    return label
