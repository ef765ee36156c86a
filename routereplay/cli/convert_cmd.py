"""``routereplay convert``: engine routing arrays or wire payloads to a sidecar stream, or
sidecar streams re-encoded as one (another codec or section grid)."""
from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

from routereplay.cli.common import UsageError, open_streams, printable, progress, require
from routereplay.cli.outputs import check_out, local_path, new_sibling, report_to, write_through
from routereplay.codec import REMOVED_CODECS, removed_codec_error
from routereplay.errors import ConfigError, RouteReplayError, SidecarError


def cmd_convert(a: argparse.Namespace) -> int:
    """Check the options ``a``, then convert ``a.input`` to ``a.out``.

    Raises:
        UsageError: a removed codec or format version, a schema missing or given with
            ``--from sidecar``, or one the codec cannot write.
    """
    from routereplay.convert import schema_from_args
    from routereplay.errors import SchemaError
    from routereplay.sidecar import writer_codec
    if a.codec in REMOVED_CODECS:
        raise UsageError(f"--codec {a.codec}: {removed_codec_error(f'codec {a.codec!r}')}")
    if a.format_version == 2:
        from routereplay.sidecar.layout import check_writable
        try:
            check_writable(2)
        except ConfigError as e:
            raise UsageError(f"--format-version 2: {e}") from None
    given = a.config is not None or any(x is not None for x in (a.num_experts, a.top_k,
                                                                 a.moe_layers, a.num_layers))
    if a.kind == "sidecar":
        # NOTE: re-encoding a stream (another codec or geometry): the schema, token ids,
        # log-probs and spans come from the stream itself
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
        writer_codec(a.codec, a.column_order, schema=schema)
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
    from routereplay.sidecar.scan import MAX_REPORTED
    n, skipped = 0, []

    def bad(msg: str) -> None:
        if not skip:
            raise RouteReplayError(f"{msg}; the {n} records before it were converted")
        skipped.append(msg)
        print(printable(f"routereplay convert: skipped: {msg}"), file=sys.stderr)
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
        if reader.num_corrupt > MAX_REPORTED:
            bad(f"{reader.name}: {reader.num_corrupt - MAX_REPORTED} more corrupt frames")
        if reader.torn_tail is not None:
            bad(f"{reader.name}: torn tail at offset {reader.torn_tail} (a frame cut short)")
        elif not reader.complete:
            print(printable(f"routereplay convert: warning: {reader.name} is not complete (no "
                            "index and trailer: its writer is still running or was killed); "
                            "records written to it later are not in the output"),
                  file=sys.stderr)
    if skipped:
        raise RouteReplayError(f"{len(skipped)} frames or records skipped (listed above); the "
                               f"{n} records that read were converted")


def _sidecar_input(a: argparse.Namespace) -> tuple[Any, Any, Any, dict]:
    """``--from sidecar``: (reader, its schema, its records, the output's extra header).

    Raises:
        UsageError: a codec the input's schema cannot take, or streams whose column order
            is mixed or sorted without ``--column-order sorted`` (the reader is closed)."""
    from routereplay.sidecar import MultiSidecarReader, writer_codec
    reader = open_streams([a.input], a)
    readers = reader.readers if isinstance(reader, MultiSidecarReader) else [reader]
    try:
        writer_codec(a.codec, a.column_order, schema=reader.schema)
    except (ConfigError, SidecarError) as e:
        reader.close()
        raise UsageError(f"--codec: {e}") from None
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
    # NOTE: several streams: the extras they all share (same key, same value)
    extras = [dict(rd.header.get("extra") or {}) for rd in readers]
    extra = {k: v for k, v in extras[0].items() if all(x.get(k) == v for x in extras[1:])}
    if len(readers) > 1:
        extra["streams"] = len(readers)
    extra = {"source": "sidecar", **extra, "converted_from": "sidecar"}
    return reader, reader.schema, _sidecar_records(readers, a.skip_corrupt), extra


def _convert(a: argparse.Namespace, schema) -> int:
    """convert's reading and writing, once the arguments are checked (``schema`` None:
    ``--from sidecar``, the input stream's)."""
    from routereplay.convert import iter_records
    from routereplay.sidecar import SidecarWriter
    # NOTE: file:// URLs are local files: written as paths are and checked
    # against the inputs like paths (a URL output once wrote over its input in place)
    a.out, a.input = local_path(a.out), local_path(a.input)
    pattern = a.kind == "sidecar" and any(c in a.input for c in "*?[")
    if "://" not in a.input and not pattern:
        if not os.path.exists(a.input):
            raise RouteReplayError(f"input {a.input} does not exist")
        mode = os.stat(a.input).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            # NOTE: a FIFO or device would block the read (or never end)
            raise RouteReplayError(f"input {a.input} is not a regular file")
    check_out(a.out, [a.input])
    local = "://" not in a.out
    if not local or "://" in a.input:
        require("fsspec")
    # NOTE: a FIFO or character device (/dev/null) is written through; a file is written
    # to a new sibling renamed over --out at the end (write_through), so a failed
    # conversion never truncates an existing file at --out. The sibling does not exist
    # yet: the writer creates its path exclusively.
    through = local and write_through(a.out)
    dest = a.out if not local else None if through else new_sibling(a.out)
    nothing = (f"{a.out} got a stream of no records" if through else
               f"nothing written to {a.out}" if local else
               f"{a.out} left as it was (what was written is in a .partial beside it)")
    n = tokens = 0
    interrupted = False
    # NOTE: records are written as they are read; on a bad sample the writer still closes
    # (index + trailer), so every sample before it stays readable.
    reader, extra = None, {}
    if a.kind == "sidecar":
        # NOTE: a file, a folder or a glob of streams (one per weight version, say) read as
        # one and written as one stream
        reader, schema, records, extra = _sidecar_input(a)
    elif a.kind == "sglang-json":
        from engine_patches.sglang.records import iter_jsonl   # lazy: engine side
        records = iter_jsonl(a.input, schema, num_fused_shared_experts=a.num_fused_shared_experts)
    else:
        records = iter_records(a.kind, a.input, schema,
                               num_fused_shared_experts=a.num_fused_shared_experts)
    if through:
        dest = open(a.out, "wb")    # NOTE: a FIFO: blocks until its reader opens it
    try:
        with SidecarWriter(dest, schema, codec=a.codec, column_order=a.column_order,
                           layer_group=a.layer_group, token_block=a.token_block,
                           extra_header=extra or {"source": a.kind},
                           # NOTE: an --out URL is replaced as a local --out is: the
                           # writer writes beside it and moves it over on close
                           replace=not local) as w:
            for rec in progress(records, a, desc="convert", unit="record"):
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
    print(f"wrote {n} records, {tokens} tokens, {size} bytes"
          + (f", {8 * size / rows:.3f} bits per token-layer" if rows else "") + f" -> {a.out}",
          file=report_to(a.out))
    return 0
