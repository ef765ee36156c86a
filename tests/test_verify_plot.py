"""`routereplay verify --plot` (issue 17 item 6): what the figure shows, checked on the
matplotlib figure itself."""
import numpy as np
import pytest

from routereplay import verify
from routereplay.record import RoutingRecord

matplotlib = pytest.importorskip("matplotlib")


def _summary(num_layers=3, seed=0):
    rng = np.random.default_rng(seed)
    recs, passes = [], {"no_replay": [], "replay": []}
    for i in range(6):
        n, p = 30, 10
        ids = np.argsort(rng.random((n - 1, num_layers, 16)), -1)[..., :4].astype(np.uint8)
        r = RoutingRecord(f"s{i}", ids, prompt_len=p,
                          token_ids=rng.integers(0, 100, n).astype(np.int32),
                          logprobs=-rng.random(n - p).astype(np.float32))
        recs.append(r)
        used = np.concatenate([ids, ids[-1:]], 0).astype(np.int64)
        lp = np.zeros(n - 1)
        lp[p - 1:] = r.logprobs
        flipped = used.copy()
        flipped[rng.random(flipped.shape[:2]) < 0.1, 0] += 16          # a different expert
        passes["no_replay"].append((lp + rng.normal(0, 0.3, n - 1), flipped))
        passes["replay"].append((lp, used))                          # delta exactly 0
    return verify.summarize(recs, passes)


def test_plot_shows_ccdf_layers_and_split(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    out = tmp_path / "v.png"
    verify.plot(_summary(), str(out), sidecar="/data/rollout-step7.rrsc", model="/m/qwen3-tiny/",
                layer_ids=(1, 2, 3), trainer="hf")
    assert out.stat().st_size > 10_000
    fig = figs[0]
    ccdf, layers, split = fig.axes
    assert (ccdf.get_xscale(), ccdf.get_yscale()) == ("log", "log")
    assert any(abs(line.get_xdata()[0] - np.log(2)) < 1e-12 for line in ccdf.get_lines()
               if len(line.get_xdata()) == 2)                          # the ln 2 line
    legend = [t.get_text() for t in ccdf.get_legend().get_texts()]
    assert any(t.startswith("no replay") for t in legend)
    assert any("replay" in t and "100.0% exactly 0" in t for t in legend)
    assert layers.get_yscale() == "log" and split.get_yscale() == "log"
    assert [t.get_text() for t in layers.get_xticklabels()] == ["1", "2", "3"]
    assert [t.get_text() for t in split.get_xticklabels()] == ["all", "prompt", "response"]
    title = fig._suptitle.get_text()
    assert "rollout-step7.rrsc" in title and "qwen3-tiny" in title and "6 samples" in title
    assert "120 response tokens" in title


def test_verify_cli_plot_end_to_end_and_no_progress_is_silent(tiny_model, tmp_path):
    """`routereplay verify --plot --no-progress` on records from the HF reference: a PNG,
    the JSON's prompt/response split, and not one progress bar on stderr (transformers'
    "Loading weights" included)."""
    import json

    from routereplay.sidecar import write_records
    from tests.conftest import run_py
    from tests.hf_reference import hf_records
    rng = np.random.default_rng(0)
    schema, recs = hf_records(tiny_model, [rng.integers(3, 500, n).tolist() for n in (30, 26)],
                              prompt_len=12)
    sc = tmp_path / "rollout.rrsc"
    write_records(str(sc), schema, recs)
    p = run_py(["-m", "routereplay", "verify", str(sc), "--model", tiny_model, "--plot",
                str(tmp_path / "v.png"), "--json", str(tmp_path / "v.json"), "--no-progress"],
               timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr == "", p.stderr[-2000:]
    assert (tmp_path / "v.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["replay"]["routing_agreement_prompt"] == 1.0
    assert out["replay"]["routing_agreement_response"] == 1.0


def test_plot_when_both_conditions_are_exact(tmp_path):
    s = _summary()
    for c in verify.CONDITIONS:
        s[c]["per_layer"] = [1.0] * 3
        for k in ("routing_agreement", "routing_agreement_prompt", "routing_agreement_response"):
            s[c][k] = 1.0
        s["deltas"][c] = np.zeros_like(s["deltas"][c])
    verify.plot(s, str(tmp_path / "exact.png"))                 # log axes without data
    assert (tmp_path / "exact.png").stat().st_size > 10_000
