"""Tensor-native trainer input (issue 15 item 4): layouts from attention masks (left, right,
mixed padding, packed), routing sources built from a batch tensor ``routed_experts
[b, s, L, K]`` and from megatron-style per-layer lists, one id check for every source, and
the trainer-token check. numpy only (no megatron)."""
import dataclasses

import numpy as np
import pytest

from routereplay import align
from routereplay.errors import AlignmentError, RecordError, UnknownSampleError
from routereplay.source import (InMemorySource, TokenRowSource, as_source, checked_ids,
                                source_token_ids)
from tests.conftest import random_record

torch = pytest.importorskip("torch")

# verl's bshd batch: prompt left-padded to 4 columns, response right-padded to 4 columns
MASK = np.array([[0, 1, 1, 1, 1, 1, 0, 0],      # prompt 3, response 2
                 [1, 1, 1, 1, 1, 1, 1, 1],      # prompt 4, response 4
                 [0, 0, 1, 1, 1, 0, 0, 0]])     # prompt 2, response 1


def _gather(layout, source, layers, schema, sample_ids, shard=align.Shard()):
    tm = align.token_map(layout, shard)
    return align.gather_rows(tm, lambda j, runs: source.fetch(sample_ids[j], layers, runs),
                             len(layers), schema.top_k), tm


def test_layout_from_attention_mask_left_right_mixed_packed():
    right = align.Layout.from_attention_mask(np.array([[1, 1, 1, 0], [1, 1, 0, 0]]))
    assert (right.padding, right.lengths, right.seq_len) == ("right", (3, 2), 4)
    left = align.Layout.from_attention_mask(torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]]))
    assert (left.padding, left.lengths) == ("left", (3, 2))
    mixed = align.Layout.from_attention_mask(MASK.astype(bool))
    assert (mixed.padding, mixed.offsets, mixed.lengths) == ("mixed", (1, 0, 2), (5, 8, 3))
    # router row c * b + j holds column c of sample j, position = column - offset
    tm = align.token_map(mixed)
    sample = tm.sample.reshape(8, 3).T
    pos = tm.position.reshape(8, 3).T
    assert (sample >= 0).tolist() == MASK.astype(bool).tolist()
    assert pos[0].tolist() == [-1, 0, 1, 2, 3, 4, -1, -1]
    assert pos[2].tolist() == [-1, -1, 0, 1, 2, -1, -1, -1]
    packed = align.Layout.from_attention_mask(MASK, packed=True, multiple=4)
    assert packed.cu_seqlens_padded == (0, 8, 16, 20) and packed.lengths == (5, 8, 3)


@pytest.mark.parametrize("mask, why", [
    (np.array([[1, 0, 1, 1]]), "row 0: its real tokens are not contiguous (column 1"),
    (np.ones((2, 1, 4, 4), bool), "the 4-D [b, 1, s, s] mask is not accepted"),
    (np.array([[1, 1, 2, 2, 0]]), "segment-id mask"),
])
def test_layout_from_attention_mask_refuses(mask, why):
    with pytest.raises(AlignmentError, match=None) as e:
        align.Layout.from_attention_mask(mask)
    assert why in str(e.value)


def test_mixed_layout_needs_offsets_and_they_must_fit():
    with pytest.raises(AlignmentError, match="offsets are given with padding='mixed'"):
        align.Layout(lengths=(2,), seq_len=4, padding="mixed")
    with pytest.raises(AlignmentError, match=r"sample #0 at columns \[3, 5\) does not fit"):
        align.Layout(lengths=(2,), seq_len=4, padding="mixed", offsets=(3,))


def _verl_batch(schema, seed=0, full_layers=True, dtype=np.int16):
    """A verl-style batch: routed_experts [b, s, L, K] aligned with input_ids, rows of
    padding and of each row's last real token zero (no routing)."""
    rng = np.random.default_rng(seed)
    b, s = MASK.shape
    n_layers = schema.num_hidden_layers if full_layers else schema.num_moe_layers
    routed = np.zeros((b, s, n_layers, schema.top_k), dtype)
    moe = list(schema.moe_layer_ids) if full_layers else list(range(schema.num_moe_layers))
    want = {}
    lay = align.Layout.from_attention_mask(MASK)
    for j, (a, n) in enumerate(zip(lay.columns(), lay.lengths)):
        ids = np.argsort(rng.random((n - 1, schema.num_moe_layers, schema.num_experts)), -1)
        ids = ids[..., :schema.top_k]
        routed[j, a:a + n - 1][:, moe] = ids
        want[j] = ids
    input_ids = rng.integers(3, 500, (b, s)) * MASK
    return routed, input_ids, want


