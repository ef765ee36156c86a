"""Exact static categorical models on constriction's rANS stack (docs/FORMAT.md "ANS").

Our context model (routereplay.codec.ctx_ans) hands out integer weights; this module turns
them into frequencies that sum to 2**PRECISION, in integer arithmetic only, so an
independent decoder reproduces every model bit for bit. The entropy coder itself is
constriction's ``AnsCoder`` (32-bit words, 64-bit state, precision 24), whose decoding
step FORMAT.md restates.

NOTE: constriction's ``Categorical(p, perfect=False)`` quantizes float probabilities with
cdf[i] = floor(sum(p[:i]) * (2**24 - n) / sum(p)) + i. We pass p = f - 1, integers that
already sum to 2**24 - n, so the scale is exactly 1.0, every partial sum is exact in
float64, and the model's frequencies are exactly our ``f``.
"""
from __future__ import annotations

import constriction
import numpy as np

from routereplay.errors import SidecarError

PRECISION = 24
TOTAL = 1 << PRECISION
END_MARKER = 0xA5            # 8-bit symbol decoded last; proves the section was read whole
_MARKER_MODEL = None
_FAMILY = None


def frequencies(weights: np.ndarray) -> np.ndarray:
    """Integer weights int64 [..., n] (n >= 2, each >= 1) -> frequencies int64 [..., n],
    each row summing to 2**24.

    f_i = floor(u_i * (2**24 - n) / U) + 1 with U = sum(u); the remainder
    2**24 - sum(f) goes to the first index of the largest weight. Every f_i >= 1.
    """
    u = np.asarray(weights, dtype=np.int64)
    n = u.shape[-1]
    free = TOTAL - n
    w = (u * free) // u.sum(axis=-1, keepdims=True)        # a new C-contiguous array
    # NOTE: plain fancy indexing on a 2-D view: take/put_along_axis cost ~10 us a call, a
    # large share of xl-ans's per-call work on small row blocks
    w2, u2 = w.reshape(-1, n), u.reshape(-1, n)
    rows = np.arange(w2.shape[0])
    top = u2.argmax(axis=1)
    w2[rows, top] += free - w2.sum(axis=1)
    return w + 1


def model(weights: np.ndarray):
    """constriction Categorical whose frequencies are exactly ``frequencies(weights)``."""
    return constriction.stream.model.Categorical(
        (frequencies(weights) - 1).astype(np.float64), perfect=False)


def family():
    """constriction's Categorical model family (per-symbol parameters float64 [n, m], each
    row ``frequencies(weights) - 1`` for exact frequencies)."""
    global _FAMILY
    if _FAMILY is None:
        _FAMILY = constriction.stream.model.Categorical(perfect=False)
    return _FAMILY


def contiguous(params: np.ndarray) -> np.ndarray:
    """Per-symbol parameters as a C-contiguous float64 array.

    NOTE: constriction 0.4 reads a non-contiguous array (e.g. a broadcast view's copy made
    by ``astype``, which keeps its strides) as if it were contiguous, silently: encoder
    and decoder then agree with each other but not with the spec (found by
    tests/spec_reader.py)."""
    return np.ascontiguousarray(params, dtype=np.float64)


def marker_model():
    global _MARKER_MODEL
    if _MARKER_MODEL is None:
        _MARKER_MODEL = model(np.ones(256, dtype=np.int64))
    return _MARKER_MODEL


def ends_early(where: str) -> SidecarError:
    """The error of a decoder that runs dry before the symbols its metadata promises."""
    return SidecarError(f"ANS section ends early, at {where}")


def bad_end() -> SidecarError:
    """The error of a section whose end marker is missing or that has words left over."""
    return SidecarError("ANS section does not end where its metadata says "
                        "(end marker missing or words left over)")


def check_words(data: bytes) -> None:
    """Raise SidecarError unless ``data`` is a whole, non-empty number of u32 LE words whose
    last word is nonzero (FORMAT.md "ANS decoder")."""
    if len(data) % 4 or not data:
        raise SidecarError(f"ANS section of {len(data)} bytes is not a whole, non-empty "
                           "number of u32 words")
    if data[-4:] == bytes(4):
        raise SidecarError("ANS section ends in a zero word")


class Decoder:
    """Pops symbol blocks off one section's ANS stack, in the order they were listed.

    Raises SidecarError (never another exception) on a malformed section: a length that is
    not a whole number of u32 words, a last word of zero, a stack that runs dry before the
    symbols the metadata promises, or words left over after the end marker.
    """

    def __init__(self, data: bytes):
        check_words(data)
        words = np.frombuffer(data, dtype="<u4").astype(np.uint32)
        self._coder = constriction.stream.stack.AnsCoder(words)

    def decode(self, count: int, weights: np.ndarray, where: str) -> np.ndarray:
        """``count`` symbols int32 [count] under the model of ``weights``."""
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        if self._empty():
            raise ends_early(where)
        return self._coder.decode(model(weights), count)

    def decode_params(self, params: np.ndarray, where: str) -> np.ndarray:
        """One symbol per row of ``params`` float64 [n, m] (:func:`family` parameters)."""
        if params.shape[0] == 0:
            return np.zeros(0, dtype=np.int32)
        if self._empty():
            raise ends_early(where)
        return self._coder.decode(family(), contiguous(params))

    def _empty(self) -> bool:
        # NOTE: state 0 and every word consumed (num_words counts both); constriction's
        # is_empty() looks at the state only, which garbage can zero with words left.
        return self._coder.num_words() == 0

    def finish(self) -> None:
        """Check the end marker and that no word is left."""
        if self._empty() or int(self._coder.decode(marker_model(), 1)[0]) != END_MARKER \
                or not self._empty():
            raise bad_end()
