"""``xl-ans`` compiled: the section coder of routereplay.codec.xl_ans as numba kernels.

Same model, same words: the kernels follow docs/FORMAT.md "xl-ans" and "ANS decoder"
step by step (constriction's ``AnsCoder``: 32-bit words, 64-bit state, precision 24), so a
section encoded by either path decodes with the other, byte for byte
(tests/test_xl_ans.py checks both directions, and that both refuse the same corrupt
sections). What differs is the cost: the constriction path calls the coder once per layer
and column with per-symbol models (E float64 parameters a symbol, built with numpy), about
10 MB/s at E=8 top-2; these kernels walk the section once, symbol by symbol, with the
cumulative frequency tables routereplay.codec.xl_ans computes once per model (61-66 /
84-92 MB/s there).

This module imports numba; routereplay.codec.xl_ans imports it on first use
(:func:`routereplay.codec.xl_ans.compiled`, which also reads ``ROUTEREPLAY_XL_ANS_JIT``),
where numba is installed (vLLM depends on it; ``pip install 'routereplay[jit]'``
elsewhere). The kernels compile on their first call (5-11 s in all) and are cached on
disk (in ``NUMBA_CACHE_DIR`` when set, else next to this file where writable, else in
numba's per-user cache; later processes load them in 0.2-2 s). They release the GIL: threads
each with their own SidecarReader overlap their decoding (one reader's methods take
turns; the rest of a read holds the GIL).

Shape legend: T rows, G layers of the section, K = top_k, E = num_experts, L = the model's
MoE layers, C = expert sets of the joint table (possibly 0).
"""
from __future__ import annotations

import numba
import numpy as np

from routereplay.codec.ans import END_MARKER, PRECISION
# NOTE: routereplay.codec.xl_ans imports this module on first use, once it is loaded itself
from routereplay.codec.xl_ans import (BAD_END, CHUNK_ROWS, ENDS_EARLY, FIRST_REPEATS,
                                      FRESH_REPEATS, OK, OVER_BUDGET, REPEATED_ID)

_MASK = (1 << PRECISION) - 1
_TOTAL = 1 << PRECISION


