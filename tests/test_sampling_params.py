"""Issue 28 item 8: records carry the sampling parameters behind their log-probs, through
both formats and the spec reader, from vLLM's SamplingParams; `verify` compares like with
like (the engine's transform applied to the trainer's logits) or refuses with the reason."""
import math
import struct

import numpy as np
import pytest

from routereplay import verify
from routereplay.errors import AlignmentError, RecordError, SidecarError
from routereplay.record import RoutingRecord, SamplingInfo, sampling_from_sglang
from routereplay.schema import RoutingSchema
from routereplay.sidecar import write_records
from routereplay.sidecar.legacy import decode_payload_v2
from routereplay.sidecar.payload import encode_record_payload
from routereplay.sidecar.record_meta import decode_head, encode_meta, head_length
from tests import crafted
from tests import spec_reader

SCHEMA = RoutingSchema(4, (1, 2, 3), 2, 8)
SMP = SamplingInfo("processed_logprobs", temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                   processors=("repetition_penalty",))


def _record(sid="a", sampling=SMP, n=10, p=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n - 1, 3, 8)), -1)[..., :2].astype(np.uint8)
    return RoutingRecord(sid, ids, prompt_len=p, token_ids=rng.integers(0, 100, n).astype(np.int32),
                         logprobs=-rng.random(n - p).astype(np.float32), sampling=sampling)


# --------------------------------------------------------------------------- the field

@pytest.mark.parametrize("kw, what", [
    ({"top_p": float("nan")}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"min_p": 2.0}, "min_p"), ({"top_k": True}, "top_k"), ({"top_k": -1}, "top_k"),
    ({"top_k": 1 << 31}, "top_k"), ({"temperature": "0.7"}, "temperature"),
    ({"processors": tuple(f"p{i}" for i in range(17))}, "processors"),
    ({"processors": ("a", "a")}, "repeat"), ({"processors": ("",)}, "processor name"),
    ({"processors": ("x" * 65,)}, "processor name")])
def test_sampling_info_refuses_bad_values(kw, what):
    with pytest.raises(RecordError, match=what):
        SamplingInfo("raw_logprobs", **kw)
    with pytest.raises(RecordError, match="logprobs_mode"):
        SamplingInfo("m" * 65)


def test_record_validate_refuses_a_dict_for_sampling():
    r = _record(sampling=None)
    r.sampling = {"temperature": 0.7}
    with pytest.raises(RecordError, match="'a': sampling must be a SamplingInfo"):
        r.validate(SCHEMA)


# --------------------------------------------------------------------------- formats

def _stream(records, version):       # format 2 (read only): tests/crafted.py
    return write_records(None, SCHEMA, records).getvalue() if version == 3 else \
        crafted.v2_stream(SCHEMA, records)


def _payloads(data):
    """(offset, payload) of the record frames (frame layout of docs/FORMAT.md)."""
    j = struct.unpack("<I", data[12:16])[0]
    off, out = 20 + j, []
    while data[off:off + 4] == b"RRFM":
        kind, plen = data[off + 4], struct.unpack("<Q", data[off + 8:off + 16])[0]
        if kind == 1:
            out.append(data[off + 24:off + 24 + plen])
        off += 24 + plen
    return out


