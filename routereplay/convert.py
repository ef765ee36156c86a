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
  (base64 of flat little-endian int32, ``[T, num_hidden_layers, top_k + F]`` with F the
  fused shared-expert columns the payload carries, ``num_fused_shared_experts``, 0 by
  default and for SGLang 0.5.23), bare or inside a JSON object read by
  :func:`routereplay.wire.sglang_fields` (a ``/generate`` or OpenAI response, or
  ``{"id": ..., "routed_experts": ...}``).

Bare lines get the sample id ``<file stem>-<line number>`` (1-based). Nothing is
unpickled: ``.npy``/``.npz`` are loaded with ``allow_pickle=False``.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
import zipfile
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from routereplay import wire
from routereplay.errors import RecordError, SchemaError
from routereplay.record import RoutingRecord, checked_moe_ids
from routereplay.schema import RoutingSchema

KINDS = ("npy", "vllm", "vllm-b64", "sglang-b64")
MAX_LINE_BYTES = 1 << 30          # one JSON/base64 line (bytes)


def schema_from_args(config: str | None = None, num_experts: int | None = None,
                     top_k: int | None = None, moe_layers: Sequence[int] | None = None,
                     num_layers: int | None = None) -> RoutingSchema:
    """Schema from an HF config (folder or config.json) or from explicit numbers.

    Without a config, ``num_experts`` and ``top_k`` are required; ``moe_layers`` (decoder
    layer indices) defaults to every layer of ``num_layers``; ``num_layers`` defaults to
    ``max(moe_layers) + 1``.

    Raises:
        SchemaError: neither a config nor num_experts/top_k, or an inconsistent layout.
    """
    if config is not None:
        return RoutingSchema.from_hf_config(config)
    if num_experts is None or top_k is None:
        raise SchemaError("give --config (HF config folder or json) or --num-experts and --top-k")
    if moe_layers is None and num_layers is None:
        raise SchemaError("give --moe-layers or --num-layers with --num-experts/--top-k")
    moe = list(moe_layers) if moe_layers is not None else list(range(int(num_layers)))
    if not moe:
        raise SchemaError("no MoE layers given (--moe-layers is empty)")
    n = int(num_layers) if num_layers is not None else max(moe) + 1
    return RoutingSchema(num_hidden_layers=n, moe_layer_ids=tuple(moe), top_k=int(top_k),
                         num_experts=int(num_experts))


def parse_layers(spec: str) -> list[int]:
    """'1,2,5-7' -> [1, 2, 5, 6, 7] (decoder layer indices)."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def to_record(sample_id: str, arr: np.ndarray, schema: RoutingSchema, *,
              full_layout: bool | None = None, id_hint=None) -> RoutingRecord:
    """Integer ids [T, L, top_k] -> RoutingRecord with ids [T, L_moe, top_k] (schema dtype).

    ``full_layout``: True if L is num_hidden_layers (dense layers dropped), False if L is
    L_moe, None to decide from L. ``id_hint``: see routereplay.record.checked_moe_ids.

    Raises:
        RecordError: wrong shape or dtype, or an id outside [0, num_experts), naming
            sample, token and layer; non-zero routing on a layer the schema calls dense
            (see routereplay.record.checked_moe_ids).
    """
    if full_layout is None:
        nl = arr.shape[1] if isinstance(arr, np.ndarray) and arr.ndim == 3 else None
        full_layout = nl == schema.num_hidden_layers and nl != schema.num_moe_layers
    rec = RoutingRecord(sample_id=sample_id,
                        expert_ids=checked_moe_ids(arr, schema, sample_id, full_layout=full_layout,
                                                   id_hint=id_hint))
    rec.validate(schema)
    return rec


def load_npy(f: BinaryIO, size: int, what: str) -> np.ndarray:
    """One ``.npy`` array from ``f`` (``size`` bytes available), never unpickling and never
    allocating more than the bytes that are really there.

    Raises:
        RecordError: not .npy, an object dtype, or a header claiming more data than present.
    """
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    except (ValueError, OSError, EOFError) as e:
        raise RecordError(f"{what}: not .npy data ({e})") from None
    if dtype.hasobject:
        raise RecordError(f"{what}: object arrays are refused (they would need unpickling)")
    need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if need > size - f.tell():
        raise RecordError(f"{what}: the .npy header claims shape {shape} {dtype} ({need} bytes) "
                          f"but only {size - f.tell()} bytes follow")
    f.seek(0)
    return np.load(f, allow_pickle=False)


def iter_arrays(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(sample_id, array) from an .npy, an .npz, or a folder of them."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".npy", ".npz")))
        if not names:
            raise RecordError(f"{path}: folder holds no .npy or .npz files")
        for n in names:
            yield from iter_arrays(os.path.join(path, n))
        return
    stem = os.path.splitext(os.path.basename(path))[0]
    try:
        if path.endswith(".npz"):
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if not info.filename.endswith(".npy"):
                        continue
                    with z.open(info) as f:
                        data = io.BytesIO(f.read(info.file_size))
                    yield info.filename[:-4], load_npy(data, info.file_size,
                                                       f"{path}:{info.filename}")
        else:
            with open(path, "rb") as f:
                arr = load_npy(f, os.fstat(f.fileno()).st_size, path)
            yield stem, arr
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise RecordError(f"{path}: not a readable .npy/.npz array file ({e})") from None


def iter_b64(path: str, kind: str, schema: RoutingSchema, *, num_fused_shared_experts: int = 0
             ) -> Iterator[tuple[str, np.ndarray]]:
    """(sample_id, array [T, num_hidden_layers, top_k]) per line of a vllm-b64 / sglang-b64
    file (sglang-b64: ``num_fused_shared_experts`` columns per row are dropped)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    found = False
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if len(line) > MAX_LINE_BYTES:
                raise RecordError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            default_id = f"{stem}-{lineno}"
            for sid, b64 in _payloads(line, default_id, f"{path}:{lineno}", kind):
                found = True
                yield sid, _decode_b64(b64, kind, schema, sid, num_fused_shared_experts)
    if not found:
        raise RecordError(f"{path}: no routing payloads (the file is empty)")


