"""Shared fixtures. Heavy engine/trainer work runs in subprocesses with timeouts."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def schema() -> RoutingSchema:
    """4 decoder layers, layer 0 dense, 16 experts, top-4 (the tiny model's shape)."""
    return RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=4, num_experts=16)


def random_record(schema: RoutingSchema, sample_id: str, n_tokens: int, seed: int,
                  prompt_len: int | None = None, with_arrays: bool = True) -> RoutingRecord:
    """A valid record: distinct ids per row, token ids, log-probs."""
    rng = np.random.default_rng(seed)
    t = n_tokens - 1
    ids = np.argsort(rng.random((t, schema.num_moe_layers, schema.num_experts)), axis=-1)
    ids = ids[..., :schema.top_k].astype(schema.id_dtype)
    p = prompt_len if prompt_len is not None else max(1, n_tokens // 2)
    return RoutingRecord(
        sample_id=sample_id, expert_ids=ids, prompt_len=p,
        token_ids=rng.integers(0, 500, n_tokens).astype(np.int32) if with_arrays else None,
        logprobs=(-rng.random(n_tokens - p).astype(np.float32)) if with_arrays else None,
        weight_versions=[WeightVersionSpan("v0", 0, n_tokens)], engine="test")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The built-in tiny Qwen3-MoE, built once per machine (cached)."""
    pytest.importorskip("transformers", reason="needs the engine extra")
    from routereplay.cli.demo.tiny_model import ensure_tiny_model
    return ensure_tiny_model()


def checkpoint_variant(src: str, dst: str, edit) -> str:
    """Copy the HF checkpoint folder ``src`` to ``dst`` with every tensor replaced by
    ``edit(name, tensor)`` (return the tensor unchanged to keep it). Returns ``dst``."""
    import shutil

    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd = {k: edit(k, v.clone()).contiguous() for k, v in sd.items()}
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def rolled_routers(src: str, dst: str) -> str:
    """The checkpoint with every MoE router's expert rows rolled by 3: different routing."""
    import torch
    return checkpoint_variant(src, dst, lambda k, v: torch.roll(v, 3, 0)
                              if k.endswith("mlp.gate.weight") else v)


def run_py(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` from the repo root with a timeout (fails the test on hang)."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def pytest_collection_modifyitems(config, items):
    """GPU checks run only when asked for (``-m gpu``); otherwise they are deselected and
    the summary says so (never a silent skip). Selected on a machine without CUDA, they
    fail (see :func:`require_cuda`)."""
    if "gpu" in (config.getoption("-m") or ""):
        return
    gpu = [i for i in items if "gpu" in i.keywords]
    if gpu:
        items[:] = [i for i in items if "gpu" not in i.keywords]
        config.hook.pytest_deselected(items=gpu)
        config._routereplay_gpu_deselected = len(gpu)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_routereplay_gpu_deselected", 0)
    if n:
        terminalreporter.write_line(f"{n} GPU checks deselected: run `python -m pytest -m gpu` "
                                    "on a CUDA machine")


def require_cuda() -> None:
    """Fail (not skip) a GPU check on a machine without CUDA."""
    import torch
    if not torch.cuda.is_available():
        pytest.fail("this GPU check was selected (-m gpu) on a machine without CUDA")
