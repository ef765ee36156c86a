"""Format version 2 record payloads, read only (docs/FORMAT.md "Version 2 record payload"):
JSON meta, then the sections back to back, one CRC over the whole payload (the frame's).

    payload = meta_len(u32) meta_json body
    body    = section bytes back to back, in the order of meta["sections"]

Version 2 meta leaves defaults out and lists sections as compact arrays
``[name, codec, length, a, b]``. routereplay 0.3.0 writes format 3 only; format 1 and the
codecs it removed are refused by name (routereplay.codec.removed_codec_error). Depends only
on the shared primitives (routereplay.sidecar.limits, routereplay.sidecar.record_meta).
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any

from routereplay.codec import CODECS, REMOVED_CODECS, removed_codec_error
from routereplay.errors import RecordError, SidecarError
from routereplay.record import SamplingInfo, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import MAX_JSON_BYTES, MAX_TOKENS
from routereplay.sidecar.limits import EXPANSION, EXPANSION_SLACK, section_fits
from routereplay.sidecar.record_meta import (ARRAY_SECTIONS, MetaError, RecordMeta, Section,
                                             check_counts, is_int)

# Meta keys a version-2 writer left out when they held their default.
META_DEFAULTS: dict[str, Any] = {"start": 0, "prompt_len": None, "weight_versions": [],
                                 "recomputed": [], "prefix_cached": [], "engine": "",
                                 "sampling": None}

# Section entries a format-2 meta may hold beyond one per MoE layer (FORMAT.md "Record
# payload, version 2"): 0.2 writers wrote two (token_ids, logprobs)
MAX_EXTRA_SECTIONS = 64


def decode_payload_v2(payload: bytes | memoryview, schema: RoutingSchema,
                      offset: int | None = None) -> tuple[RecordMeta, memoryview]:
    """Split a version-2 record payload into validated meta and the body.

    Args:
        payload: the frame's payload (its CRC already checked).
        offset: the frame's offset, for error messages.
    Raises:
        SidecarError: naming the offset (and the sample id when the meta names one); a
            routing section of a removed codec names its MoE layers and the removal.
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
        raw = {**META_DEFAULTS, **raw,
               "sections": _sections_v2(raw.get("sections"), raw.get("num_tokens"), schema)}
        meta = _validate(raw, schema, len(body))
    except MetaError as e:
        raise SidecarError("invalid record meta" + (f" for sample {sid!r}" if sid else "")
                           + f": {e}", offset=offset, sample_id=sid) from None
    return meta, body


def _sections_v2(secs: Any, num_tokens: Any, schema: RoutingSchema) -> list[Section]:
    """``[name, codec, length, a, b]`` arrays -> sections with body offsets."""
    if not isinstance(secs, list):
        raise MetaError("field 'sections' missing or not list")
    # NOTE: 0.2 writers wrote at most one routing section per MoE layer plus two arrays;
    # a meta of many more entries is crafted (each costs a check on every scan and read)
    if len(secs) > schema.num_moe_layers + MAX_EXTRA_SECTIONS:
        raise MetaError(f"{len(secs)} sections, more than {schema.num_moe_layers} MoE layers + "
                        f"{MAX_EXTRA_SECTIONS}")
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


def _parse_spans(meta: dict[str, Any]) -> tuple[list[WeightVersionSpan],
                                                dict[str, tuple[tuple[int, int], ...]]]:
    """JSON span lists -> weight-version spans and the flag spans."""
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
    return spans, flags


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
    spans, flags = _parse_spans(meta)
    sampling = None
    if meta.get("sampling") is not None:
        # NOTE: an addition to version 2's meta: readers before it ignore the key
        try:
            sampling = SamplingInfo.from_json(meta["sampling"])
        except (RecordError, TypeError) as e:
            raise MetaError(str(e)) from None
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
        # NOTE: Python ints: a crafted shape of 10**400 is a size to refuse, not an overflow
        decoded = itemsize * math.prod(sec.shape) if itemsize else 0
        if itemsize and not section_fits(sec.codec, decoded, sec.length) and not too_big:
            too_big = (f"section {sec.name!r} ({sec.codec}) declares {decoded} bytes from "
                       f"{sec.length} stored bytes: beyond the reader's limit of "
                       f"{EXPANSION[sec.codec]} x + min({EXPANSION_SLACK}, "
                       f"{EXPANSION[sec.codec]} x) bytes")
        if sec.name == "routing":
            ly = sec.moe_layers
            if ly is None or not (0 <= ly[0] < ly[1] <= schema.num_moe_layers):
                raise MetaError(f"routing section has bad layers {None if ly is None else list(ly)}")
            if sec.shape != (t, ly[1] - ly[0], schema.top_k):
                raise MetaError(f"routing section shape {list(sec.shape)} does not match "
                                "num_tokens/top_k")
            if sec.codec in REMOVED_CODECS:
                raise MetaError(f"routing section of MoE layers [{ly[0]}, {ly[1]}): "
                                + removed_codec_error(f"routing codec {sec.codec!r}"))
            if sec.codec not in CODECS:
                raise MetaError(f"routing section of MoE layers [{ly[0]}, {ly[1]}): unknown "
                                f"routing codec {sec.codec!r} (this release reads {CODECS})")
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
    check_counts(t, meta["start"], pl, arrays.get("token_ids"), arrays.get("logprobs"))
    if too_big:
        raise MetaError(too_big)
    return RecordMeta(sample_id=meta["sample_id"], num_tokens=t, start=meta["start"],
                      prompt_len=pl, weight_versions=tuple(spans),
                      recomputed=flags["recomputed"], prefix_cached=flags["prefix_cached"],
                      engine=meta["engine"], sections=tuple(meta["sections"]),
                      sampling=sampling)


def peek_sample_id_v2(payload: bytes | memoryview) -> str | None:
    """Best-effort sample id from a payload whose checksum failed (for error messages)."""
    try:
        (mlen,) = struct.unpack("<I", payload[:4])
        meta = json.loads(bytes(payload[4:4 + min(mlen, MAX_JSON_BYTES)]))
        sid = meta.get("sample_id")
        return sid if isinstance(sid, str) else None
    except Exception:  # noqa: BLE001 - corrupt bytes (also RecursionError): nothing to report
        return None
