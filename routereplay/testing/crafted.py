"""Crafted sidecar inputs: valid checksums around forged sizes, bombs and junk (issue 16).

Each builder returns bytes that a reader must handle within its limits (docs/FORMAT.md
"Reader limits"): refused with a RouteReplayError, or read, at a cost bounded by the
input's size. Used by tests/test_fuzz_bounds.py and benchmarks/robustness.py.
"""
from __future__ import annotations

import json
import struct
from typing import Callable

import numpy as np
import zstandard

from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import KIND_RECORD, encode_frame, encode_header
from routereplay.sidecar.payload import encode_record_payload

MiB = 1 << 20


def record(schema: RoutingSchema, sample_id: str, num_tokens: int, seed: int,
           arrays: bool = True) -> RoutingRecord:
    """A valid record with ``num_tokens`` tokens (``num_tokens - 1`` rows)."""
    rng = np.random.default_rng(seed)
    t = num_tokens - 1
    ids = np.argsort(rng.random((t, schema.num_moe_layers, schema.num_experts)), axis=-1)
    ids = ids[..., :schema.top_k].astype(schema.id_dtype)
    p = max(1, num_tokens // 2)
    return RoutingRecord(
        sample_id=sample_id, expert_ids=ids, prompt_len=p,
        token_ids=rng.integers(0, 500, num_tokens).astype(np.int32) if arrays else None,
        logprobs=(-rng.random(num_tokens - p).astype(np.float32)) if arrays else None,
        weight_versions=[WeightVersionSpan("v0", 0, num_tokens)], engine="crafted")


def split_payload(payload: bytes) -> tuple[dict, list[bytes]]:
    """(meta JSON object, section bytes in list order) of a record payload."""
    (mlen,) = struct.unpack("<I", payload[:4])
    meta = json.loads(payload[4:4 + mlen])
    body, parts, pos = payload[4 + mlen:], [], 0
    for sec in meta["sections"]:
        parts.append(body[pos:pos + sec[2]])
        pos += sec[2]
    return meta, parts


def join_payload(meta: dict, parts: list[bytes]) -> bytes:
    """Inverse of :func:`split_payload`; section lengths are set from ``parts``."""
    for sec, part in zip(meta["sections"], parts):
        sec[2] = len(part)
    js = json.dumps(meta).encode()
    return struct.pack("<I", len(js)) + js + b"".join(parts)


def stream(schema: RoutingSchema, payloads: list[bytes]) -> bytes:
    """A stream (no index) framing ``payloads`` with valid checksums."""
    return encode_header(schema) + b"".join(encode_frame(KIND_RECORD, p) for p in payloads)


def forged(schema: RoutingSchema, rec: RoutingRecord, edit: Callable[[dict, list], None],
           codec: str | None = None) -> bytes:
    """A one-record stream whose meta and sections ``edit(meta, parts)`` changed in place."""
    meta, parts = split_payload(encode_record_payload(
        rec, schema, **({"codec": codec} if codec else {})))
    edit(meta, parts)
    return stream(schema, [join_payload(meta, parts)])


def zstd_bomb(nbytes: int, fill: bytes = b"\0") -> bytes:
    """One zstd frame holding ``nbytes`` bytes of ``fill`` (about 32 KiB per GiB)."""
    cobj = zstandard.ZstdCompressor(level=19).compressobj(size=nbytes)
    block, out, left = fill * MiB, [], nbytes
    while left:
        out.append(cobj.compress(block[:min(left, MiB)]))
        left -= min(left, MiB)
    return b"".join(out) + cobj.flush()


def _section(meta: dict, name: str) -> int:
    return next(i for i, s in enumerate(meta["sections"]) if s[0] == name)


def ctx_ans_forged_count(schema: RoutingSchema, num_tokens: int = 1 << 24) -> bytes:
    """Issue 16 item 8: a ctx-ans record of 11 rows whose meta claims ``num_tokens``."""
    def edit(meta, parts):
        meta["num_tokens"] = num_tokens
    return forged(schema, record(schema, "ans", 12, 1, arrays=False), edit, codec="ctx-ans")


def ctx_zstd_bomb(schema: RoutingSchema, num_tokens: int = 1 << 24) -> bytes:
    """Issue 16 item 8: a ctx-zstd section whose frame expands to its full size limit."""
    g, k = schema.num_moe_layers, schema.top_k
    nbits = -(-num_tokens * g // 8)
    bomb = zstd_bomb(nbits + num_tokens * g * k, b"\xff")

    def edit(meta, parts):
        meta["num_tokens"] = num_tokens
        parts[_section(meta, "routing")] = bomb
    return forged(schema, record(schema, "zb", 12, 2, arrays=False), edit)


def token_count_bomb(schema: RoutingSchema, count: int = 1 << 28) -> bytes:
    """Issue 16 item 7: 11 rows, a token_ids section claiming ``count`` ids (a zstd bomb)."""
    bomb = zstd_bomb(4 * count)

    def edit(meta, parts):
        i = _section(meta, "token_ids")
        meta["sections"][i][3] = count
        parts[i] = bomb
    return forged(schema, record(schema, "tok", 12, 3), edit)


def resync_junk(schema: RoutingSchema, nbytes: int = 32 * MiB) -> bytes:
    """Issue 16 item 8: a corrupt frame header, then ``nbytes`` of forged ``RRFM`` magics,
    then one good frame."""
    good = encode_frame(KIND_RECORD, encode_record_payload(record(schema, "g", 10, 4), schema))
    return encode_header(schema) + b"\0" * 24 + b"RRFM" * (nbytes // 4) + good


def many_tiny_records(schema: RoutingSchema, nbytes: int = 8 * MiB) -> bytes:
    """Valid records of one row each, ``nbytes`` of them (index memory per record)."""
    rec = record(schema, "x", 2, 5, arrays=False)
    meta, parts = split_payload(encode_record_payload(rec, schema))
    frames, size, i = [], 0, 0
    while size < nbytes:
        meta["sample_id"] = f"t{i:08d}"
        f = encode_frame(KIND_RECORD, join_payload(meta, list(parts)))
        frames.append(f)
        size += len(f)
        i += 1
    return encode_header(schema) + b"".join(frames)


def many_corrupt_frames(schema: RoutingSchema, nbytes: int = 8 * MiB) -> bytes:
    """Frames whose headers are valid and whose payload checksums fail."""
    f = bytearray(encode_frame(KIND_RECORD, encode_record_payload(
        record(schema, "c", 2, 6, arrays=False), schema)))
    f[-1] ^= 0xFF
    return encode_header(schema) + bytes(f) * (nbytes // len(f))


def big_meta(schema: RoutingSchema, nbytes: int = 1 << 20) -> bytes:
    """A record meta of just under ``nbytes`` (the JSON limit), mostly recomputed spans."""
    def edit(meta, parts):
        meta["recomputed"] = [[0, 1]] * ((nbytes - 4096) // 8)
    return forged(schema, record(schema, "m", 12, 7), edit)


def largest_valid_ctx_ans(schema: RoutingSchema, num_tokens: int = 1 << 20) -> bytes:
    """A valid, highly repetitive record written by the writer (its sections at or under the
    expansion limit; the writer falls back where ctx-ans would exceed it)."""
    from routereplay.sidecar.writer import write_records
    rng = np.random.default_rng(8)
    t = num_tokens - 1
    fresh = rng.random(t) < 0.02
    fresh[0] = True
    rows = np.argsort(rng.random((int(fresh.sum()), schema.num_moe_layers, schema.num_experts)),
                      -1)[..., :schema.top_k]
    ids = rows[np.cumsum(fresh) - 1].astype(schema.id_dtype)
    return write_records(None, schema, [RoutingRecord("rep", ids)], codec="ctx-ans").getvalue()


CASES: dict[str, Callable[[RoutingSchema], bytes]] = {
    "ctx-ans forged token count": ctx_ans_forged_count,
    "ctx-zstd bomb": ctx_zstd_bomb,
    "token-id count bomb": token_count_bomb,
    "resync over forged magics": resync_junk,
    "many tiny records": many_tiny_records,
    "many corrupt frames": many_corrupt_frames,
    "meta JSON at its limit": big_meta,
    "largest valid ctx-ans record": largest_valid_ctx_ans,
}

__all__ = ["CASES", "record", "forged", "split_payload", "join_payload", "stream", "zstd_bomb"]
