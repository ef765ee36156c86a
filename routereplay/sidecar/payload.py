"""Record payloads (docs/FORMAT.md "Record payload (kind 1)"): meta JSON + section bytes.

    payload = meta_len(u32) meta_json body
    body    = section bytes back to back, in the order of meta["sections"]

Version 2 meta leaves defaults out and lists sections as compact arrays
``[name, codec, length, a, b]``; version 1 meta (read only) is handled by
routereplay.sidecar.payload_v1 and becomes the same :class:`RecordMeta`.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np
import zstandard

from routereplay import codec as _codec
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import DEFAULT_LAYER_GROUP, MAX_JSON_BYTES, MAX_TOKENS

ARRAY_SECTIONS = {"token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4")}

# NOTE: reader limit (docs/FORMAT.md "Reader limits"): a section of a known codec may
# decode to at most EXPANSION[codec] x its stored bytes + EXPANSION_SLACK bytes, so that
# the work and memory a record costs are bounded by its size on disk (a 359-byte section
# claiming 2^24 rows, or a zstd bomb, is refused before anything is decompressed). Real
# routing expands 1.4-5x (ctx-zstd up to ~15x with long repeat runs); the writer stores a
# section that would exceed the limit with the next codec that fits (FALLBACK), so it
# never writes what readers refuse. ctx-ans gets the lowest factor: it decodes at 5-90 MB/s
# of ids, ctx-zstd at 60-2000 MB/s.
EXPANSION = {"ctx-ans": 16, "ctx-ans-sorted": 16, "ctx-zstd": 64, "zstd-lm": 64, "raw-lm": 1,
             "zstd": 64, "raw": 1}
EXPANSION_SLACK = 64 << 10             # bytes a section may always decode to
FALLBACK = ("ctx-zstd", "raw-lm")      # routing codecs a writer falls back to, in order


def largest_record_bytes(schema: RoutingSchema, stream_bytes: int) -> int:
    """Decoded bytes (ids, token ids, log-probs) of the largest record that the reader
    limits let a stream of ``stream_bytes`` bytes hold: the bound that a reader's work and
    memory on any input are measured against (docs/FORMAT.md "Reader limits").

    min(format limit, expansion limit): the format allows ``MAX_TOKENS`` rows of
    ``L_moe x top_k`` ids plus ``MAX_TOKENS + 1`` token ids and log-probs; the expansion
    limit allows ``max(EXPANSION) x`` the stored bytes plus ``EXPANSION_SLACK`` for each of
    the at most ``L_moe + 2`` sections.
    """
    fmt = MAX_TOKENS * schema.num_moe_layers * schema.top_k * schema.id_dtype.itemsize \
        + 8 * (MAX_TOKENS + 1)
    exp = max(EXPANSION.values()) * stream_bytes + (schema.num_moe_layers + 2) * EXPANSION_SLACK
    return min(fmt, exp)


def section_fits(codec: str, decoded: int, stored: int) -> bool:
    """Whether a section of ``stored`` bytes declaring ``decoded`` bytes is within the
    reader's expansion limit (:data:`EXPANSION`); True for codecs without a limit here
    (a reader refuses those by name when asked to decode them)."""
    r = EXPANSION.get(codec)
    return r is None or decoded <= r * stored + EXPANSION_SLACK

# Meta keys a version-2 writer leaves out when they hold their default.
META_DEFAULTS: dict[str, Any] = {"start": 0, "prompt_len": None, "weight_versions": [],
                                 "recomputed": [], "prefix_cached": [], "engine": ""}


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of a record body.

    Attributes:
        name: "routing", "token_ids", "logprobs" (others are skipped by readers).
        codec: routing codec name, or "zstd"/"raw" for arrays.
        offset: byte offset in the body.
        length: bytes.
        shape: routing: (T, l1 - l0, top_k); arrays: (N,) or (G,).
        moe_layers: routing only: MoE-axis positions [l0, l1).
    """

    name: str
    codec: str
    offset: int
    length: int
    shape: tuple[int, ...]
    moe_layers: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class RecordMeta:
    """Validated record metadata (everything but the arrays), as read from a frame."""

    sample_id: str
    num_tokens: int
    start: int = 0
    prompt_len: int | None = None
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    recomputed: tuple[tuple[int, int], ...] = ()
    prefix_cached: tuple[tuple[int, int], ...] = ()
    engine: str = ""
    sections: tuple[Section, ...] = ()

    def versions(self) -> list[str]:
        """Distinct weight versions, in order of first appearance."""
        return list(dict.fromkeys(s.version for s in self.weight_versions))


