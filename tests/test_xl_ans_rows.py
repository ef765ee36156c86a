"""``xl-ans-rows``: the ``xl-ans`` model coded one symbol per row (routereplay.codec
.xl_ans_rows; docs/FORMAT.md "xl-ans-rows"). Both coders (numba kernels, constriction) write
the same words and refuse the same corrupt sections; the writer picks it per section where it
applies. The spec reader's side: tests/test_xl_ans_spec.py."""
from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest

from routereplay import codec
from routereplay.codec import xl_ans, xl_ans_rows
from routereplay.errors import RecordError, SidecarError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader, write_records
from routereplay.sidecar import writer as writer_module
from tests.test_xl_ans import (_corrupt_variants, _random_model,  # helpers
                               _same_verdicts, _same_words_on_both_paths, _source)


def _model(src, rng, records=3, t=300):
    m = xl_ans.XlModel.empty(src.num_layers, src.num_experts, src.top_k)
    for _ in range(records):
        m.count(src.sample(rng, t)[0])
    return xl_ans.XlModel.from_bytes(m.stored().to_bytes(), src.num_layers, src.num_experts,
                                     src.top_k)


def test_which_schemas_it_codes():
    """Top-1 (E <= 64) and top-2 of at most 8 experts, tables within 4 MiB a model (the
    attacker review: 16 models of 8 MiB tables, each from a 11 KB payload, cost a reader
    217-270 MiB from a 0.24 MiB stream)."""
    assert xl_ans_rows.applies(32, 8, 2) and xl_ans_rows.applies(32, 2, 1)
    assert xl_ans_rows.applies(41, 64, 1) and not xl_ans_rows.applies(42, 64, 1)
    assert not xl_ans_rows.applies(32, 9, 2)          # 72 ordered pairs
    assert not xl_ans_rows.applies(32, 8, 3) and not xl_ans_rows.applies(32, 16, 4)
    assert xl_ans_rows.applies(106, 8, 2) and not xl_ans_rows.applies(107, 8, 2)
    # cumulative frequencies, and constriction's parameters (larger than a guide here)
    assert xl_ans_rows.table_bytes(32, 8, 2) == 32 * 57 * (4 * 58 + 8 * 57)
    m = xl_ans.XlModel.empty(400, 8, 2)
    with pytest.raises(RecordError, match="xl-ans-rows codes"):
        xl_ans_rows.encode(np.zeros((0, 1, 2), np.uint8), m, 0)
    with pytest.raises(SidecarError, match="does not code"):
        xl_ans_rows.decode(bytes(64), (1, 1, 2), np.uint8, m.stored(), 0)


@pytest.mark.parametrize("e,k,nl", [(8, 2, 5), (3, 2, 3), (2, 1, 3), (8, 1, 4), (64, 1, 2)])
def test_both_coders_write_the_same_words_and_read_them(monkeypatch, e, k, nl):
    """0-600 rows, every first layer, and rows of one repeated id pair: the numba kernels
    and constriction write the same words, and both read them back."""
    src = _source(nl, e, k)
    rng = np.random.default_rng(e * 10 + k)
    model = _model(src, rng)
    for t in (0, 1, 2, 37, 600):
        x = src.sample(rng, t)[0] if t else np.zeros((0, nl, k), np.uint8)
        if t == 37:
            x[5:20] = x[4]                                   # long repeats
        for l0 in range(nl):
            xs = np.ascontiguousarray(x[:, l0:], dtype=np.uint8)
            # NOTE: over the work limit the writer codes xl-ans instead
            _same_words_on_both_paths(monkeypatch, xl_ans_rows, xs, model, l0,
                                      xl_ans_rows.least_bytes(xs.shape[1]),
                                      xl_ans_rows.section_work(xs.shape, e),
                                      xl_ans_rows.WORK_PER_BYTE, (t, l0))


def test_same_size_as_xl_ans_columns():
    """The row symbol's probability is the product of xl-ans's flag and column
    probabilities: sections within 0.2 % of xl-ans's bytes (E=8 top-2 and top-1)."""
    for e, k in ((8, 2), (8, 1)):
        src = _source(8, e, k)
        rng = np.random.default_rng(3)
        model = _model(src, rng, 8, 1024)
        x = src.sample(rng, 1024)[0].astype(np.uint8)
        rows, cols = len(xl_ans_rows.encode(x, model, 0)), len(xl_ans.encode(x, model, 0))
        assert abs(rows / cols - 1) < 0.002, (e, k, rows, cols)


