"""Harness around the vLLM product, never imported by it: the demo's rollout runner
(:mod:`~engine_patches.vllm.harness.rollout`) and the Triton-interpreter shim that lets
Model Runner V2 (routing capture) run on machines without CUDA
(:mod:`~engine_patches.vllm.harness.triton_cpu`)."""
