"""Sizes of the engines' own routing wire formats, to compare the sidecar against.

- vLLM 0.32 OpenAI server: ``choices[i].routed_experts`` = base64 of ``np.save`` bytes of
  the uint8/uint16 array [T, num_hidden_layers, top_k] (``vllm/utils/serial_utils.py``
  numpy2base64), dense layers included.
- SGLang 0.5: ``meta_info["routed_experts"]`` = base64 of raw int32, flat, shape
  [T, num_hidden_layers, top_k].
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Sequence

import numpy as np


def vllm_b64_npy(full_ids: np.ndarray) -> bytes:
    """vLLM's wire bytes for ``full_ids: uint8|uint16 [T, num_hidden_layers, top_k]``."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(full_ids), allow_pickle=False)
    return base64.b64encode(buf.getvalue())


def sglang_b64_int32(full_ids: np.ndarray) -> bytes:
    """SGLang's wire bytes for ``full_ids: int [T, num_hidden_layers, top_k]``."""
    return base64.b64encode(np.ascontiguousarray(full_ids, dtype="<i4").tobytes())


def decode_vllm_b64_npy(data: bytes | str) -> np.ndarray:
    """Inverse of :func:`vllm_b64_npy` (never unpickles: allow_pickle=False)."""
    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)


def decode_sglang_b64_int32(data: str | bytes, num_hidden_layers: int, top_k: int,
                            extra_widths: Sequence[int] = ()) -> np.ndarray:
    """Inverse of :func:`sglang_b64_int32`: int32 [rows, num_hidden_layers, width].

    ``width`` is top_k, or the first of ``extra_widths`` (e.g. top_k plus fused
    shared-expert columns) that makes the payload a whole number of rows.

    Raises:
        ValueError: not base64, or not a whole number of rows (the message says which).
    """
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"routed_experts is not base64 ({e})") from None
    for width in (top_k, *extra_widths):
        if len(raw) % (4 * num_hidden_layers * width) == 0:
            return np.frombuffer(raw, dtype="<i4").reshape(-1, num_hidden_layers, width)
    raise ValueError(
        f"routed_experts holds {len(raw)} bytes: not a whole number of rows of "
        f"num_hidden_layers x top_k = {num_hidden_layers} x {top_k} int32"
        + "".join(f" (or x {w})" for w in extra_widths))

