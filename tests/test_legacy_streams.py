"""What routereplay 0.3.0 removed (issue 29), read from streams routereplay 0.2 wrote
(tests/fixtures/legacy, made by make_fixtures.py from a 0.2 checkout): format 2 still reads
identically; format 1, and sections of the removed codecs, are refused with the removal
text; a writer asked for a removed codec or format refuses with it."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from routereplay.errors import ConfigError, SidecarError
from routereplay.sidecar import SidecarReader, SidecarWriter, encode_record_payload, write_records

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "legacy")
_spec = importlib.util.spec_from_file_location("legacy_fixtures", os.path.join(HERE, "make_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)
REMOVAL = (r"was removed in routereplay 0\.3\.0; routereplay 0\.2\.x reads it and converts it, in "
           r"an environment of its own: python -m venv rr02 && rr02/bin/pip install "
           r"'routereplay==0\.2\.\*' && rr02/bin/routereplay convert --from sidecar IN --out OUT "
           r"--codec xl-zstd")


def _path(name: str) -> str:
    return os.path.join(HERE, name)


def test_fixtures_are_tiny():
    for name in os.listdir(HERE):
        assert os.path.getsize(_path(name)) < 20_000, name


def test_format2_stream_of_02_reads_identically():
    rd = SidecarReader(_path("format2.rrsc"))
    assert rd.version == 2 and rd.complete and rd.codec == "ctx-zstd"
    want = fx.records()
    assert rd.sample_ids() == [r.sample_id for r in want]
    for w in want:
        for got in (rd.read(w.sample_id), rd.read(w.sample_id, moe_layers=[2, 0], tokens=(3, 17))):
            lyr = [0, 1, 2, 3] if got.expert_ids.shape[1] == 4 else [2, 0]
            r0 = got.start
            assert np.array_equal(got.expert_ids, w.expert_ids[r0:r0 + got.num_tokens][:, lyr])
            assert np.array_equal(got.token_ids, w.token_ids)
            assert np.array_equal(got.logprobs, w.logprobs)
            assert (got.prompt_len, got.engine, got.weight_versions) == \
                (w.prompt_len, w.engine, w.weight_versions)
    rd.check()                                    # the scan finds nothing wrong either


def test_format1_stream_is_refused_with_the_removal():
    with pytest.raises(SidecarError, match="format version 1 " + REMOVAL):
        SidecarReader(_path("format1.rrsc"))


@pytest.mark.parametrize("name,codec", [("ctx-ans.rrsc", "ctx-ans"), ("zstd-lm.rrsc", "zstd-lm")])
def test_sections_of_removed_codecs_are_refused_by_name(name, codec):
    rd = SidecarReader(_path(name))
    sid = rd.sample_ids()[0]
    # read through the index: the section names the sample and its layers and rows
    with pytest.raises(SidecarError, match=rf"sample '{sid}' .*section 0 \(MoE layers \[0, 4\), "
                       rf"rows \[0, \d+\)\): routing codec '{codec}' " + REMOVAL) as e:
        rd.read(sid)
    assert e.value.sample_id == sid
    # a scan reports the frame as corrupt with the same words, and read() still says why
    rd = SidecarReader(_path(name))
    rd.scan()
    assert any(f"routing codec '{codec}' " in m for m in rd.errors)
    assert not any("missing from the stream" in m for m in rd.errors)
    with pytest.raises(SidecarError, match=REMOVAL):
        rd.read(sid)


def test_xl_ans_stream_its_xl_zstd_records_read_its_xl_ans_ones_are_refused():
    rd = SidecarReader(_path("xl-ans.rrsc"))
    xl, plain = fx.cross_layer(2, 600), fx.records(2, 12, seed=5)
    rd.scan()
    assert list(rd.model_frames) == [386] and rd.model_frames[386] > 24
    for rec in plain:                              # xl-zstd records after a model frame
        got = rd.read(rec.sample_id)
        assert np.array_equal(got.expert_ids, rec.expert_ids)
        assert np.array_equal(got.token_ids, rec.token_ids)
    for rec in xl:
        with pytest.raises(SidecarError, match=rf"sample '{rec.sample_id}'.*MoE layers \[0, 4\)"
                           r".*routing codec 'xl-ans-rows' " + REMOVAL):
            SidecarReader(_path("xl-ans.rrsc")).read(rec.sample_id)
    assert sum("xl-ans-rows" in m for m in rd.errors) == 2 and not any(
        "model frame" in m for m in rd.errors)


def test_corrupt_model_frame_is_reported_by_the_scan():
    data = bytearray(open(_path("xl-ans.rrsc"), "rb").read())
    data[386 + 30] ^= 0xFF                          # inside the model frame's payload
    rd = SidecarReader(bytes(data))
    rd.scan()
    assert any(m.startswith("xl-ans model frame at offset 386:") and "checksum" in m
               for m in rd.errors)
    rec = fx.records(2, 12, seed=5)[0]
    assert np.array_equal(rd.read(rec.sample_id).expert_ids, rec.expert_ids)


@pytest.mark.parametrize("codec", ["xl-ans", "xl-ans-rows", "ctx-ans", "ctx-ans-sorted", "zstd-lm"])
def test_writers_refuse_removed_codecs_with_the_removal(codec):
    schema, rec = fx.SCHEMA, fx.records(1)[0]
    for make in (lambda: SidecarWriter(None, schema, codec=codec),
                 lambda: SidecarWriter(None, schema, codec=codec, column_order="sorted"),
                 lambda: write_records(None, schema, [rec], codec=codec),
                 lambda: encode_record_payload(rec, schema, codec)):
        with pytest.raises(ConfigError, match=f"codec '{codec}' " + REMOVAL):
            make()


@pytest.mark.parametrize("version, want", [
    (1, "format version 1 has not been written since before routereplay 0.2; write format 3"),
    # NOTE: no conversion hint: 0.2 reads format 3, so writing 3 is the whole answer
    (2, r"writing format version 2 was removed in routereplay 0\.3\.0: write format 3 \(the "
        r"default\), which routereplay 0\.2\.x also reads")])
def test_writers_refuse_removed_format_versions(version, want):
    rec = fx.records(1)[0]
    for make in (lambda: SidecarWriter(None, fx.SCHEMA, format_version=version),
                 lambda: write_records(None, fx.SCHEMA, [rec], format_version=version),
                 lambda: encode_record_payload(rec, fx.SCHEMA, version=version)):
        with pytest.raises(ConfigError, match=want):
            make()
