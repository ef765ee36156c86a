"""``routereplay verify``: log-prob mismatch and routing agreement of a rollout sidecar,
recomputed with and without replay (transformers in process, megatron-core as a stage)."""
from __future__ import annotations

import argparse
import os
import sys

from routereplay.cli.common import progress, require
from routereplay.cli.outputs import check_out, json_writer, report_to, write_output


def cmd_verify(a: argparse.Namespace) -> int:
    """Recompute the records of ``a.sidecar`` with ``a.trainer`` and report the metrics."""
    from routereplay import verify
    from routereplay.errors import AlignmentError, SchemaError
    from routereplay.schema import RoutingSchema
    from routereplay.sidecar import SidecarReader
    # NOTE: before any long step (a missing matplotlib found after minutes of recompute)
    for option, out in (("--json", a.json), ("--plot", a.plot)):
        if out:
            check_out(out, [a.sidecar], option)
    require("torch", "transformers", *(["megatron"] if a.trainer == "megatron" else []),
             *(["matplotlib"] if a.plot else []))
    try:
        schema = RoutingSchema.from_hf_config(a.model)
    except SchemaError as e:
        raise SchemaError(f"--model {a.model}: {e}") from None
    with SidecarReader(a.sidecar) as r:
        schema.check_same(r.schema, what=f"sidecar {os.path.basename(a.sidecar)}")
        records = []
        for rec in progress(r.records(), a, desc="read sidecar", unit="record"):
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
    replay_stats = None
    if a.trainer == "hf":
        from trainer_hooks.hf.recompute import recompute     # lazy: trainer side
        summary = verify.summarize(records, recompute(a.model, records, schema,
                                                      device=a.device,
                                                      progress=not a.no_progress))
    elif a.trainer == "fsdp":
        from trainer_hooks.fsdp.recompute import recompute as fsdp_recompute   # lazy
        res = fsdp_recompute(a.model, records, schema, device=a.device,
                             progress=not a.no_progress)
        replay_stats = res.pop("stats")
        summary = verify.summarize(records, res)
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
    report = report_to(a.json, a.plot)
    print(verify.format_report(summary), file=report)
    if replay_stats is not None:
        print("replayer: " + ", ".join(f"{k.split('/')[-1]}={replay_stats[k]:g}" for k in (
            "routereplay/replayed_rows", "routereplay/fallback_rows",
            "routereplay/token_checked_samples", "routereplay/microbatches")), file=report)
    if a.json:
        out = {k: v for k, v in summary.items() if k != "deltas"}
        out.update({"trainer": a.trainer, "model": a.model, "sidecar": a.sidecar})
        if replay_stats is not None:
            out["replay_stats"] = replay_stats
        write_output(a.json, json_writer(verify.json_safe(out), allow_nan=False), "--json")
    if a.plot:
        # NOTE: a file object: matplotlib writes its default format, PNG (what --plot is)
        write_output(a.plot, lambda f: verify.plot(
            summary, f, sidecar=a.sidecar, model=a.model, layer_ids=schema.moe_layer_ids,
            trainer=a.trainer), "--plot")
        print(f"plot: {a.plot}", file=report)
    return 0
