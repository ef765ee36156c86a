"""``xl-ans``: a cross-layer context model, shared by a stream's records, driving an rANS
coder (docs/FORMAT.md "xl-ans").

Shape legend: T rows (tokens) of a section, G MoE layers in it, K = top_k, E = num_experts,
L = L_moe (the stream's MoE layers), C = C(E, K) unordered expert sets.

A trained router sends a token at MoE layer l much where it sent it at layer l - 1, and
every record of a stream comes from the same routers. So the model of this codec is
learned from the stream's earlier records (counts), written once into the stream as a
*model frame* (:class:`XlModel`, FORMAT.md "Model payload"), and used by every later
record's sections, which name it by its frame offset. Per section, layer by layer:

1. Repeat flag, rows 1..T-1: 1 when the row equals the previous token's row of its
   layer. Its context is the flag of the same token one layer up (a token whose routing
   repeats at layer l - 1 tends to repeat at l), or "none" at the section's first layer.
2. Fresh rows, column by column, with exclusion of the columns before: the expert's
   probability given the token's expert *set* one layer up. With few sets
   (C x E <= ``JOINT_LIMIT``) the counts of each set are used directly, smoothed towards
   the mean of the per-expert successor counts; otherwise that mean alone. At the
   section's first layer (no layer up inside the section): the layer's popularity.
3. Repeated rows copy the row before.

Models are static within a record (no adaptation). Two coders write the same words:
numba kernels (routereplay.codec.xl_ans_jit, where numba imports: :func:`compiled`), one
pass over the section, about 61-66 / 84-92 MB/s (encode / decode) at E=8 top-2; else
constriction, vectorized over a section's rows, 1 + K calls per layer, about 10 MB/s.
For top-1 and top-2 of at most 8 experts the same model is also coded one symbol per
row (routereplay.codec.xl_ans_rows, ``xl-ans-rows``: about 140 / 210 MB/s at E=8 top-2).
``xl-ans`` needs a model frame; the writer codes a stream's first records with
``xl-zstd`` while it learns, and keeps each section's smaller of ``xl-ans`` and
``xl-zstd`` (so the ``xl-zstd`` bound holds).

NOTE: measured on the cross-layer source of routereplay.testing (E=8, top-2, 32 layers,
1K-token records), against the exact entropy rate: a model learned from 1 earlier record
codes at 1.033x, from 4 at 1.018x, from 16 at 1.013x; the successor-mean model alone (what
large E gets) stays at 1.065x whatever the data, as the mean of per-expert successor
distributions is not the distribution given a set.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from math import comb
from typing import Any

import constriction
import numpy as np
import zstandard

from routereplay.codec import ans
from routereplay.errors import ConfigError, RecordError, SidecarError

MAX_EXPERTS = 64            # E above this: use xl-zstd (the model's E x E tables grow as E^2)
JOINT_LIMIT = 1 << 13       # joint (expert-set) tables when C(E, K) x E <= this
SCALE = 1 << 16             # successor distributions are scaled to SCALE per up expert
SMOOTH = 4                  # pseudo-rows of the successor mean in each set's distribution
COUNT_MAX = 0xFFFF          # model counts are u16
NONE_CTX = 2                # flag context of a section's first layer
BYTES_PER_CALL = 32         # an xl-ans section holds at least this many bytes per coder call
WORK_PER_BYTE = 128         # coder work (parameter entries, :func:`work`) per section byte
CHUNK_ROWS = 4096           # rows whose coder parameters are built at once
MODEL_EXPANSION = 16        # a model payload's tables are at most this many times its bytes
# how a section is refused (routereplay.codec.xl_ans_jit's decode kernels return the code;
# FIRST_REPEATS: xl-ans-rows only, a layer's row 0 coded as a repeat)
OK, ENDS_EARLY, OVER_BUDGET, REPEATED_ID, FRESH_REPEATS, BAD_END, FIRST_REPEATS = range(7)


JIT_ENV = "ROUTEREPLAY_XL_ANS_JIT"
_JIT: list = []             # [module or None] once numba's import was tried
_JIT_OFF, _JIT_ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes")
_JIT_WARNED: set = set()    # values of ROUTEREPLAY_XL_ANS_JIT already warned about


def compiled() -> Any:
    """routereplay.codec.xl_ans_jit (numba kernels, imported on first call), or None: then
    this module codes with constriction (the same bytes, its section coder 4-11x slower).

    ``ROUTEREPLAY_XL_ANS_JIT`` (read at every call): unset or ``auto``: the kernels where
    numba imports, else constriction with a RuntimeWarning, once per process (a trainer
    environment without vLLM often lacks numba: ``pip install 'routereplay[jit]'``);
    ``0``/``false``/``off``/``no``: constriction; ``1``/``true``/``on``/``yes``: the
    kernels, or ConfigError where numba does not import; empty: auto; another value: auto,
    with a RuntimeWarning once (a setting of speed never makes a stream unreadable).

    Raises:
        ConfigError: the kernels required (``1``) and not available."""
    mode = os.environ.get(JIT_ENV, "").strip().lower() or "auto"
    if mode in _JIT_OFF:
        return None
    if mode not in _JIT_ON and mode != "auto":
        if mode not in _JIT_WARNED:
            _JIT_WARNED.add(mode)
            warnings.warn(f"routereplay: {JIT_ENV}={mode!r} is not auto, 1 or 0; using auto",
                          RuntimeWarning, stacklevel=3)
        mode = "auto"
    if not _JIT:
        why = None
        try:
            from routereplay.codec import xl_ans_jit
        except ModuleNotFoundError as exc:
            if exc.name == "numba":
                xl_ans_jit, why = None, "numba is not installed (pip install 'routereplay[jit]')"
            elif (exc.name or "").split(".")[0] in ("numba", "llvmlite"):
                xl_ans_jit, why = None, f"numba's install is broken ({exc})"
            else:
                raise
        except Exception as exc:  # noqa: BLE001 - a broken numba must not make data unreadable
            xl_ans_jit, why = None, f"numba's kernels cannot be built ({type(exc).__name__}: {exc})"
        _JIT.extend([xl_ans_jit, why, False])
    if _JIT[0] is None:
        if mode in _JIT_ON:
            raise ConfigError(f"{JIT_ENV}={mode}: {_JIT[1]}")
        if not _JIT[2]:
            _JIT[2] = True
            warnings.warn(f"routereplay: {_JIT[1]}; xl-ans is coded with constriction (the same "
                          f"bytes, 4-11x slower)", RuntimeWarning, stacklevel=3)
    return _JIT[0]


def warm_up() -> bool:
    """Compile the numba kernels (or load them from numba's disk cache) by coding one small
    section, so that a process's first xl-ans record does not wait for them (5-11 s the
    first time on a machine, 0.2-2 s from the cache); e.g. once while building an image.

    Returns:
        True where the numba kernels code xl-ans, False where constriction does.

    Raises:
        ConfigError: as :func:`compiled`."""
    if compiled() is None:
        return False
    x = np.argsort(np.random.default_rng(0).random((500, 2, 8)), axis=-1)[..., :2]
    x = x.astype(np.uint8)
    m = XlModel.empty(2, 8, 2)
    m.count(x)
    model = XlModel.from_bytes(m.stored().to_bytes(), 2, 8, 2)
    decode(encode(x, model, 0), x.shape, np.uint8, model, 0)
    from routereplay.codec import xl_ans_rows       # NOTE: it imports this module
    xl_ans_rows.decode(xl_ans_rows.encode(x, model, 0), x.shape, np.uint8, model, 0)
    return True


def joint_sets(num_experts: int, top_k: int) -> int:
    """C: the number of expert sets the joint table has rows for, 0 when it has none."""
    c = comb(num_experts, top_k)
    return c if c * num_experts <= JOINT_LIMIT else 0


def least_bytes(num_layers: int, top_k: int) -> int:
    """The fewest data bytes (after the model offset) of an ``xl-ans`` section of
    ``num_layers`` layers: ``BYTES_PER_CALL`` per coder call, G x (1 + K) calls.

    NOTE: each call (a flag block or a column of a layer) has a fixed cost of 10-30 us;
    without this floor a stream of tiny sections would cost seconds of CPU per MiB."""
    return BYTES_PER_CALL * num_layers * (1 + top_k)


def check_floor(nbytes: int, num_layers: int, top_k: int) -> None:
    """Refuse a section whose words (``nbytes``, after the model offset) are under
    :func:`least_bytes`.

    Raises:
        SidecarError: naming the floor."""
    if nbytes < least_bytes(num_layers, top_k):
        raise SidecarError(f"xl-ans section of {num_layers} layers holds {nbytes} bytes, below "
                           f"the reader's floor of {least_bytes(num_layers, top_k)} "
                           f"({BYTES_PER_CALL} per coder call)")


def table_shapes(num_layers: int, num_experts: int, top_k: int) -> list[tuple[int, ...]]:
    """Shapes of a model's tables, in payload order: flags [L, 3, 2], pop [L, E], pair
    [L, E, E], joint [L, C, E] (C = :func:`joint_sets`, possibly 0)."""
    nl, e = num_layers, num_experts
    return [(nl, 3, 2), (nl, e), (nl, e, e), (nl, joint_sets(e, top_k), e)]


def table_bytes(num_layers: int, num_experts: int, top_k: int) -> int:
    """Bytes of a model's u16 tables: 2 x L x (6 + E + E^2 + C x E)."""
    return 2 * sum(int(np.prod(s)) for s in table_shapes(num_layers, num_experts, top_k))


