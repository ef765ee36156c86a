"""Alignment of records to trainer token layouts (routereplay.align): padding, packing,
context-parallel zig-zag, sequence-parallel split, validation, fallback ids."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from routereplay import align
from routereplay.errors import AlignmentError
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema
from routereplay.source import rows_of
from tests.conftest import random_record


def _fetch_from(records, layers, calls=None):
    """align.Fetch over in-memory records (routereplay.source.rows_of), counting calls."""
    def fetch(j, runs):
        if calls is not None:
            calls.append((j, list(runs)))
        return rows_of(records[j], layers, runs)
    return fetch


def test_right_and_left_padding_rows_are_s_major(schema):
    recs = [random_record(schema, "a", 6, 1), random_record(schema, "b", 4, 2)]
    for padding in ("right", "left"):
        lay = align.Layout(lengths=(6, 4), seq_len=7, padding=padding)
        tm = align.token_map(lay)
        ids = align.gather_rows(tm, _fetch_from(recs, [0, 1, 2]), 3, 4)
        assert ids.shape == (14, 3, 4)
        for c in range(7):
            for j, r in enumerate(recs):
                n = lay.lengths[j]
                a = 0 if padding == "right" else 7 - n
                row = ids[c * 2 + j]                   # megatron: [s, b] flattened s-major
                p = c - a
                if 0 <= p < r.num_tokens:              # record rows: positions 0..n-2
                    assert (row == r.expert_ids[p]).all()
                    assert tm.sample[c * 2 + j] == j and tm.position[c * 2 + j] == p
                else:
                    assert (row == align.MISSING).all()


def test_packed_rows_and_start_offset(schema):
    r0 = random_record(schema, "a", 5, 1)
    r1 = random_record(schema, "b", 7, 2)
    r1 = RoutingRecord(sample_id="b", expert_ids=r1.expert_ids[3:], start=3)   # prompt rows 0..2 skipped
    lay = align.Layout.packed_from_lengths([5, 7], multiple=4)
    assert lay.cu_seqlens_padded == (0, 8, 16)
    tm = align.token_map(lay)
    ids = align.gather_rows(tm, _fetch_from([r0, r1], [2]), 1, 4)
    assert (ids[0:4, 0] == r0.expert_ids[:, 2]).all()
    assert (ids[4:8] == align.MISSING).all()           # last token of a + segment padding
    assert (ids[8:11] == align.MISSING).all()          # positions 0..2 of b: no routing
    assert (ids[11:14, 0] == r1.expert_ids[:, 2]).all()       # positions 3..5
    assert (ids[14:16] == align.MISSING).all()
    assert align.coverage(ids, tm) == (4 + 3, 12)


def test_gather_fetches_each_sample_once_with_all_its_runs(schema):
    """Context parallel keeps two chunks of each sequence: both runs come from one fetch
    per sample, and the rows keep the replay width (int16) from the gather on."""
    recs = [random_record(schema, "a", 16, 1), random_record(schema, "b", 12, 2)]
    lay = align.Layout(lengths=(16, 12), seq_len=16)
    tm = align.token_map(lay, align.Shard(cp_size=2, cp_rank=0))
    calls = []
    ids = align.gather_rows(tm, _fetch_from(recs, [0, 2], calls), 2, 4,
                            align.replay_dtype(schema.num_experts))
    assert ids.dtype == np.int16 and ids.shape == (16, 2, 4)
    assert sorted(calls) == [(0, [(0, 4), (12, 16)]), (1, [(0, 4)])]    # b: 12..15 padding
    for n in range(16):
        j, p = int(tm.sample[n]), int(tm.position[n])
        if j >= 0 and p < recs[j].num_tokens:
            assert (ids[n] == recs[j].expert_ids[p][[0, 2]]).all()
        else:
            assert (ids[n] == align.MISSING).all()
    assert align.replay_dtype(40000) == np.int32


def test_sequence_parallel_split_is_contiguous_in_s(schema):
    lay = align.Layout(lengths=(8, 5), seq_len=8)
    full = align.token_map(lay)
    parts = [align.token_map(lay, align.Shard(tp_size=2, tp_rank=t, sequence_parallel=True))
             for t in range(2)]
    assert np.array_equal(np.concatenate([p.sample for p in parts]), full.sample)
    assert np.array_equal(np.concatenate([p.position for p in parts]), full.position)
    with pytest.raises(AlignmentError, match="not a multiple of tp"):
        align.token_map(align.Layout(lengths=(7,), seq_len=7),
                        align.Shard(tp_size=2, tp_rank=0, sequence_parallel=True))


def test_cp_zigzag_matches_megatron_get_batch_on_this_cp_rank(monkeypatch):
    """Our bshd CP split against megatron-core's own get_batch_on_this_cp_rank."""
    pytest.importorskip("megatron.core", reason="needs the trainer extra")
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    lay = align.Layout(lengths=(16, 11, 9), seq_len=16, padding="left")
    sample, pos = lay.grid()                         # [s, b]
    for cp in (2, 4):
        for r in range(cp):
            monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: cp)
            monkeypatch.setattr(ps, "get_context_parallel_rank", lambda: r)
            got = get_batch_on_this_cp_rank({"tokens": torch.from_numpy(pos.T.copy()),
                                             "labels": torch.from_numpy(sample.T.copy())})
            tm = align.token_map(lay, align.Shard(cp_size=cp, cp_rank=r))
            assert np.array_equal(tm.position, got["tokens"].numpy().T.reshape(-1))
            assert np.array_equal(tm.sample, got["labels"].numpy().T.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
       cp=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2, 4]), packed=st.booleans(),
       left=st.booleans())