# --------------------------------------------------------------------------- encoding


def encode_record_payload(record: RoutingRecord, schema: RoutingSchema,
                          codec: str = _codec.DEFAULT_CODEC,
                          layer_group: int = DEFAULT_LAYER_GROUP,
                          column_order: str = "engine") -> bytes:
    """Record frame payload: u32 meta_len, meta JSON, then the section blobs (FORMAT.md).

    Meta keys equal to their default are left out; sections are ``[name, codec, length,
    a, b]`` arrays laid back to back in list order. ``column_order="sorted"`` stores each
    row in ascending expert order. The record must be valid (``RoutingRecord.validate``).
    A section that would expand beyond the reader's limit (:func:`section_fits`) is stored
    with the next codec of :data:`FALLBACK` that fits (``raw-lm`` always does).

    Raises:
        RecordError: the meta JSON exceeds the reader's limit (``MAX_JSON_BYTES``).
    """
    sections: list[list[Any]] = []
    blobs: list[bytes] = []
    ids = np.sort(record.expert_ids, axis=-1) if column_order == "sorted" else record.expert_ids
    for l0 in range(0, schema.num_moe_layers, layer_group):
        l1 = min(l0 + layer_group, schema.num_moe_layers)
        part = ids[:, l0:l1]
        for c in (codec,) + tuple(f for f in FALLBACK if f != codec):
            blob = _codec.encode(part, c, schema.num_experts)
            if section_fits(c, part.nbytes, len(blob)):
                break
        blobs.append(blob)
        sections.append(["routing", c, len(blobs[-1]), l0, l1])
    if record.token_ids is not None:
        tok = np.ascontiguousarray(record.token_ids, dtype="<i4").tobytes()
        blob, c = zstandard.ZstdCompressor(level=3).compress(tok), "zstd"
        if not section_fits(c, len(tok), len(blob)):
            blob, c = tok, "raw"
        blobs.append(blob)
        sections.append(["token_ids", c, len(blobs[-1]), len(tok) // 4])
    if record.logprobs is not None:
        lp = np.ascontiguousarray(record.logprobs, dtype="<f4")
        blobs.append(lp.tobytes())
        sections.append(["logprobs", "raw", len(blobs[-1]), int(lp.shape[0])])
    meta = {k: v for k, v in record.meta().items() if META_DEFAULTS.get(k, ...) != v}
    meta["sections"] = sections
    js = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    if len(js) > MAX_JSON_BYTES:
        raise RecordError(f"sample {str(record.sample_id)[:80]!r}: record meta of {len(js)} bytes "
                          f"exceeds the reader's limit of {MAX_JSON_BYTES} bytes")
    return struct.pack("<I", len(js)) + js + b"".join(blobs)


# --------------------------------------------------------------------------- decoding


def decode_record_payload(payload: bytes | memoryview, schema: RoutingSchema, version: int,
                          offset: int | None = None) -> tuple[RecordMeta, memoryview]:
    """Split a record payload into validated meta and the body.

    Args:
        payload: the frame's payload (its CRC already checked).
        version: the stream's format version (1 or 2).
        offset: the frame's offset, for error messages.
    Raises:
        SidecarError: naming the offset (and the sample id when the meta names one).
    """
    payload = memoryview(payload)
    if len(payload) < 4:
        raise SidecarError("record payload shorter than its meta length", offset=offset)
    (mlen,) = struct.unpack("<I", payload[:4])
    if mlen > min(len(payload) - 4, MAX_JSON_BYTES):
        raise SidecarError(f"meta length {mlen} exceeds the payload ({len(payload)} bytes) or "
                           f"the reader's limit of {MAX_JSON_BYTES} bytes", offset=offset)
    try:
        raw = json.loads(bytes(payload[4:4 + mlen]))
    except (ValueError, RecursionError) as e:
        raise SidecarError(f"record meta is not JSON: {e!r}"[:300], offset=offset) from None
    body = payload[4 + mlen:]
    if not isinstance(raw, dict):
        raise SidecarError("invalid record meta: not an object", offset=offset)
    sid = raw.get("sample_id")
    sid = sid if isinstance(sid, str) else None
    try:
        if version == 1:
            from routereplay.sidecar.payload_v1 import sections_v1
            raw = {**raw, "sections": sections_v1(raw.get("sections"), raw.get("num_tokens"),
                                                  schema)}
        else:
            raw = {**META_DEFAULTS, **raw,
                   "sections": _sections_v2(raw.get("sections"), raw.get("num_tokens"), schema)}
        meta = _validate(raw, schema, len(body))
    except MetaError as e:
        raise SidecarError("invalid record meta" + (f" for sample {sid!r}" if sid else "")
                           + f": {e}", offset=offset, sample_id=sid) from None
    return meta, body


class MetaError(Exception):
    """Why a record meta is invalid (decode_record_payload wraps it into a SidecarError
    naming the frame offset)."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sections_v2(secs: Any, num_tokens: Any, schema: RoutingSchema) -> list[Section]:
    """``[name, codec, length, a, b]`` arrays -> sections with body offsets."""
    if not isinstance(secs, list):
        raise MetaError("field 'sections' missing or not list")
    out, pos = [], 0
    for sec in secs:
        if not (isinstance(sec, list) and 4 <= len(sec) <= 5 and isinstance(sec[0], str)
                and isinstance(sec[1], str) and all(is_int(x) and x >= 0 for x in sec[2:])):
            raise MetaError(f"bad section {str(sec)[:80]}")
        name, codec, length = sec[0], sec[1], sec[2]
        if name == "routing" and len(sec) == 5:
            layers = (sec[3], sec[4])
            shape = (num_tokens if is_int(num_tokens) else -1, sec[4] - sec[3], schema.top_k)
        else:
            layers, shape = None, tuple(sec[3:])
        out.append(Section(name, codec, pos, length, shape, layers))
        pos += length
    return out


def _validate(meta: dict[str, Any], schema: RoutingSchema, body_len: int) -> RecordMeta:
    types = {"sample_id": str, "num_tokens": int, "start": int, "weight_versions": list,
             "recomputed": list, "prefix_cached": list, "engine": str}
    for k, ty in types.items():
        if not isinstance(meta.get(k), ty) or isinstance(meta.get(k), bool):
            raise MetaError(f"field {k!r} missing or not {ty.__name__}")
    t = meta["num_tokens"]
    if t < 0 or meta["start"] < 0:
        raise MetaError("negative num_tokens or start")
    if t > MAX_TOKENS:
        raise MetaError(f"num_tokens {t} above the format's limit {MAX_TOKENS}")
    pl = meta.get("prompt_len")
    if pl is not None and (not is_int(pl) or pl < 0):
        raise MetaError("prompt_len not a non-negative integer")
    spans = []
    for span in meta["weight_versions"]:
        if not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
                and all(is_int(x) for x in span[1:]) and 0 <= span[1] <= span[2]):
            raise MetaError(f"bad weight-version span {span!r}")
        spans.append(WeightVersionSpan(span[0], span[1], span[2]))
    flags: dict[str, tuple[tuple[int, int], ...]] = {}
    for key in ("recomputed", "prefix_cached"):
        for span in meta[key]:
            if not (isinstance(span, list) and len(span) == 2
                    and all(is_int(x) for x in span) and 0 <= span[0] <= span[1]):
                raise MetaError(f"bad {key} span {span!r}")
        flags[key] = tuple((a, b) for a, b in meta[key])
    covered: list[int] = []
    arrays: dict[str, int] = {}
    too_big = ""
    for sec in meta["sections"]:
        if not (0 <= sec.offset and 0 <= sec.length and sec.offset + sec.length <= body_len):
            raise MetaError(f"section {sec.name!r} lies outside the payload")
        if not all(is_int(x) and x >= 0 for x in sec.shape):
            raise MetaError(f"section {sec.name!r} has a bad shape")
        itemsize = (schema.id_dtype.itemsize if sec.name == "routing"
                    else ARRAY_SECTIONS[sec.name].itemsize if sec.name in ARRAY_SECTIONS else 0)
        decoded = itemsize * int(np.prod(sec.shape, dtype=np.float64))
        if itemsize and not section_fits(sec.codec, decoded, sec.length) and not too_big:
            too_big = (f"section {sec.name!r} ({sec.codec}) declares {decoded} bytes from "
                       f"{sec.length} stored bytes: beyond the reader's limit of "
                       f"{EXPANSION[sec.codec]} x + {EXPANSION_SLACK} bytes")
        if sec.name == "routing":
            ly = sec.moe_layers
            if ly is None or not (0 <= ly[0] < ly[1] <= schema.num_moe_layers):
                raise MetaError(f"routing section has bad layers {None if ly is None else list(ly)}")
            if sec.shape != (t, ly[1] - ly[0], schema.top_k):
                raise MetaError(f"routing section shape {list(sec.shape)} does not match "
                               "num_tokens/top_k")
            covered.extend(range(ly[0], ly[1]))
        elif sec.name in ARRAY_SECTIONS:
            if len(sec.shape) != 1 or sec.codec not in ("zstd", "raw"):
                raise MetaError(f"section {sec.name!r} has a bad shape or codec")
            if sec.name in arrays:
                raise MetaError(f"section {sec.name!r} appears twice")
            arrays[sec.name] = sec.shape[0]
    if sorted(covered) != list(range(schema.num_moe_layers)):
        raise MetaError(f"routing sections cover MoE layers {sorted(covered)}, "
                       f"expected 0..{schema.num_moe_layers - 1} once each")
    _check_counts(t, meta["start"], pl, arrays.get("token_ids"), arrays.get("logprobs"))
    if too_big:
        raise MetaError(too_big)
    return RecordMeta(sample_id=meta["sample_id"], num_tokens=t, start=meta["start"],
                      prompt_len=pl, weight_versions=tuple(spans),
                      recomputed=flags["recomputed"], prefix_cached=flags["prefix_cached"],
                      engine=meta["engine"], sections=tuple(meta["sections"]))


def _check_counts(t: int, start: int, prompt_len: int | None, n: int | None,
                  g: int | None) -> None:
    """The writer's rules (RoutingRecord.validate and SidecarWriter.write) on counts:
    positions ``start + T <= MAX_TOKENS``; with token ids, N = start + T + 1, prompt_len in
    [1, N] and G = N - prompt_len log-probs; without, prompt_len and G at most start + T + 1.

    NOTE: checked before any section is decompressed, so a forged count (2^28 token ids for
    11 rows) costs nothing, and a record the writer would refuse is never returned.
    """
    seq = start + t + 1                       # tokens of the sequence the rows imply
    if start + t > MAX_TOKENS:
        raise MetaError(f"start {start} + {t} rows above the format's limit {MAX_TOKENS}")
    if n is not None:
        if n != seq:
            raise MetaError(f"{n} token ids for {t} routing rows from position {start}: "
                            f"expected start + T + 1 = {seq}")
        if prompt_len is not None and not 0 < prompt_len <= n:
            raise MetaError(f"prompt_len {prompt_len} outside [1, {n}]")
        if g is not None and prompt_len is not None and g != n - prompt_len:
            raise MetaError(f"{g} log-probs for {n - prompt_len} generated tokens")
    if prompt_len is not None and prompt_len > seq:
        raise MetaError(f"prompt_len {prompt_len} above the {seq} tokens the rows imply")
    if g is not None and g > seq - (prompt_len or 0):
        raise MetaError(f"{g} log-probs, more than the {seq - (prompt_len or 0)} generated "
                        "tokens the rows imply")


def decode_array(blob: bytes | memoryview, sec: Section) -> np.ndarray:
    """A ``token_ids`` (int32 [N]) or ``logprobs`` (float32 [G]) section, native byte order.

    Raises:
        SidecarError: the bytes do not hold exactly the section's shape.
    """
    dtype = ARRAY_SECTIONS[sec.name]
    n = sec.shape[0] * dtype.itemsize
    if sec.codec == "zstd":
        blob = _codec.bounded_zstd_decompress(bytes(blob), n)
    if len(blob) != n:
        raise SidecarError(f"section {sec.name!r} holds {len(blob)} bytes, expected {n}")
    return np.frombuffer(blob, dtype=dtype).astype(dtype.newbyteorder("="))


def peek_sample_id(payload: bytes | memoryview) -> str | None:
    """Best-effort sample id from a payload whose checksum failed (for error messages)."""
    try:
        (mlen,) = struct.unpack("<I", payload[:4])
        meta = json.loads(bytes(payload[4:4 + min(mlen, MAX_JSON_BYTES)]))
        sid = meta.get("sample_id")
        return sid if isinstance(sid, str) else None
    except Exception:  # noqa: BLE001 - corrupt bytes (also RecursionError): nothing to report
        return None
