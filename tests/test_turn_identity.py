"""Multi-turn merges check token identity (issue 28 item 4) and say how rows are compared
(item 9): a later turn whose prompt re-renders or branches from the earlier turn's sequence
is asked from the longest common prefix (next_start with the new prompt) and merged exactly,
or refused naming what was found and where; turns without token ids are merged only when the
caller states that they extend each other."""
from __future__ import annotations

import numpy as np
import pytest

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema

# Qwen3's chat template drops the reasoning of assistant turns before the last one; this
# is that rule in the tiny model's ChatML template (a real jinja template, rendered by
# transformers' apply_chat_template).
RERENDERING_TEMPLATE = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCHEMA = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4, num_experts=16)


def _rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n, SCHEMA.num_moe_layers, SCHEMA.num_experts)), axis=-1)
    return ids[..., :SCHEMA.top_k].astype(SCHEMA.id_dtype)


def _turn(sid: str, toks, rows: np.ndarray, start: int, prompt_len: int) -> RoutingRecord:
    """A turn's record: rows [start, len(toks) - 1) of ``rows`` (the routing of ``toks``)."""
    toks = np.asarray(toks, np.int32)
    r = RoutingRecord(sid, rows[start:len(toks) - 1].copy(), start=start, prompt_len=prompt_len,
                      token_ids=toks, weight_versions=[WeightVersionSpan("v0", 0, len(toks))])
    r.validate(SCHEMA)
    return r


@pytest.fixture(scope="module")
def rerendered(tiny_model):
    """Two turns of a chat whose template re-renders turn 1 in turn 2's prompt, and the HF
    routing (fp32 forward of the tiny Qwen3-MoE) of both turns' whole sequences."""
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_records
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def render(msgs):
        return list(tok.apply_chat_template(msgs, chat_template=RERENDERING_TEMPLATE,
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
    end = tok.encode("<|im_end|>")
    m1 = [{"role": "user", "content": "Hello world! This tokenizer was trained."}]
    p1 = render(m1)
    a1 = "<think>a tiny corpus for a tiny model</think>Hello world!"
    seq1 = p1 + tok.encode(a1) + end                          # turn 1 as sampled
    p2 = render(m1 + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "This tokenizer?"}])
    seq2 = p2 + tok.encode("A tiny model.") + end
    schema, (h1, h2) = hf_records(tiny_model, [seq1, seq2], prompt_len=len(p1))
    return dict(p1=p1, seq1=seq1, p2=p2, seq2=seq2, schema=schema, rows1=h1.expert_ids,
                rows2=h2.expert_ids)


def test_rerendered_turn_is_asked_from_the_common_prefix_and_merged_exactly(rerendered):
    from routereplay.multi_turn import common_prefix_len, merge_segments, next_start
    c = rerendered
    q = common_prefix_len(c["seq1"], c["p2"])
    assert q == len(c["p1"]) < len(c["seq1"]) - 1         # the template dropped <think> there
    t1 = RoutingRecord("turn1", c["rows1"].copy(), prompt_len=len(c["p1"]),
                       token_ids=np.asarray(c["seq1"], np.int32))
    # the old start: the previous turn's end, 16 positions past where the prompts part
    assert next_start(t1) == len(c["seq1"]) - 1
    s = next_start(t1, c["p2"])
    assert s == q
    t2 = RoutingRecord("turn2", c["rows2"][s:].copy(), start=s, prompt_len=len(c["p2"]),
                       token_ids=np.asarray(c["seq2"], np.int32))
    t1.validate(c["schema"]), t2.validate(c["schema"])
    conv = merge_segments([t2, t1], "conv")
    assert conv.start == 0 and conv.token_ids.tolist() == c["seq2"]
    np.testing.assert_array_equal(conv.expert_ids, c["rows2"])      # the conversation's routing
    assert conv.recomputed == []
    # turn 2 asked from the old start: rows [q, old) of the conversation exist in no turn
    # (turn 1's there route the <think> tokens); refused, saying what was found and where
    old = next_start(t1)
    t2_old = RoutingRecord("turn2", c["rows2"][old:].copy(), start=old, prompt_len=len(c["p2"]),
                           token_ids=np.asarray(c["seq2"], np.int32))
    with pytest.raises(RecordError) as e:
        merge_segments([t1, t2_old], "conv")
    msg = str(e.value)
    assert f"[({q}, {old})]" in msg and f"differ from position {q}" in msg
    assert "re-rendered or branched prefix" in msg and "next_start(previous, new_prompt_ids)" in msg
    # without token ids the merge cannot see any of this: refused unless the caller states it
    bare = [RoutingRecord(r.sample_id, r.expert_ids, start=r.start, prompt_len=r.prompt_len)
            for r in (t1, t2_old)]
    with pytest.raises(RecordError, match=r"turns \['turn1', 'turn2'\] have no token ids.*"
                                          r"assume_extends=True"):
        merge_segments(bare, "conv")
    stitched = merge_segments(bare, "conv", assume_extends=True)    # the caller's statement
    assert (stitched.expert_ids[q:old] != c["rows2"][q:old]).any()   # ... and what a false one costs