def test_both_coders_refuse_the_same_corrupt_sections(monkeypatch):
    """Flipped bits, cut or added words, garbage words, and a layer whose row 0 is coded
    as a repeat: the same ids or the same error (message included) from both coders."""
    rng = np.random.default_rng(11)
    src = _source(4, 8, 2)
    model = _model(src, rng)
    x = src.sample(rng, 300)[0].astype(np.uint8)
    words = xl_ans_rows.encode(x, model, 0)
    cases = _corrupt_variants(rng, words, 80, (32, 48, 200))
    refused = _same_verdicts(monkeypatch, lambda data: xl_ans_rows.decode(
        data, x.shape, np.uint8, model, 0), cases)
    assert len(refused) > 100
    messages = {m.split(" at ")[0] for m in refused}
    assert any("first row of a layer as a repeat" in m for m in messages), messages
    assert any("fresh that repeats" in m for m in messages), messages


def test_both_coders_agree_on_garbage_under_random_models(monkeypatch):
    """Garbage words under random sparse models (E 2-8, top-1/top-2, 1-2 layers, 1-9000
    rows: layers of more than a chunk of 4096 rows, whose errors the constriction path
    once met a chunk later than the kernel): the same ids or the same error from both
    coders, never a crash."""
    for i in range(300):
        rng = np.random.default_rng(2 * 10 ** 6 + i)
        e = int(rng.integers(2, 9))
        k = int(rng.integers(1, 3))
        nl = int(rng.integers(1, 3))
        model = _random_model(rng, nl, e, k)
        nw = xl_ans_rows.least_bytes(nl) // 4 + int(rng.integers(0, 40))
        words = np.zeros(nw, np.uint32)
        nz = rng.random(nw) < rng.choice([0.02, 0.1, 0.5])
        words[nz] = rng.integers(1, 2 ** 32, nz.sum(), dtype=np.uint64)
        words[-1] = rng.choice([1, 0xA5 << 16, int(rng.integers(1, 2 ** 32))])
        t = int(rng.choice([1, 2, 3, 10, 100, 1000, 9000]))   # 9000: rows past a chunk
        _same_verdicts(monkeypatch,
                       lambda d: xl_ans_rows.decode(d, (t, nl, k), np.uint8, model, 0),
                       [words.astype("<u4").tobytes()])


def test_through_the_codec_registry():
    rng = np.random.default_rng(5)
    src = _source(6, 8, 2)
    model = _model(src, rng)
    ids = src.sample(rng, 400)[0].astype(np.uint8)
    blob = codec.encode(ids, "xl-ans-rows", 8, model=(1234, model))
    assert np.array_equal(codec.decode(blob, "xl-ans-rows", ids.shape, np.uint8, 8,
                                       models={1234: model}.__getitem__), ids)
    with pytest.raises(SidecarError, match="needs its stream's model"):
        codec.decode(blob, "xl-ans-rows", ids.shape, np.uint8, 8)
    with pytest.raises(SidecarError, match="floor"):              # before the model resolves
        codec.decode(blob[:20], "xl-ans-rows", ids.shape, np.uint8, 8,
                     models=lambda off: pytest.fail("resolved a model below the floor"))
    with pytest.raises(RecordError, match="repeats an expert"):
        xl_ans_rows.encode(np.zeros((3, 6, 2), np.uint8), model, 0)
    with pytest.raises(RecordError, match="outside"):
        xl_ans_rows.encode(np.full((3, 6, 2), 9, np.uint8), model, 0)


def _stream(src, records, rng, rows=True):
    schema = RoutingSchema(src.num_layers, tuple(range(src.num_layers)), src.top_k,
                           src.num_experts)
    recs = [RoutingRecord(f"s{i}", src.sample(rng, 1024)[0].astype(np.uint8))
            for i in range(records)]
    with contextlib.nullcontext() if rows else writers_before_rows():
        data = write_records(None, schema, recs, codec="xl-ans", background=False).getvalue()
    return data, recs


def writers_before_rows():
    """Writers opened inside declare the codec table of writers before xl-ans-rows
    (``xl-ans``, ``xl-zstd``, ...), so their sections take xl-ans: the streams those wrote."""
    return mock.patch.object(writer_module, "codec_table", lambda c: (
        "xl-ans", "xl-zstd", "ctx-zstd", "raw-lm", "zstd", "raw"))


