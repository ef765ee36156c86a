"""``xl-ans-rows``: the ``xl-ans`` model coded one symbol per row (docs/FORMAT.md
"xl-ans-rows").

Shape legend: T rows (tokens) of a section, G MoE layers in it, K = top_k (1 or 2),
E = num_experts, L = L_moe, C = C(E, K) expert sets, A = the row alphabet's expert tuples
(E for top-1, E(E - 1) ordered pairs for top-2), X = 2C + 1 contexts per layer.

``xl-ans`` codes a row as up to 1 + K symbols (a repeat flag, then one id per column,
each found by comparing its interval starts). Here a row is one symbol of an alphabet of
1 + A: "repeats the previous token's row" or one ordered tuple of ids, under the product
of the same model's probabilities (flag, column 0, column 1 given column 0) in the same
context (the flag and the expert set of the token one layer up). Its tables are built once
per model: cumulative frequencies of every context, and a guide per context (the symbol
at each 2^16-wide slice of the coder's range) that finds a symbol with one lookup and
rarely a step. Measured (E=8 top-2, 1K-token sections, one core, numba): the same bytes
within 0.1 %, encode and decode about 2.3x ``xl-ans`` at 32 layers a section (about 140 /
210 MB/s), decode 3x at 8-16 (benchmarks/README.md "xl-ans").

Used where the alphabet is small (:func:`applies`: top-1, or top-2 with E <= 8, and the
tables within ``TABLES_MAX``); a writer of ``codec="xl-ans"`` picks it per section where
it applies and its coder work fits the reader's limit, else ``xl-ans``.
"""
from __future__ import annotations

from typing import Any

import constriction
import numpy as np

from routereplay.codec import ans, xl_ans
from routereplay.codec.xl_ans import (BAD_END, ENDS_EARLY, FIRST_REPEATS, FRESH_REPEATS, OK,
                                      OVER_BUDGET, XlModel)
from routereplay.errors import RecordError, SidecarError

MAX_TUPLES = 64             # A: a row alphabet of at most this many expert tuples
TABLES_MAX = 4 << 20        # bytes of a model's row tables (:func:`table_bytes`) at most
GUIDE_BITS = 8              # a context's guide: 2^8 slices of the coder's range
# NOTE: a reader's coder work limit, per byte of words. A unit of row work costs about
# 1.6 ns in the constriction path (a row's 1 + A parameters gathered, 96 ns a row at E=8
# top-2), xl-ans's about 14 (its per-block numpy calls): 256 bounds a crafted section's
# decode at about 0.5 s per MiB there (0.1 with numba), and lets rows code routing down to
# about 1.8 bits a row at E=8 top-2 (repeat rates up to about 0.75 on the benchmark's source)
WORK_PER_BYTE = 256
_FLAG_SHIFT, _TUPLE_SHIFT = 10, 14  # weights: repeat g1 * 2^10, tuple p * g0 / 2^14 (FORMAT.md)


def tuples(num_experts: int, top_k: int) -> int:
    """A: expert tuples of a row alphabet (E for top-1, E(E - 1) for top-2, else 0)."""
    e = num_experts
    return e if top_k == 1 else e * (e - 1) if top_k == 2 else 0


def table_bytes(num_layers: int, num_experts: int, top_k: int) -> int:
    """Bytes of a model's row tables, on either coder path: L x X contexts x
    (4 (A + 2) + max(2^GUIDE_BITS, 8 (1 + A))): cumulative frequencies, and the numba
    kernels' guide or constriction's parameters."""
    a, c = tuples(num_experts, top_k), xl_ans.joint_sets(num_experts, top_k)
    return num_layers * (2 * c + 1) * (4 * (a + 2) + max(1 << GUIDE_BITS, 8 * (1 + a)))


def applies(num_layers: int, num_experts: int, top_k: int) -> bool:
    """Whether ``xl-ans-rows`` codes this schema: top-1 or top-2, 2 <= A <= MAX_TUPLES
    (top-2: E <= 8), a joint table, and row tables of at most ``TABLES_MAX`` bytes (a
    reader keeps them per model, at most 16: 64 MiB; E=8 top-2 up to 106 MoE layers,
    E=64 top-1 up to 41).

    NOTE: the guide is one uint8 per slice, and the tables grow as L x C x A."""
    a = tuples(num_experts, top_k)
    return 2 <= a <= MAX_TUPLES and 2 <= num_experts <= xl_ans.MAX_EXPERTS and \
        xl_ans.joint_sets(num_experts, top_k) > 0 and \
        table_bytes(num_layers, num_experts, top_k) <= TABLES_MAX


def least_bytes(num_layers: int) -> int:
    """The fewest bytes of words of a section of G layers: ``xl_ans.BYTES_PER_CALL`` per
    layer (a coder call per layer in the constriction path)."""
    return xl_ans.BYTES_PER_CALL * num_layers


