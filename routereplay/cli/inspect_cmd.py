"""``routereplay inspect``: a summary of sidecar streams, as text or JSON."""
from __future__ import annotations

import argparse
import json
from typing import Any

from routereplay.cli.common import open_streams, printable, progress
from routereplay.errors import RouteReplayError


def cmd_inspect(a: argparse.Namespace) -> int:
    """Summarise the streams ``a.sidecar``; exit status 1 on any error or incomplete stream."""
    from routereplay.sidecar import MultiSidecarReader
    out: dict[str, Any] = {"num_records": 0, "num_tokens": 0, "bytes": 0,
                           "bits_per_token_layer": None, "routing_bits_per_token_layer": None,
                           "complete": False, "errors": [],
                           "records": []}
    try:
        r = open_streams(a.sidecar, a)
    except (RouteReplayError, OSError) as e:
        out["errors"].append(str(e))
        return _emit(out, a.json, 1)
    with r:
        readers = r.readers if isinstance(r, MultiSidecarReader) else [r]
        multi = isinstance(r, MultiSidecarReader)
        schema = r.schema
        streams = []
        routing_bytes = 0
        codecs: dict[str, int] = {}         # routing sections by codec
        for rd in progress(readers, a, desc="scan", unit="stream"):
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
            # NOTE: xl-ans model frames (a codec removed in 0.3.0) are routing data shared
            # by the records after them; the scan checks and counts them
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
    return _emit(out, a.json, 1 if out["errors"] else 0)


def _emit(out: dict, as_json: bool, rc: int) -> int:
    if as_json:
        # NOTE: ensure_ascii: ids with lone surrogates or control characters stay valid JSON
        print(json.dumps(out, indent=2))
        return rc
    if "schema" not in out and out["errors"]:
        for e in out["errors"]:                     # NOTE: nothing opened: no summary
            print(printable(f"error: {e}"))
        return rc
    frames = out.get("model_frames")
    print(f"records {out['num_records']}, tokens {out['num_tokens']}, "
          f"MoE layers {out.get('num_layers', '?')}, bytes {out['bytes']}"
          + (f", {out['bits_per_token_layer']:.3f} bits per token-layer (whole file: token "
             f"ids, log-probs and framing included), {out['routing_bits_per_token_layer']:.3f} "
             "in routing sections" + (f" ({frames} xl-ans model frame{'s' if frames > 1 else ''}"
                                      f", {out['model_frame_bytes']} bytes, included)"
                                      if frames else "")
             if out["bits_per_token_layer"] else ""))
    if "codec" in out:
        print(f"format v{out['format_version']}, codec {out['codec']}, column order "
              f"{out['column_order']}, weight versions {out['versions']}"
              + ("" if out["complete"] else ", NOT COMPLETE"))
    if frames:
        from routereplay.codec import removed_codec_error
        print(f"note: {frames} xl-ans model frame{'s' if frames > 1 else ''}: "
              + removed_codec_error("the codec 'xl-ans'"))
    if out.get("routing_codecs"):
        print("routing sections by codec: " + ", ".join(
            f"{c} {n}" for c, n in out["routing_codecs"].items()))
    if "schema" in out:
        print(f"schema {out['schema']}")
    for st in out.get("streams", []):
        print(printable(f"stream {st['path']}: {st['num_records']} records, {st['bytes']} bytes"
                        + ("" if st["complete"] else ", not complete")))
    for rec in out["records"][:20]:
        print(f"  {rec['sample_id']!r}: {rec['num_tokens']} tokens, versions {rec['versions']}")
    if len(out["records"]) > 20:
        print(f"  ... {len(out['records']) - 20} more")
    for e in out["errors"]:
        print(printable(f"error: {e}"))
    if out["errors"]:
        print(f"recovered {out['num_records']} records")
    return rc