@pytest.mark.parametrize("version", [3, 2])
def test_sampling_round_trips_both_formats_and_the_spec_reader(version):
    recs = [_record("a"), _record("b", sampling=None, seed=1),
            _record("c", SamplingInfo("raw_logprobs", temperature=0.0), seed=2)]
    data = _stream(recs, version)
    metas = []
    for pl in _payloads(data):
        if version == 3:
            metas.append(decode_head(pl[:head_length(pl, len(pl))], SCHEMA, len(pl)))
        else:
            metas.append(decode_payload_v2(pl, SCHEMA)[0])
    assert [m.sampling for m in metas] == [SMP, None, recs[2].sampling]
    _, spec = spec_reader.read_stream(data)
    assert spec[0]["sampling"] == {"logprobs_mode": "processed_logprobs", "temperature": 0.7,
                                   "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                   "processors": ["repetition_penalty"]}
    assert spec[1]["sampling"] is None
    assert spec[2]["sampling"]["temperature"] == 0.0


def test_v3_sampling_meta_bytes_as_specified():
    """docs/FORMAT.md "Version 3 meta": flag bit 9, then mode, three f64 and a varint, the
    processor names; the field comes after prefix_cached."""
    smp = SamplingInfo("processed_logprobs", temperature=0.5, top_p=0.75, top_k=300,
                       min_p=0.0, processors=("logit_bias", "min_tokens"))
    got = encode_meta("s", 3, sampling=smp, engine="e")
    want = (bytes([0x80 | 64, 0x04]) + b"\x01s" + b"\x03" + b"\x01e"          # flags 576
            + b"\x12processed_logprobs" + struct.pack("<dd", 0.5, 0.75) + b"\xac\x02"
            + struct.pack("<d", 0.0) + b"\x02" + b"\x0alogit_bias" + b"\x0amin_tokens")
    assert got == want


def _v3_payload_with_meta(meta_tail: bytes, flags: int) -> bytes:
    """A one-record payload of 'x' (T = 9 from _record) with a forged meta tail."""
    good = encode_record_payload(_record("x", sampling=None), SCHEMA)
    h = head_length(good, len(good))
    m_old = good[:h]
    from routereplay.varint import varint
    # the record's own meta: flags, sid, T, fields; rebuilt with the forged flags + tail
    own = encode_meta("x", 9, start=0, prompt_len=4, arrays={"token_ids": 10, "logprobs": 6})
    assert m_old.endswith(own)
    meta = varint(flags | 4 | 8 | 16) + own[1:] + meta_tail
    return varint(len(meta)) + meta + good[h:]


@pytest.mark.parametrize("tail, flags, match", [
    (b"", 1024, "unknown flags 0x400"),                               # a newer writer's bit
    (b"\x0craw_logprobs" + struct.pack("<dd", 1.0, float("nan")) + b"\x00"
     + struct.pack("<d", 0.0) + b"\x00", 512, "top_p"),
    (b"\x0craw_logprobs" + struct.pack("<dd", 1.0, 1.0) + b"\x00"
     + struct.pack("<d", 0.0) + b"\x80\x80\x80\x80\x10", 512, "processors count"),
    (b"\x0craw_logprobs" + struct.pack("<d", 1.0), 512, "runs past the meta")])
def test_v3_bad_sampling_meta_refused_naming_the_sample(tail, flags, match):
    pl = _v3_payload_with_meta(tail, flags)
    with pytest.raises(SidecarError, match=f"sample 'x'.*{match}"):
        decode_head(pl[:head_length(pl, len(pl))], SCHEMA, len(pl))


def test_v2_bad_sampling_meta_refused():
    import json
    pl = crafted.v2_payload(_record("x"), SCHEMA)
    mlen = struct.unpack("<I", pl[:4])[0]
    meta = json.loads(pl[4:4 + mlen])
    for bad in ({**meta["sampling"], "seed": 3}, {**meta["sampling"], "top_k": 2.5}, [1]):
        js = json.dumps({**meta, "sampling": bad}).encode()
        with pytest.raises(SidecarError, match="sample 'x'.*sampling"):
            decode_payload_v2(struct.pack("<I", len(js)) + js + pl[4 + mlen:], SCHEMA)


# --------------------------------------------------------------------------- engines

def _vllm_parts(n=10, p=4):
    from vllm.logprobs import Logprob
    rng = np.random.default_rng(3)
    full = np.zeros((n - 1, 4, 2), np.uint8)
    full[:, 1:] = np.argsort(rng.random((n - 1, 3, 8)), -1)[..., :2]
    toks = rng.integers(0, 100, n).tolist()
    lps = [{t: Logprob(logprob=-0.5)} for t in toks[p:]]
    return dict(prompt=toks[:p], generated=toks[p:], routed_experts=full, logprobs=lps)


def test_vllm_sampling_params_recorded_through_record_from_parts():
    from vllm import SamplingParams

    from engine_patches.vllm.records import record_from_parts, sampling_from_vllm
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05,
                        repetition_penalty=1.1, logit_bias={3: 1.0}, logprobs=0)
    smp = sampling_from_vllm(sp, "processed_logprobs")
    assert smp == SamplingInfo("processed_logprobs", 0.7, 0.9, 0, 0.05,
                               ("repetition_penalty", "logit_bias"))
    rec = record_from_parts("v", SCHEMA, sampling=smp, **_vllm_parts())
    assert rec.sampling == smp
    # raw mode: vLLM takes its raw log-probs before penalties and bias, so none is listed
    assert sampling_from_vllm(sp).processors == ()
    assert sampling_from_vllm(sp).logprobs_mode == "raw_logprobs"
    # greedy: SamplingParams turns off top_p/top_k/min_p itself
    g = sampling_from_vllm(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, logprobs=0),
                           "processed_logprobs")
    assert (g.temperature, g.top_k, g.top_p, g.min_p) == (0.0, 0, 1.0, 0.0)
    # no log-probs: nothing for the sampling parameters to describe
    parts = {**_vllm_parts(), "logprobs": None}
    assert record_from_parts("v", SCHEMA, sampling=smp, **parts).sampling is None
    with pytest.raises(RecordError, match="unknown vLLM logprobs_mode 'processed'"):
        sampling_from_vllm(sp, "processed")


