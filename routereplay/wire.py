"""Sizes of the engines' own routing wire formats, to compare the sidecar against.

- vLLM 0.32 OpenAI server: ``choices[i].routed_experts`` = base64 of ``np.save`` bytes of
  the uint8/uint16 array [T, num_hidden_layers, top_k] (``vllm/utils/serial_utils.py``
  numpy2base64), dense layers included.
- SGLang 0.5: ``meta_info["routed_experts"]`` = base64 of raw int32, flat, shape
  [T, num_hidden_layers, top_k].
"""
from __future__ import annotations

import base64
import io

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
