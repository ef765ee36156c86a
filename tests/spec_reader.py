"""An independent sidecar reader written from docs/FORMAT.md alone.

Plain Python (struct, zlib, json; zstandard only for RFC 8878 zstd frames), no numpy and
nothing from routereplay, so it checks the spec against what our writer produces.
"""
import json
import math
import struct
import zlib

import zstandard

REMOVED = ("xl-ans", "xl-ans-rows", "ctx-ans", "ctx-ans-sorted", "zstd-lm")    # "Removed in 0.3.0"


def zstd_frame(blob):
    """The content of the zstd frame at the start of ``blob`` (FORMAT.md "Conventions"):
    the frame must be whole (the decoder reaches its end) and hold exactly its declared
    content size, if it declares one; bytes after it are not read."""
    declared = zstandard.frame_content_size(blob)       # raises on a non-frame (skippable too)
    obj = zstandard.ZstdDecompressor().decompressobj()
    c = obj.decompress(blob)
    assert obj.eof, "truncated zstd frame"
    assert declared < 0 or len(c) == declared, "zstd frame holds other than its declared size"
    return c


def ctx_zstd(blob, t, g_count, k, e):
    c = zstd_frame(blob)                                    # size declared or not
    total = g_count * t
    nbits = (total + 7) // 8
    fresh = [(c[i // 8] >> (7 - i % 8)) & 1 for i in range(total)]
    assert t == 0 or all(fresh[g * t] for g in range(g_count))
    p = 4 if e <= 4 else 2 if e <= 11 or e == 16 else 1 if e <= 256 else 0
    stored, pos = [], nbits
    for g in range(g_count):
        n_ids = sum(fresh[g * t:(g + 1) * t]) * k
        if p == 0:
            lo, hi = c[pos:pos + n_ids], c[pos + n_ids:pos + 2 * n_ids]
            seq = [lo[i] | hi[i] << 8 for i in range(n_ids)]
            pos += 2 * n_ids
        else:
            nb = -(-n_ids // p)
            seq = []
            for byte in c[pos:pos + nb]:
                assert byte < e ** p
                seq += [byte // e ** (p - 1 - q) % e for q in range(p)]
            seq = seq[:n_ids]
            pos += nb
        stored += [seq[m:m + k] for m in range(0, n_ids, k)]
    assert pos == len(c)
    assert all(x < e for row in stored for x in row)
    rows, s = [], 0
    for i in range(total):
        s += fresh[i]
        rows.append(stored[s - 1])
    return [[rows[g * t + row] for g in range(g_count)] for row in range(t)]   # [T][G][K]


def xl_zstd(blob, t, g_count, k, e):
    assert len(blob) >= 1
    mode, body = blob[0], blob[1:]
    if mode == 0:
        return ctx_zstd(body, t, g_count, k, e)
    assert mode in (1, 2)
    c = zstd_frame(body)
    n = t * g_count * k
    p = 4 if e <= 4 else 2 if e <= 11 or e == 16 else 1 if e <= 256 else 0
    if mode == 2 or p <= 1:
        item = 1 if e <= 256 else 2
        assert len(c) == n * item
        seq = list(struct.unpack(f"<{n}{'B' if item == 1 else 'H'}", c))
    else:
        assert len(c) == -(-n // p)
        seq = []
        for byte in c:
            assert byte < e ** p
            seq += [byte // e ** (p - 1 - q) % e for q in range(p)]
        seq = seq[:n]
    assert all(x < e for x in seq)
    return [[seq[(row * g_count + g) * k:(row * g_count + g + 1) * k] for g in range(g_count)]
            for row in range(t)]                                            # [T][G][K]


def varint(buf, pos):
    """-> (value, position after it): unsigned LEB128, at most 10 bytes."""
    n = shift = 0
    for i in range(10):
        b = buf[pos + i]
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos + i + 1
        shift += 7
    raise AssertionError("varint longer than 10 bytes")


def string(buf, pos):
    n, pos = varint(buf, pos)
    assert pos + n <= len(buf)
    return buf[pos:pos + n].decode("utf-8", "surrogatepass"), pos + n


def routing_part(codec, blob, t, g_count, k, e):
    """One routing section (either version) -> [t][g_count][K]."""
    item = 1 if e <= 256 else 2
    assert codec not in REMOVED, f"routing codec {codec!r} was removed in routereplay 0.3.0"
    if codec == "ctx-zstd":
        return ctx_zstd(blob, t, g_count, k, e)
    if codec == "xl-zstd":
        return xl_zstd(blob, t, g_count, k, e)
    assert codec == "raw-lm", codec
    raw = blob
    assert len(raw) == t * g_count * k * item
    vals = struct.unpack(f"<{len(raw) // item}{'B' if item == 1 else 'H'}", raw)
    return [[list(vals[((g * t) + row) * k:((g * t) + row + 1) * k])
             for g in range(g_count)] for row in range(t)]


def array(name, codec, blob, count):
    raw = zstd_frame(blob) if codec == "zstd" else blob
    return list(struct.unpack(f"<{count}{'i' if name == 'token_ids' else 'f'}", raw))


def record_v3(payload, pcrc, header, lmoe, k, e):
    """A version-3 record payload ("Record payload (kind 1), version 3") -> record dict."""
    m, pos = varint(payload, 0)
    h = pos + m
    assert zlib.crc32(payload[:h]) == pcrc                      # the head's CRC
    flags, pos = varint(payload, pos)
    assert flags < 1024
    sid, pos = string(payload, pos)
    t, pos = varint(payload, pos)
    rec = {"sample_id": sid, "start": 0, "prompt_len": None, "weight_versions": [],
           "engine": "", "recomputed": [], "prefix_cached": []}
    b_rows, g_size = max(t, 1), lmoe
    if flags & 1:
        b_rows, pos = varint(payload, pos)
        g_size, pos = varint(payload, pos)
    if flags & 2:
        rec["start"], pos = varint(payload, pos)
    if flags & 4:
        rec["prompt_len"], pos = varint(payload, pos)
    arrays = []
    for bit, name in ((8, "token_ids"), (16, "logprobs")):
        if flags & bit:
            n, pos = varint(payload, pos)
            arrays.append((name, n))
    if flags & 32:
        n, pos = varint(payload, pos)
        for _ in range(n):
            v, pos = string(payload, pos)
            a, pos = varint(payload, pos)
            ln, pos = varint(payload, pos)
            rec["weight_versions"].append([v, a, a + ln])
    if flags & 64:
        rec["engine"], pos = string(payload, pos)
    for bit, key in ((128, "recomputed"), (256, "prefix_cached")):
        if flags & bit:
            n, pos = varint(payload, pos)
            for _ in range(n):
                a, pos = varint(payload, pos)
                ln, pos = varint(payload, pos)
                rec[key].append([a, a + ln])
    rec["sampling"] = None
    if flags & 512:
        mode, pos = string(payload, pos)
        temperature, top_p = struct.unpack("<dd", payload[pos:pos + 16])
        top_k, pos = varint(payload, pos + 16)
        (min_p,) = struct.unpack("<d", payload[pos:pos + 8])
        n, pos = varint(payload, pos + 8)
        assert n <= 16
        procs = []
        for _ in range(n):
            name, pos = string(payload, pos)
            procs.append(name)
        rec["sampling"] = {"logprobs_mode": mode, "temperature": temperature, "top_p": top_p,
                           "top_k": top_k, "min_p": min_p, "processors": procs}
        _check_sampling(rec["sampling"])
    assert pos == h
    _check_spans(rec, t)
    n_blocks = max(1, -(-t // b_rows))
    n_groups = -(-lmoe // g_size)
    s = n_groups * n_blocks + len(arrays)
    ends = list(struct.unpack(f"<{s - 1}I", payload[h:h + 4 * (s - 1)]))
    body = payload[h + 4 * (s - 1):]
    ends.append(len(body))
    codecs = header["codecs"]
    rec["routing"] = [[None] * lmoe for _ in range(t)]
    rec["section_codecs"] = []              # per routing section: codec, l0, r0
    for i in range(s):
        sec = body[(ends[i - 1] if i else 0):ends[i]]
        assert len(sec) >= 5
        assert struct.unpack("<I", sec[:4])[0] == zlib.crc32(struct.pack("<I", i) + sec[4:])
        codec, blob = codecs[sec[4]], sec[5:]
        if i < n_groups * n_blocks:
            g, b = divmod(i, n_blocks)
            l0, l1 = g * g_size, min(lmoe, (g + 1) * g_size)
            r0, r1 = b * b_rows, min(t, (b + 1) * b_rows)
            rec["section_codecs"].append((codec, l0, r0))
            part = routing_part(codec, blob, r1 - r0, l1 - l0, k, e)
            for row in range(r0, r1):
                rec["routing"][row][l0:l1] = part[row - r0]
        else:
            name, n = arrays[i - n_groups * n_blocks]
            rec[name] = array(name, codec, blob, n)
    return rec


def index_v3(payload):
    n, pos = varint(payload, 0)
    out, off = [], 0
    for _ in range(n):
        sid, pos = string(payload, pos)
        d, pos = varint(payload, pos)
        off += d
        out.append([sid, off])
    assert pos == len(payload)
    return {"records": out}


def _check_sampling(smp):
    """"Version 3 meta", SAMPLING: the ranges (the same for version 2's ``sampling``)."""
    assert set(smp) == {"logprobs_mode", "temperature", "top_p", "top_k", "min_p",
                        "processors"}
    text = [smp["logprobs_mode"]] + list(smp["processors"])
    assert all(isinstance(x, str) and 1 <= len(x.encode("utf-8", "surrogatepass")) <= 64
               for x in text)
    assert len(smp["processors"]) <= 16 and len(set(smp["processors"])) == len(smp["processors"])
    assert math.isfinite(smp["temperature"]) and smp["temperature"] >= 0
    assert math.isfinite(smp["top_p"]) and 0 < smp["top_p"] <= 1
    assert math.isfinite(smp["min_p"]) and 0 <= smp["min_p"] <= 1
    assert isinstance(smp["top_k"], int) and 0 <= smp["top_k"] < 2 ** 31


def _check_spans(rec, t):
    """Spans lie within the sequence the rows imply ("Reader limits": spans)."""
    seq = rec["start"] + t + 1
    assert all(0 <= w[1] <= w[2] <= seq for w in rec["weight_versions"]), "span beyond the record"
    assert all(0 <= a <= b <= seq for key in ("recomputed", "prefix_cached")
               for a, b in rec[key]), "span beyond the record"


def read_stream(data):
    """-> (header dict, [record dicts with 'routing' as nested lists [T][L_moe][K]])."""
    assert data[:8] == b"\x89RRSC\r\n\x1a"
    version, flags, j = struct.unpack("<HHI", data[8:16])
    assert version in (2, 3), f"format version {version} (1 was removed in routereplay 0.3.0)"
    hjs = data[16:16 + j]
    assert struct.unpack("<I", data[16 + j:20 + j])[0] == zlib.crc32(hjs)
    header = json.loads(hjs)
    sch = header["schema"]
    lmoe, k, e = len(sch["moe_layer_ids"]), sch["top_k"], sch["num_experts"]
    off, records, index, offsets = 20 + j, [], None, []
    end = len(data) - 16 if data[-8:] == b"RRSCEND\x00" else len(data)
    while off + 24 <= end:
        magic, kind, plen, pcrc, hcrc = struct.unpack("<4sB3xQII", data[off:off + 24])
        if magic != b"RRFM":
            break                                         # the trailer
        assert hcrc == zlib.crc32(data[off:off + 20])
        payload = data[off + 24:off + 24 + plen]
        if kind == 3 and version == 3:                    # a 0.2 xl-ans model: CRC only
            assert zlib.crc32(payload) == pcrc
        elif kind == 2:
            assert zlib.crc32(payload) == pcrc
            index = index_v3(payload) if version == 3 else json.loads(payload)
        elif kind == 1 and version == 3:
            records.append(record_v3(payload, pcrc, header, lmoe, k, e))
            offsets.append(off)
        elif kind == 1:
            assert zlib.crc32(payload) == pcrc
            (mlen,) = struct.unpack("<I", payload[:4])
            meta = json.loads(payload[4:4 + mlen])
            body = payload[4 + mlen:]
            t = meta["num_tokens"]
            rec = {"sample_id": meta["sample_id"], "start": meta.get("start", 0),
                   "prompt_len": meta.get("prompt_len"),
                   "weight_versions": meta.get("weight_versions", []),
                   "engine": meta.get("engine", ""), "recomputed": meta.get("recomputed", []),
                   "prefix_cached": meta.get("prefix_cached", []),
                   "sampling": meta.get("sampling"),
                   "routing": [[None] * lmoe for _ in range(t)]}
            if rec["sampling"] is not None:
                _check_sampling(rec["sampling"])
            pos = 0
            for sec in meta["sections"]:
                name, codec, length, *dims = sec
                blob = body[pos:pos + length]
                pos += length
                if name == "routing":
                    l0, l1 = dims
                    part = routing_part(codec, blob, t, l1 - l0, k, e)
                    for row in range(t):
                        rec["routing"][row][l0:l1] = part[row]
                elif name in ("token_ids", "logprobs"):
                    rec[name] = array(name, codec, blob, dims[0])
            _check_spans(rec, t)
            records.append(rec)
            offsets.append(off)
        off += 24 + plen
    if index is not None:
        assert struct.unpack("<8s", data[-8:])[0] == b"RRSCEND\x00"
        assert [sid for sid, _ in index["records"]] == [r["sample_id"] for r in records]
        assert [o for _, o in index["records"]] == offsets
    return header, records
