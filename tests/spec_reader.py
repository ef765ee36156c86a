"""An independent sidecar reader written from docs/FORMAT.md alone.

Plain Python (struct, zlib, json; zstandard only for RFC 8878 zstd frames), no numpy and
nothing from routereplay, so it checks the spec against what our writer produces.
"""
import json
import math
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


def binom(n, r):
    return math.comb(n, r) if 0 <= r <= n else 0


class XlModel:
    """An `xl-ans` model payload (frame kind 3, "Model payload (kind 3)")."""

    def __init__(self, payload, lmoe, k, e):
        lm, pos = varint(payload, 0)
        em, pos = varint(payload, pos)
        km, pos = varint(payload, pos)
        assert (lm, em, km) == (lmoe, e, k), "model L/E/K differ from the stream's"
        assert 2 <= e <= 64
        c = binom(e, k) if binom(e, k) * e <= 8192 else 0
        n = 2 * lmoe * (6 + e + e * e + c * e)
        assert -(-n // 16) <= len(payload) <= n + n // 64 + 64, "model payload size"
        assert zstandard.frame_content_size(payload[pos:]) == n, "model tables: declared size"
        obj = zstandard.ZstdDecompressor().decompressobj()
        tables = obj.decompress(payload[pos:])
        assert obj.eof and not obj.unused_data, "model tables: not exactly one zstd frame"
        assert len(tables) == n, "model tables size"
        v = list(struct.unpack(f"<{n // 2}H", tables))
        i = 0

        def take(count):
            nonlocal i
            i += count
            return v[i - count:i]

        self.c = c
        self.flag_f, self.p, self.xn, self.j = [], [], [], []
        for _ in range(lmoe):                                   # F[L][3][2]
            f = take(6)
            self.flag_f.append([freqs([f[2 * x] + 1, f[2 * x + 1] + 1]) for x in range(3)])
        for _ in range(lmoe):                                   # P[L][E]
            self.p.append(take(e))
        for _ in range(lmoe):                                   # X[L][E][E], normalized
            rows = []
            for _u in range(e):
                xr = take(e)
                tot = sum(xr) + e
                rows.append([(x + 1) * 65536 // tot for x in xr])
            self.xn.append(rows)
        for _ in range(lmoe):                                   # J[L][C][E]
            self.j.append([take(e) for _c in range(c)])
        assert i == len(v)


def model_at(ctx, o):
    """The model of the kind-3 frame at stream offset ``o`` (checked, cached)."""
    if o not in ctx["models"]:
        # NOTE: only frames the scan reaches are model frames ("xl-ans": a kind-3 frame
        # nested in another frame's bytes is none)
        assert o in ctx["model_frames"], "model offset is not a model frame the scan found"
        data, (start, end) = ctx["data"], ctx["area"]
        assert start <= o and o + 24 <= end, "model offset outside the frame area"
        magic, kind, plen, pcrc, hcrc = struct.unpack("<4sB3xQII", data[o:o + 24])
        assert magic == b"RRFM" and hcrc == zlib.crc32(data[o:o + 20])
        assert kind == 3, "frame at the model offset is not of kind 3"
        assert o + 24 + plen <= end
        assert o + 24 + plen <= ctx.get("record", end), "model frame runs into the record"
        payload = data[o + 24:o + 24 + plen]
        assert zlib.crc32(payload) == pcrc, "model payload CRC"
        ctx["models"][o] = XlModel(payload, ctx["lmoe"], ctx["k"], ctx["e"])
    return ctx["models"][o]


def xl_ans(blob, t, g_count, k, e, l0, ctx):
    """An `xl-ans` section -> [t][g_count][K]; l0 = its first MoE layer position."""
    assert ctx is not None, "xl-ans outside a version-3 record"
    assert 2 <= e <= 64 and l0 + g_count <= ctx["lmoe"]
    assert t * g_count * k <= 8 * len(blob) + min(65536, 8 * len(blob)), "expansion"
    o, pos = varint(blob, 0)
    words = blob[pos:]
    assert len(words) >= 32 * g_count * (1 + k), "below the floor of 32 bytes per call"
    assert o < ctx.get("record", o + 1), "a model frame precedes the record naming it"
    m = model_at(ctx, o)
    assert len(ctx["models"]) <= 16, "more than 16 model frames named"
    work = 0
    dec = Ans(words)
    rows, prev_flags = [], None
    for lp in range(g_count):
        l = l0 + lp
        flags = [0] * t
        for row in range(1, t):
            flags[row] = dec.decode(m.flag_f[l][2 if lp == 0 else prev_flags[row]])
        fresh = [row for row in range(t) if row == 0 or flags[row] == 0]
        work += 2 * max(t - 1, 0) + len(fresh) * k * e
        assert work <= 128 * len(words), "coder work beyond 128 per byte of words"
        bases = []
        for row in fresh:
            if lp == 0:
                bases.append(m.p[l])
                continue
            u = rows[lp - 1][row]
            s = [sum(m.xn[l][ui][x] for ui in u) for x in range(e)]
            if m.c:
                jr = m.j[l][sum(binom(si, i + 1) for i, si in enumerate(sorted(u)))]
                bases.append([jr[x] * 65536 + 4 * s[x] for x in range(e)])
            else:
                bases.append(s)
        got = [[] for _ in fresh]
        for j in range(k):
            for i in range(len(fresh)):
                w = [b + 1 for b in bases[i]]
                for x in got[i]:
                    w[x] = 1
                y = dec.decode(freqs(w))
                assert y not in got[i], "id repeated in a row"
                got[i].append(y)
        layer = [None] * t
        for i, row in enumerate(fresh):
            layer[row] = got[i]
        for row in range(1, t):
            if flags[row]:
                layer[row] = list(layer[row - 1])
            else:
                assert layer[row] != layer[row - 1], "fresh row equal to the previous row"
        rows.append(layer)
        prev_flags = flags
    assert dec.decode([65536] * 256) == 0xA5 and dec.empty(), "end marker"
    return [[rows[lp][row] for lp in range(g_count)] for row in range(t)]   # [T][G][K]


def xl_ans_rows(blob, t, g_count, k, e, l0, ctx):
    """An `xl-ans-rows` section -> [t][g_count][K]; l0 = its first MoE layer position."""
    assert ctx is not None, "xl-ans-rows outside a version-3 record"
    assert k in (1, 2) and 2 <= e <= 64 and l0 + g_count <= ctx["lmoe"]
    a = e if k == 1 else e * (e - 1)
    c = binom(e, k) if binom(e, k) * e <= 8192 else 0
    assert a <= 64 and c > 0, "xl-ans-rows: top-1, or top-2 with E <= 8"
    assert ctx["lmoe"] * (2 * c + 1) * (4 * (a + 2) + max(256, 8 * (a + 1))) <= 4 << 20, \
        "row tables too large"
    assert t * g_count * k <= 8 * len(blob) + min(65536, 8 * len(blob)), "expansion"
    o, pos = varint(blob, 0)
    words = blob[pos:]
    assert len(words) >= 32 * g_count, "below the floor of 32 bytes per layer"
    assert o < ctx.get("record", o + 1), "a model frame precedes the record naming it"
    m = model_at(ctx, o)
    assert len(ctx["models"]) <= 16, "more than 16 model frames named"
    tuples = [(x,) for x in range(e)] if k == 1 else \
        [(x, y) for x in range(e) for y in range(e) if x != y]
    cache = {}

    def row_freqs(l, x, up):
        """Frequencies of the 1 + A row symbols at layer l, flag context x, ids one layer
        up ``up`` (None at the section's first layer)."""
        key = (l, x, None if up is None else tuple(sorted(up)))
        if key not in cache:
            if up is None:
                b = m.p[l]
            else:
                s = [sum(m.xn[l][ui][y] for ui in up) for y in range(e)]
                jr = m.j[l][sum(binom(si, i + 1) for i, si in enumerate(sorted(up)))]
                b = [jr[y] * 65536 + 4 * s[y] for y in range(e)]
            f0 = freqs([v + 1 for v in b])
            p = []
            for tu in tuples:
                if k == 1:
                    p.append(f0[tu[0]])
                else:
                    w = [v + 1 for v in b]
                    w[tu[0]] = 1
                    p.append(f0[tu[0]] * freqs(w)[tu[1]] // (1 << 24))
            g = m.flag_f[l][x]
            cache[key] = freqs([g[1] * 1024 + 1] + [pi * g[0] // (1 << 14) + 1 for pi in p])
        return cache[key]

    dec = Ans(words)
    rows, prev_flags, work = [], None, 0
    for lp in range(g_count):
        l = l0 + lp
        work += t * (1 + a)
        assert work <= 256 * len(words), "coder work beyond 256 per byte of words"
        layer, flags = [], []
        for row in range(t):
            if lp == 0:
                f = row_freqs(l, 2, None)
            else:
                f = row_freqs(l, prev_flags[row], rows[lp - 1][row])
            sym = dec.decode(f)
            if sym == 0:
                assert row > 0, "row 0 coded as a repeat"
                layer.append(list(layer[row - 1]))
            else:
                layer.append(list(tuples[sym - 1]))
                assert row == 0 or layer[row] != layer[row - 1], \
                    "fresh row equal to the previous row"
            flags.append(1 if sym == 0 else 0)
        rows.append(layer)
        prev_flags = flags
    assert dec.decode([65536] * 256) == 0xA5 and dec.empty(), "end marker"
    return [[rows[lp][row] for lp in range(g_count)] for row in range(t)]   # [T][G][K]


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


def routing_part(codec, blob, t, g_count, k, e, l0=0, ctx=None):
    """One routing section (any version) -> [t][g_count][K].

    ``l0`` and ``ctx`` (the stream, for model frames) only for `xl-ans` and `xl-ans-rows`
    (version 3)."""
    item = 1 if e <= 256 else 2
    if codec == "xl-ans":
        return xl_ans(blob, t, g_count, k, e, l0, ctx)
    if codec == "xl-ans-rows":
        return xl_ans_rows(blob, t, g_count, k, e, l0, ctx)
    if codec == "ctx-zstd":
        return ctx_zstd(blob, t, g_count, k, e)
    if codec == "xl-zstd":
        return xl_zstd(blob, t, g_count, k, e)
    if codec.startswith("ctx-ans"):
        return ctx_ans(blob, t, g_count, k, e, codec == "ctx-ans-sorted")
    assert codec in ("raw-lm", "zstd-lm"), codec
    raw = blob if codec == "raw-lm" else zstd_frame(blob)
    assert len(raw) == t * g_count * k * item
    vals = struct.unpack(f"<{len(raw) // item}{'B' if item == 1 else 'H'}", raw)
    return [[list(vals[((g * t) + row) * k:((g * t) + row + 1) * k])
             for g in range(g_count)] for row in range(t)]


def array(name, codec, blob, count):
    raw = zstd_frame(blob) if codec == "zstd" else blob
    return list(struct.unpack(f"<{count}{'i' if name == 'token_ids' else 'f'}", raw))


def record_v3(payload, pcrc, header, lmoe, k, e, ctx=None):
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
    rec["section_codecs"] = []              # per routing section: codec, l0, r0, model offset
    for i in range(s):
        sec = body[(ends[i - 1] if i else 0):ends[i]]
        assert len(sec) >= 5
        assert struct.unpack("<I", sec[:4])[0] == zlib.crc32(struct.pack("<I", i) + sec[4:])
        codec, blob = codecs[sec[4]], sec[5:]
        if i < n_groups * n_blocks:
            g, b = divmod(i, n_blocks)
            l0, l1 = g * g_size, min(lmoe, (g + 1) * g_size)
            r0, r1 = b * b_rows, min(t, (b + 1) * b_rows)
            model = varint(blob, 0)[0] if codec in ("xl-ans", "xl-ans-rows") else None
            rec["section_codecs"].append((codec, l0, r0, model))
            part = routing_part(codec, blob, r1 - r0, l1 - l0, k, e, l0, ctx)
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
    assert version in (1, 2, 3)
    hjs = data[16:16 + j]
    assert struct.unpack("<I", data[16 + j:20 + j])[0] == zlib.crc32(hjs)
    header = json.loads(hjs)
    sch = header["schema"]
    lmoe, k, e = len(sch["moe_layer_ids"]), sch["top_k"], sch["num_experts"]
    off, records, index, offsets = 20 + j, [], None, []
    end = len(data) - 16 if data[-8:] == b"RRSCEND\x00" else len(data)
    ctx = {"data": data, "area": (20 + j, end), "models": {}, "lmoe": lmoe, "k": k, "e": e,
           "model_frames": set()}
    while off + 24 <= end:
        magic, kind, plen, pcrc, hcrc = struct.unpack("<4sB3xQII", data[off:off + 24])
        if magic != b"RRFM":
            break                                         # the trailer
        assert hcrc == zlib.crc32(data[off:off + 20])
        payload = data[off + 24:off + 24 + plen]
        if kind == 3 and version == 3:                    # xl-ans model: scans check it
            ctx["model_frames"].add(off)
            ctx.pop("record", None)                       # not named by a record here
            model_at(ctx, off)
        elif kind == 2:
            assert zlib.crc32(payload) == pcrc
            index = index_v3(payload) if version == 3 else json.loads(payload)
        elif kind == 1 and version == 3:
            ctx["record"] = off
            records.append(record_v3(payload, pcrc, header, lmoe, k, e, ctx))
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
            _check_spans(rec, t)
            records.append(rec)
            offsets.append(off)
        off += 24 + plen
    if index is not None:
        assert struct.unpack("<8s", data[-8:])[0] == b"RRSCEND\x00"
        assert [sid for sid, _ in index["records"]] == [r["sample_id"] for r in records]
        assert [o for _, o in index["records"]] == offsets
    return header, records
