"""The harness that proves trainer_hooks.megatron on this machine: not the product.

The product (``trainer_hooks.megatron``: RouterReplayer, Microbatch, ReplayStats) never
imports anything here. The harness builds real megatron-core models from Hugging Face
Qwen3-MoE checkpoints and runs them on CPU (gloo) or GPU:

- ``cpu_shim``: megatron-core's MoE GPTModel on a CPU-only torch; ``mcore_fixes``: a
  megatron-core 0.16.1 bug without Transformer Engine;
- ``qwen3_moe``: HF Qwen3-MoE -> megatron-core config and state dict;
- ``parallel``: TP/SP/EP/PP/VPP/DP layouts, gloo launch, model chunks, sharded loading;
- ``plan``: the global batch cut into microbatch plans; ``passes``: one pass through
  ``forward_backward_func`` with a RouterReplayer;
- ``checks``: replay exactness checks (tests); ``perturb``: router perturbation experiments;
- ``recompute``: the driver (``routereplay verify --trainer megatron``, the demo).
"""
