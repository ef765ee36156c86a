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