def test_branched_turns_are_used_up_to_the_branch_point_or_refused():
    from routereplay.multi_turn import merge_segments, next_start
    rng = np.random.default_rng(5)
    base = rng.integers(0, 500, 30)
    rows = _rows(60, 1)
    t1 = _turn("t1", base, rows, 0, 10)                              # rows [0, 29)
    branch = np.concatenate([base[:20], rng.integers(500, 900, 25)])  # leaves t1 at 20
    rows_b = rows.copy()
    rows_b[20:] = _rows(60, 2)[20:]                                  # its own routing from 20
    s = next_start(t1, branch[:35])
    assert s == 20
    t2 = _turn("t2", branch, rows_b, s, 35)
    m = merge_segments([t1, t2], "conv")
    np.testing.assert_array_equal(m.expert_ids, rows_b[:44])
    assert m.recomputed == [] and m.token_ids.tolist() == branch.tolist()
    assert [(v.version, v.start, v.end) for v in m.weight_versions] == [("v0", 0, 20),
                                                                        ("v0", 20, 44)]
    with pytest.raises(RecordError, match=r"\[\(20, 29\)\].*differ from position 20"):
        merge_segments([t1, _turn("t2", branch, rows_b, 29, 35)], "conv")
    # a sibling of turn 2 (leaves it at 40) whose rows before 40 are turn 2's: another branch
    sib = np.concatenate([branch[:40], rng.integers(900, 999, 3)])
    with pytest.raises(RecordError, match=r"turn 'sib'.*differ from position 40.*gives the "
                                          r"conversation no row\): not a turn"):
        merge_segments([t1, t2, _turn("sib", sib, rows_b, 25, 35)], "conv")
    twin = np.concatenate([branch[:40], rng.integers(900, 999, 5)])     # as long as turn 2
    with pytest.raises(RecordError, match=r"turns 't2' and 'twin' both reach position 44 with "
                                          r"different tokens \(from position 40\)"):
        merge_segments([t1, t2, _turn("twin", twin, rows_b, 25, 35)], "conv")


def test_assume_extends_trusts_bare_turns_but_still_checks_token_ids():
    from routereplay.multi_turn import merge_segments
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 500, 31)
    rows = _rows(30, 3)
    a = RoutingRecord("a", rows[:12].copy())                         # no token ids
    b = _turn("b", toks, rows, 8, 20)
    m = merge_segments([b, a], "conv", assume_extends=True)
    np.testing.assert_array_equal(m.expert_ids, rows)
    other = toks.copy()
    other[3] += 1
    c = _turn("c", other[:15], rows, 0, 10)
    with pytest.raises(RecordError, match=r"turn 'c'.*not a prefix.*position 3.*not a turn"):
        merge_segments([a, b, c], "conv", assume_extends=True)
    assert merge_segments([a], "one").expert_ids.shape == (12, 3, 4)    # one turn: nothing to check


def test_next_start_with_the_new_prompt():
    from routereplay.multi_turn import next_start
    toks = np.arange(10, 30)
    t = _turn("t", toks, _rows(40, 0), 0, 12)
    assert next_start(t, np.concatenate([toks, [7, 8]])) == next_start(t) == 19   # extends it
    assert next_start(t, toks[:8]) == 7              # a shorter prompt: its last token is computed
    assert next_start(t, np.concatenate([toks[:5], [0, 1, 2]])) == 5
    later = _turn("t3", toks, _rows(40, 0), 15, 12)
    assert next_start(later, np.concatenate([toks[:5], [0]])) == 5    # before the turn's own start
    with pytest.raises(RecordError, match="'bare': no token ids"):
        next_start(RoutingRecord("bare", t.expert_ids), toks)


def test_recomputed_spans_compare_slots_or_sets():
    from routereplay.multi_turn import merge_segments
    rng = np.random.default_rng(11)
    toks = rng.integers(0, 500, 41)
    rows = _rows(40, 4)
    again = rows.copy()
    again[0:13] = again[0:13, :, ::-1]                   # 13 rows: the same experts, other order
    sets = np.zeros(40, bool)
    sets[13:29] = True                                   # 16 rows: another expert in layer 1
    again[13:29, 1, 0] = [next(e for e in range(16) if e not in row) for row in rows[13:29, 1]]
    t1 = _turn("t1", toks[:30], rows, 0, 10)
    t2 = _turn("t2", toks, again, 0, 10)                 # resent in full after an update
    by_slot = merge_segments([t1, t2], "conv")
    by_set = merge_segments([t1, t2], "conv", compare="set")
    assert by_slot.recomputed == [(0, 29)] and sum(b - a for a, b in by_slot.recomputed) == 29
    assert by_set.recomputed == [(13, 29)] and sum(b - a for a, b in by_set.recomputed) == 16
    np.testing.assert_array_equal(by_slot.expert_ids, by_set.expert_ids)
    np.testing.assert_array_equal(by_slot.expert_ids[:29], rows[:29])    # turn 1's rows kept
    with pytest.raises(RecordError, match="compare must be one of"):
        merge_segments([t1, t2], "conv", compare="sorted")