def work(t: int, num_experts: int, top_k: int) -> int:
    """Coder work of one layer (parameter entries): 1 + A per row (the constriction path
    builds each row's frequencies)."""
    return t * (1 + tuples(num_experts, top_k))


def section_work(shape: tuple[int, int, int], num_experts: int) -> int:
    """Coder work of a section of ids [T, G, K]: G x :func:`work`; at most
    ``WORK_PER_BYTE`` x its words' bytes."""
    t, g, k = shape
    return g * work(t, num_experts, k)


class RowTables:
    """A model's row tables, built once per model (:func:`tables`).

    - ``cum`` int32 [L * X * (A + 2)]: cumulative frequencies (0 first, 2^24 last) of each
      context's 1 + A symbols; context ``l * X + x * C + c`` for layer l at section layer
      >= 1 (x: the flag of the row one layer up, c: its expert set's rank), ``l * X + 2C``
      at a section's first layer.
    - :meth:`guide`, for the numba kernels.
    - ``first``, ``second``, ``rank`` int64 [1 + A]: symbol -> column 0 and 1 ids (second
      = first for top-1) and its set's rank (index 0 unused); ``symbol`` int64 [E, E]:
      (column 0, column 1) -> symbol (top-1: [E, 1]).
    """

    def __init__(self, m: XlModel, tab: Any, jit: Any):
        e, k, nl = m.num_experts, m.top_k, m.num_layers
        c, a = xl_ans.joint_sets(e, k), tuples(e, k)
        self.contexts, self.sets, self.tuples = 2 * c + 1, c, a
        self.num_layers, self.num_experts, self.top_k = nl, e, k
        if k == 1:
            self.first = np.arange(-1, e, dtype=np.int64)
            self.second = self.first.copy()
            self.symbol = np.arange(1, e + 1, dtype=np.int64)[:, None]
        else:
            a0, a1 = np.nonzero(~np.eye(e, dtype=bool))       # ordered pairs, a-major
            self.first = np.concatenate([[-1], a0]).astype(np.int64)
            self.second = np.concatenate([[-1], a1]).astype(np.int64)
            self.symbol = np.zeros((e, e), dtype=np.int64)
            self.symbol[a0, a1] = np.arange(1, a + 1)
        self.first[0] = self.second[0] = 0
        members = np.stack([self.first, self.second], axis=1)[:, :k]
        self.rank = xl_ans.set_index(members)
        self.rank[0] = 0
        # NOTE: top-2 of E <= 8 always has the column-1 joint table (TABLES_MEMORY)
        assert k == 1 or tab.joint1 is not None
        self._tab = tab
        self._params: np.ndarray | None = None
        self._guide: np.ndarray | None = None
        if jit is not None:
            self.cum, self._guide = self._build(jit)
        else:
            self.cum = self._cum(tab)

    def _build(self, jit: Any) -> tuple[np.ndarray, np.ndarray]:
        """(cum, guide) by ``jit``'s kernel (the same cum as :meth:`_cum`)."""
        a = self._tab.kernel_args()
        return jit.row_tables(a[0], a[2], a[3], a[6], a[7], self.num_layers, self.num_experts,
                              self.top_k, self.sets, self.first, self.second, GUIDE_BITS)

    def _cum(self, tab: Any) -> np.ndarray:
        """cum by numpy (FORMAT.md "xl-ans-rows", step by step)."""
        k, c, nl = self.top_k, self.sets, self.num_layers
        g = tab.flags.astype(np.int64) + 1                          # [L, 3, 2] frequencies
        # column frequencies: the joint table's sets [L, C, E] / [L, C, E, E] (column 1
        # given column 0), then a section's first layer [L, 1, E] / [L, 1, E, E]
        f0 = np.concatenate([_diff(tab.joint0), _diff(tab.pop0)[:, None]], axis=1)
        if k == 2:
            f1 = np.concatenate([_diff(tab.joint1), _diff(tab.pop1)[:, None]], axis=1)
            p = (f0[:, :, self.first[1:]] * f1[:, :, self.first[1:], self.second[1:]]) >> 24
        else:
            p = f0                                                  # [L, C + 1, A]
        u = np.empty((nl, self.contexts, 1 + self.tuples), dtype=np.int64)
        for x in range(2):                                          # section layer >= 1
            sl = slice(x * c, (x + 1) * c)
            u[:, sl, 0] = (g[:, x, 1] << _FLAG_SHIFT)[:, None] + 1
            u[:, sl, 1:] = ((p[:, :c] * g[:, x, 0][:, None, None]) >> _TUPLE_SHIFT) + 1
        u[:, 2 * c, 0] = (g[:, xl_ans.NONE_CTX, 1] << _FLAG_SHIFT) + 1  # first layer
        u[:, 2 * c, 1:] = ((p[:, c] * g[:, xl_ans.NONE_CTX, 0][:, None]) >> _TUPLE_SHIFT) + 1
        return xl_ans._cumulative(u).ravel()                        # [L * X * (A + 2)]

    def guide(self, jit: Any) -> np.ndarray:
        """uint8 [L * X * 2^GUIDE_BITS]: per context and slice j, the symbol whose interval
        holds j * 2^(24 - GUIDE_BITS) (built on first use, by ``jit``'s kernel)."""
        if self._guide is None:
            self._guide = self._build(jit)[1]
        return self._guide

    def params(self) -> np.ndarray:
        """constriction parameters float64 [L * X, 1 + A] (frequency - 1), for the coder
        without numba (built on first use)."""
        if self._params is None:
            self._params = xl_ans._cum_params(self.cum.reshape(-1, self.tuples + 2))
        return self._params

    def kernel_args(self, jit: Any) -> tuple:
        """The tables as routereplay.codec.xl_ans_jit's row kernels take them."""
        return (self.cum, self.guide(jit), self.contexts, self.first, self.second, self.rank,
                self.symbol)


