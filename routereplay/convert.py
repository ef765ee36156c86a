"""Routing arrays from other containers and engine wire formats -> records.

Input kinds (``routereplay convert --from KIND``):

- ``npy``: arrays ``[T, L, top_k]`` of integer expert ids, with L = L_moe (MoE layers
  only) or L = num_hidden_layers (dense layers are then dropped). One sample per ``.npy``
  file (sample id = file stem), per key of an ``.npz`` (sample id = key), or per such file
  in a folder (sorted by name).
- ``vllm``: the same containers holding vLLM 0.32 ``CompletionOutput.routed_experts``
  arrays, ``[T, num_hidden_layers, top_k]`` with dense layers zero-filled.
- ``vllm-b64``: text, one sample per line: vLLM's OpenAI-server field ``routed_experts``
  (base64 of ``np.save`` bytes), either bare or inside a JSON object (a completion
  response with ``choices[*].routed_experts``, or ``{"id": ..., "routed_experts": ...}``).
- ``sglang-b64``: text, one sample per line: SGLang's ``meta_info.routed_experts``
  (base64 of little-endian int32 ``[T, num_hidden_layers, top_k + num_fused_shared_experts]``),
  bare or inside a JSON object read by :func:`routereplay.wire.sglang_fields`; row 0 at
  :func:`sglang_start`.

Bare lines get the sample id ``<file stem>-<line number>`` (1-based). Nothing is
unpickled: ``.npy``/``.npz`` are loaded with ``allow_pickle=False``.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
import stat
import zipfile
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from routereplay import wire
from routereplay.errors import ConfigError, RecordError, SchemaError
from routereplay.record import RoutingRecord, check_written_rows, checked_moe_ids
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import MAX_JSON_BYTES

KINDS = ("npy", "vllm", "vllm-b64", "sglang-b64")
MAX_LINE_BYTES = 1 << 30          # one JSON/base64 line (bytes)
# NOTE: an .npz member may inflate to at most this many times its compressed bytes (as
# the sidecar reader): engines' int32 routing deflates 4-30x; 1 GiB of zeros about 1000x.
NPZ_EXPANSION = 128
# NOTE: the most MoE layer ids a sidecar header can list: its JSON is at most
# MAX_JSON_BYTES (1 MiB) and each id takes at least two bytes (a digit and a comma).
MAX_LAYER_IDS = MAX_JSON_BYTES // 2


def schema_from_args(config: str | None = None, num_experts: int | None = None,
                     top_k: int | None = None, moe_layers: Sequence[int] | None = None,
                     num_layers: int | None = None) -> RoutingSchema:
    """Schema from an HF config (folder or config.json) or from explicit numbers.

    Without a config, ``num_experts`` and ``top_k`` are required; ``moe_layers`` (decoder
    layer indices) defaults to every layer of ``num_layers``; ``num_layers`` defaults to
    ``max(moe_layers) + 1``.

    Raises:
        SchemaError: neither a config nor num_experts/top_k, an inconsistent layout, more
            MoE layers than :data:`MAX_LAYER_IDS`, or a schema whose JSON is above the
            sidecar header's ``MAX_JSON_BYTES`` (1 MiB).
    """
    if config is not None:
        return _fits_header(RoutingSchema.from_hf_config(config))
    if num_experts is None or top_k is None:
        raise SchemaError("give --config (HF config folder or json) or --num-experts and --top-k")
    if moe_layers is None and num_layers is None:
        raise SchemaError("give --moe-layers or --num-layers with --num-experts/--top-k")
    if moe_layers is None and int(num_layers) > MAX_LAYER_IDS:
        raise SchemaError(f"--num-layers {num_layers} (every layer MoE): above the "
                          f"{MAX_LAYER_IDS} MoE layers a sidecar header could list (an "
                          "upper bound: each takes at least 2 bytes of its 1 MiB of JSON)")
    moe = list(moe_layers) if moe_layers is not None else list(range(int(num_layers)))
    if not moe:
        raise SchemaError("no MoE layers given (--moe-layers is empty)")
    n = int(num_layers) if num_layers is not None else max(moe) + 1
    return _fits_header(RoutingSchema(num_hidden_layers=n, moe_layer_ids=tuple(moe),
                                      top_k=int(top_k), num_experts=int(num_experts)))


def _fits_header(schema: RoutingSchema) -> RoutingSchema:
    """``schema``, refused if its JSON alone is above the header's ``MAX_JSON_BYTES``
    (NOTE: here the error names the MoE layers; the writer's would blame the header)."""
    size = len(json.dumps(schema.to_dict(), separators=(",", ":")))
    if size > MAX_JSON_BYTES:
        raise SchemaError(f"{schema.num_moe_layers} MoE layers take {size} bytes of sidecar "
                          f"header JSON, above the format's limit of {MAX_JSON_BYTES} bytes")
    return schema


def parse_layers(spec: str) -> list[int]:
    """'1,2,5-7' -> [1, 2, 5, 6, 7] (decoder layer indices).

    The count of ids is checked before any range is expanded (more than
    :data:`MAX_LAYER_IDS` is refused at once).

    Raises:
        ConfigError: not a comma-separated list of non-negative integers and ranges a-b,
            or more than MAX_LAYER_IDS ids in all (naming the part that goes over).
    """
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a or a < 0:
                    raise ValueError(part)
            else:
                a = b = int(part)
                if a < 0:
                    raise ValueError(part)
        except ValueError:
            raise ConfigError(f"layer list {spec!r}: {part!r} is not a layer index or a range "
                              "a-b of them") from None
        if len(out) + b - a + 1 > MAX_LAYER_IDS:
            raise ConfigError(f"layer list {spec!r}: {part!r} makes {len(out) + b - a + 1} "
                              f"layer ids, above the {MAX_LAYER_IDS} a sidecar header could "
                              "list (an upper bound: each takes at least 2 bytes of its 1 MiB "
                              "of JSON)")
        out.extend(range(a, b + 1))
    return out


def to_record(sample_id: str, arr: np.ndarray, schema: RoutingSchema, *,
              full_layout: bool | None = None, id_hint=None, start: int = 0) -> RoutingRecord:
    """Integer ids [T, L, top_k] -> RoutingRecord with ids [T, L_moe, top_k] (schema dtype).

    ``full_layout``: True if L is num_hidden_layers (dense layers dropped), False if L is
    L_moe, None to decide from L. ``id_hint``: see routereplay.record.checked_moe_ids.
    ``start``: token position of row 0.

    Raises:
        RecordError: as routereplay.record.checked_moe_ids (shape, dtype, id range,
            repeats, routing on a dense layer) and check_written_rows.
    """
    if full_layout is None:
        full_layout = _full_layout(arr.shape if isinstance(arr, np.ndarray) else (), schema)
    rec = RoutingRecord(sample_id=sample_id, start=start, expert_ids=checked_moe_ids(
        arr, schema, sample_id, start=start, full_layout=full_layout, check_duplicates=True,
        id_hint=id_hint))
    rec.validate(schema)
    check_written_rows(rec.expert_ids, sample_id, start)
    return rec


def _full_layout(shape: tuple, schema: RoutingSchema) -> bool:
    nl = shape[1] if len(shape) == 3 else None
    return nl == schema.num_hidden_layers and nl != schema.num_moe_layers


def read_npy_header(f: BinaryIO, what: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the ``.npy`` data at ``f``'s position; ``f`` is
    left at the first data byte.

    Raises:
        RecordError: not .npy data, or an object dtype (it would need unpickling).
    """
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except (ValueError, OSError, EOFError) as e:
        raise RecordError(f"{what}: not .npy data ({e})") from None
    if dtype.hasobject:
        raise RecordError(f"{what}: object arrays are refused (they would need unpickling)")
    return shape, fortran, dtype


def read_npy_record(f: BinaryIO, size: int, what: str, sample_id: str, schema: RoutingSchema,
                    *, full_layout: bool | None = None) -> RoutingRecord:
    """A record from ``.npy`` routing data at ``f`` (``size`` bytes from its start), read
    in row chunks: the header is checked against the schema before any data is read, and
    every chunk is checked (range, repeated ids) as it arrives.

    NOTE: work and memory follow what the data really holds: an all-zero 1 GiB member is
    refused at its first chunk, a header claiming more bytes than follow before reading.

    Args:
        full_layout: as in :func:`to_record` (None: decided from the header's shape).
    Raises:
        RecordError: not .npy, not integers, a dtype too narrow for num_experts, a shape
            that is not [T, num_hidden_layers or L_moe, top_k] or T above the sidecar's
            limit, fewer bytes than the header claims, and as :func:`to_record`.
    """
    from routereplay.record import moe_rows, row_chunks
    from routereplay.sidecar.layout import MAX_TOKENS
    base = f.tell()
    shape, fortran, dtype = read_npy_header(f, what)
    if dtype.kind not in "iu":
        raise RecordError(f"{what}: routing ids must be integers, got {dtype}")
    if full_layout is None:
        full_layout = _full_layout(shape, schema)
    width = schema.num_hidden_layers if full_layout else schema.num_moe_layers
    if len(shape) != 3 or shape[1:] != (width, schema.top_k):
        raise RecordError(f"{what}: array of shape {list(shape)}, expected [T, {width} "
                          f"({'num_hidden_layers' if full_layout else 'MoE layers'}), "
                          f"top_k={schema.top_k}]")
    need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    avail = size - (f.tell() - base)
    if need > avail:
        raise RecordError(f"{what}: the .npy header claims shape {shape} {dtype} ({need} bytes) "
                          f"but only {avail} bytes follow")
    if shape[0] > MAX_TOKENS:
        raise RecordError(f"{what}: {shape[0]} routing rows, above the sidecar format's limit "
                          f"of {MAX_TOKENS}")
    from routereplay.record import check_id_dtype
    check_id_dtype(dtype, schema, sample_id)
    if fortran:            # column-major: rows are not contiguous; the bytes are all there
        arr = np.frombuffer(f.read(need), dtype).reshape(shape, order="F")
        return to_record(sample_id, arr, schema, full_layout=full_layout)
    t = shape[0]
    row_bytes = width * schema.top_k * dtype.itemsize
    out = None
    for a, b in row_chunks(t, width * schema.top_k):
        buf = f.read((b - a) * row_bytes)
        if len(buf) != (b - a) * row_bytes:
            raise RecordError(f"{what}: data ends at row {a + len(buf) // row_bytes} of {t}")
        chunk = np.frombuffer(buf, dtype).reshape(b - a, width, schema.top_k)
        moe = moe_rows(chunk, schema, sample_id, start=a, full_layout=full_layout,
                       check_duplicates=True)
        if out is None:        # NOTE: only once the first chunk holds valid routing
            out = np.empty((t, schema.num_moe_layers, schema.top_k), schema.id_dtype)
        out[a:b] = moe
    if out is None:
        out = np.empty((0, schema.num_moe_layers, schema.top_k), schema.id_dtype)
    rec = RoutingRecord(sample_id=sample_id, expert_ids=out)
    rec.validate(schema)
    check_written_rows(out, sample_id)
    return rec


def check_regular_file(path: str) -> None:
    """Refuse an input that is not a regular file (a FIFO or device would block the read,
    or never end).

    Raises:
        RecordError: naming the path.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise RecordError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise RecordError(f"{path}: not a regular file")


def iter_npy_records(path: str, schema: RoutingSchema, *, full_layout: bool | None = None
                     ) -> Iterator[RoutingRecord]:
    """Records from an .npy (sample id = file stem), each ``.npy`` member of an .npz
    (sample id = member name), or a folder of them (sorted by name), read as
    :func:`read_npy_record` does: in checked row chunks, members never inflated whole.

    Raises:
        RecordError: unreadable input or a bad sample (named), when reached.
    """
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".npy", ".npz")))
        if not names:
            raise RecordError(f"{path}: folder holds no .npy or .npz files")
        for n in names:
            yield from iter_npy_records(os.path.join(path, n), schema, full_layout=full_layout)
        return
    stem = os.path.splitext(os.path.basename(path))[0]
    check_regular_file(path)
    try:
        if path.endswith(".npz"):
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if not info.filename.endswith(".npy"):
                        continue
                    sid = info.filename[:-4]
                    if info.compress_type != zipfile.ZIP_STORED and \
                            info.file_size > NPZ_EXPANSION * info.compress_size:
                        # NOTE: work and memory stay in proportion to the input's size
                        raise RecordError(
                            f"{path}:{info.filename}: member declares {info.file_size} bytes "
                            f"from {info.compress_size} compressed bytes, beyond the limit of "
                            f"{NPZ_EXPANSION} x (store it uncompressed: np.savez, or as .npy)")
                    with z.open(info) as f:
                        rec = read_npy_record(f, info.file_size, f"{path}:{info.filename}", sid,
                                              schema, full_layout=full_layout)
                    yield rec
        else:
            with open(path, "rb") as f:
                rec = read_npy_record(f, os.fstat(f.fileno()).st_size, path, stem, schema,
                                      full_layout=full_layout)
            yield rec
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        if isinstance(e, RecordError):
            raise
        raise RecordError(f"{path}: not a readable .npy/.npz array file ({e})") from None


