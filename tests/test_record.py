import numpy as np
import pytest

from routereplay.errors import RecordError
from routereplay.record import RoutingRecord
from tests.conftest import random_record


def test_valid_record_passes(schema):
    random_record(schema, "a", 20, 0).validate(schema)


def test_out_of_range_names_sample_token_layer(schema):
    r = random_record(schema, "s7", 20, 1)
    r.ids[5, 2, 1] = 16
    r.ids[5, 2, 0] = 3 if r.ids[5, 2, 1] != 3 else 4
    with pytest.raises(RecordError, match=r"sample 's7', token 5, layer 3: expert id 16"):
        r.validate(schema)


def test_duplicate_ids_and_all_zero_hint(schema):
    r = random_record(schema, "z", 10, 2)
    r.ids[3, 0] = 0
    with pytest.raises(RecordError, match=r"token 3, layer 1: duplicate .*capturer was never bound"):
        r.validate(schema)


def test_row_count_must_match_tokens(schema):
    r = random_record(schema, "n", 10, 3)
    r.ids = r.ids[:-1]
    with pytest.raises(RecordError, match=r"sample 'n': 8 routing rows but 10 tokens"):
        r.validate(schema)


def test_logprob_count(schema):
    r = random_record(schema, "lp", 10, 4, prompt_len=4)
    r.logprobs = r.logprobs[:-1]
    with pytest.raises(RecordError, match="5 log-probs for 6 generated tokens"):
        r.validate(schema)


def test_wrong_layer_axis(schema):
    r = random_record(schema, "w", 10, 5)
    r.ids = np.concatenate([np.zeros_like(r.ids[:, :1]), r.ids], 1)   # dense layer kept
    with pytest.raises(RecordError, match="does not match the schema"):
        r.validate(schema)
