"""``ctx-ans``: the routing context model driving an rANS coder (docs/FORMAT.md "ctx-ans").

Per MoE layer, over a section's rows (tokens) in blocks of growing size:

1. Repeat flag, for every row but the first: 1 when the row equals the previous token's
   row (same experts, same column order). A repeated row costs only this flag.
2. Fresh rows, column by column: the expert's popularity rank ``a`` (experts sorted by how
   often earlier blocks of this layer used them, most used first, ties by lower id), then
   its rank among the experts that earlier columns of the row did not take:
   ``r_j = a_j - #{i < j : a_i < a_j}``. Exclusion makes an ordered top-k of distinct
   experts cost no more than log2(E!/(E-k)!) bits when routing is uniform, and popularity
   ranks pile skewed routing up near 0. In the canonical sorted mode
   (``ctx-ans-sorted``, rows in ascending expert order) a row's ranks are sorted and coded
   as gaps ``g_0 = a_0, g_j = a_j - a_{j-1} - 1``.
3. Models are adaptive but fixed within a block: weight ``2 * count + 1`` per symbol, from
   what the earlier blocks held: repeat flags and expert ids per layer, rank symbols
   pooled over the columns and layers of the section. No table is stored: a decoder
   rebuilds every model from what it has already decoded.

NOTE: pooling rank symbols over layers and columns halves the learning cost on short
records (measured against per-layer and per-column models on synthetic traces: 1.5-2.5 %
above the entropy rate at 2048 rows instead of 2-5 %); the per-layer popularity order
keeps what differs between layers, which experts are popular.

NOTE: blocks start small (16 rows) so models learn quickly on short records, and grow
(doubling, up to 4096 rows) so that Python work grows with log(T) x layers, not with T.
Within a block everything is vectorized over rows and layers.
"""
from __future__ import annotations

import constriction
import numpy as np

from routereplay.codec import ans
from routereplay.errors import RecordError, SidecarError

FIRST_BLOCK = 16          # rows
MAX_BLOCK = 4096          # rows
# NOTE: the reader's floor (docs/FORMAT.md "Reader limits", issue 27): a section's words
# must hold at least least_bytes() bytes, checked before anything is decoded. Decoding costs
# a fixed ~0.3 ms a row block (Python: a constriction model per layer, an argsort, a few
# numpy calls), a few us more a layer, and an O(E) popularity order per layer and block
# (~1-3 ms at E=65536); without a floor, tiny sections (one row, one layer) read at 16-37 s
# of CPU per MiB, 223-293 s at E=65536. At the floor they read at about 1 s per MiB (a scan
# and a read of every record); the writer stores a section under it with ctx-zstd.
FLOOR_BLOCK_BYTES = 384   # per row block
FLOOR_LAYER_BYTES = 8     # per layer and row block
FLOOR_EXPERTS_PER_BYTE = 16   # per layer and row block: E / this


def blocks(num_rows: int) -> list[tuple[int, int]]:
    """Row blocks [(start, end), ...] of a section: 16, 16, 32, 64, ... rows, at most 4096."""
    out, s = [], 0
    while s < num_rows:
        size = FIRST_BLOCK if s == 0 else min(s, MAX_BLOCK)
        out.append((s, min(s + size, num_rows)))
        s += size
    return out


