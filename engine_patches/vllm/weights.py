"""Deprecated alias of :mod:`engine_patches.vllm.worker_extension` (the pre-0.2 name, kept for one release)."""
from routereplay._deprecated import alias_module

alias_module(__name__, "engine_patches.vllm.worker_extension")
