"""Issue 28 item 3: ``fallback="dummy"`` ids spread over expert-parallel ranks.

The replayer fills the rows without routing with ``align.fill_dummy(ids, E,
mb.sample_ids, layer_ids, shard)`` (trainer_hooks/core/prefetch.py ``load``). These
tests lay out a step the way an RL trainer does (8 data-parallel ranks, each with its own
microbatches of padded or packed sequences), fill each rank's rows as the replayer does, and
count the dummy assignments each expert-parallel rank receives per layer from the 8 ranks'
concurrent microbatches, with experts split contiguously over EP=8 ranks as megatron does
(EP rank r holds experts ``[r*E/8, (r+1)*E/8)``). Before the fix every rank numbered its
dummy rows from expert 0 in every layer, so EP rank 0 received up to 100 % of them.
"""
import hashlib

import numpy as np
import pytest

from routereplay import align
from routereplay.align import MISSING, Layout, Shard

EP = 8
DP = 8
LAYERS = (1, 2, 3, 5)              # decoder layer ids of the chunk's MoE routers


def _rank_rows(layout: Layout, covered: list[tuple[int, int]], k: int, shard=Shard()):
    """ids [N, L, K] of one rank as the loader leaves them: sample j has routing for the
    positions ``covered[j]`` (hi exclusive), everything else (the last token, skipped prompt
    rows, padding) is MISSING."""
    tm = align.token_map(layout, shard)
    ids = np.full((tm.num_rows, len(LAYERS), k), MISSING, np.int16)
    have = np.zeros(tm.num_rows, bool)
    for j, (lo, hi) in enumerate(covered):
        have |= (tm.sample == j) & (tm.position >= lo) & (tm.position < hi)
    ids[have] = np.arange(k, dtype=np.int16)          # routed rows: any valid ids
    return ids


def _ep_load(microbatches, e: int, k: int) -> np.ndarray:
    """Dummy assignments per (layer, EP rank) of concurrent microbatches [(layout, covered,
    sample ids, shard), ...], filled as the replayer does; checks each row's ids."""
    load = np.zeros((len(LAYERS), EP), np.int64)
    for layout, covered, sids, shard in microbatches:
        ids = _rank_rows(layout, covered, k, shard)
        out = align.fill_dummy(ids, e, sids, LAYERS, shard)
        miss = (ids == MISSING).all(-1)
        assert (out[~miss] == ids[~miss]).all()
        srt = np.sort(out, -1)
        assert (srt[..., 1:] != srt[..., :-1]).all() and out.min() >= 0 and out.max() < e
        for li in range(len(LAYERS)):
            load[li] += np.bincount(out[miss[:, li], li].ravel() // (e // EP), minlength=EP)
    return load


def _hottest_share(load: np.ndarray) -> float:
    """Worst layer's share of the hottest EP rank in that layer's dummy assignments."""
    assert (load.sum(1) > 0).all()
    return float((load.max(1) / load.sum(1)).max())


def _sid(*parts) -> str:
    # RL frameworks key samples by opaque uids
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:16]