def test_from_batch_engine_layout_strips_dense_layers_and_replays_exactly(schema):
    routed, input_ids, want = _verl_batch(schema)
    ids = [f"u{j}" for j in range(3)]
    src = InMemorySource.from_batch(torch.from_numpy(routed), torch.from_numpy(MASK), ids,
                                    schema, input_ids=torch.from_numpy(input_ids))
    lay = align.Layout.from_attention_mask(MASK)
    for j, sid in enumerate(ids):
        rec = src.record(sid)
        assert rec.expert_ids.dtype == schema.id_dtype and rec.start == 0
        assert (rec.expert_ids == want[j]).all()
        a, n = lay.columns()[j], lay.lengths[j]
        assert (source_token_ids(src, sid) == input_ids[j, a:a + n]).all()
    # the trainer's bshd batch as it is: every real token but the last replays its column
    got, tm = _gather(lay, src, [0, 1, 2], schema, ids)
    for r in range(tm.num_rows):
        j, p = tm.sample[r], tm.position[r]
        if j < 0 or p == lay.lengths[j] - 1:
            assert (got[r] == align.MISSING).all()
        else:
            assert (got[r] == want[j][p]).all()
    # the same batch packed (THD) by the trainer: same rows by (sample, position)
    packed = align.Layout.from_attention_mask(MASK, packed=True, multiple=4)
    gp, tp = _gather(packed, src, [2], schema, ids)
    for r in range(tp.num_rows):
        j, p = tp.sample[r], tp.position[r]
        if j >= 0 and p < packed.lengths[j] - 1:
            assert (gp[r, 0] == want[j][p, 2]).all()


def test_from_batch_moe_axis_routing_mask_and_refusals(schema):
    routed, _, want = _verl_batch(schema, full_layers=False, dtype=np.int64)
    ids = ["a", "b", "c"]
    # skipped prompt rows: routing only from the prompt's last token on (row 1: position 3)
    rmask = np.zeros_like(MASK)
    rmask[1, 3:7] = 1
    rmask[0, 1:5] = 1
    rmask[2, 2:4] = 1
    src = InMemorySource.from_batch(routed, MASK, ids, schema, routing_mask=rmask)
    assert src.record("b").start == 3 and (src.record("b").expert_ids == want[1][3:7]).all()
    # dense layer holding routing in the engine layout: the schema does not match the model
    full, _, _ = _verl_batch(schema)
    full[1, 2, 0] = [1, 2, 3, 4]
    with pytest.raises(RecordError, match=r"sample 'b', token 2, layer 0: the engine routed"):
        InMemorySource.from_batch(full, MASK, ids, schema)
    bad = routed.copy()
    bad[2, 3, 1, 0] = 300                  # int64 id that uint8 would wrap to 44
    with pytest.raises(RecordError, match=r"sample 'c', token 1, layer 2: expert id 300 "):
        InMemorySource.from_batch(bad, MASK, ids, schema)
    zero = routed.copy()
    zero[0, 3] = 0                         # a zero row inside the routed region
    with pytest.raises(RecordError, match=r"sample 'a', token 2, layer 1: duplicate expert "
                                          r"ids \[0, 0, 0, 0\].*capturer was never bound"):
        InMemorySource.from_batch(zero, MASK, ids, schema)
    with pytest.raises(AlignmentError, match="routed_experts has 5 layers"):
        InMemorySource.from_batch(np.zeros((3, 8, 5, 4), np.int16), MASK, ids, schema)
    hole = rmask.copy()
    hole[1, 5] = 0
    with pytest.raises(AlignmentError, match=r"sample 'b', token position 5: no routing "
                                             "between routed positions"):
        InMemorySource.from_batch(routed, MASK, ids, schema, routing_mask=hole)
    pad = rmask.copy()
    pad[2, 7] = 1
    with pytest.raises(AlignmentError, match="sample 'c': routing_mask marks column 7, a "
                                             "padding column"):
        InMemorySource.from_batch(routed, MASK, ids, schema, routing_mask=pad)
    with pytest.raises(RecordError, match="sample 'b' given twice"):
        InMemorySource.from_batch(routed, MASK, ["a", "b", "b"], schema)
    with pytest.raises(AlignmentError, match="float"):
        InMemorySource.from_batch(routed.astype(np.float32), MASK, ids, schema)


def test_one_id_check_for_every_source(schema):
    """The dict path narrows any integer width after a range check (it took int64 without
    a check before); a sidecar-style uint8 record passes unchanged."""
    r = random_record(schema, "x", 9, 3)
    wide = dataclasses.replace(r, expert_ids=r.expert_ids.astype(np.int64))
    src = as_source({"x": wide}, schema)
    assert src.record("x").expert_ids.dtype == np.uint8
    assert (src.record("x").expert_ids == r.expert_ids).all()
    assert checked_ids(r.expert_ids, schema, "x") is r.expert_ids
    neg = wide.expert_ids.copy()
    neg[5, 0, 2] = -1
    with pytest.raises(RecordError, match=r"sample 'x', token 5, layer 1: expert id -1 outside"):
        as_source({"x": dataclasses.replace(r, expert_ids=neg)}, schema)
    with pytest.raises(RecordError, match="expected integer"):
        as_source({"x": dataclasses.replace(r, expert_ids=neg.astype(np.float64))}, schema)