def _diff(cum: np.ndarray) -> np.ndarray:
    """Cumulative frequencies int32 [..., n + 1] -> frequencies int64 [..., n]."""
    return np.diff(cum.astype(np.int64), axis=-1)


def tables(model: XlModel) -> RowTables:
    """The row tables of ``model``, built once and kept on it (built anew where its coder
    tables are: routereplay.codec.xl_ans._tables).

    Raises:
        RecordError (a ValueError): a model whose schema :func:`applies` refuses."""
    tab = xl_ans._tables(model)
    t = tab.__dict__.get("_rows")
    if t is None:
        if not applies(model.num_layers, model.num_experts, model.top_k):
            raise RecordError(f"xl-ans-rows codes top-1, or top-2 of at most 8 experts, with "
                              f"row tables of at most {TABLES_MAX} bytes; got "
                              f"L={model.num_layers}, E={model.num_experts}, K={model.top_k}")
        t = tab._rows = RowTables(model, tab, xl_ans.compiled())
    return t


def _symbols(ids: np.ndarray, rt: RowTables) -> np.ndarray:
    """ids int [T, G, K] -> row symbols int32 [T, G] (0: repeats the row before)."""
    a = ids.astype(np.int64)
    s = rt.symbol[a[..., 0], a[..., -1] if a.shape[2] == 2 else 0]
    s[1:] = np.where((a[1:] == a[:-1]).all(axis=2), 0, s[1:])
    return s.astype(np.int32)


def _contexts(t: int, up: np.ndarray | None, resolved: np.ndarray | None, lyr: int,
              rt: RowTables) -> np.ndarray:
    """Context ids int64 [T] of the T rows of MoE layer ``lyr``: ``up`` int32 [T] the row
    symbols one layer up and ``resolved`` int64 [T] the same with repeats replaced by the
    symbol they copy; None at the section's first layer."""
    base = lyr * rt.contexts
    if up is None:
        return np.full(t, base + 2 * rt.sets, dtype=np.int64)
    return base + np.where(up == 0, rt.sets, 0) + rt.rank[resolved]


def _resolve(sym: np.ndarray) -> np.ndarray:
    """Row symbols int32 [T] -> int64 [T]: a repeat (0) replaced by the last fresh symbol
    before it (row 0 is fresh)."""
    t = sym.shape[0]
    src = np.maximum.accumulate(np.where(sym == 0, 0, np.arange(t)))
    return sym[src].astype(np.int64)


