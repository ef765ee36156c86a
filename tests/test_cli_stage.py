"""routereplay.cli.stage: long subprocess stages (demo, megatron verify)."""
import sys

import pytest

from routereplay.cli.stage import StageError, run_stage


def test_stage_success_failure_and_timeout(tmp_path):
    log = str(tmp_path / "s.log")
    run_stage("ok", [sys.executable, "-c", "print('step 1'); print('step 2')"], env=None,
              timeout=30, log=log)
    assert open(log).read().split() == ["step", "1", "step", "2"]
    with pytest.raises(StageError, match=r"bad failed \(exit 3, log: .*\):\nerror: boom"):
        run_stage("bad", [sys.executable, "-c",
                          "import sys; print('noise'); print('error: boom'); sys.exit(3)"],
                  env=None, timeout=30, log=log)
    with pytest.raises(StageError, match="slow did not finish within 1 s"):
        run_stage("slow", [sys.executable, "-c", "import time; time.sleep(30)"], env=None,
                  timeout=1, log=log)


def test_stage_progress_line_shows_elapsed_and_last_log_line(tmp_path, monkeypatch, capsys):
    import io

    import tqdm
    buf = io.StringIO()
    real = tqdm.tqdm
    # NOTE: tqdm disables itself off a terminal (disable=None); force it on into a buffer
    monkeypatch.setattr(tqdm, "tqdm", lambda *a, **k: real(*a, **{**k, "disable": False,
                                                                  "file": buf}))
    run_stage("roll", [sys.executable, "-c",
                       "import time; print('generated 3 of 16', flush=True); time.sleep(2.5)"],
              env=None, timeout=30, log=str(tmp_path / "p.log"))
    out = buf.getvalue()
    assert "roll: 00:0" in out and "generated 3 of 16" in out