def _payloads(line: bytes, default_id: str, where: str,
              kind: str = "vllm-b64") -> list[tuple[str, str | bytes]]:
    if not line.startswith(b"{"):
        return [(default_id, line)]
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
        return [(sid, f.routed_experts)]
    if isinstance(obj.get("choices"), list):                       # OpenAI-style response
        rid = str(obj["id"]) if obj.get("id") is not None else default_id
        out = []
        for i, ch in enumerate(obj["choices"]):
            if not isinstance(ch, dict) or not isinstance(ch.get("routed_experts"), str):
                raise RecordError(f"{where}: choice {i} of {rid!r} has no routed_experts (start "
                                  "the server with --enable-return-routed-experts)")
            idx = ch.get("index", i)
            out.append((rid if len(obj["choices"]) == 1 else f"{rid}-{idx}", ch["routed_experts"]))
        return out
    src = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else obj
    b64 = src.get("routed_experts")
    sid = next((x for x in (src.get("id"), obj.get("id"), obj.get("sample_id"))
                if x is not None), default_id)
    if not isinstance(b64, str):
        raise RecordError(f"{where}: sample {sid!r} has no routed_experts string (is capture on? "
                          "vLLM: --enable-return-routed-experts; SGLang: "
                          "--enable-return-routed-experts and return_routed_experts=True)")
    return [(str(sid), b64)]


def _decode_b64(b64: str | bytes, kind: str, schema: RoutingSchema, sid: str,
                num_fused_shared_experts: int = 0) -> np.ndarray:
    if not b64.strip():
        raise RecordError(f"sample {sid!r}: routed_experts is empty")
    if kind == "sglang-b64":
        try:
            full = wire.decode_sglang_b64_int32(b64, schema.num_hidden_layers, schema.top_k,
                                                num_fused_shared_experts=num_fused_shared_experts)
            return wire.split_fused_shared_columns(full, schema.top_k, schema.num_experts)
        except RecordError as e:
            raise RecordError(f"sample {sid!r}: {e}") from None
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RecordError(f"sample {sid!r}: routed_experts is not base64 ({e})") from None
    return load_npy(io.BytesIO(raw), len(raw), f"sample {sid!r}: routed_experts")


def iter_records(kind: str, path: str, schema: RoutingSchema, *,
                 num_fused_shared_experts: int = 0) -> Iterator[RoutingRecord]:
    """Records of ``path`` read as ``kind`` (see the module docstring);
    ``num_fused_shared_experts``: fused shared-expert columns per row of ``sglang-b64``
    payloads (never guessed from the byte count).

    Raises:
        RecordError: unreadable input or a bad sample (named), when reached.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown input kind {kind!r}; known: {KINDS}")
    if kind in ("npy", "vllm"):
        for sid, arr in iter_arrays(path):
            yield to_record(sid, arr, schema, full_layout=True if kind == "vllm" else None)
    else:
        hint = (wire.sglang_id_hint(schema.num_experts, num_fused_shared_experts)
                if kind == "sglang-b64" else None)
        for sid, arr in iter_b64(path, kind, schema,
                                 num_fused_shared_experts=num_fused_shared_experts):
            yield to_record(sid, arr, schema, full_layout=True, id_hint=hint)
