"""``routereplay demo``: the options of the end-to-end demo (routereplay.cli.demo)."""
from __future__ import annotations

import argparse
import sys

from routereplay.cli.common import UsageError, require
from routereplay.cli.outputs import check_out, json_writer, report_to, write_output


def cmd_demo(a: argparse.Namespace) -> int:
    """Run the demo (routereplay.cli.demo.run) with the options ``a`` and report it."""
    if a.json:
        check_out(a.json, [], "--json")          # NOTE: before minutes of rollout
    require("torch", "transformers", "vllm", "megatron")
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
    print(format_report(res), file=report_to(a.json))
    if a.json:
        write_output(a.json, json_writer(res), "--json")
    return 0