def test_vllm_structured_outputs_listed_in_every_mode():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from engine_patches.vllm.records import sampling_from_vllm
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"), logprobs=0)
    assert sampling_from_vllm(sp).processors == ("structured_outputs",)
    with pytest.raises(AlignmentError, match="structured_outputs"):
        verify.sampling_transform(_record(sampling=sampling_from_vllm(sp)))


def test_sglang_helper(monkeypatch):
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    s = sampling_from_sglang({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                              "max_new_tokens": 8})
    assert s == SamplingInfo("temperature_logprobs", 0.6, 0.95, 20, 0.0)
    assert verify.sampling_transform(_record(sampling=s)) == verify.Transform(temperature=0.6)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "True")
    assert sampling_from_sglang({"temperature": 0.6}).logprobs_mode == "raw_logprobs"
    assert sampling_from_sglang({"temperature": 0.6},
                                return_original_logprob=False).logprobs_mode == \
        "temperature_logprobs"
    assert sampling_from_sglang({"temperature": 0}).logprobs_mode == "raw_logprobs"
    assert sampling_from_sglang(None) == SamplingInfo("raw_logprobs")
    assert sampling_from_sglang({"temperature": 0.5, "top_k": 1},
                                return_original_logprob=False).logprobs_mode == \
        "batch_dependent_logprobs"
    s = sampling_from_sglang({"frequency_penalty": 0.5, "json_schema": "{}", "top_k": -1},
                             custom_logit_processor="x")
    assert s.processors == ("frequency_penalty", "json_schema", "custom_logit_processor")
    assert s.top_k == 0


# --------------------------------------------------------------------------- verify

def _np_transformed(logits, targets, t, keep_target=False):
    """The transform written directly in numpy, float64, from vLLM 0.32's sampler;
    ``keep_target``: the target stays in the kept set (what the trainer side computes)."""
    out = []
    for row, tgt in zip(np.asarray(logits, np.float64), targets):
        x = row / t.temperature
        scaled = x[tgt]
        if t.min_p > 0:
            p = np.exp(x - x.max())
            p /= p.sum()
            x = np.where(p < t.min_p * p.max(), -np.inf, x)
        if 0 < t.top_k < x.size:
            kth = np.sort(x)[::-1][t.top_k - 1]
            x = np.where(x < kth, -np.inf, x)
        if t.top_p < 1:
            order = np.argsort(x, kind="stable")
            xs = x[order]
            p = np.exp(xs - xs.max())
            p /= p.sum()
            drop = np.cumsum(p) <= 1 - t.top_p
            drop[-1] = False
            x = x.copy()
            x[order[drop]] = -np.inf
        if keep_target:
            x = x.copy()
            x[tgt] = scaled
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum())
        out.append(x[tgt] - lse)
    return np.array(out)


TRANSFORMS = [verify.Transform(), verify.Transform(temperature=0.7),
              verify.Transform(temperature=1.3, top_k=5),
              verify.Transform(temperature=0.8, top_p=0.8),
              verify.Transform(min_p=0.1),
              verify.Transform(temperature=0.6, min_p=0.02, top_k=12, top_p=0.9)]