def least_bytes(num_rows: int, num_layers: int, num_experts: int) -> int:
    """The reader's floor for a section of ids [num_rows, num_layers, K] (bytes of words):
    per row block of :func:`blocks` (at least one: the end marker), ``FLOOR_BLOCK_BYTES``
    plus, per layer, ``FLOOR_LAYER_BYTES + num_experts // FLOOR_EXPERTS_PER_BYTE``."""
    return max(1, len(blocks(num_rows))) * (
        FLOOR_BLOCK_BYTES + num_layers * (FLOOR_LAYER_BYTES + num_experts // FLOOR_EXPERTS_PER_BYTE))


def fits_floor(nbytes: int, shape: tuple[int, int, int], num_experts: int) -> bool:
    """Whether a section of ``nbytes`` bytes of words holding ids ``shape`` [T, L_g, K]
    is at or above the reader's floor (:func:`least_bytes`)."""
    return nbytes >= least_bytes(shape[0], shape[1], num_experts)


def _alphabet(num_experts: int, top_k: int, sorted_rows: bool) -> int:
    return num_experts - top_k + 1 if sorted_rows else num_experts


class _State:
    """Adaptive counts of every layer in a section (step 3 above).

    flags int64 [L_g, 2] ([fresh, repeat]); experts int64 [L_g, E]; symbols int64 [A]
    (shared by all layers of the section).
    """

    def __init__(self, lg: int, num_experts: int, alphabet: int):
        self.flags = np.zeros((lg, 2), dtype=np.int64)
        self.experts = np.zeros((lg, num_experts), dtype=np.int64)
        self.symbols = np.zeros(alphabet, dtype=np.int64)

    def order(self) -> np.ndarray:
        """int32 [L_g, E]: the expert at each popularity rank, per layer."""
        return np.argsort(-self.experts, axis=1, kind="stable").astype(np.int32)

    def flag_weights(self) -> np.ndarray:
        """int64 [L_g, 2]: model weights of each layer's repeat flag."""
        return 2 * self.flags + 1

    def update(self, flags: np.ndarray, layer: np.ndarray, experts: np.ndarray,
               symbols: np.ndarray) -> None:
        """flags [L_g, n0]; layer int [N] (each fresh row's layer); experts, symbols int32 [K, N]."""
        lg, e = self.experts.shape
        nrep = flags.sum(axis=1)
        self.flags[:, 1] += nrep
        self.flags[:, 0] += flags.shape[1] - nrep
        self.experts += np.bincount((layer * e + experts).ravel(), minlength=lg * e).reshape(lg, e)
        self.symbols += np.bincount(symbols.ravel(), minlength=self.symbols.shape[0])


def _flag_span(s: int, e: int) -> int:
    """Rows of block [s, e) that carry a repeat flag (every row but row 0)."""
    return e - max(s, 1)


def encode(ids: np.ndarray, num_experts: int, sorted_rows: bool = False) -> bytes:
    """ids: uint8|uint16 [T, L_g, top_k] -> ``ctx-ans`` section bytes (u32 words).

    Raises:
        RecordError (a ValueError): an id out of [0, num_experts), a row with a repeated expert, or (sorted
            mode) a row not in strictly ascending order.
    """
    t, lg, k = ids.shape
    x = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(np.int32)      # [L_g, T, K]
    if x.size and int(x.max()) >= num_experts:
        raise RecordError(f"expert id out of range [0, {num_experts})")
    if sorted_rows and (x[..., 1:] <= x[..., :-1]).any():
        raise RecordError("sorted mode needs rows in strictly ascending expert order")
    rep = np.zeros((lg, t), dtype=bool)
    rep[:, 1:] = (x[:, 1:] == x[:, :-1]).all(-1)
    alphabet = _alphabet(num_experts, k, sorted_rows)
    st = _State(lg, num_experts, alphabet)
    steps: list = []                                      # (symbols, model) in decoding order
    for s, e in blocks(t):
        n0 = _flag_span(s, e)
        flags = rep[:, e - n0:e].astype(np.int32)                           # [L_g, n0]
        if flags.size:
            fw = st.flag_weights()
            steps.extend((flags[g], ans.model(fw[g])) for g in range(lg))
        layer, row = np.nonzero(~rep[:, s:e])                               # fresh rows
        fresh = np.ascontiguousarray(x[layer, s + row].T)                   # [K, N]
        order = st.order()
        rank = np.empty_like(order)
        rank[np.arange(lg)[:, None], order] = np.arange(num_experts, dtype=np.int32)
        sym = _to_symbols(rank[layer[None, :], fresh], sorted_rows)
        if alphabet > 1 and sym.size:
            steps.append((sym.ravel(), ans.model(2 * st.symbols + 1)))
        st.update(flags, layer, fresh, sym)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.array([ans.END_MARKER], dtype=np.int32), ans.marker_model())
    for symbols, m in reversed(steps):
        coder.encode_reverse(symbols, m)
    return coder.get_compressed().astype("<u4").tobytes()


def _to_symbols(a: np.ndarray, sorted_rows: bool) -> np.ndarray:
    """Popularity ranks int32 [K, N] (column-major) -> coded symbols int32 [K, N].

    Raises:
        RecordError (a ValueError): a row (column of ``a``) holds the same rank twice.
    """
    if sorted_rows:
        a = np.sort(a, axis=0)
        sym = a.copy()
        sym[1:] -= a[:-1] + 1
        return sym
    sym = a.copy()
    dup = np.zeros(a.shape[1], dtype=bool)
    for j in range(1, a.shape[0]):
        for m in range(j):
            sym[j] -= a[m] < a[j]
            dup |= a[m] == a[j]
    if dup.any():
        raise RecordError("a routing row repeats an expert")
    return sym


def _from_symbols(sym: np.ndarray, sorted_rows: bool) -> np.ndarray:
    """Inverse of :func:`_to_symbols`: symbols int32 [K, N] -> popularity ranks [K, N].

    NOTE: the r-th expert not taken by earlier ranks e_(0) < e_(1) < ... (sorted) is
    r + #{i : e_(i) - i <= r}; p[m] tracks each earlier rank's sorted position i.
    """
    if sorted_rows:
        return np.cumsum(sym + 1, axis=0) - 1
    k = sym.shape[0]
    a = np.empty_like(sym)
    p = np.zeros_like(sym)
    if k:
        a[0] = sym[0]
    for j in range(1, k):
        x = sym[j].copy()
        for m in range(j):
            x += (a[m] - p[m]) <= sym[j]
        a[j] = x
        p[j] = x - sym[j]
        for m in range(j):
            p[m] += x < a[m]
    return a


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int,
           sorted_rows: bool = False) -> np.ndarray:
    """``ctx-ans`` section bytes -> ids [T, L_g, top_k] of ``dtype``.

    Memory grows block by block with rows actually decoded, so a section that runs dry
    before ``shape`` is filled fails at that block, not with a huge allocation.

    Raises:
        SidecarError: malformed section (see routereplay.codec.ans.Decoder), or symbols that
            decode to no valid expert. (The reader's floor, :func:`least_bytes`, is checked
            by the sidecar reader before it calls this: routereplay.sidecar.payload.)
    """
    t, lg, k = shape
    dec = ans.Decoder(data)
    alphabet = _alphabet(num_experts, k, sorted_rows)
    st = _State(lg, num_experts, alphabet)
    parts: list[np.ndarray] = []
    prev = None                                                   # [L_g, K] last decoded row
    for s, e in blocks(t):
        n0 = _flag_span(s, e)
        where = f"rows [{s}, {e})"
        flags = np.zeros((lg, n0), dtype=np.int32)
        if n0:
            fw = st.flag_weights()
            for g in range(lg):
                flags[g] = dec.decode(n0, fw[g], where)
        fresh_mask = np.ones((lg, e - s), dtype=bool)
        fresh_mask[:, e - s - n0:] = flags == 0
        layer, row = np.nonzero(fresh_mask)
        n = layer.shape[0]
        sym = np.zeros((k, n), dtype=np.int32)
        if alphabet > 1 and n * k:
            sym = dec.decode(n * k, 2 * st.symbols + 1, where).reshape(k, n)
        a = _from_symbols(sym, sorted_rows)
        if a.size and int(a.max()) >= num_experts:
            raise SidecarError(f"ANS section decodes to an expert rank >= {num_experts} at {where}")
        fresh = st.order()[layer[None, :], a]                                # [K, N]
        if sorted_rows:
            fresh = np.sort(fresh, axis=0)
        block = np.empty((lg, e - s, k), dtype=np.int32)
        block[layer, row] = fresh.T
        # NOTE: a repeated row copies the last fresh row at or before it in its layer; a
        # block that starts with repeats continues the previous block's last row.
        src = np.maximum.accumulate(np.where(fresh_mask, np.arange(e - s), -1), axis=1)
        if (src < 0).any():
            if prev is None:
                raise SidecarError("ANS section marks the first row as a repeat")
            gi, ti = np.nonzero(src < 0)
            block[gi, ti] = prev[gi]
        gi, ti = np.nonzero(~fresh_mask & (src >= 0))
        block[gi, ti] = block[gi, src[gi, ti]]
        # NOTE: an encoder flags every row equal to its predecessor (FORMAT.md), so a fresh
        # row repeating it is corrupt. This also stops a decoder that ran out of data: with
        # no words left and a small state, rANS keeps decoding symbol 0 forever (state
        # unchanged), i.e. fresh rows of identical ranks, at full CPU cost per row.
        before = np.concatenate([block[:, :1] if prev is None else prev[:, None],
                                 block[:, :-1]], axis=1)
        same = fresh_mask & (block == before).all(-1)
        if s == 0:
            same[:, 0] = False
        if same.any():
            g0, t0 = np.unravel_index(int(np.argmax(same)), same.shape)
            raise SidecarError(f"ANS section: row {s + t0} of layer {g0} is coded fresh but "
                               "repeats the previous row (corrupt, or decoding past its data)")
        prev = block[:, -1].copy()
        parts.append(block.astype(dtype))       # NOTE: narrow now: peak memory ~3x the output
        st.update(flags, layer, fresh, sym)
    dec.finish()
    out = np.concatenate(parts, axis=1) if parts else np.zeros((lg, 0, k), dtype)
    del parts
    return np.ascontiguousarray(out.transpose(1, 0, 2))