def test_all_ranks_together_see_every_token_once(lengths, cp, tp, packed, left):
    mult = 2 * cp * tp
    if packed:
        lay = align.Layout.packed_from_lengths(lengths, multiple=mult)
    else:
        s = -(-max(max(lengths), 1) // mult) * mult
        lay = align.Layout(lengths=tuple(lengths), seq_len=s, padding="left" if left else "right")
    seen = []
    for c in range(cp):
        for t in range(tp):
            tm = align.token_map(lay, align.Shard(cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t,
                                                  sequence_parallel=True))
            seen += [(int(a), int(b)) for a, b in zip(tm.sample, tm.position) if a >= 0]
    want = [(j, p) for j, n in enumerate(lengths) for p in range(n)]
    assert sorted(seen) == sorted(want)


def _rows(schema, rows):
    return np.array(rows, dtype=np.int16).reshape(len(rows), 1, schema.top_k)


def test_check_rows_names_sample_position_layer(schema):
    tm = align.TokenMap(sample=np.array([0, 0, 1, -1]), position=np.array([0, 1, 5, -1]))
    ok = _rows(schema, [[0, 1, 2, 3], [4, 5, 6, 7], [-1] * 4, [-1] * 4])
    align.check_rows(ok, tm, schema, [2], ["s0", "s1"])
    # NOTE: range and distinctness are the source's checks (routereplay.source), made once
    # when it decodes or takes the ids; check_rows checks what the layout adds.
    align.check_rows(_rows(schema, [[0, 1, 2, 3], [4, 5, 6, 7], [9, 9, 1, 2], [-1] * 4]),
                     tm, schema, [2], ["s0", "s1"])
    cases = [
        ([[0, 1, -1, 3], [4, 5, 6, 7], [-1] * 4, [-1] * 4],
         "sample 's0', token position 0.*partly missing"),
        ([[0, 1, 2, 3], [4, 5, 6, 7], [-1] * 4, [1, 2, 3, 4]], "padding slot carries routing"),
    ]
    for rows, msg in cases:
        with pytest.raises(AlignmentError, match=msg):
            align.check_rows(_rows(schema, rows), tm, schema, [2], ["s0", "s1"])


def test_check_rows_group_limited_routing():
    schema = RoutingSchema(num_hidden_layers=2, moe_layer_ids=(0, 1), top_k=4, num_experts=16)
    tm = align.TokenMap(sample=np.array([0, 0]), position=np.array([3, 4]))
    # 4 groups of 4 experts, at most 2 groups per token
    ok = _rows(schema, [[0, 1, 4, 5], [8, 9, 10, 11]])
    align.check_rows(ok, tm, schema, [1], ["x"], num_groups=4, topk_group=2)
    bad = _rows(schema, [[0, 1, 4, 5], [0, 4, 8, 9]])
    with pytest.raises(AlignmentError, match="token position 4, decoder layer 1.*3 expert groups"):
        align.check_rows(bad, tm, schema, [1], ["x"], num_groups=4, topk_group=2)


def test_fill_dummy_gives_distinct_ids():
    ids = np.full((40, 2, 6), align.MISSING, np.int16)
    ids[3, 1] = [0, 1, 2, 3, 4, 5]
    out = align.fill_dummy(ids, 8)
    assert out.dtype == np.int16 and (out[3, 1] == ids[3, 1]).all()
    srt = np.sort(out, -1)
    assert (srt[..., 1:] != srt[..., :-1]).all() and out.min() >= 0 and out.max() < 8
    assert (ids[0] == align.MISSING).all()          # input untouched


def test_layout_errors():
    with pytest.raises(AlignmentError, match="seq_len is 4"):
        align.Layout(lengths=(5,), seq_len=4)
    with pytest.raises(AlignmentError, match="packed segment"):
        align.Layout(lengths=(5, 2), cu_seqlens_padded=(0, 4, 8))
    with pytest.raises(AlignmentError, match="multiple of 2\\*cp"):
        align.token_map(align.Layout(lengths=(5,), seq_len=6), align.Shard(cp_size=2))


def test_shard_and_row_shape_errors(schema):
    with pytest.raises(AlignmentError, match="cp_rank < cp_size"):
        align.Shard(cp_size=2, cp_rank=5)
    with pytest.raises(AlignmentError, match="tp_rank < tp_size"):
        align.Shard(tp_size=2, tp_rank=3, sequence_parallel=True)
    tm = align.TokenMap(sample=np.array([0, 1]), position=np.array([0, 0]))
    with pytest.raises(AlignmentError, match=r"shape \(2, 1, 3\), expected \[2, 1, 4\]"):
        align.check_rows(np.zeros((2, 1, 3), np.int64), tm, schema, [1], ["a", "b"])
    with pytest.raises(AlignmentError, match="names sample #1 but only 1 sample ids"):
        align.check_rows(np.full((2, 1, 4), -1, np.int64), tm, schema, [1], ["a"])


def test_fill_dummy_balances_experts():
    # issue 16 item 6: 30 dummy rows over 16 experts (top-4), rows scattered among routed
    # ones: every expert gets the same number of dummy assignments, +-1, in every layer
    ids = np.zeros((60, 2, 4), np.int64) + np.arange(4)
    ids[::2] = align.MISSING                                 # 30 rows without routing
    ids[1::4, 1] = align.MISSING                             # layer 1: 15 more
    out = align.fill_dummy(ids, 16)
    for layer in range(2):
        miss = (ids[:, layer] == align.MISSING).all(-1)
        counts = np.bincount(out[miss, layer].ravel(), minlength=16)
        assert counts.max() - counts.min() <= 1, (layer, counts)
    srt = np.sort(out, -1)
    assert (srt[..., 1:] != srt[..., :-1]).all()


def test_verl_thd_layout_and_contiguous_cp_split():
    """verl's THD packing (per-sequence alignment tp*cp*(2 if zigzag), FP8 last-sequence
    padding, min_local_rows) and the contiguous CP split of the padded buffer; bad input is
    refused by name (tests/test_verl.py checks the same against verl's own code)."""
    lay = align.verl_thd_layout([5, 3], tp=2, cp=2)                     # align 8
    assert lay.cu_seqlens_padded == (0, 8, 16)
    assert align.verl_thd_layout([5, 3], cp=2, cp_layout="contiguous").cu_seqlens_padded \
        == (0, 6, 10)
    assert align.verl_thd_layout([5, 3], tp=2, fp8=True).cu_seqlens_padded == (0, 16, 256)
    assert align.verl_thd_layout([5, 3], cp=4, cp_layout="contiguous",
                                 min_local_rows=10).cu_seqlens_padded == (0, 8, 40)
    c = align.verl_thd_layout([5, 3], cp=2, cp_layout="contiguous")
    r0, r1 = (align.token_map(c, align.Shard(cp_size=2, cp_rank=r, cp_layout="contiguous"))
              for r in (0, 1))
    assert r0.sample.tolist() == [0, 0, 0, 0, 0]
    assert r1.sample.tolist() == [-1, 1, 1, 1, -1] and r1.position.tolist()[1:4] == [0, 1, 2]
    with pytest.raises(AlignmentError, match="cp_layout must be 'zigzag' or 'contiguous'"):
        align.Shard(cp_layout="ring")
    with pytest.raises(AlignmentError, match="splits a packed \\(THD\\) buffer.*bshd"):
        align.token_map(align.Layout(lengths=(4, 4), seq_len=4),
                        align.Shard(cp_size=2, cp_layout="contiguous"))
    with pytest.raises(AlignmentError, match="need tp, cp >= 1"):
        align.verl_thd_layout([5], tp=0)


def test_nested_tensors_are_read_by_parts_not_as_arrays():
    torch = pytest.importorskip("torch")
    nt = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    assert [p.tolist() for p in align.jagged_parts(nt, "x")] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    assert align.jagged_parts(np.zeros(3), "x") is None
    with pytest.raises(AlignmentError, match="x is a nested \\(jagged\\) tensor"):
        align.host_array(nt, "x")
