"""Sidecar writer: append records to a stream off the caller's thread (docs/FORMAT.md).

A bounded queue feeds one background thread that encodes and appends frames, so a slow
destination pushes back on the producer instead of growing memory.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import stat
import queue
import threading
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np

from routereplay import codec as _codec
from routereplay.codec import xl_ans
from routereplay.errors import ConfigError, RecordError, SidecarError, StreamExistsError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import (COLUMN_ORDERS, DEFAULT_LAYER_GROUP,
                                        DEFAULT_MIN_SECTION_BYTES, DEFAULT_ONE_SECTION_BYTES,
                                        DEFAULT_TOKEN_BLOCK,
                                        FORMAT_VERSION, KIND_INDEX, KIND_MODEL, KIND_RECORD,
                                        MAX_JSON_BYTES,
                                        MAX_TOKENS, V2_LAYER_GROUP, WRITABLE_VERSIONS,
                                        codec_table, encode_frame, encode_header, encode_index,
                                        encode_trailer)
from routereplay.sidecar.payload import encode_record_payload

FSYNC_MODES = ("close", "frame", "never")
# xl-ans model frames (SidecarWriter._learn_from); measured in benchmarks/codec.py
XL_ANS_LAYER_GROUP = 8        # a grid's layer group: cross-layer context is lost at its edges
MODEL_FIRST_ROWS = 8192       # token-layer rows counted before the first model
MODEL_FIRST_SHARE = 1 / 16    # the first model frame: at most this share of the raw ids so far
MODEL_SHARE = 1 / 64          # all model frames together, once there is one
MODEL_REFRESH = 4             # a new model is learned from this many times the rows
SEED_COUNT_MAX = 1 << 40      # a seed's counts (scaling them stays within int64)
FLOOR_MARGIN = 1.5            # model-coded sections under this x the reader's floor: no bet
SEED_ROWS = 1 << 20           # a seed (xl_ans_seed) counts as at most this many rows
COUNT_SEED_ROWS = 1 << 22     # count_seed: records counted up to this many token-layer rows
COUNT_SEED_RECORDS = 1 << 16  # count_seed: and at most this many records
MAX_MODELS = 12               # model frames a stream gets (readers parse at most 16)
CANDIDATE_SCALE = 4           # _candidates: the coarser counts' divisor


def _candidates(counts: "xl_ans.XlModel", coarse: bool) -> "list[xl_ans.XlModel]":
    """The models a writer tries for a model frame learned from ``counts``, as int64
    XlModels of ``counts``' shapes: first, where the model has a joint table (C x E <=
    ``xl_ans.JOINT_LIMIT``, C = binom(E, K): E=8 any top-k, E=16 top-2, top-1 up to E=64),
    the counts without the pair table (the joint table holds what it knows: a frame about
    25 % smaller at E=8 top-2, the same or a better rate), else the counts as they are;
    then, with ``coarse``, that model with its counts divided by CANDIDATE_SCALE (a smaller
    frame, a less exact model).

    NOTE: measured on the cross-layer source (benchmarks/README.md "xl-ans"): without the
    pair table, one-pass streams are 0.3-1.7 % smaller (E=8 top-2 and top-4, E=16 top-2;
    trying both as counted and without was no better, at twice the cost). Coarse
    candidates are for a seed (``_maybe_seed``), whose counts are about as many as the rows
    its frame will code (records counted first: 1-2.5 % smaller streams of 100-256-token
    records); a one-pass writer's first model, learned from a few records and coding many
    more, paid early with them and then lost (256-token records: 110.2 % of the entropy
    rate against 108.7 %)."""
    base = counts.coarsened(without_pair=True) if counts.joint.shape[1] else counts
    return [base] + ([base.coarsened(CANDIDATE_SCALE)] if coarse else [])


def _check_seed(seed: Any, codec: str, schema: RoutingSchema) -> None:
    """``xl_ans_seed`` for a writer of ``codec`` and ``schema``.

    Raises:
        ConfigError: a codec other than ``xl-ans``, not an XlModel of the schema's MoE
            layers, experts and top-k, or counts that are not non-negative integers."""
    if codec != "xl-ans":
        raise ConfigError(f"xl_ans_seed is for codec 'xl-ans', not {codec!r}")
    s = schema
    if not isinstance(seed, xl_ans.XlModel):
        raise ConfigError(f"xl_ans_seed must be an XlModel (a writer's learned_model(), "
                          f"SidecarReader(path).xl_ans_counts() or count_seed(records, "
                          f"schema)[0]), got {type(seed).__name__}")
    if (seed.num_layers, seed.num_experts, seed.top_k) != (s.num_moe_layers, s.num_experts,
                                                           s.top_k):
        raise ConfigError(f"xl_ans_seed is a model of {seed.num_layers} MoE layers, "
                          f"{seed.num_experts} experts, top-{seed.top_k}; this stream has "
                          f"{s.num_moe_layers}, {s.num_experts}, top-{s.top_k}")
    shapes = xl_ans.table_shapes(s.num_moe_layers, s.num_experts, s.top_k)
    for a, shape in zip((seed.flags, seed.pop, seed.pair, seed.joint), shapes):
        a = np.asarray(a)
        if a.shape != shape or a.dtype.kind not in "iu" or (a.size and (
                int(a.min()) < 0 or int(a.max()) > SEED_COUNT_MAX)):
            raise ConfigError(f"xl_ans_seed counts must be integer arrays of shapes {shapes} "
                              f"with counts in [0, 2^40]")


def count_seed(records: Iterable[RoutingRecord], schema: RoutingSchema, *,
               max_rows: int = COUNT_SEED_ROWS,
               consume: bool = False) -> "tuple[xl_ans.XlModel, int]":
    """An ``xl_ans_seed`` counted from the records a writer is about to write: a two-pass
    write (``routereplay convert --codec xl-ans`` does it by default), whose first model
    frame is learned from the stream's own routing and written before its first record,
    instead of learned from its first record or two.

    Usage: ``seed, _ = count_seed(records, schema)``, then ``SidecarWriter(path, schema,
    codec="xl-ans", xl_ans_seed=seed)`` and write the same ``records``.

    Args:
        records: RoutingRecord of ``schema`` (ids ``[T, L_moe, top_k]``, engine column
            order), e.g. a list; read until ``max_rows`` rows are counted (the record that
            crosses it included) or ``COUNT_SEED_RECORDS`` (2^16) records are read.
        max_rows: rows to count, (T - 1) x MoE layers a record (>= 1; a record's first
            token has no previous token to learn from: ``XlModel.rows_counted``). The
            writer weighs a seed as at most ``SEED_ROWS`` (2^20) such rows; counting more
            (default 2^22, 4 MB of ids at top-1) only refines proportions.
        consume: allow a one-shot iterator (e.g. a generator over a first read of the
            input, to be read again for writing): it is read up to ``max_rows`` and the
            rest is left unread. Without it an iterator is refused, since the writer would
            then get none of the records it counted.

    Returns:
        (model, records counted): an XlModel of int64 counts, as
        ``SidecarWriter.learned_model()`` holds them: ``flags [L_moe, 3, 2]``, ``pop
        [L_moe, E]``, ``pair [L_moe, E, E]``, ``joint [L_moe, C, E]``.

    Raises:
        TypeError: ``records`` is an iterator and ``consume`` is False;
        ConfigError: a schema xl-ans cannot model (E outside 2-64), or ``max_rows`` < 1;
        RecordError: a record that does not fit ``schema`` (named, as ``write`` names it:
            sample, token and layer of an out-of-range id)."""
    s = schema
    if not 2 <= s.num_experts <= xl_ans.MAX_EXPERTS:
        raise ConfigError(f"xl-ans models 2 to {xl_ans.MAX_EXPERTS} experts, the schema has "
                          f"{s.num_experts}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) \
            or max_rows < 1:
        raise ConfigError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    if not consume and iter(records) is records:
        raise TypeError("count_seed got an iterator: counting would consume the records the "
                        "writer is to write. Pass a list (or another re-iterable), or "
                        "consume=True with an iterator over a first read of the input")
    m = xl_ans.XlModel.empty(s.num_moe_layers, s.num_experts, s.top_k)
    n = rows = 0
    for rec in records:
        rec.validate(s)
        m.count(rec.expert_ids)
        # NOTE: learnable rows, and a cap on records: one-token (or empty) records teach
        # nothing and would otherwise be read to the end (attacker review: +29 % on an
        # input of one-token records, never returning on an endless iterator)
        n, rows = n + 1, rows + max(rec.num_tokens - 1, 0) * s.num_moe_layers
        if rows >= max_rows or n >= COUNT_SEED_RECORDS:
            break
    return m, n


def writer_codec(codec: str | None, column_order: str = "engine",
                 format_version: int = FORMAT_VERSION,
                 schema: RoutingSchema | None = None) -> str:
    """The routing codec a writer uses for ``codec`` (None: the default) and ``column_order``.

    None -> ``xl-zstd`` (engine order; ``ctx-zstd`` for a ``format_version=2`` writer, whose
    readers may predate ``xl-zstd``) or ``ctx-ans-sorted`` (sorted); ``ctx-ans`` with
    sorted rows -> ``ctx-ans-sorted``.

    Raises:
        ConfigError (a ValueError): unknown codec or column order, ``xl-ans-rows`` (a
            layout the ``xl-ans`` writer picks), ``ctx-ans-sorted`` for engine order, or
            ``xl-ans`` for ``format_version=2``, (given ``schema``) for more than 64
            experts, or with ``ROUTEREPLAY_XL_ANS_JIT=1`` where numba does not import.
    """
    if column_order not in COLUMN_ORDERS:
        raise ConfigError(f"column_order must be one of {COLUMN_ORDERS}")
    if codec is None:
        return "ctx-ans-sorted" if column_order == "sorted" else \
            _codec.DEFAULT_CODEC if format_version >= 3 else _codec.V2_DEFAULT_CODEC
    if column_order == "sorted" and codec == "ctx-ans":
        return "ctx-ans-sorted"
    if codec == "xl-ans-rows":
        raise ConfigError("codec 'xl-ans-rows' is a section layout of 'xl-ans': a writer of "
                          "codec='xl-ans' codes sections with it where it applies")
    if codec not in _codec.CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(_codec.WRITER_CODECS)}")
    if codec == "ctx-ans-sorted" and column_order != "sorted":
        raise ConfigError("codec 'ctx-ans-sorted' needs column_order='sorted'")
    if codec == "xl-ans" and format_version < 3:
        raise ConfigError("codec 'xl-ans' needs format_version 3 (its models are frames of "
                          "a version-3 stream)")
    if codec == "xl-ans" and schema is not None \
            and not 2 <= schema.num_experts <= xl_ans.MAX_EXPERTS:
        raise ConfigError(f"codec 'xl-ans' models 2 to {xl_ans.MAX_EXPERTS} experts, the "
                          f"schema has {schema.num_experts}: use xl-zstd")
    if codec == "xl-ans":
        xl_ans.compiled()       # NOTE: ROUTEREPLAY_XL_ANS_JIT=1 without numba: refused here
    return codec


def _bettable(saved: int, coded: Any) -> int:
    """What a model saves on a record (``saved`` bytes, its payload ``coded`` under the
    model) that a model frame may be bet on: 0 where the model-coded sections hold, summed,
    under FLOOR_MARGIN x the reader's floors (``RecordPayload.floor_margin``).

    NOTE: a record whose model-coded sections sit near the reader's floor says little about
    the next: as many of those fall under it (their sections then xl-zstd). Measured at
    64-token records (E=8 top-2, 32 layers, at about 1.0-1.1x the floor): a frame written
    on such savings cost 1.5 % more than the 24 of 64 records it coded saved. Summed over
    the record's sections (the attacker review: the least section's, a short last token
    block, kept 4160-token records from any model); 1.5, not 2: 300-token records of 6
    layers sit at 1.6x xl-ans's floor and gain from a model."""
    if coded.floor_margin is not None and coded.floor_margin < FLOOR_MARGIN:
        return 0
    return saved