def payload_limits(num_layers: int, num_experts: int, top_k: int) -> tuple[int, int]:
    """(least, most) bytes of a model payload a reader accepts for this model shape: its
    tables expand at most ``MODEL_EXPANSION`` x (a reader's work per stored byte stays
    bounded), and zstd stores them with at most a small overhead."""
    n = table_bytes(num_layers, num_experts, top_k)
    return -(-n // MODEL_EXPANSION), n + n // 64 + 64


def set_index(rows: np.ndarray) -> np.ndarray:
    """ids int [N, K] (distinct per row, any column order) -> the set's rank int64 [N] in
    the combinatorial number system: sum_i C(s_i, i + 1), s ascending.

    NOTE: the binomials come from a table of exact integers (C(n, r) < 2^63 for n <= 64):
    products of K factors overflowed int64 for K near E."""
    s = np.sort(np.asarray(rows, dtype=np.int64), axis=1)
    if not s.size:
        return np.zeros(s.shape[0], dtype=np.int64)
    table = _binomials(int(s.max()) + 1, s.shape[1])
    return table[s, np.arange(1, s.shape[1] + 1)].sum(axis=1)


_BINOMIALS: dict[tuple[int, int], np.ndarray] = {}


def _binomials(n: int, k: int) -> np.ndarray:
    """int64 [n, k + 1]: C(i, r) for i < n, r <= k (n <= 65)."""
    t = _BINOMIALS.get((n, k))
    if t is None:
        t = _BINOMIALS[(n, k)] = np.array([[comb(i, r) for r in range(k + 1)] for i in range(n)],
                                          dtype=np.int64).reshape(n, k + 1)
    return t


@dataclasses.dataclass(eq=False)
class XlModel:
    """The counts of an ``xl-ans`` model (one per model frame), all u16 (stored) or int64
    (accumulating):

    - ``flags [L, 3, 2]``: rows (t >= 1) with repeat flag 0 / 1, by context (0: the same
      token's row one layer up was fresh, 1: it repeated, 2: all rows, the "none" context);
    - ``pop [L, E]``: expert ids of fresh rows;
    - ``pair [L, E, E]``: ``pair[l, u, x]``: fresh rows of layer l holding x whose token held
      u at layer l - 1 (zero at l = 0);
    - ``joint [L, C, E]``: ``joint[l, c, x]``: fresh rows of layer l holding x whose token
      held the expert set c at layer l - 1 (C = :func:`joint_sets`, possibly 0).
    """

    num_experts: int
    top_k: int
    flags: np.ndarray
    pop: np.ndarray
    pair: np.ndarray
    joint: np.ndarray

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, top_k: int) -> "XlModel":
        """Zero counts for L MoE layers (int64, ready for :meth:`count`).

        Raises:
            RecordError (a ValueError): E outside [2, ``MAX_EXPERTS``], top_k outside
                [1, E], or fewer than 1 MoE layer.
        """
        e, k = num_experts, top_k
        if not 2 <= e <= MAX_EXPERTS or not 1 <= k <= e or num_layers < 1:
            raise RecordError(f"xl-ans models 1 <= top_k <= num_experts, 2 <= num_experts <= "
                              f"{MAX_EXPERTS} and >= 1 MoE layer, got E={e}, K={k}, "
                              f"L={num_layers} (use xl-zstd)")
        z = np.zeros
        return cls(e, k, z((num_layers, 3, 2), np.int64), z((num_layers, e), np.int64),
                   z((num_layers, e, e), np.int64), z((num_layers, joint_sets(e, k), e), np.int64))

    @property
    def num_layers(self) -> int:
        """L: the MoE layers the model has tables for."""
        return self.pop.shape[0]

    def check_shapes(self, coding: bool = False) -> None:
        """Raise RecordError (a ValueError) unless E and K are in range and the four tables
        have the shapes :func:`table_shapes` gives for them (the compiled coder indexes
        them unchecked); ``coding``: also unless every count is an integer in [0, 65535]
        (what a model frame stores: :meth:`stored`; a coder's weights stay exact in int64
        only below that)."""
        e, k = self.num_experts, self.top_k
        ok = isinstance(self.pop, np.ndarray) and self.pop.ndim == 2 and \
            2 <= e <= MAX_EXPERTS and 1 <= k <= e
        shapes = table_shapes(self.pop.shape[0], e, k) if ok else []
        if not ok or any(not isinstance(a, np.ndarray) or a.shape != sh for a, sh in
                         zip((self.flags, self.pop, self.pair, self.joint), shapes)):
            got = [getattr(a, "shape", None) for a in (self.flags, self.pop, self.pair, self.joint)]
            raise RecordError(f"xl-ans model tables of shapes {got} do not fit E={e}, top-{k} "
                              f"({shapes or 'E or K out of range'})")
        if coding:
            for a in (self.flags, self.pop, self.pair, self.joint):
                if a.dtype != np.uint16 and a.size and (
                        a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) > COUNT_MAX):
                    raise RecordError(f"xl-ans codes with counts in [0, {COUNT_MAX}] (a model "
                                      f"frame's: XlModel.stored()), got {a.dtype} counts in "
                                      f"[{a.min()}, {a.max()}]")

    def count(self, ids: np.ndarray) -> None:
        """Add a record's routing, ids int [T, L, K] (all MoE layers, engine column order),
        to the counts.

        Raises:
            RecordError (a ValueError): ids not an integer array, of another number of MoE
                layers or top_k, or tables that do not fit the model's E and top_k."""
        ids = np.asarray(ids)
        self.check_shapes()
        _check_dtype(ids)
        t, nl, k = ids.shape
        e = self.num_experts
        if nl != self.num_layers or k != self.top_k:
            raise RecordError(f"xl-ans model of {self.num_layers} MoE layers x top-"
                              f"{self.top_k} cannot count ids of shape {ids.shape}")
        if t == 0:
            return
        jit = compiled()
        tables = (self.flags, self.pop, self.pair, self.joint)
        if jit is not None and ids.dtype.isnative and all(
                a.dtype == np.int64 and a.flags.c_contiguous and a.flags.writeable
                for a in tables):
            ids = np.ascontiguousarray(ids)
            if jit.check_ids(ids, e) == 0:          # NOTE: else numpy's errors, as before
                jit.count_record(ids, *tables, _binomials(e + 1, k))
                return
        ids = ids.astype(np.int64)
        rep = np.zeros((t, nl), dtype=bool)
        rep[1:] = (ids[1:] == ids[:-1]).all(axis=2)
        for lyr in range(nl):
            f = rep[1:, lyr].astype(np.int64)
            self.flags[lyr, NONE_CTX] += np.bincount(f, minlength=2)
            if lyr:
                ctx = rep[1:, lyr - 1].astype(np.int64)
                self.flags[lyr, :2] += np.bincount(ctx * 2 + f, minlength=4).reshape(2, 2)
            fresh = ~rep[:, lyr]
            x = ids[fresh, lyr]                                          # [N, K]
            self.pop[lyr] += np.bincount(x.ravel(), minlength=e)
            if lyr:
                u = ids[fresh, lyr - 1]
                pairs = (u[:, :, None] * e + x[:, None, :]).ravel()
                self.pair[lyr] += np.bincount(pairs, minlength=e * e).reshape(e, e)
                if self.joint.shape[1]:
                    c = np.repeat(set_index(u), k) * e + x.ravel()
                    self.joint[lyr] += np.bincount(
                        c, minlength=self.joint.shape[1] * e).reshape(-1, e)

    def rows_counted(self) -> int:
        """Token-layer rows counted so far (t >= 1 rows, summed over layers)."""
        return int(self.flags[:, NONE_CTX].sum())

    def frozen(self) -> "XlModel":
        """A u16 copy, each table scaled down (floor) so its largest count is <= 65535."""
        def q(a: np.ndarray) -> np.ndarray:
            m = int(a.max()) if a.size else 0
            if m > COUNT_MAX:
                a = a * COUNT_MAX // m
            return a.astype(np.uint16)
        return XlModel(self.num_experts, self.top_k, q(self.flags), q(self.pop), q(self.pair),
                       q(self.joint))

    def stored(self) -> "XlModel":
        """What a writer stores in a model frame: :meth:`frozen`, then the pop, pair and
        joint counts rounded to a grid whose step grows as the count's square root
        (c -> round((round(2 sqrt(c)) / 2)^2): 0, 1, 2, 4, 6, 9, 12, 16, ...), nonzero
        counts staying nonzero. Readers take stored counts as they are (any u16 values are
        valid), so this is the writer's choice, not the format's.

        NOTE: a count learned from n rows is only known to about +-sqrt(n) (sampling noise),
        so the digits below that step cost model bytes and buy no rate. Measured on the
        cross-layer source (E=8 top-2, 32 layers, 1K-token records): model frames 25-35 %
        smaller when learned from 1-16 records (a model of 1 record: 8.0 -> 5.8 KB), 20 %
        from 64, 15 % from 256, at the same rate (1.033x from 1 record, 1.018x from 4), so
        the writer can afford its first model frame earlier; whole streams of 64 records
        104.2 -> 103.9 % of the entropy rate, of 256 records 102.6 -> 102.4 %.
        """
        def q(a: np.ndarray) -> np.ndarray:
            r = np.rint((np.rint(2.0 * np.sqrt(a.astype(np.float64))) / 2.0) ** 2)
            return np.minimum(r, COUNT_MAX).astype(np.uint16)
        m = self.frozen()
        return XlModel(self.num_experts, self.top_k, m.flags, q(m.pop), q(m.pair), q(m.joint))

    def coarsened(self, scale: int = 1, without_pair: bool = False) -> "XlModel":
        """A copy, int64 tables of the same shapes, with the pop, pair and joint counts
        divided by ``scale`` (floor, nonzero counts staying nonzero; flags as they are),
        and with ``without_pair`` the pair table zeroed (its successor term then uniform).
        A writer's candidate for a model frame: coarser counts make a smaller frame and a
        less exact model, which pays where the frame is a large share of what the model
        codes (records counted first, short records); where the joint table exists it
        holds what the pair table knows and more. Any counts are a valid model: the
        reader's rules do not change.

        Raises:
            ValueError: ``scale`` not an integer in [1, 2^62], or counts that are not
                integers in [0, 2^62)."""
        if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) \
                or not 1 <= scale <= 1 << 62:
            raise ValueError(f"scale must be an integer in [1, 2^62], got {scale!r}")

        def int64(a: np.ndarray) -> np.ndarray:
            a = np.asarray(a)
            if a.dtype.kind not in "iu" or (a.size and (int(a.min()) < 0 or
                                                        int(a.max()) >= 1 << 62)):
                raise ValueError(f"counts must be integers in [0, 2^62), got {a.dtype} "
                                 f"[{a.min() if a.size else '-'}, {a.max() if a.size else '-'}]")
            return a.astype(np.int64)

        def q(a: np.ndarray) -> np.ndarray:
            a = int64(a)
            return np.where(a > 0, np.maximum(a // scale, 1), 0)
        flags, pop, pair, joint = (int64(self.flags), q(self.pop), int64(self.pair),
                                   q(self.joint))
        pair = np.zeros_like(pair) if without_pair else q(pair)
        return XlModel(self.num_experts, self.top_k, flags, pop, pair, joint)

    # -- model payload (docs/FORMAT.md "Model payload") ------------------------------------

    def to_bytes(self) -> bytes:
        """Model payload: varint L, E, K, then one zstd frame of the u16 LE tables
        flags, pop, pair, joint (C-order)."""
        from routereplay.sidecar.layout import varint
        m = self.frozen()
        body = b"".join(np.ascontiguousarray(a, dtype="<u2").tobytes()
                        for a in (m.flags, m.pop, m.pair, m.joint))
        return varint(self.num_layers) + varint(self.num_experts) + varint(self.top_k) + \
            zstandard.ZstdCompressor(level=19).compress(body)

    @classmethod
    def from_bytes(cls, payload: bytes, num_layers: int, num_experts: int,
                   top_k: int) -> "XlModel":
        """Parse a model payload for a stream of L MoE layers, E experts, top-k K.

        Raises:
            SidecarError: header varints that do not parse, L, E, K other than the
                stream's, E outside [2, ``MAX_EXPERTS``], or tables that are not exactly
                one zstd frame declaring and holding the tables' bytes.
        """
        from routereplay.sidecar.layout import read_varint
        buf = memoryview(payload)
        try:
            lm, pos = read_varint(buf, 0)
            e, pos = read_varint(buf, pos)
            k, pos = read_varint(buf, pos)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt model
            raise SidecarError(f"xl-ans model payload does not parse: {exc}") from None
        if (lm, e, k) != (num_layers, num_experts, top_k):
            raise SidecarError(f"xl-ans model is for L={lm}, E={e}, K={k}; the stream has "
                               f"L={num_layers}, E={num_experts}, K={top_k}")
        if not (1 <= k <= e and 2 <= e <= MAX_EXPERTS):
            raise SidecarError(f"xl-ans model for E={e}, K={k}: models need 1 <= K <= E, 2 <= E <= "
                               f"{MAX_EXPERTS}")
        shapes = table_shapes(lm, e, k)
        n = table_bytes(lm, e, k) // 2
        body = bytes(buf[pos:])
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise SidecarError(f"xl-ans model tables are not a zstd frame: {exc}") from None
        if declared != 2 * n:
            raise SidecarError(f"xl-ans model tables' zstd frame declares {declared} bytes, "
                               f"not the {2 * n} of the tables")
        # NOTE: the frame declares its size, so the output is bounded by it; exactly one
        # frame, nothing before or after it (no skippable frames)
        obj = zstandard.ZstdDecompressor().decompressobj()
        try:
            raw = obj.decompress(body)
        except zstandard.ZstdError as exc:
            raise SidecarError(f"xl-ans model tables do not decode: {exc}") from None
        if len(raw) != 2 * n or not obj.eof or obj.unused_data:
            raise SidecarError(f"xl-ans model payload is not exactly one zstd frame of the "
                               f"{2 * n} bytes of its tables")
        arrs, off = [], 0
        for s in shapes:
            m = int(np.prod(s))
            arrs.append(np.frombuffer(raw, dtype="<u2", count=m, offset=2 * off)
                        .astype(np.uint16).reshape(s))        # NOTE: u16 kept: 2 bytes a count
            off += m
        return cls(e, k, *arrs)


def _check_dtype(ids: np.ndarray) -> None:
    """Raise RecordError unless ``ids`` is an integer array [T, L, K] (a float or object
    array would be truncated on the way to the coder)."""
    if ids.dtype.kind not in "iu" or ids.ndim != 3:
        raise RecordError(f"xl-ans codes integer ids [T, L, K], got {ids.dtype} {ids.shape}")


def _column_weights(base: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """base int64 [N, E] (or [1, E]), taken bool [N, E] -> weights base + 1, 1 where taken."""
    return np.where(taken, 1, base + 1)


def _params(weights: np.ndarray) -> np.ndarray:
    """Integer weights int64 [..., E] -> constriction parameters int32 [..., E]
    (``ans.frequencies - 1``: exact in float64, see routereplay.codec.ans)."""
    return (ans.frequencies(weights) - 1).astype(np.int32)


def _cumulative(weights: np.ndarray) -> np.ndarray:
    """Integer weights int64 [..., E] -> cumulative frequencies int32 [..., E + 1]: 0, then
    the running sums of ``ans.frequencies(weights)`` (the last is 2^24). Symbol x's interval
    is ``[cum[x], cum[x + 1])``."""
    f = ans.frequencies(weights)
    out = np.zeros(f.shape[:-1] + (f.shape[-1] + 1,), dtype=np.int32)
    np.cumsum(f, axis=-1, out=out[..., 1:])
    return out


def _cum_params(cum: np.ndarray) -> np.ndarray:
    """Cumulative frequencies int32 [..., E + 1] -> constriction parameters float64
    [..., E] (frequency - 1)."""
    return (np.diff(cum, axis=-1) - 1).astype(np.float64)


class _Tables:
    """What a model's weights need, computed once per model (they depend on the context
    only): per-layer successor rows, and the cumulative frequencies of every context whose
    count is small: repeat flags [L, 3, 2] (as parameters); a section's first layer,
    columns 0 and 1 [L, E + 1] / [L, E, E + 1]; with a joint table, columns 0 and 1 of each
    expert set [L, C, E + 1] / [L, C, E, E + 1] (column 1 given column 0's id). Other
    columns are computed per row.

    NOTE: building the frequencies (ans.frequencies) of every row's weights took about
    half of the decode time; contexts repeat across rows and records. Cumulative tables
    let the compiled decoder find a symbol with E - 1 compares and no per-row copy.
    """

    def __init__(self, m: XlModel):
        m.check_shapes(coding=True)
        self.source = (m.num_experts, m.top_k, m.flags, m.pop, m.pair, m.joint)
        e, k, c = m.num_experts, m.top_k, m.joint.shape[1]
        nl = m.num_layers
        self.top_k = k
        self.flags = _params(m.flags.astype(np.int64) + 1)                       # [L, 3, 2]
        pr = m.pair.astype(np.int64)
        self.succ = (((pr + 1) * SCALE) // (pr.sum(axis=2, keepdims=True) + e)  # [L, E, E]
                     ).astype(np.int32)                  # NOTE: <= SCALE; K of them fit int32
        self.pop = m.pop.astype(np.int64)                                       # [L, E]
        self.pop0 = _cumulative(self.pop + 1)                                   # [L, E + 1]
        self.pop1 = _cumulative(_exclude_one(self.pop)) if k > 1 else None   # [L, E, E + 1]
        self.joint = None
        if c:
            members = _set_members(e, k)                                        # [C, K]
            s = self.succ[:, members].sum(axis=2, dtype=np.int64)               # [L, C, E]
            self.joint = m.joint.astype(np.int64) * SCALE + SMOOTH * s          # [L, C, E]
            self.joint0 = _cumulative(self.joint + 1)                           # [L, C, E + 1]
            self.joint1 = None
            if k > 1 and 4 * nl * c * e * (e + 1) <= TABLES_MEMORY * table_bytes(nl, e, k):
                self.joint1 = _cumulative(_exclude_one(self.joint))         # [L, C, E, E + 1]

    def built_from(self, m: XlModel) -> bool:
        """Whether these tables were built from ``m`` as it is now: the same E, K and table
        arrays (a model edited after use needs new ones)."""
        e, k, *arrays = self.source
        return (e, k) == (m.num_experts, m.top_k) and all(
            a is b for a, b in zip(arrays, (m.flags, m.pop, m.pair, m.joint)))

    def kernel_args(self) -> tuple:
        """The tables as routereplay.codec.xl_ans_jit's kernels take them (the cumulative
        tables flattened, absent ones as empty arrays of the same dtype and rank),
        computed once per model."""
        a = self.__dict__.get("_kernel_args")
        if a is None:
            e, k = self.pop.shape[1], self.top_k
            none1 = np.zeros(0, np.int32)
            has_joint = self.joint is not None
            a = self._kernel_args = (
                np.ascontiguousarray(self.flags), np.ascontiguousarray(self.pop),
                self.pop0.ravel(), none1 if self.pop1 is None else self.pop1.ravel(),
                np.ascontiguousarray(self.succ),
                np.ascontiguousarray(self.joint) if has_joint else
                np.zeros((0, 0, 0), np.int64),
                self.joint0.ravel() if has_joint else none1,
                none1 if not has_joint or self.joint1 is None else self.joint1.ravel(),
                _binomials(e + 1, k))
        return a


TABLES_MEMORY = 16          # a joint column-1 table is kept where <= this x the model's tables


def _exclude_one(base: np.ndarray) -> np.ndarray:
    """base int64 [..., E] -> weights [..., E(x0), E]: base + 1, and 1 at x0."""
    e = base.shape[-1]
    w = np.repeat((base + 1)[..., None, :], e, axis=-2)
    idx = np.arange(e)
    w[..., idx, idx] = 1
    return w


def _set_members(e: int, k: int) -> np.ndarray:
    """int64 [C, K]: the sets of K of E experts, ascending, in set_index order."""
    from itertools import combinations
    sets = np.array(list(combinations(range(e), k)), dtype=np.int64).reshape(-1, k)
    out = np.empty_like(sets)
    out[set_index(sets)] = sets
    return out


def _tables(model: XlModel) -> _Tables:
    """The coder tables of ``model``, built once and kept on it; built anew (and its shapes
    checked again) where the model's E, K or tables are no longer those they were built
    from.

    NOTE: the compiled coder indexes the tables unchecked, by the model's L, E and K as the
    caller checked them: a model edited after use (another ``pop``, another
    ``num_experts``) must not meet the tables of its old shapes (the attacker review: a
    segfault)."""
    t = model.__dict__.get("_tables")
    if t is None or not t.built_from(model):
        t = model.__dict__["_tables"] = _Tables(model)
    return t


def _layer_context(tab: _Tables, up: np.ndarray | None) -> np.ndarray | None:
    """The context of a layer's fresh rows, once per layer: None (the section's first
    layer), their ids one layer up int [N, K] (no joint table), or their expert sets' ranks
    int64 [N] (joint table)."""
    if up is None or tab.joint is None:
        return up
    return set_index(up)


def _column_params(tab: _Tables, lyr: int, ctx: np.ndarray | None, prev: np.ndarray,
                   j: int) -> np.ndarray:
    """Coder parameters float64 [n, E] of column ``j`` of n fresh rows of layer ``lyr``:
    ``ctx`` their context (:func:`_layer_context`, sliced to the n rows), ``prev`` int
    [n, >= j] their columns before j (excluded)."""
    n = prev.shape[0]
    rows = np.arange(n)
    if ctx is None:
        base, p0, p1 = tab.pop[lyr][None], tab.pop0[lyr][None], \
            None if tab.pop1 is None else tab.pop1[lyr]
    elif tab.joint is None:
        base, p0, p1 = tab.succ[lyr][ctx].sum(axis=1), None, None
    else:
        base, p0 = tab.joint[lyr][ctx], tab.joint0[lyr][ctx]
        p1 = None if tab.joint1 is None else tab.joint1[lyr][ctx]
    if j == 0 and p0 is not None:
        return np.ascontiguousarray(np.broadcast_to(_cum_params(p0), (n, p0.shape[-1] - 1)))
    if j == 1 and p1 is not None:
        x0 = prev[:, 0].astype(np.int64)
        return _cum_params(p1[x0] if p1.ndim == 2 else p1[rows, x0])
    taken = np.zeros((n, base.shape[-1]), dtype=bool)
    if j:
        taken[rows[:, None], prev[:, :j]] = True          # NOTE: one call, whatever j
    return (ans.frequencies(_column_weights(base, taken)) - 1).astype(np.float64)


def _chunks(n: int):
    """Row slices of at most CHUNK_ROWS: the parameters of one chunk exist at a time."""
    return [slice(a, min(a + CHUNK_ROWS, n)) for a in range(0, n, CHUNK_ROWS)]


def work(t: int, fresh: int, k: int, e: int) -> int:
    """Coder work of one layer of a section (parameter entries): 2 per repeat flag, E per
    id of a fresh row."""
    return 2 * max(t - 1, 0) + fresh * k * e


def section_work(ids: np.ndarray, num_experts: int) -> int:
    """Coder work a reader spends on a section of ids [T, G, K] (:func:`work` over its
    layers); a section of S data bytes may need at most ``WORK_PER_BYTE x S``."""
    t, g, k = ids.shape
    if t == 0:
        return 0
    # NOTE: rows differing in any column, column by column (an any() along the short last
    # axis took a tenth of a writer's time)
    differs = ids[1:, :, 0] != ids[:-1, :, 0]
    for j in range(1, k):
        differs |= ids[1:, :, j] != ids[:-1, :, j]
    fresh = np.count_nonzero(differs, axis=0) + 1     # per layer; row 0 is always fresh
    return sum(work(t, int(n), k, num_experts) for n in fresh)


def _plan(ids: np.ndarray, model: XlModel, l0: int):
    """Yield, in decode order, (symbols int32 [n], params float64 [n, m]) of a section
    ids int64 [T, G, K] whose first layer is MoE layer ``l0``."""
    t, g, k = ids.shape
    tab = _tables(model)
    rep = np.zeros((t, g), dtype=bool)
    rep[1:] = (ids[1:] == ids[:-1]).all(axis=2)
    for lp in range(g):
        lyr = l0 + lp
        if t > 1:
            ctx = rep[1:, lp - 1].astype(np.int64) if lp else np.full(t - 1, NONE_CTX)
            yield rep[1:, lp].astype(np.int32), tab.flags[lyr][ctx].astype(np.float64)
        fresh = np.nonzero(~rep[:, lp])[0]
        ctx = _layer_context(tab, ids[fresh, lp - 1] if lp else None)
        for j in range(k):
            for sl in _chunks(fresh.size):
                f = fresh[sl]
                yield ids[f, lp, j].astype(np.int32), _column_params(
                    tab, lyr, None if ctx is None else ctx[sl], ids[f, lp], j)


def encode(ids: np.ndarray, model: XlModel, l0: int) -> bytes:
    """ids uint8 [T, G, K] (MoE layers l0 .. l0 + G - 1 of the stream) -> the ANS words of
    an ``xl-ans`` section under ``model`` (without the section's model reference, which
    routereplay.codec adds).

    NOTE: readers refuse a section whose words are under :func:`least_bytes` or that
    needs more than ``WORK_PER_BYTE`` x its words' bytes of :func:`section_work`; the
    writer checks both and keeps ``xl-zstd`` there.

    Raises:
        RecordError (a ValueError): ids not an integer array [T, G, K], an id out of
            [0, E), a row repeating an expert, or layers beyond the model's.
    """
    jit, ids = checked_section(ids, model, l0, "xl-ans")
    if jit is not None:
        return jit.encode_section(ids, l0, *_tables(model).kernel_args()).astype("<u4").tobytes()
    steps = list(_plan(ids, model, l0))
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.array([ans.END_MARKER], dtype=np.int32), ans.marker_model())
    for sym, p in reversed(steps):
        coder.encode_reverse(sym, ans.family(), ans.contiguous(p))
    return coder.get_compressed().astype("<u4").tobytes()


def checked_section(ids: np.ndarray, model: XlModel, l0: int, codec: str) -> tuple[Any, np.ndarray]:
    """What an encoder of ``codec`` (``xl-ans`` or ``xl-ans-rows``) takes from ids int
    [T, G, K] of MoE layers l0 .. l0 + G - 1: (the numba kernels, the ids as uint8
    C-contiguous), or (None, the ids as int64) where constriction codes.

    Raises:
        RecordError (a ValueError): ids not an integer array [T, G, K], layers or top_k
            beyond the model's, an id out of [0, E), or a row repeating an expert."""
    _check_dtype(ids)
    t, g, k = ids.shape
    e = model.num_experts
    if l0 < 0 or l0 + g > model.num_layers or k != model.top_k:
        raise RecordError(f"{codec} section of layers [{l0}, {l0 + g}) x top-{k} does not fit "
                          f"a model of {model.num_layers} layers x top-{model.top_k}")
    jit = compiled()
    if jit is not None:
        ids = np.ascontiguousarray(ids, dtype=ids.dtype.newbyteorder("="))
        bad = jit.check_ids(ids, e)
    else:
        ids = ids.astype(np.int64)
        s = np.sort(ids, axis=2)
        bad = 1 if ids.size and (int(ids.max()) >= e or int(ids.min()) < 0) else \
            2 if k > 1 and (s[..., 1:] == s[..., :-1]).any() else 0
    if bad == 1:
        raise RecordError(f"an expert id is outside [0, {e})")
    if bad == 2:
        raise RecordError("a routing row repeats an expert")
    return jit, ids.astype(np.uint8, copy=False) if jit is not None else ids


def decode(data: bytes, shape: tuple[int, int, int], dtype: np.dtype, model: XlModel,
           l0: int) -> np.ndarray:
    """ANS words of an ``xl-ans`` section -> ids [T, G, K] of ``dtype`` (uint8).

    Raises:
        SidecarError: layers beyond the model's, words under the floor
            (:func:`least_bytes`), coder work beyond ``WORK_PER_BYTE`` per byte of words
            (checked layer by layer, before the layer's ids are decoded), a malformed ANS
            stack (routereplay.codec.ans.Decoder), an id decoded twice in a row, a fresh row
            equal to the row before it, or words left over.
    """
    t, g, k = shape
    e = model.num_experts
    if l0 < 0 or l0 + g > model.num_layers or k != model.top_k:
        raise SidecarError(f"xl-ans section of layers [{l0}, {l0 + g}) x top-{k} does not fit "
                           f"its model of {model.num_layers} layers x top-{model.top_k}")
    check_floor(len(data), g, k)
    jit = compiled()
    if jit is not None:
        return _decode_compiled(jit, data, shape, dtype, model, l0)
    dec = ans.Decoder(data)
    tab = _tables(model)
    budget = WORK_PER_BYTE * len(data)
    spent = 0
    out = np.empty((t, g, k), dtype=np.uint8)
    rep_up = None
    for lp in range(g):
        lyr = l0 + lp
        where = f"MoE layer {lyr}"
        rep = np.zeros(t, dtype=bool)
        if t > 1:
            ctx = rep_up[1:].astype(np.int64) if lp else np.full(t - 1, NONE_CTX)
            rep[1:] = dec.decode_params(tab.flags[lyr][ctx].astype(np.float64), where) == 1
        fresh = np.nonzero(~rep)[0]
        spent += work(t, fresh.size, k, e)
        if spent > budget:
            raise _section_error(OVER_BUDGET, len(data), where)
        ctx = _layer_context(tab, out[fresh, lp - 1] if lp else None)
        for j in range(k):
            for sl in _chunks(fresh.size):
                f = fresh[sl]
                p = _column_params(tab, lyr, None if ctx is None else ctx[sl], out[f, lp], j)
                x = dec.decode_params(p, where)
                if j and (out[f, lp, :j] == x[:, None]).any():
                    raise _section_error(REPEATED_ID, len(data), where)
                out[f, lp, j] = x
        # NOTE: a repeated row copies the last fresh row before it (row 0 is always fresh)
        src = np.maximum.accumulate(np.where(rep, 0, np.arange(t)))
        out[:, lp] = out[src, lp]
        if fresh.size > 1:
            f = fresh[fresh > 0]
            if (out[f, lp] == out[f - 1, lp]).all(axis=1).any():
                raise _section_error(FRESH_REPEATS, len(data), where)
        rep_up = rep
    dec.finish()
    return out.astype(dtype)


def _decode_compiled(jit: Any, data: bytes, shape: tuple[int, int, int], dtype: np.dtype,
                     model: XlModel, l0: int) -> np.ndarray:
    """:func:`decode` by routereplay.codec.xl_ans_jit's kernel (same checks, same errors
    as the constriction path; ``shape`` and ``l0`` already checked against the model)."""
    t, g, k = shape
    ans.check_words(data)
    out = np.empty((t, g, k), dtype=np.uint8)
    code, lyr = jit.decode_section(
        np.frombuffer(data, dtype="<u4").astype(np.uint32), t, g, k, model.num_experts, l0,
        *_tables(model).kernel_args(),
        WORK_PER_BYTE * len(data), out)
    if code != OK:
        raise _section_error(code, len(data), f"MoE layer {lyr}")
    return out.astype(dtype)


def _section_error(code: int, nbytes: int, where: str) -> SidecarError:
    """The error both coders raise for a section of ``nbytes`` bytes of words refused with
    ``code`` (one of ENDS_EARLY, OVER_BUDGET, REPEATED_ID, FRESH_REPEATS, BAD_END) at
    ``where``."""
    if code == ENDS_EARLY:
        return ans.ends_early(where)
    if code == OVER_BUDGET:
        return SidecarError(f"xl-ans section of {nbytes} bytes needs more coder work than the "
                            f"reader's limit of {WORK_PER_BYTE} per byte (at {where})")
    if code == REPEATED_ID:
        return SidecarError(f"xl-ans section repeats an expert in a row at {where}")
    if code == FRESH_REPEATS:
        return SidecarError(f"xl-ans section codes a row as fresh that repeats the row before "
                            f"it at {where} (corrupt, or decoding past its data)")
    return ans.bad_end()