def _section_codecs(data):
    """Routing section codecs of every record (each section's codec byte)."""
    r = SidecarReader(data)
    out, codecs = [], r.header["codecs"]
    for sid in r.sample_ids():
        o, h = r._frame_meta(sid)
        g = h.grid
        ends = r._table_ends(g, r._payload(h, g.head_len, h.body_at), h.payload_len - h.body_at)
        out += [codecs[data[o + 24 + h.body_at + int(ends[i]) + 4]] for i in range(g.n_routing)]
    return out


def test_the_writer_codes_rows_where_they_apply_and_columns_where_rows_cost_too_much():
    """E=8 top-2: sections with a model are xl-ans-rows, and the stream is within 0.2 % of
    one written with xl-ans alone; with 80 % repeats (a row under 1.8 bits) the rows' coder
    work is over the reader's limit, so the writer keeps xl-ans. Both read back."""
    src = _source(8, 8, 2)
    data, recs = _stream(src, 8, np.random.default_rng(1))
    cols, _ = _stream(src, 8, np.random.default_rng(1), rows=False)
    used = _section_codecs(data)
    assert used.count("xl-ans-rows") >= 5 and "xl-ans" not in used, used
    assert "xl-ans-rows" not in _section_codecs(cols)
    assert abs(len(data) / len(cols) - 1) < 0.002, (len(data), len(cols))
    rep = _source(8, 8, 2, repeat=0.8)
    data2, recs2 = _stream(rep, 12, np.random.default_rng(2))
    used2 = _section_codecs(data2)
    assert "xl-ans" in used2 and "xl-ans-rows" not in used2, used2
    for d, rr in ((data, recs), (data2, recs2)):
        r = SidecarReader(d)
        for x in rr:
            assert np.array_equal(r.read(x.sample_id).expert_ids, x.expert_ids)


def test_a_crafted_stream_near_the_work_limit_reads_back():
    """routereplay.testing.crafted's row case (benchmarks/robustness.py measures its CPU
    per MiB): valid xl-ans-rows sections at over half the reader's work limit read back."""
    from routereplay.testing import crafted
    data = crafted.xl_ans_rows_at_work_limit(None, nbytes=1 << 14, rows=4096)
    r = SidecarReader(data)
    assert _section_codecs(data) == ["xl-ans-rows"] * len(r.sample_ids())
    sid = r.sample_ids()[0]
    assert r.read(sid).expert_ids.shape == (4096, 1, 2)
    words = r.record_bytes(sid).routing - 5 - 2          # the CRC and codec byte, the offset
    work = xl_ans_rows.section_work((4096, 1, 2), 8)
    assert 0.5 * xl_ans_rows.WORK_PER_BYTE * words < work <= xl_ans_rows.WORK_PER_BYTE * words


def test_a_writer_is_set_to_xl_ans_not_to_its_row_layout():
    """xl-ans-rows is a layout the xl-ans writer picks per section; set as a writer's codec
    (SidecarWriter, the vLLM plugin's ROUTEREPLAY_CODEC, convert --codec) it is refused by
    name, before anything is written."""
    from routereplay.errors import ConfigError
    from routereplay.sidecar import writer_codec
    schema = RoutingSchema(4, (0, 1, 2, 3), 2, 8)
    with pytest.raises(ConfigError, match="section layout of 'xl-ans'"):
        writer_codec("xl-ans-rows", schema=schema)
    assert "xl-ans-rows" not in codec.WRITER_CODECS and "xl-ans" in codec.WRITER_CODECS


def test_convert_refuses_the_row_layout_as_its_codec_by_name(tmp_path):
    """`convert --codec xl-ans-rows` says why (the newcomer review: argparse's bare
    "invalid choice")."""
    from tests.conftest import run_py
    np.save(tmp_path / "a.npy", np.argsort(np.random.default_rng(0).random((50, 4, 8)),
                                           axis=-1)[..., :2].astype(np.uint8))
    p = run_py(["-m", "routereplay.cli", "convert", "--from", "npy", str(tmp_path / "a.npy"),
                "--out", str(tmp_path / "o.rrsc"), "--num-experts", "8", "--top-k", "2",
                "--num-layers", "4", "--codec", "xl-ans-rows"], timeout=60)
    assert p.returncode == 2 and "section layout of 'xl-ans'" in p.stderr, p.stderr
    assert not (tmp_path / "o.rrsc").exists()