@pytest.mark.parametrize("t", TRANSFORMS, ids=lambda t: t.describe())
def test_transform_matches_numpy_and_vllms_sampler(t):
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from trainer_hooks.hf.recompute import transformed_logprobs
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (40, 50)).astype(np.float32)
    # targets: the argmax and random tokens (some of them dropped by the truncation)
    targets = np.where(np.arange(40) % 3 == 0, logits.argmax(-1), rng.integers(0, 50, 40))
    got = transformed_logprobs(torch.from_numpy(logits), torch.from_numpy(targets), t).numpy()
    want = _np_transformed(logits, targets, t)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=2e-5)
    # a target the truncation drops stays in the trainer's set (the engine sampled it):
    # its log-prob over the kept tokens plus itself, never -inf
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _np_transformed(logits, targets, t, keep_target=True),
                               atol=2e-5)
    if not t.identity and (t.top_k or t.top_p < 1):
        assert not fin.all()                         # the case exercises the truncation
    # vLLM's own temperature and top-k/top-p code (no min_p: a batch-state processor)
    if t.min_p == 0:
        x = torch.from_numpy(logits.copy()) / t.temperature
        k = torch.full((40,), t.top_k, dtype=torch.long) if t.top_k else None
        p = torch.full((40,), t.top_p) if t.top_p < 1 else None
        ref = torch.log_softmax(apply_top_k_top_p_pytorch(x, k, p), -1)
        ref = ref.gather(-1, torch.from_numpy(targets)[:, None])[:, 0].numpy()
        assert (np.isfinite(ref) == fin).all()
        np.testing.assert_allclose(got[fin], ref[fin], atol=1e-5)


@pytest.mark.parametrize("smp, match", [
    (SamplingInfo("raw_logits"), "recorded logits, not log-probs"),
    (SamplingInfo("processed_logits", temperature=0.7), "recorded logits"),
    (SamplingInfo("batch_dependent_logprobs", 0.5, top_k=1), "'batch_dependent_logprobs' is not"),
    (SMP, "repetition_penalty")])
def test_verify_refuses_unlike_comparisons(smp, match):
    recs = [_record("ok", sampling=None), _record("bad", sampling=smp, seed=1)]
    with pytest.raises(AlignmentError, match=f"sample 'bad'.*{match}"):
        verify.sampling_notes(recs)


def test_verify_transforms_and_report():
    assert verify.sampling_transform(_record(sampling=None)) is None
    assert verify.sampling_transform(_record(sampling=SamplingInfo(
        "raw_logprobs", 0.5, 0.9, 5))).identity
    assert verify.sampling_transform(_record(sampling=SamplingInfo(
        "processed_logprobs", 0.0))).identity                         # greedy
    assert verify.sampling_transform(_record(sampling=SamplingInfo(
        "processed_logprobs", 0.7, 0.9, 20, 0.05))) == verify.Transform(0.7, 0.05, 20, 0.9)
    with pytest.raises(AlignmentError, match="sample 'a'.*top_k 20.*--trainer hf"):
        verify.check_full_vocabulary([_record(sampling=SamplingInfo(
            "processed_logprobs", 1.0, top_k=20))], "megatron")
    verify.check_full_vocabulary([_record(sampling=SamplingInfo("raw_logprobs", 0.7))],
                                 "megatron")
    recs = [_record("a", None), _record("b", SamplingInfo("processed_logprobs", 0.7), seed=1)]
    passes = {c: [(np.zeros(len(r.token_ids) - 1), np.concatenate(
        [r.expert_ids, r.expert_ids[-1:]]).astype(np.int64)) for r in recs]
        for c in verify.CONDITIONS}
    s = verify.summarize(recs, passes)
    assert s["sampling"] == {"unknown": 1, "compared": {"temperature 0.7": 1}}
    line = [x for x in verify.format_report(s).splitlines() if x.startswith("sampling")]
    assert line == ["sampling (2 samples): 1 as temperature 0.7; 1 with unknown sampling "
                    "parameters (compared as a full-vocabulary log-softmax: temperature or "
                    "top-k/top-p in the engine's log-probs would read as mismatch)"]


