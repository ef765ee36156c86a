"""benchmarks/scale.py --quick: the per-rank delivery simulation (issue 19) runs on the
product's writer, reader and alignment, and what it measures is consistent."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from tests.conftest import REPO


def _scale():
    spec = importlib.util.spec_from_file_location(
        "rr_benchmark_scale", os.path.join(REPO, "benchmarks", "scale.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_scale_quick_measures_every_rank(tmp_path, capsys):
    scale = _scale()
    rep = scale.main(["--quick", "--v3", "512:1,64:3:0", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "| bytes read from storage |" in out and "| scheme | stored vs v2 |" in out
    assert json.loads((tmp_path / "r.json").read_text())["tokens"] == rep["tokens"]

    spec = scale.StepSpec(**rep["spec"])
    par = scale.Parallel(**rep["layout"])
    schema = scale.RoutingSchema.from_hf_config(scale.DEEPSEEK_V3)
    lengths = scale.sample_lengths(spec)
    plan = scale.plan_step(lengths, par)
    stages = scale.stage_layers(par, schema.num_hidden_layers)
    moe = set(schema.moe_layer_ids)
    k = schema.top_k
    v2 = rep["ranks"]["v2"]
    assert len(v2) == par.dp * par.cp * par.tp * par.pp            # --quick: every rank
    # The (CP, TP) ranks of one (DP, PP) coordinate together fetched every routing row of
    # that DP rank's samples for the stage's MoE layers: the product's alignment and
    # reader, as the replayer calls them, cover the rows exactly (no row twice or missed).
    for d in range(par.dp):
        rows = sum(int(lengths[i]) - 1 for mb in plan.microbatches[d] for i in mb)
        for p in range(par.pp):
            n_layers = sum(lid in moe for c in range(par.vpp) for lid in stages[c * par.pp + p])
            got = sum(r["share"] for r in v2 if r["coord"][0] == d and r["coord"][3] == p)
            assert got == rows * n_layers * k, (d, p)
    # every scheme fetched the same ids (run_layout checks digests) and the same share
    for name, ranks in rep["ranks"].items():
        assert [r["share"] for r in ranks] == [r["share"] for r in v2], name
    naive = rep["ranks"]["naive int32"][0]
    assert naive["bytes_read"] == rep["routing_rows"] * schema.num_hidden_layers * k * 4
    # format 2 reads whole frames (all layers, all rows) for each sample and chunk;
    # format 3 reads its sections only
    stored, raw = rep["stored"], rep["raw_routing"]

    def read_over_share(name):
        ratio = stored[name] / raw
        return max(r["bytes_read"] / (r["share"] * ratio) for r in rep["ranks"][name])

    assert read_over_share("v2") > 20
    assert read_over_share("v3 B=64,G=3,one<=0") < 3 < read_over_share("v3 B=512,G=1") \
        < read_over_share("v2") / 5
    for r in rep["ranks"]["v3 B=64,G=3,one<=0"]:
        assert r["bytes_decoded"] < 3 * r["share"]
        assert r["peak_inflight_share"] <= r["peak_held_reader"] < 3 * r["peak_inflight_share"]
