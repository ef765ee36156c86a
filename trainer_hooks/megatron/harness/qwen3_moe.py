"""Hugging Face Qwen3-MoE checkpoint -> megatron-core GPTModel (local spec, no TE). Harness.

Mapping (HF ``Qwen3MoeForCausalLM`` -> megatron-core names):

- ``model.embed_tokens`` -> ``embedding.word_embeddings``; ``lm_head`` -> ``output_layer``;
  ``model.norm`` -> ``decoder.final_layernorm``.
- per layer i: ``input_layernorm`` -> ``input_layernorm``; ``post_attention_layernorm`` ->
  ``pre_mlp_layernorm``; ``self_attn.{q,k}_norm`` -> ``self_attention.{q,k}_layernorm``;
  ``self_attn.o_proj`` -> ``self_attention.linear_proj``;
  q/k/v_proj -> ``self_attention.linear_qkv``, interleaved per query group:
  for each KV group g, [q heads of g, k of g, v of g] (megatron's fused QKV layout).
- dense MLP (``mlp_only_layers``): cat(gate_proj, up_proj) -> ``mlp.linear_fc1`` (SwiGLU:
  megatron's glu takes silu of the first half), down_proj -> ``mlp.linear_fc2``.
- MoE: ``mlp.gate`` -> ``mlp.router``; expert e: cat(gate, up) ->
  ``mlp.experts.local_experts.{e}.linear_fc1``, down -> ``...linear_fc2``.

Router semantics: Qwen3 takes softmax over all experts, top-k, then renormalises
(norm_topk_prob=True); that equals megatron's softmax over the top-k logits
(``moe_router_pre_softmax=False``), and top-k selection is the same either way.

The full (world size 1) state dict is made here; trainer_hooks.megatron.harness.parallel
cuts it for a rank's TP/EP/PP shard.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from routereplay.errors import SchemaError
from routereplay.schema import RoutingSchema


def load_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json of a HF checkpoint folder as a dict."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def transformer_config(hf: dict[str, Any], *, params_dtype: torch.dtype = torch.float32,
                       **overrides: Any):
    """megatron-core TransformerConfig equivalent to a Qwen3-MoE HF config.

    Raises:
        SchemaError: the config is not a Qwen3-MoE / Qwen2-MoE style MoE.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    schema = RoutingSchema.from_hf_config(hf)
    if hf.get("model_type") not in ("qwen3_moe", "qwen2_moe") and "mlp_only_layers" not in hf:
        raise SchemaError(f"HF->Megatron mapping supports Qwen3-MoE; got model_type "
                          f"{hf.get('model_type')!r}")
    if hf.get("shared_expert_intermediate_size"):
        raise SchemaError("Qwen2-MoE shared experts are not mapped yet")
    moe = set(schema.moe_layer_ids)
    kw = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        num_moe_experts=schema.num_experts, moe_router_topk=schema.top_k,
        moe_layer_freq=[1 if i in moe else 0 for i in range(schema.num_hidden_layers)],
        moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
        moe_router_score_function="softmax", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=params_dtype,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, moe_enable_routing_replay=True,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def rotary_base(hf: dict[str, Any]) -> float:
    """RoPE theta of a HF config (transformers 5 ``rope_parameters`` or the older
    top-level ``rope_theta``); GPTModel's ``rotary_base``."""
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def hf_to_megatron_state_dict(hf_sd: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Map a HF Qwen3-MoE state dict to megatron-core GPTModel (local spec) names."""
    schema = RoutingSchema.from_hf_config(hf)
    nh = hf["num_attention_heads"]
    ng = hf.get("num_key_value_heads", nh)
    d = hf.get("head_dim") or hf["hidden_size"] // nh
    hpg = nh // ng
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_sd["model.norm.weight"],
    }
    if not hf.get("tie_word_embeddings"):
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    moe = set(schema.moe_layer_ids)
    for i in range(hf["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_sd[h + "self_attn.q_proj.weight"].view(ng, hpg * d, -1)
        k = hf_sd[h + "self_attn.k_proj.weight"].view(ng, d, -1)
        v = hf_sd[h + "self_attn.v_proj.weight"].view(ng, d, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = hf_sd[h + "self_attn.o_proj.weight"]
        out[m + "self_attention.q_layernorm.weight"] = hf_sd[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf_sd[h + "self_attn.k_norm.weight"]
        out[m + "input_layernorm.weight"] = hf_sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[h + "post_attention_layernorm.weight"]
        if i in moe:
            out[m + "mlp.router.weight"] = hf_sd[h + "mlp.gate.weight"]
            for e in range(schema.num_experts):
                src, dst = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
                if src + "gate_proj.weight" in hf_sd:
                    gate, up = hf_sd[src + "gate_proj.weight"], hf_sd[src + "up_proj.weight"]
                    down = hf_sd[src + "down_proj.weight"]
                else:   # transformers 5 fused layout: experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
                    gu = hf_sd[f"{h}mlp.experts.gate_up_proj"][e]
                    gate, up = gu.chunk(2, 0)
                    down = hf_sd[f"{h}mlp.experts.down_proj"][e]
                out[dst + "linear_fc1.weight"] = torch.cat([gate, up], 0)
                out[dst + "linear_fc2.weight"] = down
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [hf_sd[h + "mlp.gate_proj.weight"], hf_sd[h + "mlp.up_proj.weight"]], 0)
            out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
    return out


def load_hf_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``model_dir`` (fp32 on CPU)."""
    from safetensors.torch import load_file
    sd: dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for f in files:
        sd.update(load_file(os.path.join(model_dir, f)))
    return {k: v.float() for k, v in sd.items()}
