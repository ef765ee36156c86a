"""The harness that proves trainer_hooks.megatron on this machine: not the product.

The product (``trainer_hooks.megatron``: RouterReplayer, Microbatch, ReplayStats) never
imports anything here. The harness builds real megatron-core models from Hugging Face
Qwen3-MoE checkpoints and runs them on CPU (gloo) or GPU:

- ``cpu_shim``: in-process patches that let megatron-core's MoE GPTModel run on a CPU-only
  torch; ``mcore_fixes``: a megatron-core 0.16.1 bug without Transformer Engine;
- ``qwen3_moe``: HF Qwen3-MoE config and weights -> megatron-core TransformerConfig and
  state dict;
- ``parallel``: parallel layouts (TP/SP/EP/PP/VPP/DP), gloo process launch, model chunks,
  sharded weight loading;
- ``plan``: the global batch cut into typed microbatch plans and their tensors;
- ``passes``: one pass (forward-only or a training step) through megatron's
  ``forward_backward_func`` with a RouterReplayer, collecting log-probs and used experts;
- ``checks``: RECORD -> replay exactness and recompute checks (tests);
- ``perturb``: router-weight perturbation and the top-k selection-noise experiment;
- ``recompute``: the driver, ``python -m trainer_hooks.megatron.harness.recompute``
  (behind ``routereplay verify --trainer megatron`` and the demo's trainer stage).
"""