def _step(rng, packed: bool, seqs: int, skip_prompt: bool):
    """One step: per microbatch slot, the 8 DP ranks' concurrent microbatches."""
    slots = []
    for m in range(4):
        mbs = []
        for d in range(DP):
            lengths = tuple(int(x) for x in rng.integers(64, 768, seqs))
            if packed:
                layout = Layout.packed_from_lengths(lengths, multiple=8)
            else:
                layout = Layout(lengths=lengths, seq_len=-(-max(lengths) // 64) * 64)
            # the record covers the prompt (or the prompt after skipped rows) and the
            # response but the last token
            covered = [(int(rng.integers(1, 40)) if skip_prompt and j % 2 else 0, n - 1)
                       for j, n in enumerate(lengths)]
            mbs.append((layout, covered, [_sid(d, m, j) for j in range(seqs)], Shard()))
        slots.append(mbs)
    return slots


CASES = [(e, k) for e in (64, 128) for k in (8, 2)]


@pytest.mark.parametrize("e,k", CASES)
@pytest.mark.parametrize("packed,seqs,skip_prompt", [
    (False, 4, False),          # padded bshd: last tokens + right padding
    (True, 4, False),           # packed THD: last tokens + segment padding (multiple 8)
    (True, 8, True),            # packed, skipped prompt rows in every other sample
])
def test_dummy_rows_spread_over_ep_ranks(e, k, packed, seqs, skip_prompt):
    rng = np.random.default_rng(28 + e + k)
    worst = 0.0
    for slot in _step(rng, packed, seqs, skip_prompt):
        worst = max(worst, _hottest_share(_ep_load(slot, e, k)))
    assert worst <= 2 / EP, worst


@pytest.mark.parametrize("e,k", CASES + [(160, 6), (384, 8)])
def test_last_token_only_rows_spread_over_ep_ranks(e, k):
    # packed without segment padding: the only dummy rows are each sequence's last token
    # (E = 160 top-6: DeepSeek-V2; 384 top-8: Kimi K2)
    rng = np.random.default_rng(3)
    for m in range(4):
        slot = []
        for d in range(DP):
            lengths = tuple(int(x) for x in rng.integers(64, 768, 4))
            slot.append((Layout.packed_from_lengths(lengths), [(0, n - 1) for n in lengths],
                         [_sid(d, m, j) for j in range(4)], Shard()))
        load = _ep_load(slot, e, k)
        assert load.sum() == DP * 4 * len(LAYERS) * k
        assert _hottest_share(load) <= 2 / EP, load


@pytest.mark.parametrize("e,k", CASES)
@pytest.mark.parametrize("cp", [1, 2])
def test_whole_long_sequence_falls_back(e, k, cp):
    # long context: each DP rank's microbatch is one 16k-token sequence without any routing
    # (context parallel: each CP rank fills its zig-zag half)
    n = 16384
    slot = [(Layout(lengths=(n,), seq_len=n), [(0, 0)], [_sid("long", d)],
             Shard(cp_size=cp, cp_rank=r)) for d in range(DP) for r in range(cp)]
    load = _ep_load(slot, e, k)
    assert load.sum() == DP * n * len(LAYERS) * k
    # each call walks whole cycles of the experts: within 1 % of a fair share
    assert (load.max(1) / load.sum(1)).max() <= 1.01 / EP, load


@pytest.mark.parametrize("e", [64, 128])
def test_one_call_balances_every_power_of_two_ep(e):
    # any run of ep consecutive dummy assignments hits every EP rank once: one call's
    # per-EP-rank counts differ by at most 1, whatever the row count and start
    for k, n in ((8, 1), (2, 3), (2, 13), (1, 5), (6, 7)):
        out = align.fill_dummy(np.full((n, len(LAYERS), k), MISSING, np.int16), e, [_sid(n)],
                               LAYERS)
        for ep in (2, 4, 8, 16):
            for li in range(len(LAYERS)):
                c = np.bincount(out[:, li].ravel() // (e // ep), minlength=ep)
                assert c.max() - c.min() <= 1, (k, n, ep, li, c)


def test_layers_and_ranks_start_at_different_experts():
    # one dummy row per microbatch (the last token) must not start at one expert everywhere
    e, k = 128, 2
    firsts = set()
    for d in range(DP):
        ids = _rank_rows(Layout(lengths=(9,), seq_len=9), [(0, 8)], k)
        out = align.fill_dummy(ids, e, [_sid(d)], LAYERS)
        firsts |= {int(out[8, li, 0]) for li in range(len(LAYERS))}
    assert len(firsts) >= 24, firsts             # of 32 (rank, layer) pairs


def test_same_ids_on_ranks_that_see_the_same_rows():
    ids = _rank_rows(Layout(lengths=(40, 30), seq_len=48), [(5, 39), (0, 29)], 4)
    sids = ["a", "b"]
    base = align.fill_dummy(ids, 16, sids, LAYERS)
    # deterministic, and tensor-parallel ranks without sequence parallel see the same rows
    assert (align.fill_dummy(ids, 16, sids, LAYERS) == base).all()
    assert (align.fill_dummy(ids, 16, sids, LAYERS, Shard(tp_size=2, tp_rank=1)) == base).all()
    # a different layer id, microbatch or sequence-split rank starts elsewhere
    miss = (ids == MISSING).all(-1)
    for other in (align.fill_dummy(ids, 16, sids, (1, 2, 3, 6)),
                  align.fill_dummy(ids, 16, ["a", "c"], LAYERS),
                  align.fill_dummy(ids, 16, sids, LAYERS, Shard(cp_size=2, cp_rank=1))):
        assert (other[miss] != base[miss]).any()


def test_rule_as_documented():
    # pins the rule of fill_dummy's docstring, so the ids are the same on every process and
    # every run (the start is blake2b, not Python's salted hash())
    e, k = 8, 2
    ids = np.full((5, 2, k), MISSING, np.int64)
    ids[1] = [3, 4]                                  # a routed row, kept
    out = align.fill_dummy(ids, e, ["x", "y"], (4, 7), Shard(cp_size=2, cp_rank=1))
    order = np.array([0, 4, 2, 6, 1, 5, 3, 7])
    for li, lid in enumerate((4, 7)):
        h = hashlib.blake2b(b"x\0y\x011\x01" + str(lid).encode(), digest_size=8).digest()
        c = int.from_bytes(h, "little") % e
        for j, row in enumerate((0, 2, 3, 4)):
            assert out[row, li].tolist() == order[((c + j) * k + np.arange(k)) % e].tolist()
    assert out[1].tolist() == [[3, 4], [3, 4]]


def test_non_power_of_two_experts_and_bad_layer_ids():
    # E = 60 (Qwen1.5-MoE) and 160 (DeepSeek-V2), top-6 / top-4: distinct, in range, each
    # expert used equally (+-1) by one call's dummy rows
    for e, k in ((60, 4), (160, 6)):
        ids = np.full((1000, 1, k), MISSING, np.int16)
        out = align.fill_dummy(ids, e, ["s"], (3,))
        srt = np.sort(out, -1)
        assert (srt[..., 1:] != srt[..., :-1]).all() and out.min() >= 0 and out.max() < e
        counts = np.bincount(out.ravel(), minlength=e)
        assert counts.max() - counts.min() <= 1, counts
    with pytest.raises(align.AlignmentError, match="3 layer ids for rows of 2 layers"):
        align.fill_dummy(np.full((2, 2, 2), MISSING), 8, ["s"], (1, 2, 3))