def encode(ids: np.ndarray, model: XlModel, l0: int) -> bytes:
    """ids uint8 [T, G, K] (MoE layers l0 .. l0 + G - 1) -> the ANS words of an
    ``xl-ans-rows`` section under ``model`` (without the model reference).

    NOTE: readers refuse a section whose words are under :func:`least_bytes` or whose
    :func:`section_work` exceeds ``WORK_PER_BYTE`` x its words' bytes; the writer checks
    both and codes ``xl-ans`` there.

    Raises:
        RecordError (a ValueError): as routereplay.codec.xl_ans.encode, and a schema
            :func:`applies` refuses.
    """
    jit, ids = xl_ans.checked_section(ids, model, l0, "xl-ans-rows")
    rt = tables(model)
    t, g, _ = ids.shape
    if jit is not None:
        return jit.encode_rows(ids, l0, *rt.kernel_args(jit)).astype("<u4").tobytes()
    sym = _symbols(ids, rt)
    ctx = np.empty((t, g), dtype=np.int64)
    resolved = None
    for lp in range(g):
        ctx[:, lp] = _contexts(t, sym[:, lp - 1] if lp else None, resolved, l0 + lp, rt)
        resolved = _resolve(sym[:, lp])
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.array([ans.END_MARKER], dtype=np.int32), ans.marker_model())
    for lp in range(g - 1, -1, -1):
        for sl in reversed(xl_ans._chunks(t)):        # NOTE: a chunk's parameters at a time
            coder.encode_reverse(sym[sl, lp], ans.family(),
                                 ans.contiguous(rt.params()[ctx[sl, lp]]))
    return coder.get_compressed().astype("<u4").tobytes()


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, model: XlModel,
           l0: int) -> np.ndarray:
    """ANS words of an ``xl-ans-rows`` section -> ids [T, G, K] of ``dtype`` (uint8).

    Raises:
        SidecarError: layers beyond the model's or a schema :func:`applies` refuses, words
            under the floor (:func:`least_bytes`), coder work beyond ``WORK_PER_BYTE`` per
            byte of words (checked layer by layer), a malformed ANS stack, a layer whose
            row 0 is coded as a repeat, a fresh row equal to the row before it, or words
            left over.
    """
    t, g, k = shape
    if l0 < 0 or l0 + g > model.num_layers or k != model.top_k:
        raise SidecarError(f"xl-ans-rows section of layers [{l0}, {l0 + g}) x top-{k} does not "
                           f"fit its model of {model.num_layers} layers x top-{model.top_k}")
    if not applies(model.num_layers, model.num_experts, k):
        raise SidecarError(f"xl-ans-rows section in a stream of E={model.num_experts}, top-{k}, "
                           f"{model.num_layers} MoE layers, which xl-ans-rows does not code")
    check_floor(len(data), g)
    rt = tables(model)
    budget = WORK_PER_BYTE * len(data)
    jit = xl_ans.compiled()
    out = np.empty((t, g, k), dtype=np.uint8)
    if jit is not None:
        ans.check_words(data)
        code, lyr = jit.decode_rows(np.frombuffer(data, dtype="<u4").astype(np.uint32), t, g, l0,
                                    *rt.kernel_args(jit), work(t, model.num_experts, k),
                                    budget, out)
        if code != OK:
            raise _error(code, len(data), f"MoE layer {lyr}")
        return out.astype(dtype, copy=False)
    dec = ans.Decoder(data)
    spent = 0
    sym = resolved = None
    for lp in range(g):
        lyr = l0 + lp
        where = f"MoE layer {lyr}"
        spent += work(t, model.num_experts, k)
        if spent > budget:
            raise _error(OVER_BUDGET, len(data), where)
        ctx = _contexts(t, sym, resolved, lyr, rt)
        sym = np.empty(t, dtype=np.int32)
        # NOTE: a chunk's parameters at a time, its rows checked before the next chunk is
        # decoded (where the compiled decoder stops: the same error at the same place)
        for sl in xl_ans._chunks(t):
            sym[sl] = dec.decode_params(rt.params()[ctx[sl]], where)
            if sym[0] == 0:
                raise _error(FIRST_REPEATS, len(data), where)
            resolved = _resolve(sym[:sl.stop])
            a = max(sl.start, 1)
            if ((sym[a:sl.stop] != 0) & (sym[a:sl.stop] == resolved[a - 1:sl.stop - 1])).any():
                raise _error(FRESH_REPEATS, len(data), where)
        resolved = _resolve(sym)
        out[:, lp, 0] = rt.first[resolved]
        if k == 2:
            out[:, lp, 1] = rt.second[resolved]
    dec.finish()
    return out.astype(dtype)


def check_floor(nbytes: int, num_layers: int) -> None:
    """Refuse a section whose words (``nbytes``) are under :func:`least_bytes`.

    Raises:
        SidecarError: naming the floor."""
    if nbytes < least_bytes(num_layers):
        raise SidecarError(f"xl-ans-rows section of {num_layers} layers holds {nbytes} bytes, "
                           f"below the reader's floor of {least_bytes(num_layers)} "
                           f"({xl_ans.BYTES_PER_CALL} per layer)")


def _error(code: int, nbytes: int, where: str) -> SidecarError:
    """The error both coders raise for a section refused with ``code``."""
    if code == FIRST_REPEATS:
        return SidecarError(f"xl-ans-rows section codes the first row of a layer as a repeat "
                            f"at {where} (corrupt)")
    if code == OVER_BUDGET:
        return SidecarError(f"xl-ans-rows section of {nbytes} bytes needs more coder work than "
                            f"the reader's limit of {WORK_PER_BYTE} per byte (at {where})")
    if code == FRESH_REPEATS:
        return SidecarError(f"xl-ans-rows section codes a row as fresh that repeats the row "
                            f"before it at {where} (corrupt, or decoding past its data)")
    if code in (ENDS_EARLY, BAD_END):
        return xl_ans._section_error(code, nbytes, where)
    raise AssertionError(code)
