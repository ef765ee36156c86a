"""errors.py's promise (issue 13 item 5): bad input to the core's public API raises a
RouteReplayError subclass (some also derive from the builtin they replaced: KeyError,
ValueError), never a bare builtin (TypeError, AttributeError, IndexError, ...)."""
import io

import numpy as np
import pytest

from routereplay import codec, metrics
from routereplay.convert import iter_records, parse_layers, schema_from_args, to_record
from routereplay.errors import RouteReplayError
from routereplay.record import RoutingRecord, WeightVersionSpan, checked_moe_ids
from routereplay.schema import RoutingSchema, schema_layers_for
from routereplay.sidecar import (MultiSidecarReader, SidecarReader, SidecarWriter,
                                 open_sidecar, write_records, writer_codec)
from routereplay.source import InMemorySource, NoRouting, as_source
from tests.conftest import random_record

S = RoutingSchema(4, (1, 2, 3), 4, 16)


def _rec(**kw):
    r = random_record(S, "r", 12, 1)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _stream():
    return write_records(None, S, [random_record(S, "a", 12, 1)]).getvalue()


BAD_CALLS = {
    # schema
    "schema top_k str": lambda: RoutingSchema(4, (1,), "4", 16),
    "schema num_experts None": lambda: RoutingSchema(4, (1,), 2, None),
    "schema layers not ints": lambda: RoutingSchema(4, ("a",), 2, 16),
    "schema layers None": lambda: RoutingSchema(4, None, 2, 16),
    "schema num_hidden_layers str": lambda: RoutingSchema("4", (1,), 2, 16),
    "schema score": lambda: RoutingSchema(4, (1,), 2, 16, score_function=3),
    "from_dict list": lambda: RoutingSchema.from_dict([1, 2]),
    "from_dict missing": lambda: RoutingSchema.from_dict({"top_k": 2}),
    "from_dict bad layers": lambda: RoutingSchema.from_dict(
        {"num_hidden_layers": 4, "moe_layer_ids": 7, "top_k": 2, "num_experts": 8}),
    "from_hf_config int": lambda: RoutingSchema.from_hf_config(5),
    "from_hf_config missing file": lambda: RoutingSchema.from_hf_config("/nonexistent/x"),
    "from_hf_config str layers": lambda: RoutingSchema.from_hf_config(
        {"num_hidden_layers": "4", "num_experts": 8, "num_experts_per_tok": 2}),
    "from_hf_config str experts": lambda: RoutingSchema.from_hf_config(
        {"num_hidden_layers": 4, "num_experts": "8", "num_experts_per_tok": 2}),
    "schema_layers_for dense": lambda: schema_layers_for(S, [0]),
    "schema_layers_for str": lambda: schema_layers_for(S, ["x"]),
    "check_same other type": lambda: S.check_same("not a schema"),
    "strip_dense list": lambda: S.strip_dense([[1]]),
    # records
    "record ids list": lambda: _rec(expert_ids=[[1, 2]]).validate(S),
    "record ids None": lambda: RoutingRecord("x", None).validate(S),
    "record token_ids strs": lambda: _rec(token_ids=np.array(["a"] * 12)).validate(S),
    "record token_ids list": lambda: _rec(token_ids=[1, 2, 3]).validate(S),
    "record logprobs list": lambda: _rec(logprobs=["x"]).validate(S),
    "record start str": lambda: _rec(start="0").validate(S),
    "record prompt_len float": lambda: _rec(prompt_len=2.5).validate(S),
    "record spans bad objects": lambda: _rec(weight_versions=[("v", 0, 3)]).validate(S),
    "record spans bad ints": lambda: _rec(weight_versions=[WeightVersionSpan("v", "a", 3)]
                                          ).validate(S),
    "record recomputed ints": lambda: _rec(recomputed=[5]).validate(S),
    "record engine int": lambda: _rec(engine=3).validate(S),
    "checked_moe_ids list": lambda: checked_moe_ids([[[1]]], S, "x"),
    "checked_moe_ids float": lambda: checked_moe_ids(np.zeros((2, 4, 4)), S, "x"),
    # sources
    "InMemorySource int": lambda: InMemorySource(5, S),
    "InMemorySource list of ints": lambda: InMemorySource([1, 2], S),
    "InMemorySource unknown": lambda: InMemorySource({}, S).fetch("x", [0], [(0, 1)]),
    "InMemorySource bad runs": lambda: InMemorySource([random_record(S, "a", 12, 1)], S).fetch(
        "a", [0], [(0,)]),
    "InMemorySource bad layers": lambda: InMemorySource([random_record(S, "a", 12, 1)], S).fetch(
        "a", [7], [(0, 3)]),
    "as_source int": lambda: as_source(5, S),
    "NoRouting bad runs": lambda: NoRouting(S).fetch("a", [0], [5]),
    # sidecar
    "reader int": lambda: SidecarReader(5),
    "reader missing path": lambda: SidecarReader("/nonexistent/s.rrsc"),
    "reader garbage": lambda: SidecarReader(b"garbage" * 10),
    "reader empty": lambda: SidecarReader(b""),
    "read unknown": lambda: SidecarReader(_stream()).read("nope"),
    "read layers str": lambda: SidecarReader(_stream()).read("a", moe_layers=["x"]),
    "read layers range": lambda: SidecarReader(_stream()).read("a", moe_layers=[9]),
    "read tokens short": lambda: SidecarReader(_stream()).read("a", tokens=(1,)),
    "read tokens str": lambda: SidecarReader(_stream()).read("a", tokens=("a", "b")),
    "fetch runs bad": lambda: SidecarReader(_stream()).fetch("a", [0], [(1,)]),
    "fetch runs none": lambda: SidecarReader(_stream()).fetch("a", [0], None),
    "writer dest int": lambda: SidecarWriter(5, S),
    "writer schema none": lambda: SidecarWriter(None, None),
    "writer codec": lambda: SidecarWriter(None, S, codec="nope"),
    "writer fsync": lambda: SidecarWriter(None, S, fsync="sometimes"),
    "writer max_queue": lambda: SidecarWriter(None, S, max_queue=0),
    "writer extra not json": lambda: SidecarWriter(None, S, extra_header={"x": object()}),
    "write non record": lambda: SidecarWriter(None, S).write("record"),
    "write bad id": lambda: SidecarWriter(None, S).write(_rec(sample_id=5)),
    "writer_codec": lambda: writer_codec("nope"),
    "multi empty list": lambda: MultiSidecarReader([]),
    "multi int": lambda: MultiSidecarReader(5),
    "open_sidecar int": lambda: open_sidecar(5),
    # codec
    "encode list": lambda: codec.encode([[[1]]]),
    "encode float": lambda: codec.encode(np.zeros((2, 1, 2)), "ctx-zstd", 8),
    "encode unknown": lambda: codec.encode(np.zeros((2, 1, 2), np.uint8), "nope", 8),
    "encode no experts": lambda: codec.encode(np.zeros((2, 1, 2), np.uint8), "ctx-zstd"),
    "encode out of range": lambda: codec.encode(np.full((2, 1, 2), 9, np.uint8), "ctx-zstd", 8),
    "encode removed": lambda: codec.encode(np.zeros((2, 1, 2), np.uint8), "ctx-ans", 8),
    "writer removed codec": lambda: SidecarWriter(None, S, codec="xl-ans"),
    "decode unknown": lambda: codec.decode(b"x", "nope", (1, 1, 1), np.uint8, 8),
    "decode garbage": lambda: codec.decode(b"xyz", "ctx-zstd", (1, 1, 1), np.uint8, 8),
    "decode shape": lambda: codec.decode(b"", "raw-lm", (1, 1), np.uint8, 8),
    # convert
    "parse_layers": lambda: parse_layers("1-x"),
    "schema_from_args none": lambda: schema_from_args(),
    "to_record float": lambda: to_record("x", np.zeros((3, 4, 4)), S),
    "to_record list": lambda: to_record("x", [[1]], S),
    "iter_records kind": lambda: list(iter_records("nope", "x", S)),
    "iter_records missing": lambda: list(iter_records("npy", "/nonexistent.npy", S)),
    # metrics / verify
    "agreement shapes": lambda: metrics.routing_agreement(np.zeros((2, 1, 2)), np.zeros((3, 1, 2))),
    "logprob strs": lambda: metrics.logprob_metrics(["a"]),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_raises_our_errors(name):
    with pytest.raises(RouteReplayError):
        BAD_CALLS[name]()


def test_errors_keep_their_builtin_bases():
    from routereplay.errors import ConfigError, UnknownSampleError
    with pytest.raises(KeyError):
        SidecarReader(_stream()).read("nope")
    with pytest.raises(ValueError):
        writer_codec("nope")
    assert issubclass(UnknownSampleError, KeyError) and issubclass(ConfigError, ValueError)
    with pytest.raises(io.UnsupportedOperation.__mro__[1]):   # OSError: not our business
        SidecarWriter("/nonexistent-dir/x.rrsc", S)
