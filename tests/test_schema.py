import json

import numpy as np
import pytest

from routereplay.errors import SchemaError
from routereplay.schema import RoutingSchema

QWEN3 = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 128,
         "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [0, 3]}


def test_qwen3_mlp_only_layers():
    s = RoutingSchema.from_hf_config(QWEN3)
    assert s.moe_layer_ids == (1, 2, 4, 5)
    assert (s.top_k, s.num_experts, s.id_dtype, s.id_bits) == (8, 128, np.uint8, 7)
    assert s.dense_layer_ids() == (0, 3)


def test_qwen3_transformers5_num_local_experts_and_sparse_step():
    cfg = dict(QWEN3, mlp_only_layers=[], decoder_sparse_step=2)
    del cfg["num_experts"]
    cfg["num_local_experts"] = 300
    s = RoutingSchema.from_hf_config(cfg)
    assert s.moe_layer_ids == (1, 3, 5)           # (i + 1) % 2 == 0
    assert s.id_dtype == np.uint16


def test_deepseek_first_k_dense_and_sigmoid():
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 5, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
           "scoring_func": "sigmoid"}
    s = RoutingSchema.from_hf_config(cfg)
    assert s.moe_layer_ids == (3, 4) and s.score_function == "sigmoid"
    assert s.id_dtype == np.uint8   # 256 experts still fit uint8 (ids 0..255)


def test_mixtral_all_layers():
    s = RoutingSchema.from_hf_config({"model_type": "mixtral", "num_hidden_layers": 3,
                                      "num_local_experts": 8, "num_experts_per_tok": 2})
    assert s.moe_layer_ids == (0, 1, 2)


@pytest.mark.parametrize("cfg", [
    {"model_type": "llama", "num_hidden_layers": 4},
    dict(QWEN3, mlp_only_layers=list(range(6))),
])
def test_no_moe_layers_is_a_clear_error(cfg):
    with pytest.raises(SchemaError, match="no MoE"):
        RoutingSchema.from_hf_config(cfg)


def test_from_config_dir_and_roundtrip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    s = RoutingSchema.from_hf_config(str(tmp_path))
    assert RoutingSchema.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_check_same_names_fields(schema):
    other = RoutingSchema(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=2, num_experts=8)
    with pytest.raises(SchemaError) as e:
        schema.check_same(other)
    assert "top_k: model 4 vs sidecar 2" in str(e.value)
    assert "num_experts: model 16 vs sidecar 8" in str(e.value)


def test_strip_dense(schema):
    full = np.zeros((5, 4, 4), np.uint8)
    full[:, 1:] = np.arange(12, dtype=np.uint8).reshape(3, 4)
    out = schema.strip_dense(full)
    assert out.shape == (5, 3, 4) and (out[0] == np.arange(12).reshape(3, 4)).all()
    with pytest.raises(SchemaError, match="num_hidden_layers=4"):
        schema.strip_dense(full[:, :3])


# --- MoE placement from every form configs state it in (issue 16 item 2) -----------------

_BASE = {"num_experts_per_tok": 2}


@pytest.mark.parametrize("cfg,want", [
    # hybrid pattern string, one character a layer (NVIDIA Nemotron-H): 'E' = MoE
    ({"model_type": "nemotron_h", "num_hidden_layers": 6, "n_routed_experts": 8,
      "hybrid_override_pattern": "MEM*E-"}, (1, 4)),
    # transformers 5 Nemotron-H: per-layer kinds, no num_hidden_layers
    ({"model_type": "nemotron_h", "n_routed_experts": 8,
      "layers_block_type": ["linear_attention", "moe", "full_attention", "moe", "mlp"]}, (1, 3)),
    # per-layer MLP kinds
    ({"num_hidden_layers": 4, "num_experts": 8, "mlp_layer_types": ["dense", "sparse", "dense",
                                                                     "sparse"]}, (1, 3)),
    # attention-kind list says nothing about MoE (gpt-oss): every layer MoE
    ({"model_type": "gpt_oss", "num_hidden_layers": 3, "num_local_experts": 8,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, (0, 1, 2)),
    # moe_layer_freq as an int and as a Megatron list, with first_k_dense_replace
    ({"num_hidden_layers": 6, "n_routed_experts": 8, "first_k_dense_replace": 1,
      "moe_layer_freq": 2}, (2, 4)),
    ({"num_hidden_layers": 4, "n_routed_experts": 8, "moe_layer_freq": [0, 1, 1, 0]}, (1, 2)),
    ({"num_hidden_layers": 4, "num_experts": 8, "num_dense_layers": 2}, (2, 3)),      # LFM2-MoE
    # Qwen: mlp_only_layers and decoder_sparse_step together
    ({"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 8,
      "decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1, 5)),
    # Llama 4 (nested text_config), Jamba and ERNIE 4.5 (their defaults when keys are left out)
    ({"model_type": "llama4", "text_config": {"num_hidden_layers": 4, "num_local_experts": 16,
                                              "num_experts_per_tok": 1,
                                              "interleave_moe_layer_step": 2}}, (1, 3)),
    ({"model_type": "llama4", "text_config": {"num_hidden_layers": 4, "num_local_experts": 16,
                                              "num_experts_per_tok": 1, "moe_layers": [0, 2]}},
     (0, 2)),
    ({"model_type": "jamba", "num_hidden_layers": 4, "num_experts": 16}, (1, 3)),
    ({"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2},
     (1, 2, 3)),
    ({"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {
        "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "mlp_only_layers": [0]}}}, (1, 2)),
    # null placement keys count as absent
    ({"num_hidden_layers": 3, "n_routed_experts": 8, "moe_layer_freq": None,
      "first_k_dense_replace": 1}, (1, 2)),
])
def test_moe_placement_forms(cfg, want):
    cfg = {**_BASE, **cfg} if "text_config" not in cfg and "thinker_config" not in cfg else cfg
    assert RoutingSchema.from_hf_config(cfg).moe_layer_ids == want


def test_hybrid_pattern_from_transformers_config_object():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp", "moe"],
        n_routed_experts=8, num_experts_per_tok=2)
    s = RoutingSchema.from_hf_config(cfg)
    assert (s.num_hidden_layers, s.moe_layer_ids) == (6, (1, 3, 5))


@pytest.mark.parametrize("cfg,key", [
    ({"num_hidden_layers": 4, "num_experts": 8, "moe_layer_num_skipped": 1},
     "moe_layer_num_skipped"),                                     # unknown placement key
    ({"model_type": "nemotron_h", "num_hidden_layers": 4, "n_routed_experts": 8},
     "hybrid_override_pattern"),                                   # hybrid without a pattern
    ({"num_hidden_layers": 4, "num_experts": 8, "hybrid_override_pattern": "ME"},
     "hybrid_override_pattern"),                                   # wrong length
    ({"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": [0],
      "first_k_dense_replace": 2}, "first_k_dense_replace"),       # two forms disagree
    ({"num_hidden_layers": 4, "num_experts": 8, "moe_layer_freq": [1, 2, 1, 1]},
     "moe_layer_freq"),
    ({"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"num_hidden_layers": 2, "num_experts": 8, "layer_types": ["moe", "bogus"]}, "layer_types"),
    ({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": [2, 2]},
     "num_experts_per_tok"),
])
def test_undeterminable_placement_is_refused_naming_the_key(cfg, key):
    with pytest.raises(SchemaError, match=key):
        RoutingSchema.from_hf_config({**_BASE, **cfg})
