"""Output paths (``--out``, ``--json``, ``--plot``): checked before any work, then written
whole or not at all (the rules: :func:`write_through`)."""
from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

from routereplay.cli.common import UsageError


def local_path(s: str) -> str:
    """A ``file://`` URL as the local path it names (checked like one); others unchanged."""
    return s[len("file://"):] if s.startswith("file://") else s


def input_files(inputs: list[str]) -> list[str]:
    """The local paths the input arguments name: files, folders (and every file in them),
    and what globs match (so an output can be compared with each)."""
    import glob as _glob
    out: list[str] = []
    for src in map(local_path, inputs):
        if "://" in src:
            continue
        matched = _glob.glob(src) if any(c in src for c in "*?[") else [src]
        for p in matched:
            out.append(p)
            if os.path.isdir(p):
                out += [os.path.join(p, x) for x in os.listdir(p)]
    return [p for p in out if os.path.exists(p)]


def write_through(out: str, option: str = "--out") -> bool:
    """How an output path is written, by what is there now (links followed):

    - nothing, or a regular file: False. The output goes to a new sibling
      ``<out>.<random>.partial`` (created exclusively) renamed over ``out`` once whole
      (:func:`write_output`), so a failed step never leaves a half-written ``out``.
    - a FIFO or a character device (``/dev/null``, ``/dev/stdout`` on a pipe or a
      terminal): True. Written straight through (``open(out, "wb")``): the bytes go to
      the reader or the device and nothing is renamed over the node.

    Raises:
        UsageError: naming ``option`` and the path: a folder; a block device; a socket; a
            symbolic link to anything else (or to nothing). NOTE: the link is neither
            replaced (``os.replace`` renames over the link itself: ``--out /dev/stdout``
            would replace the system's ``/dev/stdout``) nor written through (its target
            would be lost): the user names the file itself.
    """
    try:
        st = os.stat(out)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{option} {out} is a folder: give a file path")
    if st is not None and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        return True
    if st is not None and stat.S_ISBLK(st.st_mode):
        raise UsageError(f"{option} {out} is a block device: refusing to write over it")
    if st is not None and stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"{option} {out} is a socket: it cannot be written as a file")
    if os.path.islink(out):
        raise UsageError(f"{option} {out} is a symbolic link (to {os.readlink(out)}): give "
                         "the path of the file itself; the link is not replaced and its "
                         "target is not written over")
    return False


def new_sibling(out: str) -> str:
    """A path next to ``out`` that does not exist yet (for a file created exclusively)."""
    import secrets
    return f"{out}.{secrets.token_hex(6)}.partial"


def check_out(out: str, inputs: list[str], option: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be written
    (:func:`write_through`), whose folder does not exist, or that is one of (or inside)
    the inputs: globs and folders are expanded first, so no spelling of an input can be
    overwritten (``file://`` URLs are checked as the paths they name)."""
    out = local_path(out)
    if "://" in out:
        return
    write_through(out, option)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {out}: its folder {parent} does not exist")
    for src in input_files(inputs):
        if os.path.exists(out) and os.path.samefile(out, src):
            raise UsageError(f"refusing to write {option} {out}: it is the input {src}")
        if os.path.isdir(src) and os.path.samefile(parent, src):
            raise UsageError(f"refusing to write {option} {out}: it is inside the input {src}")


def write_output(out: str, write, option: str = "--out") -> None:
    """``write(f)`` (``f`` a binary file) to the output ``out``, as :func:`write_through`
    decides at this moment: through a FIFO or character device, or to a new sibling file
    renamed over ``out`` at the end (removed on any failure: nothing half-written is left
    behind and an existing ``out`` stays as it was)."""
    if write_through(out, option):
        with open(out, "wb") as f:
            write(f)
        return
    tmp = new_sibling(out)
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def report_to(*outs: str | None):
    """Where a command's own lines go: stderr when one of its outputs is its stdout
    (``--out /dev/stdout | consumer``: the bytes on the pipe stay one whole stream), else
    stdout."""
    try:
        so = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return sys.stdout
    for out in outs:
        try:
            st = os.stat(out) if out and "://" not in out else None
        except OSError:
            continue
        if st is not None and (st.st_dev, st.st_ino) == (so.st_dev, so.st_ino):
            return sys.stderr
    return sys.stdout


def json_writer(obj: Any, **kw: Any):
    """A ``write(f)`` for :func:`write_output`: ``obj`` as indented JSON (UTF-8)."""
    def write(f) -> None:
        f.write(json.dumps(obj, indent=2, **kw).encode())
    return write