def iter_b64(path: str, kind: str, schema: RoutingSchema, *, num_fused_shared_experts: int = 0
             ) -> Iterator[RoutingRecord]:
    """One record per payload of a vllm-b64 / sglang-b64 file (arrays
    [T, num_hidden_layers, top_k]; sglang-b64: ``num_fused_shared_experts`` columns per row
    are dropped)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    found = False
    check_regular_file(path)
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if len(line) > MAX_LINE_BYTES:
                raise RecordError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            default_id = f"{stem}-{lineno}"
            for sid, b64, fields in _payloads(line, default_id, f"{path}:{lineno}", kind):
                found = True
                yield _decode_b64(b64, kind, schema, sid, num_fused_shared_experts, fields)
    if not found:
        raise RecordError(f"{path}: no routing payloads (the file is empty)")


def _payloads(line: bytes, default_id: str, where: str, kind: str = "vllm-b64"
              ) -> list[tuple[str, str | bytes, wire.SGLangFields | None]]:
    """(sample id, payload, the SGLang response's fields or None) of each payload of a
    line."""
    if not line.startswith(b"{"):
        return [(default_id, line, None)]
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise RecordError(f"{where}: not JSON: {e!r}"[:300]) from None
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object")
    if kind == "sglang-b64":                       # one parser of SGLang responses
        try:
            f = wire.sglang_fields(obj)
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None
        sid = str(f.id) if f.id is not None else default_id
        if not isinstance(f.routed_experts, str):
            raise RecordError(f"{where}: sample {sid!r} has no routed_experts string (is capture "
                              "on? SGLang: --enable-return-routed-experts and "
                              "return_routed_experts=True)")
        return [(sid, f.routed_experts, f)]
    if isinstance(obj.get("choices"), list):                       # OpenAI-style response
        rid = str(obj["id"]) if obj.get("id") is not None else default_id
        out = []
        for i, ch in enumerate(obj["choices"]):
            if not isinstance(ch, dict) or not isinstance(ch.get("routed_experts"), str):
                raise RecordError(f"{where}: choice {i} of {rid!r} has no routed_experts (start "
                                  "the server with --enable-return-routed-experts)")
            idx = ch.get("index", i)
            out.append((rid if len(obj["choices"]) == 1 else f"{rid}-{idx}",
                        ch["routed_experts"], None))
        return out
    src = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else obj
    b64 = src.get("routed_experts")
    sid = next((x for x in (src.get("id"), obj.get("id"), obj.get("sample_id"))
                if x is not None), default_id)
    if not isinstance(b64, str):
        raise RecordError(f"{where}: sample {sid!r} has no routed_experts string (is capture on? "
                          "vLLM: --enable-return-routed-experts; SGLang: "
                          "--enable-return-routed-experts and return_routed_experts=True)")
    return [(str(sid), b64, None)]


def _decode_b64(b64: str | bytes, kind: str, schema: RoutingSchema, sid: str,
                num_fused_shared_experts: int = 0,
                fields: wire.SGLangFields | None = None) -> RoutingRecord:
    if not b64.strip():
        raise RecordError(f"sample {sid!r}: routed_experts is empty")
    if kind == "sglang-b64":
        try:
            full = wire.decode_sglang_b64_int32(b64, schema.num_hidden_layers, schema.top_k,
                                                num_fused_shared_experts=num_fused_shared_experts)
            arr = wire.split_fused_shared_columns(full, schema.top_k, schema.num_experts)
        except RecordError as e:
            raise RecordError(f"sample {sid!r}: {e}") from None
        return to_record(sid, arr, schema, full_layout=True,
                         start=sglang_start(sid, arr.shape[0], fields),
                         id_hint=wire.sglang_id_hint(schema.num_experts, num_fused_shared_experts))
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RecordError(f"sample {sid!r}: routed_experts is not base64 ({e})") from None
    return read_npy_record(io.BytesIO(raw), len(raw), f"sample {sid!r}: routed_experts", sid,
                           schema, full_layout=True)


def sglang_start(sid: str, rows: int, fields: wire.SGLangFields | None) -> int:
    """Token position of row 0 of an ``sglang-b64`` payload of ``rows`` rows.

    The line's ``routed_experts_start_len`` (stored next to ``meta_info``), else 0. With
    token counts in the line the rows must cover [start, prompt + output - 1); without a
    stored start only the complete count is accepted (NOTE: any other count fits a later
    start as well as a truncated payload; engine_patches.sglang.records has the same
    rule). A line without token counts cannot be checked.

    Raises:
        RecordError: naming the sample: a start that is not a non-negative integer, a row
            count that does not fit the token counts and the start, or an ambiguous one.
    """
    start = None if fields is None else fields.start_len
    if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                              or start < 0):
        raise RecordError(f"sample {sid!r}: routed_experts_start_len must be a non-negative "
                          f"integer, got {start!r}")
    p = None if fields is None else fields.prompt_tokens
    g = None if fields is None else fields.completion_tokens
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (p, g)):
        return start or 0
    full = max(0, p + g - 1)
    if start is not None:
        if start > p or rows != max(0, full - start):
            raise RecordError(f"sample {sid!r}: routing row-count mismatch: {rows} rows for "
                              f"{p} prompt + {g} output tokens from routed_experts_start_len "
                              f"{start} (expected {max(0, full - start)}, start at most {p})")
        return start
    if rows != full:
        raise RecordError(
            f"sample {sid!r}: {rows} routing rows for {p} prompt + {g} output tokens ({full} "
            f"rows from position 0) and no routed_experts_start_len: "
            + (f"start_len {full - rows} with complete rows, or start_len 0 with a payload "
               f"truncated by {full - rows} rows; store the request's start as "
               '"routed_experts_start_len" next to meta_info in the line'
               if full - p <= rows < full else "no start explains that many rows"))
    return 0


def iter_records(kind: str, path: str, schema: RoutingSchema, *,
                 num_fused_shared_experts: int = 0) -> Iterator[RoutingRecord]:
    """Records of ``path`` read as ``kind`` (see the module docstring);
    ``num_fused_shared_experts``: fused shared-expert columns per row of ``sglang-b64``
    payloads (never guessed from the byte count).

    Raises:
        RecordError: unreadable input or a bad sample (named), when reached.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown input kind {kind!r}; known: {KINDS}")
    if kind in ("npy", "vllm"):
        yield from iter_npy_records(path, schema, full_layout=True if kind == "vllm" else None)
    else:
        yield from iter_b64(path, kind, schema, num_fused_shared_experts=num_fused_shared_experts)