def test_token_check_names_sample_and_first_differing_position(schema):
    routed, input_ids, _ = _verl_batch(schema)
    ids = ["a", "b", "c"]
    src = InMemorySource.from_batch(routed, MASK, ids, schema, input_ids=input_ids)
    lay = align.Layout.from_attention_mask(MASK)
    toks = align.tokens_by_sample(lay, input_ids)
    assert align.check_tokens(lay, toks, ids, lambda j: src.token_ids(ids[j])) == 3
    shifted = input_ids.copy()
    shifted[1, 1:] = input_ids[1, :-1]              # row 1 shifted right by one column
    shifted[1, 0] = 7
    with pytest.raises(AlignmentError, match=r"sample 'b', token position 0: the trainer has "
                                             r"token id 7"):
        align.check_tokens(lay, align.tokens_by_sample(lay, shifted), ids,
                           lambda j: src.token_ids(ids[j]))
    # per-sample sequences; a trainer sequence longer than the record
    longer = [np.append(t, 9) for t in toks]
    lay2 = align.Layout.packed_from_lengths([6, 9, 4])
    with pytest.raises(AlignmentError, match=r"sample 'a', token position 5: the trainer has "
                                             "6 tokens, the record ends at 5"):
        align.check_tokens(lay2, align.tokens_by_sample(lay2, longer), ids,
                           lambda j: src.token_ids(ids[j]))
    no_tok = InMemorySource.from_batch(routed, MASK, ids, schema)
    with pytest.raises(AlignmentError, match="sample 'a': the routing source holds no token ids"):
        align.check_tokens(lay, toks, ids, lambda j: source_token_ids(no_tok, ids[j]))
    with pytest.raises(AlignmentError, match=r"tokens \(3, 7\) do not match"):
        align.tokens_by_sample(lay, input_ids[:, :7])
    # per-sample sequences cannot say where the samples sit in a padded batch: a layout
    # with the wrong padding side would pass (the framework review's silent 5.5-nat replay)
    wrong_side = align.Layout(lengths=lay.lengths, seq_len=lay.seq_len)      # right padding
    with pytest.raises(AlignmentError, match="per-sample sequences cannot check a padded"):
        align.tokens_by_sample(wrong_side, toks)
    with pytest.raises(AlignmentError, match="per-sample sequences cannot check a padded"):
        align.tokens_by_sample(lay, toks)


def test_token_row_source_from_megatron_lists_rekeys_by_sample(schema):
    """Per-layer lists of one microbatch (two samples, mixed padding, SP over 2 ranks)
    replayed in another split (each sample alone, packed): same rows by (sample, position);
    -1 rows fall back; rows never added are an error naming sample, position and layer."""
    recs = [random_record(schema, "p", 7, 1), random_record(schema, "q", 5, 2)]
    mask = np.array([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0]])
    lay = align.Layout.from_attention_mask(mask)
    mem = InMemorySource(recs, schema)
    src = TokenRowSource(schema)
    for tp_rank in (0, 1):
        shard = align.Shard(tp_size=2, tp_rank=tp_rank, sequence_parallel=True)
        rows, tm = _gather(lay, mem, [0, 2], schema, ["p", "q"], shard)
        per_layer = [torch.from_numpy(rows[:, i].astype(np.int64)) for i in range(2)]
        src.add_layer_lists(["p", "q"], lay, per_layer, [0, 2], shard)
    for j, r in enumerate(recs):
        alone = align.Layout.packed_from_lengths([lay.lengths[j]], multiple=4)
        got, tm = _gather(alone, src, [2, 0], schema, [r.sample_id])
        real = tm.sample >= 0
        n = r.num_tokens
        assert (got[:n, :, :] == r.expert_ids[:, [2, 0]]).all()
        assert (got[n:][real[n:]] == align.MISSING).all()        # last token: fallback
    with pytest.raises(AlignmentError, match=r"sample 'p', token position 0, decoder layer 2:"
                                             " no row was recorded for it on this rank"):
        src.fetch("p", [1], [(0, 3)])
    with pytest.raises(UnknownSampleError):
        src.fetch("nope", [0], [(0, 3)])
    bad = [np.zeros((8, 4), np.int64)] * 2
    with pytest.raises(AlignmentError, match=r"per-layer tensor #0 \(MoE layer 0\) is \(8, 4\),"
                                             r" expected \[16 router rows"):
        TokenRowSource(schema).add_layer_lists(["p", "q"], lay, bad, [0, 2])