def test_hf_recompute_compares_like_with_like(tiny_model):
    """Tokens sampled from the HF model under temperature 0.7, top_k 8, top_p 0.9, with
    their processed log-probs as the engine's: with the record's sampling parameters the
    replayed trainer reproduces them; without them the same numbers read as mismatch."""
    import dataclasses

    import torch

    from tests.hf_reference import hf_records
    from trainer_hooks.hf.recompute import recompute, transformed_logprobs
    from transformers import AutoModelForCausalLM
    t = verify.Transform(temperature=0.7, top_k=8, top_p=0.9)
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    seq = torch.as_tensor(np.random.default_rng(0).integers(3, 500, 10))[None]
    with torch.no_grad():                   # sample 14 tokens as the engine would
        for _ in range(14):
            logits = m(seq).logits[0, -1:]
            probs = transformed_logprobs(logits.expand(logits.shape[-1], -1),
                                         torch.arange(logits.shape[-1]), t).exp()
            seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)[None]], 1)
        lp = transformed_logprobs(m(seq).logits[0][:-1], seq[0, 1:], t)[9:]
    schema, (r,) = hf_records(tiny_model, [seq[0].tolist()], prompt_len=10)
    assert np.isfinite(lp.numpy()).all()
    smp = SamplingInfo("processed_logprobs", temperature=0.7, top_k=8, top_p=0.9)
    rec = dataclasses.replace(r, logprobs=lp.numpy().astype(np.float32), sampling=smp)
    like = verify.summarize([rec], recompute(tiny_model, [rec], schema, progress=False))
    assert np.abs(like["deltas"]["replay"]).max() < 1e-4
    assert like["sampling"] == {"unknown": 0, "compared": {t.describe(): 1}}
    unknown = dataclasses.replace(rec, sampling=None)
    unlike = verify.summarize([unknown], recompute(tiny_model, [unknown], schema,
                                                   progress=False))
    assert np.abs(unlike["deltas"]["replay"]).max() > 0.05
    assert unlike["sampling"]["unknown"] == 1
    assert math.isfinite(like["replay"]["routing_agreement"])


def test_the_sidecar_reader_returns_each_records_sampling(tmp_path):
    """SidecarReader.read gives back what the writer stored (formats 3 and 2), and a record
    without it stays without it; the SGLang client derives it from its request payload."""
    from engine_patches.sglang.client import request_sampling
    from routereplay.sidecar import SidecarReader
    for v in (3, 2):
        p = tmp_path / f"s{v}.rrsc"
        recs = [_record("a"), _record("b", None, seed=1)]
        p.write_bytes(_stream(recs, v))
        with SidecarReader(str(p)) as r:
            assert r.read("a").sampling == SMP and r.read("b").sampling is None
    gen = request_sampling({"sampling_params": {"temperature": 0.5, "top_p": 0.8}})
    assert (gen.logprobs_mode, gen.temperature, gen.top_p) == ("temperature_logprobs", 0.5, 0.8)
    oa = request_sampling({"temperature": 0.5, "repetition_penalty": 1.2}, kind="chat")
    assert oa.temperature == 0.5 and oa.processors == ("repetition_penalty",)


def test_a_huge_json_integer_in_a_sampling_meta_is_a_record_error_not_a_crash():
    """(Attacker review) `"temperature": 10**400` (valid JSON) raised OverflowError out of
    math.isfinite, which format 2's meta check let through, making the whole stream
    unreadable; it is a RecordError now (a corrupt record, named), as NaN already was."""
    import json as _json
    big = "1" + "0" * 400
    with pytest.raises(RecordError, match="temperature must be a finite number"):
        SamplingInfo.from_json(_json.loads('{"logprobs_mode": "raw_logprobs", "temperature": '
                                           + big + ', "top_p": 1, "top_k": 0, "min_p": 0, '
                                           '"processors": []}'))
    for kw in ({"top_p": int(big)}, {"min_p": int(big)}):
        with pytest.raises(RecordError, match="must be a finite number"):
            SamplingInfo("raw_logprobs", **kw)
    with pytest.raises(RecordError, match="not numbers"):
        sampling_from_sglang({"top_k": float("inf")})
