"""Long subprocess stages of the command line (demo rollout and recompute, megatron
verify): run with a timeout, output to a log file, and a live progress line on stderr.

The progress line is a tqdm bar without a total: elapsed time and the stage's last log
line, refreshed every second, so a stage of several minutes is never silent. It is off
with ``--no-progress`` and when stderr is not a terminal (tqdm's ``disable=None``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from routereplay.errors import RouteReplayError

POLL_SECONDS = 1.0


class StageError(RouteReplayError):
    """A stage failed or timed out; the message names it, its exit status and its log."""


def _last_line(log: str, limit: int = 4096) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    last = next((ln for ln in reversed(lines) if ln), "")
    return last[:60]


def run_stage(name: str, cmd: list[str], *, env: dict[str, str] | None, timeout: float,
              log: str, progress: bool = True) -> None:
    """Run ``cmd`` with stdout and stderr into ``log``.

    Args:
        name: the stage's name (messages, progress line).
        timeout: seconds before the stage is killed.
        progress: show the live progress line (tqdm, when installed and on a terminal).
    Raises:
        StageError: non-zero exit (with the log's ``error:`` lines, else its last 15 lines)
            or timeout, naming the stage and the log.
    """
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(desc=name, total=None, file=sys.stderr, disable=None,
                       bar_format="{desc}: {elapsed} {postfix}")
        except ImportError:
            bar = None
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    proc.kill()
                    proc.wait()
                    raise StageError(f"{name} did not finish within {timeout:.0f} s (log: {log})")
                if bar is not None:
                    bar.set_postfix_str(_last_line(log), refresh=True)
                time.sleep(POLL_SECONDS)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if bar is not None:
                bar.close()
    if proc.returncode != 0:
        with open(log, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("error:")]
        tail = "\n".join(errs or lines[-15:])
        raise StageError(f"{name} failed (exit {proc.returncode}, log: {log}):\n{tail}")