class SidecarWriter:
    """Append routing records to a sidecar stream, off the caller's thread.

    Args:
        dest: a local path, an fsspec URL (``"memory://x"``, ``"s3://..."``), a writable
            binary file object, or None for an in-memory stream (read it with
            :meth:`getvalue` after :meth:`close`, e.g. to put it in a Ray object store).
            A path or URL must not exist yet: the writer creates it exclusively (local
            paths with ``O_CREAT | O_EXCL``, atomic also across hosts on one NFS folder;
            fsspec URLs by an existence check, which is not atomic), so that a second
            writer, or a restarted process that reuses a name, can never truncate a stream
            holding acknowledged records (docs/FORMAT.md "Stream lifecycle").
        replace: replace an existing stream at ``dest`` on purpose (a path or URL). Local
            paths: the new stream is written to a new sibling ``<dest>.<random>.partial``
            and renamed over ``dest`` by :meth:`close` (atomic: readers of ``dest`` see the
            old stream until then; a writer killed before close, whose writer thread
            failed, or whose ``with`` block raised leaves ``dest`` as it was and its
            records in the ``.partial`` file, which readers recover). An existing ``dest``
            that is not a regular file (a folder, symbolic link, FIFO, device, socket) is
            refused even then. URLs: the same, ``fs.mv`` on close (on object stores a copy
            and a delete: not atomic, but ``dest`` is never half-written).
        schema: routing schema of every record.
        token_block, layer_group: the version-3 section grid: routing sections of
            ``token_block`` rows (B, default 512) x ``layer_group`` MoE layers (G, default
            1; ``xl-ans``: 8 for records coded with a model frame). A reader reads and
            decodes whole sections, so this is the unit of partial reads (a rank's token
            runs, one pipeline stage's layers); the defaults were chosen by measurement
            (docs/FORMAT.md "Choosing the geometry"). Version 2:
            ``layer_group`` only (default 4), sections span all rows.
        one_section_bytes: version 3: a record whose ids take at most this many bytes
            (``T x L_moe x top_k x itemsize``, default 64 KiB) is written as one section:
            short records pay one section's framing, and a codec sees all their layers.
        min_section_bytes: version 3: where a record's routing sections code to less than
            this on average (default 1024; repetitive routing), its token block is multiplied
            by the smallest power of two that reaches it (0: never).
        format_version: 3 (default) or 2, for readers older than version 3 (which refuse
            version 3 by its header).
        xl_ans_seed: ``xl-ans`` only: the counts of an earlier stream of the same schema
            (:meth:`learned_model` of its writer, or ``SidecarReader.xl_ans_counts()``,
            which counts a stream on disk again; ``SidecarReader.xl_ans_model()`` holds
            only what its last model frame learned), or of the records about to be written
            (:func:`count_seed`, a two-pass write), learned on from, and written as this
            stream's first model frame before the first record on which it pays for itself
            (what it saves on the record, times the seed's records, at least the frame's
            bytes): where the seed fits the stream's routing, its first records are then
            coded with a model (one stream per weight version otherwise relearns it each
            time). A seed weighs at most as much as 2^20 token-layer rows of the new stream
            (``SEED_ROWS``). The writer also learns this stream's records alone and writes their model where it beats the
            seed's (routing that changed since the seed): a seed from other routing writes
            no frame and costs nothing (measured: the unseeded stream's bytes); one from
            routing whose statistics shifted strongly can cost a few % in short streams
            (README.md "Seeding"); never more than xl-zstd's size plus the model frames;
            from the same run's previous step it saves 1-3 %. A seeded writer runs at about
            20 MB/s (25-30 unseeded, E=8 top-2): it counts every record twice and tries two
            models where one is due.
        background: encode and write on a background thread (default). The queue holds
            at most ``max_queue`` records; :meth:`write` blocks when it is full.
        fsync: "close" (default) fsyncs local files on close; "frame" after every frame;
            "never" leaves it to the OS.
        codec: routing codec (routereplay.codec.WRITER_CODECS); None (default) picks ``xl-zstd``
            (``ctx-zstd`` for ``format_version=2``), or ``ctx-ans-sorted`` for sorted
            streams; ``ctx-ans`` is 2-5 % smaller than ``ctx-zstd`` on most routing and
            10-50x slower. ``xl-ans`` (E <= 64, version 3) learns a cross-layer model from
            the records written and writes it into the stream as a model frame (kind 3)
            when it pays for itself; later sections use it where smaller than ``xl-zstd``
            (7-14 % smaller streams on routing whose layers depend on each other; a
            writer at about 25-30 MB/s with numba, about 8 without, E=8 top-2; grid layer group
            8 by default; sections ``xl-ans-rows`` where it applies: top-1, or top-2 of at
            most 8 experts). docs/FORMAT.md "xl-ans", "xl-ans-rows".
        column_order: "engine" (default: top-k columns exactly as the engine returned
            them) or "sorted" (canonical: each row in ascending expert id; declared in the
            header; ``ctx-ans-sorted`` codes it smaller by about log2(top_k!) bits a row).

    Durability contract (what survives the writer's process being killed):

    - :meth:`write` returning means the record was validated, its sample id reserved, and
      (``background=True``) queued: it is not in the stream yet. A process killed then
      loses the records still queued or being encoded: at most ``max_queue + 1`` records
      whose :meth:`write` had returned (the default ``max_queue=64`` can lose 65).
    - ``write(record, wait=True)`` (or ``background=False``) returns only once the record's
      frame is written and flushed to the OS: a killed process no longer loses it.
    - :meth:`flush` returning: every record whose :meth:`write` returned before is written
      and flushed to the OS.
    - :meth:`close`: flush, then the index frame and trailer, then fsync (local files,
      ``fsync="close"`` or ``"frame"``). Only a closed stream is complete; a reader of an
      unclosed one recovers every whole frame and reports the stream as not complete.
    - Against power loss (not only a killed process) a frame is durable once fsynced:
      ``fsync="frame"`` fsyncs each frame as it is written.

    Bounded loss, for users who need it: ``max_queue=N`` bounds what a kill can lose to
    N + 1 records whose write() returned; ``wait=True`` per record, or
    ``background=False`` for all, to none. A frame being written when the process dies is
    a torn tail, which readers detect and skip.

    Raises:
        ConfigError: a bad codec, column order, fsync mode, format version, token block,
            layer group, one_section_bytes or max_queue; ``xl-ans`` for more than 64
            experts or format 2; an ``xl_ans_seed`` without ``codec="xl-ans"`` or not of
            the schema's shape (checked before ``dest`` is opened).
        StreamExistsError: ``dest`` exists (without ``replace``; also a ``FileExistsError``),
            or (with ``replace``) is not a regular file or is a live stream (its writer
            holds its lock; checked again by :meth:`close` before the rename, which then
            keeps the new stream in its ``.partial``). Nothing at ``dest`` is touched.
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema, *,
                 codec: str | None = None, background: bool = True, max_queue: int = 64,
                 fsync: str = "close", extra_header: dict[str, Any] | None = None,
                 layer_group: int | None = None, column_order: str = "engine",
                 token_block: int = DEFAULT_TOKEN_BLOCK,
                 one_section_bytes: int = DEFAULT_ONE_SECTION_BYTES,
                 min_section_bytes: int = DEFAULT_MIN_SECTION_BYTES,
                 format_version: int = FORMAT_VERSION,
                 xl_ans_seed: "xl_ans.XlModel | None" = None, replace: bool = False):
        if not isinstance(schema, RoutingSchema):
            raise ConfigError(f"schema must be a RoutingSchema, got {type(schema).__name__}")
        if dest is not None and not isinstance(dest, (str, os.PathLike)) \
                and not hasattr(dest, "write"):
            raise ConfigError(f"a sidecar destination is a path, an fsspec URL, a writable "
                              f"binary file object or None, not {type(dest).__name__}")
        codec = writer_codec(codec, column_order, format_version, schema)
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        if format_version not in WRITABLE_VERSIONS:
            raise ConfigError(f"format_version must be one of {WRITABLE_VERSIONS}, got "
                              f"{format_version!r}")
        # NOTE: xl-ans codes a section's layers given the layer before, so its grid sections
        # span XL_ANS_LAYER_GROUP layers; records coded without a model (none written yet,
        # or none that pays) keep the default grid, where xl-zstd codes smaller.
        self._plain_group = layer_group
        if layer_group is None:
            layer_group = DEFAULT_LAYER_GROUP if format_version >= 3 else V2_LAYER_GROUP
            self._plain_group = layer_group
            if codec == "xl-ans":
                layer_group = XL_ANS_LAYER_GROUP
        for name, v, lo in (("layer_group", layer_group, 1), ("token_block", token_block, 1),
                            ("one_section_bytes", one_section_bytes, 0),
                            ("min_section_bytes", min_section_bytes, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if token_block > MAX_TOKENS:
            raise ConfigError(f"token_block must be at most {MAX_TOKENS}, got {token_block}")
        layer_group = min(layer_group, schema.num_moe_layers)
        self._plain_group = min(self._plain_group, schema.num_moe_layers)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            # NOTE: queue.Queue(0) would be unbounded: no back-pressure, unbounded loss
            raise ConfigError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.format_version = format_version
        self.token_block, self.one_section_bytes = token_block, one_section_bytes
        self.min_section_bytes = min_section_bytes
        self._codecs = codec_table(codec)
        try:
            header = encode_header(schema, codec, extra_header, layer_group, column_order,
                                   version=format_version, token_block=token_block,
                                   one_section_bytes=one_section_bytes, codecs=self._codecs,
                                   min_section_bytes=min_section_bytes,
                                   stream_id=secrets.token_hex(8))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"extra_header is not JSON-serialisable: {e}") from None
        if len(header) - 20 > MAX_JSON_BYTES:
            raise ConfigError(f"the stream header's JSON is {len(header) - 20} bytes (schema "
                              f"and extra_header), above the reader's limit of "
                              f"{MAX_JSON_BYTES} bytes")
        self.schema, self.codec, self._fsync = schema, codec, fsync
        self.layer_group, self.column_order = layer_group, column_order
        if xl_ans_seed is not None:
            _check_seed(xl_ans_seed, codec, schema)     # NOTE: before dest is opened
        self._owns_file = True
        self._fsspec_file = None
        self._partial: tuple[str, str] | None = None       # (partial path, dest): replace=True
        self._abandon = False                               # keep the .partial name on close
        if dest is None:
            self._f: BinaryIO = io.BytesIO()
        elif isinstance(dest, (str, os.PathLike)) and "://" not in os.fspath(dest):
            self._f = self._create(os.fspath(dest), replace)
        elif isinstance(dest, (str, os.PathLike)):
            import fsspec  # lazy: only for URLs
            url = os.fspath(dest)
            fs, fs_path = fsspec.core.url_to_fs(url)
            # NOTE: object stores have no exclusive create that fsspec exposes everywhere:
            # the check and the open are two calls (docs/FORMAT.md "Stream lifecycle")
            if not replace and fs.exists(fs_path):
                raise StreamExistsError(f"sidecar destination {url} exists: a writer never "
                                        "overwrites a stream (write a new name, or pass "
                                        "replace=True to replace it on purpose)", path=url)
            target = url
            if replace:
                # NOTE: as for local paths, written beside it and moved over it on close
                # (fs.mv: a copy and a delete on object stores, never a half-written dest)
                target = f"{url}.{secrets.token_hex(6)}.partial"
                self._partial = (target, url)
            self._fsspec_file = fsspec.open(target, "wb")
            self._f = self._fsspec_file.open()
        else:
            self._f, self._owns_file = dest, False
        self._index: list[tuple[str, int]] = []
        # xl-ans: the counts learned from the records written so far, and the model frame
        # in use (offset, model as readers parse it)
        self._learn = xl_ans.XlModel.empty(schema.num_moe_layers, schema.num_experts,
                                           schema.top_k) if codec == "xl-ans" else None
        self._model: tuple[int, xl_ans.XlModel] | None = None
        self._model_bytes = self._raw_bytes = self._models_written = 0
        self._next_model_rows = MODEL_FIRST_ROWS
        # NOTE: a seeded writer also counts this stream's rows alone (_own_counts): where the
        # seed's routing differs from this stream's (another checkpoint, a changed policy),
        # a model of them alone can beat the seed's, whose weight would drown them
        self._own_counts: xl_ans.XlModel | None = None
        # the seed's model payload and the rows it was counted from, until its frame is
        # written or the stream's first records have shown that it does not pay
        self._seed_pending: "tuple[list[tuple[bytes, xl_ans.XlModel]], int] | None" = None
        self._seed_written = False
        # NOTE: the writer thread counts records into _learn while a caller may copy it
        # (learned_model): the lock keeps the copy whole
        self._learn_lock = threading.Lock()
        self._ids: set[str] = set()
        self._pos = 0
        self._closed = False
        self._error: BaseException | None = None
        self._bytes_written = 0
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._emit(header)
        if xl_ans_seed is not None:
            self._seed(xl_ans_seed)
        if background:
            self._q = queue.Queue(maxsize=max_queue)
            self._thread = threading.Thread(target=self._run, name="routereplay-sidecar-writer",
                                            daemon=True)
            self._thread.start()

    def _create(self, path: str, replace: bool) -> BinaryIO:
        """Open a new local file for the stream: ``path`` itself, created exclusively, or
        (``replace``) a new ``.partial`` sibling that :meth:`close` renames over it."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            # NOTE: a symbolic link too: renamed over, the link would become a file and
            # its target stay as it was (the CLI refuses links for the same reason)
            kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                    "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise StreamExistsError(f"sidecar destination {path} exists and is {kind}: a "
                                    "writer never replaces it, even with replace=True (give "
                                    "a new path)", path=path)
        if replace:
            if st is not None:
                _check_unlocked(path)
            partial = f"{path}.{secrets.token_hex(6)}.partial"
            f = open(partial, "xb")
            self._partial = (partial, path)
            return f
        try:
            f = open(path, "xb")
        except FileExistsError:
            raise StreamExistsError(
                f"sidecar destination {path} exists: a writer never overwrites a stream "
                "(another writer's, or an earlier run's); write a new name, or pass "
                "replace=True to replace it on purpose", path=path) from None
        # NOTE: held for the writer's life (released when its file closes): a writer with
        # replace=True refuses a stream whose writer is still running (attacker review)
        _lock(f)
        return f

    # -- public
    def write(self, record: RoutingRecord, *, wait: bool = False) -> None:
        """Validate ``record`` against the schema and append it.

        Args:
            wait: return only once the record's frame is written and flushed to the OS
                (see the durability contract in the class doc); otherwise return once it is
                queued (``background=True``).
        Raises:
            RecordError: invalid record or a sample id already in this stream (nothing written).
            SidecarError: the background writer failed (earlier, or with ``wait``, on this
                record).
        """
        self._check_open()
        if not isinstance(record, RoutingRecord):
            raise RecordError(f"expected a RoutingRecord, got {type(record).__name__}")
        record.validate(self.schema)
        if record.start + record.num_tokens > MAX_TOKENS:
            raise RecordError(f"sample {record.sample_id!r}: {record.num_tokens} routing rows from "
                              f"position {record.start}, above the sidecar format's limit of "
                              f"{MAX_TOKENS} token positions")
        # NOTE: the meta's size is checked here, not on the writer thread, so that an
        # oversized record fails its own write() and the stream stays usable.
        # (the version-3 binary meta is smaller than this JSON; version 2 adds its sections)
        sections = 0 if self.format_version >= 3 else \
            -(-self.schema.num_moe_layers // self.layer_group) + 2
        meta_len = len(json.dumps(record.meta(), separators=(",", ":")).encode()) + 48 * sections
        if meta_len > MAX_JSON_BYTES:
            raise RecordError(f"sample {str(record.sample_id)[:80]!r}: record meta of about "
                              f"{meta_len} bytes exceeds the reader's limit of {MAX_JSON_BYTES} "
                              "bytes (sample id or span lists too long)")
        if record.sample_id in self._ids:
            raise RecordError(f"sample {record.sample_id!r} already written to this stream")
        self._ids.add(record.sample_id)
        if self._q is None:
            self._write_now(record)
        elif wait:
            done = threading.Event()
            self._q.put((record, done))
            done.wait()
            self._raise_bg()
        else:
            self._q.put((record, None))

    def flush(self) -> None:
        """Block until every queued record is written and flushed to the OS."""
        if self._q is not None:
            self._q.join()
        self._raise_bg()
        self._f.flush()

    def close(self) -> None:
        """Flush, append the index frame and trailer, fsync (local files), close."""
        if self._closed:
            return
        if self._q is not None and self._thread is not None:
            self._q.put(None)
            self._thread.join()
        self._closed = True
        try:
            self._finish()
        except Exception:
            if self._error is None:
                raise                # else: the background error below says what went wrong
        finally:
            if self._owns_file and not isinstance(self._f, io.BytesIO):
                self._f.close()
                if self._fsspec_file is not None:
                    self._fsspec_file.close()
        if self._partial is not None and self._error is None and not self._abandon:
            # NOTE: only a closed (indexed) stream replaces the old one, in one rename; after
            # a background error, or an exception in the caller's `with` block, the old
            # stream stays and the new one keeps its .partial name
            partial, path = self._partial
            if self._fsspec_file is not None:
                import fsspec
                fs, src = fsspec.core.url_to_fs(partial)
                fs.mv(src, fsspec.core.url_to_fs(path)[1])
            else:
                # NOTE: checked again: a writer may have opened, or a folder or FIFO been
                # put at, the destination since this writer started
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    st = None
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise StreamExistsError(f"sidecar destination {path} is no longer a "
                                            f"regular file: not replaced; the new stream is "
                                            f"{partial}", path=path)
                if st is not None:
                    _check_unlocked(path, partial)
                try:
                    os.replace(partial, path)
                except OSError as e:
                    raise SidecarError(f"{path}: cannot replace it with {partial}: "
                                       f"{e.strerror or e}") from None
                if self._fsync != "never":
                    _fsync_dir(os.path.dirname(os.path.abspath(path)))
        self._raise_bg()

    def getvalue(self) -> bytes:
        """The whole stream, for an in-memory writer (dest=None)."""
        if not isinstance(self._f, io.BytesIO):
            raise SidecarError("getvalue() is only for in-memory sidecars (dest=None)")
        return self._f.getvalue()

    @property
    def bytes_written(self) -> int:
        """Bytes appended so far (header and frames)."""
        return self._bytes_written

    @property
    def model_frames(self) -> int:
        """``xl-ans`` model frames written so far (a seed's included; 0 for other codecs):
        0 after :meth:`close` means the stream is coded as ``xl-zstd`` throughout (too
        few rows, or no model paid for itself)."""
        return self._models_written

    def __enter__(self) -> "SidecarWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # NOTE: a `with` block left by an exception closes the stream (every record written
        # stays readable) but, with replace=True, does not put it in place of the old one
        self._abandon = exc_type is not None
        self.close()

    # -- internals
    def _finish(self) -> None:
        """Index frame and trailer over the frames written so far (also after a background
        write error: the frames before it stay indexed)."""
        index_offset = self._pos
        self._emit(encode_frame(KIND_INDEX, encode_index(self._index, self.format_version)))
        self._emit(encode_trailer(index_offset))
        self._f.flush()
        if self._fsync != "never":
            self._do_fsync()

    def _check_open(self) -> None:
        if self._closed:
            raise SidecarError("sidecar writer is closed")
        self._raise_bg()

    def _raise_bg(self) -> None:
        if self._error is not None:
            raise SidecarError(f"background sidecar writer failed: {self._error!r}") from self._error

    def _emit(self, b: bytes) -> None:
        self._f.write(b)
        self._pos += len(b)
        self._bytes_written += len(b)

    def _write_now(self, record: RoutingRecord) -> None:
        payload = self._learn_from(record) if self._learn is not None else None
        if payload is None:
            payload = self._payload(record, self._model)
        if self._model is not None and self.layer_group != self._plain_group and \
                record.expert_ids.nbytes > self.one_section_bytes:
            # NOTE: a record coded with a model takes the model's grid (layer groups of 8);
            # where its sections fall back to xl-zstd there, xl-zstd's own grid (one layer
            # a section) can be smaller (+4 % measured on independent 4K-token routing
            # under a seed from other routing): the record's smaller of the two is kept,
            # so a stream stays at most xl-zstd's plus its model frames
            plain = self._payload(record, None)
            if len(plain) < len(payload):
                payload = plain
        offset = self._pos
        self._emit(encode_frame(KIND_RECORD, payload))
        self._index.append((record.sample_id, offset))
        self._f.flush()
        if self._fsync == "frame":
            self._do_fsync()

    @property
    def seed_frame_written(self) -> bool:
        """``xl-ans`` with ``xl_ans_seed``: whether a model frame of the seed (one of its
        candidates) was written, before the first record on which it paid for itself.
        False for a writer without a seed, or whose seed never paid (its records are then
        coded as an unseeded writer's). Read after :meth:`flush` or :meth:`close`."""
        return self._seed_written

    def learned_model(self) -> "xl_ans.XlModel | None":
        """``xl-ans``: a copy of the counts learned from every record written so far (and
        the seed's), as an ``XlModel`` of int64 counts (``flags [L_moe, 3, 2]``, ``pop
        [L_moe, E]``, ``pair [L_moe, E, E]``, ``joint [L_moe, C, E]``): the seed for the
        next stream (``SidecarWriter(..., codec="xl-ans", xl_ans_seed=)``). None for other
        codecs. Call it after :meth:`flush` or :meth:`close`: the writer thread counts
        records as it writes them, so records still queued are not in it (a call while it
        writes gets the counts of whole records: a copy between two records)."""
        if self._learn is None:
            return None
        with self._learn_lock:
            m = self._learn
            return xl_ans.XlModel(m.num_experts, m.top_k, m.flags.copy(), m.pop.copy(),
                                  m.pair.copy(), m.joint.copy())

    def _seed(self, seed: "xl_ans.XlModel") -> None:
        """Learn on from ``seed`` (checked by :func:`_check_seed`), and keep its model for
        the stream's first records (:meth:`_maybe_seed`), unless its counts are too few for
        a model payload."""
        s = self.schema
        arrays = [np.asarray(a, dtype=np.int64).copy()
                  for a in (seed.flags, seed.pop, seed.pair, seed.joint)]
        rows = int(arrays[0][:, xl_ans.NONE_CTX].sum())
        if rows > SEED_ROWS:
            # NOTE: routing drifts as the weights are trained: the seed weighs at most as
            # much as SEED_ROWS rows of this stream, which then take over
            arrays = [a * SEED_ROWS // rows for a in arrays]
        self._learn = xl_ans.XlModel(seed.num_experts, seed.top_k, *arrays)
        self._own_counts = xl_ans.XlModel.empty(s.num_moe_layers, s.num_experts, s.top_k)
        least, _ = xl_ans.payload_limits(s.num_moe_layers, s.num_experts, s.top_k)
        pending = []
        for cand in _candidates(self._learn, coarse=True):
            payload = cand.stored().to_bytes()
            if len(payload) >= least:             # else nothing worth a frame (near-empty)
                # NOTE: parsed once: its coder tables are built once for every record it is
                # tried on
                pending.append((payload, xl_ans.XlModel.from_bytes(
                    payload, s.num_moe_layers, s.num_experts, s.top_k)))
        if pending:
            self._seed_pending = (pending, rows)

    def _maybe_seed(self, record: RoutingRecord) -> Any:
        """Write a model frame of the seed before ``record`` where it pays for itself on it
        (of the seed's candidates, :func:`_candidates`, the one that pays the most beyond
        its frame), and return ``record``'s payload (under that model where its frame was
        written, else without a model; None for a one-token record, not tried).

        NOTE: the bet is the seed's stream: what the model saves on this record, times as
        many records as the seed was counted from (its rows over this record's), must pay
        for the frame. A seed from the same routing pays at once; one from routing that has
        changed since (another checkpoint, another task) is tried on the records before
        the stream's own first model is due (MODEL_FIRST_ROWS rows), then dropped: its
        counts still weigh in the candidates of :meth:`_maybe_model`."""
        assert self._seed_pending is not None and self._own_counts is not None
        pending, seed_rows = self._seed_pending
        rec_rows = max(record.num_tokens - 1, 0) * self.schema.num_moe_layers
        if not rec_rows:
            return None                 # a one-token record: nothing a model could save
        if self._own_counts.rows_counted() + rec_rows >= MODEL_FIRST_ROWS:
            self._seed_pending = None                 # decided at this record either way
        plain = self._payload(record, None)
        best = None
        for payload, parsed in pending:               # the seed's candidates (_candidates)
            model = (self._pos, parsed)
            coded = self._payload(record, model)
            # NOTE: in units of this record's rows: savings over the seed's rows, less the frame
            value = _bettable(len(plain) - len(coded), coded) * seed_rows \
                - (len(payload) + 24) * rec_rows
            if value >= 0 and (best is None or value > best[0]):
                best = (value, payload, model, coded)
        if best is None:
            return plain
        _, payload, model, coded = best
        self._emit(encode_frame(KIND_MODEL, payload))
        self._model = model
        self._models_written = 1
        self._seed_pending = None
        self._seed_written = True
        # NOTE: as after any model frame, the next candidate is due at MODEL_REFRESH times
        # the stream's own rows (before: at once, then at every doubling from the first
        # record, trials that rarely paid and halved a seeded writer's speed)
        self._next_model_rows = max(self._next_model_rows,
                                    MODEL_REFRESH * (self._own_counts.rows_counted() + rec_rows))
        return coded

    def _learn_from(self, record: RoutingRecord) -> Any:
        """xl-ans: write a new model frame when due (learned from the records before
        ``record``), then count ``record``'s routing. Returns ``record``'s payload where
        it was coded to decide (under the new model where one was written, else under the
        model in use), else None.

        NOTE: a model frame costs its bytes once and saves on every later record. The first
        is written once MODEL_FIRST_ROWS rows are counted and it takes at most
        MODEL_FIRST_SHARE of the ids written so far (raw bytes, this record included); a
        new one (learned from 4x the rows) only while all model frames together stay within
        MODEL_SHARE of those bytes; either only where it pays for itself (below)."""
        assert self._learn is not None
        ids = record.expert_ids
        if self.column_order == "sorted":
            ids = np.sort(ids, axis=-1)
        self._raw_bytes += ids.nbytes
        try:
            if self._seed_pending is not None:
                # NOTE: the stream's own model is not due yet (fewer rows than the first's)
                return self._maybe_seed(record)
            return self._maybe_model(record)
        finally:
            with self._learn_lock:
                self._learn.count(ids)
            if self._own_counts is not None:
                self._own_counts.count(ids)

    def _maybe_model(self, record: RoutingRecord) -> Any:
        """Write a model frame of the records before ``record`` if one is due and pays;
        then ``record``'s payload under it; else its payload under the model in use where
        a candidate was tried, else None.

        Candidates: the counts of every record before (and the seed's); in a seeded
        writer also this stream's records alone. Rows, the frames' share of the ids and
        the schedule count this stream's own records (a seed frame is not charged)."""
        assert self._learn is not None
        own = self._own_counts if self._own_counts is not None else self._learn
        rows = own.rows_counted()
        if rows < self._next_model_rows or self._models_written >= MAX_MODELS:
            return None
        s = self.schema
        least, _ = xl_ans.payload_limits(s.num_moe_layers, s.num_experts, s.top_k)
        share = MODEL_FIRST_SHARE if not self._model_bytes else MODEL_SHARE
        offset = self._pos
        # NOTE: the model frame goes at ``offset``, so the payload coded with it here is the
        # record's payload once the frame is written
        current = best = current_payload = None
        own_only = [] if self._own_counts is None else [self._own_counts]
        cands = [c for counts in [self._learn] + own_only for c in _candidates(counts, False)]
        for cand in cands:
            payload = cand.stored().to_bytes()
            frame = len(payload) + 24
            if self._model_bytes + frame > share * self._raw_bytes or len(payload) < least:
                continue
            if current is None:
                current_payload = self._payload(record, self._model)
                current = len(current_payload)
            model = (offset, xl_ans.XlModel.from_bytes(payload, s.num_moe_layers,
                                                       s.num_experts, s.top_k))
            coded = self._payload(record, model)
            # NOTE: worth it only if it saves its bytes: what it saves on this record
            # (against the model in use, or none; a record the model has not seen), times
            # the records written so far (as many again are expected), must pay for the
            # frame; of the candidates that pay, the one that saves the most. Routing with
            # no cross-layer structure to learn gets no model frames.
            saved = _bettable(current - len(coded), coded)
            if saved * (len(self._index) + 1) >= frame and (best is None or saved > best[0]):
                best = (saved, payload, model, coded)
        if best is None:
            self._next_model_rows = 2 * rows
            return current_payload        # NOTE: coded to decide; None where it was not
        _, payload, model, coded = best
        self._emit(encode_frame(KIND_MODEL, payload))
        self._models_written += 1
        self._model = model
        self._model_bytes += len(payload) + 24
        self._next_model_rows = MODEL_REFRESH * rows
        return coded

    def _payload(self, record: RoutingRecord, model: Any) -> Any:
        """``record``'s frame payload in this writer's format, coded under ``model``
        (xl-ans: (frame offset, XlModel); None: without one, in the default grid)."""
        group = self.layer_group if model is not None else self._plain_group
        return encode_record_payload(record, self.schema, self.codec, group,
                                     self.column_order, version=self.format_version,
                                     token_block=self.token_block,
                                     one_section_bytes=self.one_section_bytes,
                                     min_section_bytes=self.min_section_bytes,
                                     codecs=self._codecs, model=model)

    def _do_fsync(self) -> None:
        try:
            os.fsync(self._f.fileno())
        except (AttributeError, OSError, io.UnsupportedOperation):
            pass  # not a local file

    def _run(self) -> None:
        assert self._q is not None
        while True:
            item = self._q.get()
            done = None
            try:
                if item is None:
                    return
                rec, done = item
                if self._error is None:
                    self._write_now(rec)
            except BaseException as e:  # reported on the next write/flush/close
                self._error = e
            finally:
                if done is not None:
                    done.set()
                self._q.task_done()


def _lock(f: BinaryIO) -> None:
    """An advisory exclusive lock (``flock``) on a writer's file, held until it is closed;
    a no-op where the file system refuses locks (some network file systems)."""
    try:
        import fcntl
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        pass


def _check_unlocked(path: str, partial: str | None = None) -> None:
    """Refuse to replace ``path`` while a writer holds its lock (:func:`_lock`): a live
    stream whose later records would go to an unlinked file.

    Raises:
        StreamExistsError: naming the path (and where the new stream stays).
    """
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StreamExistsError(
            f"sidecar destination {path} is a live stream (its writer is still running): "
            "not replaced" + (f"; the new stream is {partial}" if partial else ""),
            path=path) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """fsync a folder (a rename in it durable); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_records(dest: str | os.PathLike | BinaryIO | None, schema: RoutingSchema,
                  records: Sequence[RoutingRecord], **kw: Any) -> SidecarWriter:
    """Write ``records`` to ``dest`` and close; returns the (closed) writer."""
    w = SidecarWriter(dest, schema, **kw)
    for r in records:
        w.write(r)
    w.close()
    return w