def _njit(fn):
    """numba.njit, cached on disk where numba finds a writable place (next to this file, or
    the user's cache directory), else compiled anew in each process."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:                     # numba: "no locator available"
        return numba.njit(nogil=True)(fn)


@_njit
def _freqs(u, n, f):
    """Integer weights u int64 [>= n] (each >= 1) -> frequencies f int64 [n] summing to
    2^24 (routereplay.codec.ans.frequencies, FORMAT.md "ANS decoder")."""
    tot_u = 0
    top = 0
    for i in range(n):
        tot_u += u[i]
        if u[i] > u[top]:
            top = i
    free = _TOTAL - n
    # NOTE: floor(u[i] * free / tot_u) by a float64 multiply, corrected to the exact integer
    # (the product is below 2^24 and off by far less than 1, so one step fixes it): twice
    # as fast as an integer division per entry at E=64
    inv = free / tot_u
    tot = 0
    for i in range(n):
        num = u[i] * free
        fi = np.int64(u[i] * inv)
        if fi * tot_u > num:
            fi -= 1
        elif (fi + 1) * tot_u <= num:
            fi += 1
        fi += 1
        f[i] = fi
        tot += fi
    f[top] += _TOTAL - tot


@numba.njit(nogil=True, inline="always")
def _set_rank(ids, row, lyr, k, binom):
    """The set index c(u) of u = ids[row, lyr] (K distinct ids): sum_i binom(s_i, i + 1)
    with s = u sorted, i.e. each id u_m at its rank among the row's ids (the number of ids
    below it): no sort and no stores. Inlined into its callers (a call passing arrays costs
    reference counting)."""
    c = 0
    for m in range(k):
        v = np.int64(ids[row, lyr, m])
        rank = 0
        for mm in range(k):
            rank += np.int64(ids[row, lyr, mm]) < v
        c += binom[v, rank + 1]
    return c


# the source of a column's frequencies (see :func:`_column_mode`)
_POP0, _POP1, _JOINT0, _JOINT1, _COMPUTED = 0, 1, 2, 3, 4


@numba.njit(nogil=True, inline="always")
def _column_mode(lp, j, cpop1, joint, cjoint1):
    """Where the frequencies of column j of section layer lp come from: a cumulative table
    of routereplay.codec.xl_ans._Tables (_POP0 / _POP1: a section's first layer, columns
    0 / 1; _JOINT0 / _JOINT1: the expert set one layer up, columns 0 / 1), or _COMPUTED per
    row from the weights (:func:`_column_freqs`)."""
    if lp == 0:
        if j == 0:
            return _POP0
        if j == 1 and cpop1.shape[0]:
            return _POP1
    elif joint.shape[0]:
        if j == 0:
            return _JOINT0
        if j == 1 and cjoint1.shape[0]:
            return _JOINT1
    return _COMPUTED


@numba.njit(nogil=True, inline="always")
def _table_bases(mode, i0, i1, fresh, lp, lyr, e, nc, out, crank, base):
    """base[i - i0] = the offset of fresh row ``fresh[i]``'s cumulative frequencies (E + 1
    entries) in its column's table (``mode``, :func:`_column_mode`, not _COMPUTED),
    i0 <= i < i1 (``crank`` the fresh rows' expert sets' ranks one layer up, ``out`` their
    ids so far)."""
    ne = e + 1
    if mode == _POP0:
        for i in range(i0, i1):
            base[i - i0] = lyr * ne
    elif mode == _POP1:
        for i in range(i0, i1):
            base[i - i0] = (lyr * e + np.int64(out[fresh[i], lp, 0])) * ne
    elif mode == _JOINT0:
        for i in range(i0, i1):
            base[i - i0] = (lyr * nc + crank[i]) * ne
    else:
        for i in range(i0, i1):
            base[i - i0] = ((lyr * nc + crank[i]) * e + np.int64(out[fresh[i], lp, 0])) * ne


@_njit
def _column_freqs(ids, fresh, i0, i1, lp, lyr, j, k, e, pop, succ, joint, crank, u, out):
    """Frequencies out int64 [i1 - i0, E] of column j of the fresh rows ``fresh[i0:i1]`` of
    section layer ``lp`` (MoE layer ``lyr``) of ids [T, G, K] (their columns < j known, and
    at lp >= 1 their ids one layer up, ``crank`` their sets' ranks), from the weights of
    FORMAT.md "xl-ans" step 2, for the columns without a table (:func:`_column_mode`).
    u int64 [E]: scratch.

    NOTE: one call per block of rows, shared by both kernels: a call per symbol passing
    these arrays cost more than the symbol's own work (reference counting). Frequencies,
    not cumulative ones: the coders sum them as they search (one pass fewer, and at E=16
    to 64 the successor rows summed again per column, from L1, beat keeping the sums)."""
    for i in range(i0, i1):
        row = fresh[i]
        if lp == 0:
            for x in range(e):
                u[x] = pop[lyr, x] + 1
        elif joint.shape[0]:
            c = crank[i]                                        # the set one layer up
            for x in range(e):
                u[x] = joint[lyr, c, x] + 1
        else:
            for x in range(e):
                u[x] = 1
            for m in range(k):
                um = ids[row, lp - 1, m]
                for x in range(e):
                    u[x] += succ[lyr, um, x]
        for m in range(j):
            u[ids[row, lp, m]] = 1
        _freqs(u, e, out[i - i0])


@numba.njit(nogil=True, inline="always")
def _set_ranks(ids, fresh, n, lp, k, binom, crank):
    """crank[i] = the expert set's rank one layer up (lp - 1) of fresh row ``fresh[i]``,
    for i < n."""
    for i in range(n):
        crank[i] = _set_rank(ids, fresh[i], lp - 1, k, binom)


@numba.njit(nogil=True, inline="always")
def _advance(words, state, r, f, offset):
    """One ANS decoding step (FORMAT.md "ANS decoder"): the symbol of frequency ``f``
    whose interval holds q = state mod 2^24 at ``offset`` = q - its start; then a word from
    ``words`` (``r`` left) where the state fell below 2^32. Returns (state, r)."""
    state = (state >> np.uint64(PRECISION)) * np.uint64(f) + np.uint64(offset)
    if state < (np.uint64(1) << np.uint64(32)) and r > 0:
        state = (state << np.uint64(32)) | np.uint64(words[r - 1])
        r -= 1
    return state, r


@numba.njit(nogil=True, inline="always")
def _put(out, row, lp, j, s):
    """out[row, lp, j] = s, unless s is already in the row's columns < j: returns 1 there
    (corrupt), else 0."""
    for jj in range(j):
        if out[row, lp, jj] == s:
            return 1
    out[row, lp, j] = s
    return 0


@numba.njit(nogil=True, inline="always")
def _start(words):
    """The decoder's state from a section's last one or two words (FORMAT.md "ANS
    decoder"): returns (state, words left)."""
    r = words.shape[0]
    state = np.uint64(words[r - 1])
    r -= 1
    if r > 0:
        state = (state << np.uint64(32)) | np.uint64(words[r - 1])
        r -= 1
    return state, r


@numba.njit(nogil=True, inline="always")
def _end(words, state, r):
    """The end of a section: the end marker (one symbol under 256 equal weights, frequency
    2^16 each) must be END_MARKER, and the decoder then empty. Returns OK or BAD_END."""
    if state == 0 and r == 0:
        return BAD_END
    q = state & np.uint64(_MASK)
    marker = q >> np.uint64(16)
    state, r = _advance(words, state, r, np.uint64(1 << 16), q - (marker << np.uint64(16)))
    if marker != END_MARKER or state != 0 or r != 0:
        return BAD_END
    return OK


@numba.njit(nogil=True, inline="always")
def _flush(out, w, state):
    """The encoder's last words: ``out[:w]`` and the final state's (one or two words, none
    for a zero state), as constriction's ``get_compressed``."""
    if state > np.uint64(0xFFFFFFFF):
        out[w] = np.uint32(state & np.uint64(0xFFFFFFFF))
        out[w + 1] = np.uint32(state >> np.uint64(32))
        w += 2
    elif state:
        out[w] = np.uint32(state)
        w += 1
    return out[:w]


@_njit
def _decode_column(words, state, r, tbl, base, fresh, i0, i1, lp, j, e, out):
    """Decode column j of the fresh rows ``fresh[i0:i1]`` of section layer lp into out
    [T, G, K], row i's cumulative frequencies at ``tbl[base[i - i0]:][:E + 1]``, from the
    decoder (``state``, ``r`` words left of ``words``). Returns (state, r, 1 where a row
    repeats an expert else 0).

    NOTE: a function of its own, so the loop sees one table array (one per column pass)."""
    mask = np.uint64(_MASK)
    for i in range(i0, i1):
        row = fresh[i]
        b = base[i - i0]
        qi = np.int64(state & mask)
        # s: the symbol whose interval holds q, i.e. how many of the ascending starts
        # cum[1 .. E-1] are <= q (a count without branches: no mispredictions)
        s = 0
        q32 = np.int32(qi)                                  # NOTE: q < 2^24
        for x in range(1, e):
            s += np.int64(q32 >= tbl[b + x])
        c0 = np.int64(tbl[b + s])
        state, r = _advance(words, state, r, np.int64(tbl[b + s + 1]) - c0, qi - c0)
        if _put(out, row, lp, j, s):
            return state, r, 1
    return state, r, 0


@_njit
def _decode_column_freqs(words, state, r, fb, fresh, i0, i1, lp, j, e, out):
    """:func:`_decode_column` with row i's frequencies fb int64 [i1 - i0, E]
    (:func:`_column_freqs`), summed as the search goes."""
    mask = np.uint64(_MASK)
    for i in range(i0, i1):
        row = fresh[i]
        qi = np.int64(state & mask)
        acc = 0
        s = 0
        cs = 0
        for x in range(e - 1):
            acc += fb[i - i0, x]
            if qi >= acc:
                s = x + 1
                cs = acc
        state, r = _advance(words, state, r, fb[i - i0, s], qi - cs)
        if _put(out, row, lp, j, s):
            return state, r, 1
    return state, r, 0


@_njit
def decode_section(words, t, g, k, e, l0, flags, pop, cpop0, cpop1, succ, joint, cjoint0,
                   cjoint1, binom, budget, out):
    """Decode ``words`` uint32 [W] (W >= 1, last word nonzero) into out uint8 [T, G, K].

    Tables as routereplay.codec.xl_ans._Tables.kernel_args gives them: flags int32
    [L, 3, 2] (parameters = frequency - 1), pop int64 [L, E], succ int32 [L, E, E], joint
    int64 [L, C, E] or [0, 0, 0]; cumulative frequencies, flattened int32: cpop0 of
    [L, E + 1], cpop1 of [L, E, E + 1] or empty, cjoint0 of [L, C, E + 1] or empty, cjoint1
    of [L, C, E, E + 1] or empty; binom int64 [E + 1, K + 1].
    ``budget``: the coder work allowed (FORMAT.md: 128 per byte of words).

    Returns (error code, the MoE layer it was met at): (OK, -1) or one of ENDS_EARLY,
    OVER_BUDGET, REPEATED_ID, FRESH_REPEATS, BAD_END (the layer is -1 for BAD_END).
    """
    state, r = _start(words)
    mask = np.uint64(_MASK)
    nc = joint.shape[1]
    fb = np.empty((min(max(t, 1), CHUNK_ROWS), e), dtype=np.int64)
    u = np.empty(e, dtype=np.int64)
    rep = np.zeros(t, dtype=np.bool_)
    rep_up = np.zeros(t, dtype=np.bool_)
    fresh = np.empty(t, dtype=np.int64)
    crank = np.empty(t, dtype=np.int64)
    base = np.empty(min(max(t, 1), CHUNK_ROWS), dtype=np.int64)
    spent = 0
    for lp in range(g):
        lyr = l0 + lp
        rep[:] = False
        # NOTE: "ends early" is checked where a block of symbols starts (the flags of a
        # layer, a chunk of a column), as the constriction path does: an empty decoder
        # then decodes symbol 0 and stays empty, and a later check refuses the section
        if t > 1 and state == 0 and r == 0:
            return ENDS_EARLY, lyr
        for row in range(1, t):
            x = 2 if lp == 0 else (1 if rep_up[row] else 0)
            f0 = np.uint64(flags[lyr, x, 0] + 1)
            q = state & mask
            # NOTE: without branches (conditional moves): a repeat flag is hard to predict;
            # spelled out rather than by _advance, whose inlined call here compiled to a
            # branch (the whole decoder 25 % slower)
            hit = q >= f0
            state = (state >> np.uint64(PRECISION)) * \
                (np.uint64(flags[lyr, x, 1] + 1) if hit else f0) + (q - f0 if hit else q)
            rep[row] = hit
            if state < (np.uint64(1) << np.uint64(32)) and r > 0:
                state = (state << np.uint64(32)) | np.uint64(words[r - 1])
                r -= 1
        n = 0
        for row in range(t):
            if not rep[row]:
                fresh[n] = row
                n += 1
        spent += 2 * max(t - 1, 0) + n * k * e
        if spent > budget:
            return OVER_BUDGET, lyr
        if lp and nc:
            _set_ranks(out, fresh, n, lp, k, binom, crank)
        for j in range(k):
            mode = _column_mode(lp, j, cpop1, joint, cjoint1)
            tbl = cpop0 if mode == _POP0 else cpop1 if mode == _POP1 else \
                cjoint0 if mode == _JOINT0 else cjoint1
            for i0 in range(0, n, CHUNK_ROWS):
                i1 = min(i0 + CHUNK_ROWS, n)
                if mode == _COMPUTED:
                    _column_freqs(out, fresh, i0, i1, lp, lyr, j, k, e, pop, succ, joint,
                                  crank, u, fb)
                if state == 0 and r == 0:
                    return ENDS_EARLY, lyr
                if mode == _COMPUTED:
                    state, r, bad = _decode_column_freqs(words, state, r, fb, fresh, i0, i1,
                                                         lp, j, e, out)
                else:
                    _table_bases(mode, i0, i1, fresh, lp, lyr, e, nc, out, crank, base)
                    state, r, bad = _decode_column(words, state, r, tbl, base, fresh, i0,
                                                   i1, lp, j, e, out)
                if bad:
                    return REPEATED_ID, lyr
        for row in range(1, t):
            if rep[row]:
                for jj in range(k):
                    out[row, lp, jj] = out[row - 1, lp, jj]
            else:
                same = True
                for jj in range(k):
                    if out[row, lp, jj] != out[row - 1, lp, jj]:
                        same = False
                if same:
                    return FRESH_REPEATS, lyr
        rep_up[:] = rep
    return _end(words, state, r), -1


@_njit
def check_ids(ids, e):
    """ids int [T, G, K] -> 0, or 1 where an id is outside [0, E), or 2 where a row repeats
    an expert (what routereplay.codec.xl_ans.encode refuses)."""
    t, g, k = ids.shape
    for row in range(t):
        for lp in range(g):
            for j in range(k):
                v = ids[row, lp, j]
                if v < 0 or v >= e:
                    return 1
                for jj in range(j):
                    if ids[row, lp, jj] == v:
                        return 2
    return 0


@_njit
def count_record(ids, flags, pop, pair, joint, binom):
    """Add a record's routing, ids [T, L, K] (checked by :func:`check_ids`), to int64
    counts flags [L, 3, 2], pop [L, E], pair [L, E, E], joint [L, C, E] (C possibly 0),
    as routereplay.codec.xl_ans.XlModel.count does (FORMAT.md: our writer's counts)."""
    t, nl, k = ids.shape
    for lyr in range(nl):
        for row in range(t):
            if row:
                f = 1
                for m in range(k):
                    if ids[row, lyr, m] != ids[row - 1, lyr, m]:
                        f = 0
                flags[lyr, 2, f] += 1
                if lyr:
                    fu = 1
                    for m in range(k):
                        if ids[row, lyr - 1, m] != ids[row - 1, lyr - 1, m]:
                            fu = 0
                    flags[lyr, fu, f] += 1
                if f:
                    continue
            for m in range(k):
                pop[lyr, ids[row, lyr, m]] += 1
            if lyr == 0:
                continue
            for mu in range(k):
                uu = ids[row, lyr - 1, mu]
                for m in range(k):
                    pair[lyr, uu, ids[row, lyr, m]] += 1
            if joint.shape[1]:
                c = _set_rank(ids, row, lyr - 1, k, binom)
                for m in range(k):
                    joint[lyr, c, ids[row, lyr, m]] += 1


@numba.njit(nogil=True, inline="always")
def _push(out, w, state, f, c):
    """Encode one symbol of frequency f and interval start c (uint64) onto the ANS stack
    (``state``, ``w`` words in out uint32): returns (state, w)."""
    if state >= (f << np.uint64(64 - PRECISION)):
        out[w] = np.uint32(state & np.uint64(0xFFFFFFFF))
        w += 1
        state = state >> np.uint64(32)
    return ((state // f) << np.uint64(PRECISION)) + (state % f) + c, w


@_njit
def encode_section(ids, l0, flags, pop, cpop0, cpop1, succ, joint, cjoint0, cjoint1, binom):
    """ids uint8 [T, G, K] (checked by the caller: ids < E, distinct in a row) -> the
    section's words uint32 [W], exactly what the constriction path writes (tables as
    :func:`decode_section` takes them).

    NOTE: an ANS stack is written from the last symbol to the first, so this walks the
    section backwards (layers, columns, chunks and rows), each symbol's interval found as
    the decoder will find it: no per-symbol arrays (1-2 MB a 1K-token record, whose cost
    varied from process to process by 40 %). Queueing symbols in blocks to run the
    division chain on its own measured 2x slower here."""
    t, g, k = ids.shape
    e = pop.shape[1]
    nc = joint.shape[1]
    rep = np.zeros((t, g), dtype=np.bool_)
    nsym = 0
    for lp in range(g):
        for row in range(1, t):
            same = True
            for jj in range(k):
                if ids[row, lp, jj] != ids[row - 1, lp, jj]:
                    same = False
            rep[row, lp] = same
        nsym += max(t - 1, 0)
        for row in range(t):
            if not rep[row, lp]:
                nsym += k
    fb = np.empty((min(max(t, 1), CHUNK_ROWS), e), dtype=np.int64)
    u = np.empty(e, dtype=np.int64)
    fresh = np.empty(t, dtype=np.int64)
    crank = np.empty(t, dtype=np.int64)
    base = np.empty(min(max(t, 1), CHUNK_ROWS), dtype=np.int64)
    out = np.empty(nsym + 3, dtype=np.uint32)     # at most one word a symbol, and the state
    w = 0
    # the end marker first (decoded last): 256 equal weights, frequency 2^16 each
    state, w = _push(out, w, np.uint64(0), np.uint64(1 << 16), np.uint64(END_MARKER << 16))
    for lp in range(g - 1, -1, -1):
        lyr = l0 + lp
        n = 0
        for row in range(t):
            if not rep[row, lp]:
                fresh[n] = row
                n += 1
        if lp and nc:
            _set_ranks(ids, fresh, n, lp, k, binom, crank)
        for j in range(k - 1, -1, -1):
            mode = _column_mode(lp, j, cpop1, joint, cjoint1)
            tbl = cpop0 if mode == _POP0 else cpop1 if mode == _POP1 else \
                cjoint0 if mode == _JOINT0 else cjoint1
            for i0 in range((max(n, 1) - 1) // CHUNK_ROWS * CHUNK_ROWS, -1, -CHUNK_ROWS):
                i1 = min(i0 + CHUNK_ROWS, n)
                if mode == _COMPUTED:
                    _column_freqs(ids, fresh, i0, i1, lp, lyr, j, k, e, pop, succ, joint,
                                  crank, u, fb)
                    for ii in range(i1 - 1, i0 - 1, -1):
                        sym = ids[fresh[ii], lp, j]
                        c0 = 0
                        for y in range(sym):
                            c0 += fb[ii - i0, y]
                        state, w = _push(out, w, state, np.uint64(fb[ii - i0, sym]),
                                         np.uint64(c0))
                    continue
                _table_bases(mode, i0, i1, fresh, lp, lyr, e, nc, ids, crank, base)
                for ii in range(i1 - 1, i0 - 1, -1):
                    b = base[ii - i0] + np.int64(ids[fresh[ii], lp, j])
                    c0 = np.int64(tbl[b])
                    state, w = _push(out, w, state, np.uint64(np.int64(tbl[b + 1]) - c0),
                                     np.uint64(c0))
        for row in range(t - 1, 0, -1):
            x = 2 if lp == 0 else (1 if rep[row, lp - 1] else 0)
            f0 = np.uint64(flags[lyr, x, 0] + 1)
            hit = rep[row, lp]           # NOTE: conditional moves, as the decoder's flags
            state, w = _push(out, w, state, np.uint64(flags[lyr, x, 1] + 1) if hit else f0,
                             f0 if hit else np.uint64(0))
    return _flush(out, w, state)


# -- xl-ans-rows (routereplay.codec.xl_ans_rows): one symbol per row -----------------------


@_njit
def row_tables(flags, cpop0, cpop1, cjoint0, cjoint1, nl, e, k, nsets, first, second, bits):
    """The row tables of routereplay.codec.xl_ans_rows.RowTables from a model's coder
    tables (routereplay.codec.xl_ans._Tables.kernel_args: flags int32 [L, 3, 2] as
    parameters, cumulative int32 cpop0, cpop1, cjoint0, cjoint1 flattened; first, second
    int64 [1 + A]) -> (cum int32 [L * X * (A + 2)], guide uint8 [L * X * 2^bits]), X = 2C + 1:
    exactly what its numpy path computes (FORMAT.md "xl-ans-rows").

    NOTE: built per model, as the reader meets it: numpy took about 90 us a layer at E=8
    top-2 (57 contexts x 57 symbols), on a par with a crafted model payload's bytes."""
    a = first.shape[0] - 1
    nctx = 2 * nsets + 1
    a2 = a + 2
    nb = 1 << bits
    e1 = e + 1
    cum = np.empty(nl * nctx * a2, dtype=np.int32)
    guide = np.empty(nl * nctx * nb, dtype=np.uint8)
    u = np.empty(a + 1, dtype=np.int64)
    f = np.empty(a + 1, dtype=np.int64)
    for lyr in range(nl):
        for cx in range(nctx):
            if cx == nctx - 1:
                x = 2
                t0 = cpop0
                b0 = lyr * e1
                t1 = cpop1
                b1 = lyr * e * e1
            else:
                x = cx // nsets
                c = cx - x * nsets
                t0 = cjoint0
                b0 = (lyr * nsets + c) * e1
                t1 = cjoint1
                b1 = (lyr * nsets + c) * e * e1
            g0 = np.int64(flags[lyr, x, 0]) + 1
            g1 = np.int64(flags[lyr, x, 1]) + 1
            u[0] = (g1 << 10) + 1
            for sym in range(1, a + 1):
                x0 = first[sym]
                p = np.int64(t0[b0 + x0 + 1]) - np.int64(t0[b0 + x0])
                if k == 2:
                    bb = b1 + x0 * e1 + second[sym]
                    p = (p * (np.int64(t1[bb + 1]) - np.int64(t1[bb]))) >> 24
                u[sym] = ((p * g0) >> 14) + 1
            _freqs(u, a + 1, f)
            o = (lyr * nctx + cx) * a2
            acc = 0
            cum[o] = 0
            for sym in range(a + 1):
                acc += f[sym]
                cum[o + sym + 1] = acc
            s = 0
            og = (lyr * nctx + cx) * nb
            for j in range(nb):
                q = j << (PRECISION - bits)
                while q >= cum[o + s + 1]:
                    s += 1
                guide[og + j] = s
    return cum, guide


@_njit
def decode_rows(words, t, g, l0, cum, guide, nctx, first, second, rank, symbol, layer_work,
                budget, out):
    """Decode an ``xl-ans-rows`` section's ``words`` uint32 [W] (W >= 1, last word nonzero)
    into out uint8 [T, G, K] (K 1 or 2), with the row tables of
    routereplay.codec.xl_ans_rows.RowTables.kernel_args (cum int32 [L * X * (A + 2)],
    guide uint8 [L * X * 256], X = ``nctx`` contexts a layer; first, second, rank int64
    [1 + A]; ``symbol`` unused). ``layer_work``: the coder work of a layer, ``budget``:
    the work allowed.

    Returns (error code, the MoE layer it was met at): (OK, -1) or one of ENDS_EARLY,
    OVER_BUDGET, FRESH_REPEATS, FIRST_REPEATS, BAD_END (the layer -1).

    NOTE: a symbol is found by its context's guide (the symbol at the start of q's 2^16
    slice of the range), then a step up while q is past its interval: one lookup, rarely
    a step, where ``decode_section`` compares E - 1 starts per column."""
    state, r = _start(words)
    mask = np.uint64(_MASK)
    k = out.shape[2]
    a2 = first.shape[0] + 1                   # A + 2 cumulative entries a context
    nsets = (nctx - 1) // 2
    up = np.zeros(t, dtype=np.int64)          # the context of row t one layer up, in-layer
    spent = 0
    for lp in range(g):
        lyr = l0 + lp
        spent += layer_work
        if spent > budget:
            return OVER_BUDGET, lyr
        if t > 0 and state == 0 and r == 0:
            return ENDS_EARLY, lyr
        base = lyr * nctx
        prev = 0
        for row in range(t):
            # NOTE: "ends early" where a chunk of rows starts, as the constriction path
            # checks at each of its calls (CHUNK_ROWS rows a call)
            if row % CHUNK_ROWS == 0 and row and state == 0 and r == 0:
                return ENDS_EARLY, lyr
            ctx = base + (nctx - 1 if lp == 0 else up[row])
            qi = np.int64(state & mask)
            # NOTE: GUIDE_BITS = 8: slices of 2^16 of the range 2^24
            s = np.int64(guide[(ctx << 8) + (qi >> 16)])
            b = ctx * a2
            while qi >= cum[b + s + 1]:
                s += 1
            c0 = np.int64(cum[b + s])
            state = (state >> np.uint64(PRECISION)) * np.uint64(np.int64(cum[b + s + 1]) - c0) \
                + np.uint64(qi - c0)
            if state < (np.uint64(1) << np.uint64(32)) and r > 0:
                state = (state << np.uint64(32)) | np.uint64(words[r - 1])
                r -= 1
            if s == 0:
                if row == 0:
                    return FIRST_REPEATS, lyr
                s = prev
                up[row] = nsets + rank[s]
            else:
                if s == prev:
                    return FRESH_REPEATS, lyr
                up[row] = rank[s]
            out[row, lp, 0] = first[s]
            if k == 2:
                out[row, lp, 1] = second[s]
            prev = s
    return _end(words, state, r), -1


@_njit
def encode_rows(ids, l0, cum, guide, nctx, first, second, rank, symbol):
    """ids uint8 [T, G, K] (checked by the caller: ids < E, distinct in a row; K 1 or 2)
    -> the words uint32 [W] of an ``xl-ans-rows`` section, exactly what the constriction
    path writes (tables as :func:`decode_rows` takes them)."""
    t, g, k = ids.shape
    a2 = first.shape[0] + 1
    nsets = (nctx - 1) // 2
    sym = np.empty((t, g), dtype=np.int64)
    ctx = np.empty((t, g), dtype=np.int64)
    for lp in range(g):
        prev = 0
        for row in range(t):
            s = symbol[ids[row, lp, 0], ids[row, lp, k - 1] if k == 2 else 0]
            fresh = s
            if row and s == prev:
                # NOTE: for top-2 the symbol is the ordered pair: equal symbols, equal rows
                fresh = 0
            sym[row, lp] = fresh
            prev = s
    for lp in range(g):
        base = (l0 + lp) * nctx
        for row in range(t):
            if lp == 0:
                ctx[row, lp] = base + nctx - 1
            else:
                s = symbol[ids[row, lp - 1, 0], ids[row, lp - 1, k - 1] if k == 2 else 0]
                ctx[row, lp] = base + rank[s] + (nsets if sym[row, lp - 1] == 0 else 0)
    out = np.empty(t * g + 3, dtype=np.uint32)      # at most one word a symbol, and the state
    w = 0
    state, w = _push(out, w, np.uint64(0), np.uint64(1 << 16), np.uint64(END_MARKER << 16))
    for lp in range(g - 1, -1, -1):
        for row in range(t - 1, -1, -1):
            b = ctx[row, lp] * a2 + sym[row, lp]
            c0 = np.int64(cum[b])
            state, w = _push(out, w, state, np.uint64(np.int64(cum[b + 1]) - c0), np.uint64(c0))
    return _flush(out, w, state)