def test_no_model_frame_on_records_whose_sections_sit_at_the_floor():
    """64-token records of 32 MoE layers code to about the rows' floor (32 bytes a layer),
    so about half of them fall under it. A model frame bet on such a record's savings lost
    (the stream 1.5 % above xl-zstd's); the writer no longer counts savings of records
    whose model-coded sections are, together, under 1.5x their floors: xl-zstd's stream."""
    src = _source(32, 8, 2)
    schema = RoutingSchema(32, tuple(range(32)), 2, 8)
    rng = np.random.default_rng(64)
    recs = [RoutingRecord(f"s{i}", src.sample(rng, 64)[0].astype(np.uint8)) for i in range(64)]
    xa = write_records(None, schema, recs, codec="xl-ans", background=False).getvalue()
    xz = write_records(None, schema, recs, codec="xl-zstd", background=False).getvalue()
    assert len(xa) <= 1.001 * len(xz), (len(xa), len(xz))


def test_a_short_last_token_block_does_not_keep_a_model_away():
    """4160-token records (a grid of 512-token blocks: the last holds 64 rows, at about the
    floor): the margin is summed over the record's sections (the attacker review: the least
    section's margin kept every such stream at xl-zstd's size; 0.86x with a model)."""
    src = _source(8, 8, 2)
    schema = RoutingSchema(8, tuple(range(8)), 2, 8)
    rng = np.random.default_rng(4160)
    recs = [RoutingRecord(f"s{i}", src.sample(rng, 4160)[0].astype(np.uint8)) for i in range(6)]
    w = write_records(None, schema, recs, codec="xl-ans", background=False)
    xz = write_records(None, schema, recs, codec="xl-zstd", background=False).getvalue()
    assert w.model_frames >= 1
    assert len(w.getvalue()) < 0.95 * len(xz), (len(w.getvalue()), len(xz))


def test_the_compiled_row_tables_are_the_specs():
    """The row tables built by the numba kernel (row_tables) equal numpy's, step by step
    from FORMAT.md, on random sparse models; each guide entry is the symbol whose interval
    holds its slice's start."""
    jit = xl_ans.compiled()
    for i in range(40):
        rng = np.random.default_rng(i)
        e = int(rng.integers(2, 9))
        k = int(rng.integers(1, 3))
        nl = int(rng.integers(1, 4))
        m = _random_model(rng, nl, e, k, density=.4)
        tab = xl_ans._tables(m)
        a, b = xl_ans_rows.RowTables(m, tab, jit), xl_ans_rows.RowTables(m, tab, None)
        assert np.array_equal(a.cum, b.cum), i
        cum = a.cum.reshape(-1, a.tuples + 2).astype(np.int64)
        guide = a.guide(jit).reshape(cum.shape[0], -1).astype(np.int64)
        start = np.arange(guide.shape[1]) << (24 - xl_ans_rows.GUIDE_BITS)
        rows = np.arange(cum.shape[0])[:, None]
        assert (cum[rows, guide] <= start).all() and (start < cum[rows, guide + 1]).all(), i


def test_inspect_counts_routing_sections_by_codec(tmp_path):
    """Which layout an xl-ans writer picked is visible without internals (the newcomer
    review copied a benchmark's private helper to see it): SidecarReader.routing_codecs and
    `routereplay inspect` (text and --json)."""
    import json

    from tests.conftest import run_py
    src = _source(8, 8, 2)
    data, recs = _stream(src, 8, np.random.default_rng(1))
    r = SidecarReader(data)
    per = [r.routing_codecs(x.sample_id) for x in recs]
    assert sum(p.get("xl-ans-rows", 0) for p in per) >= 5 and per[0] == {"xl-zstd": 1}
    path = tmp_path / "s.rrsc"
    path.write_bytes(data)
    p = run_py(["-m", "routereplay.cli", "inspect", str(path), "--json"], timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)["routing_codecs"]
    assert got == {c: sum(x.get(c, 0) for x in per) for c in got} and sum(got.values()) == 8
    p = run_py(["-m", "routereplay.cli", "inspect", str(path)], timeout=60)
    assert "routing sections by codec: xl-ans-rows" in p.stdout, p.stdout
