"""An independent sidecar reader written from docs/FORMAT.md alone.

Plain Python (struct, zlib, json; zstandard only for RFC 8878 zstd frames), no numpy and
nothing from routereplay, so it checks the spec against what our writer produces.
"""
import json
import struct
import zlib

import zstandard

P = 24


class Ans:
    def __init__(self, data):
        assert len(data) % 4 == 0 and data
        self.w = list(struct.unpack(f"<{len(data) // 4}I", data))
        assert self.w[-1] != 0
        self.r = len(self.w)
        self.state = self.w[self.r - 1]
        self.r -= 1
        if self.r > 0:
            self.state = (self.state << 32) | self.w[self.r - 1]
            self.r -= 1

    def empty(self):
        return self.state == 0 and self.r == 0

    def decode(self, f):
        assert not self.empty(), "decoding from an empty decoder"
        q = self.state & ((1 << P) - 1)
        c = 0
        for s, fs in enumerate(f):
            if c <= q < c + fs:
                break
            c += fs
        self.state = (self.state >> P) * f[s] + (q - c)
        if self.state < (1 << 32) and self.r > 0:
            self.state = (self.state << 32) | self.w[self.r - 1]
            self.r -= 1
        return s


def freqs(u):
    n, total = len(u), sum(u)
    f = [x * ((1 << P) - n) // total + 1 for x in u]
    f[u.index(max(u))] += (1 << P) - sum(f)
    return f


def ctx_ans(data, t, g_count, k, e, sorted_rows):
    a_size = e - k + 1 if sorted_rows else e
    dec = Ans(data)
    flags_c = [[0, 0] for _ in range(g_count)]
    experts_c = [[0] * e for _ in range(g_count)]
    sym_c = [0] * a_size
    rows = [[None] * t for _ in range(g_count)]
    s = 0
    while s < t:
        size = 16 if s == 0 else min(s, 4096)
        end = min(s + size, t)
        fresh = [[] for _ in range(g_count)]
        for g in range(g_count):
            if s == 0:
                fresh[g].append(0)
            f = freqs([2 * flags_c[g][0] + 1, 2 * flags_c[g][1] + 1])
            for row in range(max(s, 1), end):
                flag = dec.decode(f)
                flags_c[g][flag] += 1
                if flag == 0:
                    fresh[g].append(row)
                else:
                    rows[g][row] = "repeat"
        listed = [(g, row) for g in range(g_count) for row in fresh[g]]
        n = len(listed)
        if a_size >= 2:
            f = freqs([2 * c + 1 for c in sym_c])
            flat = [dec.decode(f) for _ in range(n * k)]
        else:
            flat = [0] * (n * k)
        orders = [sorted(range(e), key=lambda x: (-experts_c[g][x], x)) for g in range(g_count)]
        for i, (g, row) in enumerate(listed):
            y = [flat[j * n + i] for j in range(k)]
            if sorted_rows:
                a = [y[0]]
                for j in range(1, k):
                    a.append(a[-1] + 1 + y[j])
            else:
                a = []
                for j in range(k):
                    free = [v for v in range(e) if v not in a]
                    a.append(free[y[j]])
            assert max(a) < e
            ids = [orders[g][v] for v in a]
            rows[g][row] = sorted(ids) if sorted_rows else ids
        for g, row in listed:
            for x in rows[g][row]:
                experts_c[g][x] += 1
        for y in flat:
            sym_c[y] += 1
        for g in range(g_count):
            for row in range(s, end):
                if rows[g][row] == "repeat":
                    rows[g][row] = list(rows[g][row - 1])
        s = end
    assert dec.decode([65536] * 256) == 0xA5 and dec.empty()
    return [[rows[g][row] for g in range(g_count)] for row in range(t)]    # [T][G][K]


def ctx_zstd(blob, t, g_count, k, e):
    c = zstandard.ZstdDecompressor().decompressobj().decompress(blob)   # size declared or not
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
    c = zstandard.ZstdDecompressor().decompressobj().decompress(body)
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
    """One routing section (any version) -> [t][g_count][K]."""
    item = 1 if e <= 256 else 2
    if codec == "ctx-zstd":
        return ctx_zstd(blob, t, g_count, k, e)
    if codec == "xl-zstd":
        return xl_zstd(blob, t, g_count, k, e)
    if codec.startswith("ctx-ans"):
        return ctx_ans(blob, t, g_count, k, e, codec == "ctx-ans-sorted")
    assert codec in ("raw-lm", "zstd-lm"), codec
    raw = blob if codec == "raw-lm" else zstandard.ZstdDecompressor().decompress(blob)
    vals = struct.unpack(f"<{len(raw) // item}{'B' if item == 1 else 'H'}", raw)
    return [[list(vals[((g * t) + row) * k:((g * t) + row + 1) * k])
             for g in range(g_count)] for row in range(t)]


def array(name, codec, blob, count):
    raw = zstandard.ZstdDecompressor().decompress(blob) if codec == "zstd" else blob
    return list(struct.unpack(f"<{count}{'i' if name == 'token_ids' else 'f'}", raw))


def record_v3(payload, pcrc, header, lmoe, k, e):
    """A version-3 record payload ("Record payload (kind 1), version 3") -> record dict."""
    m, pos = varint(payload, 0)
    h = pos + m
    assert zlib.crc32(payload[:h]) == pcrc                      # the head's CRC
    flags, pos = varint(payload, pos)
    assert flags < 512
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
    assert pos == h
    n_blocks = max(1, -(-t // b_rows))
    n_groups = -(-lmoe // g_size)
    s = n_groups * n_blocks + len(arrays)
    ends = list(struct.unpack(f"<{s - 1}I", payload[h:h + 4 * (s - 1)]))
    body = payload[h + 4 * (s - 1):]
    ends.append(len(body))
    codecs = header["codecs"]
    rec["routing"] = [[None] * lmoe for _ in range(t)]
    for i in range(s):
        sec = body[(ends[i - 1] if i else 0):ends[i]]
        assert len(sec) >= 5
        assert struct.unpack("<I", sec[:4])[0] == zlib.crc32(struct.pack("<I", i) + sec[4:])
        codec, blob = codecs[sec[4]], sec[5:]
        if i < n_groups * n_blocks:
            g, b = divmod(i, n_blocks)
            l0, l1 = g * g_size, min(lmoe, (g + 1) * g_size)
            r0, r1 = b * b_rows, min(t, (b + 1) * b_rows)
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


def read_stream(data):
    """-> (header dict, [record dicts with 'routing' as nested lists [T][L_moe][K]])."""
    assert data[:8] == b"\x89RRSC\r\n\x1a"
    version, flags, j = struct.unpack("<HHI", data[8:16])
    assert version in (1, 2, 3)
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
        if kind == 2:
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
                   "routing": [[None] * lmoe for _ in range(t)]}
            pos = 0
            for sec in meta["sections"]:
                if isinstance(sec, dict):                 # version 1: offsets and shapes given
                    name, codec, length = sec["name"], sec["codec"], sec["length"]
                    dims = sec["layers"] if name == "routing" else sec["shape"]
                    blob = body[sec["offset"]:sec["offset"] + length]
                else:
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
            records.append(rec)
            offsets.append(off)
        off += 24 + plen
    if index is not None:
        assert struct.unpack("<8s", data[-8:])[0] == b"RRSCEND\x00"
        assert [sid for sid, _ in index["records"]] == [r["sample_id"] for r in records]
        assert [o for _, o in index["records"]] == offsets
    return header, records
