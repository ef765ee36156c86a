"""Routing schema: which decoder layers are MoE, top_k, num_experts, id dtype.

The schema is what turns an engine's ``[T, num_hidden_layers, top_k]`` array into a
record ``[T, L_moe, top_k]`` with dense layers stripped (engines zero-fill dense layers,
which cannot be told from expert 0), and what a trainer checks a sidecar against.

Built from a Hugging Face config (``config.json`` or a ``transformers`` config object):

- Qwen2-MoE / Qwen3-MoE: ``num_experts``, ``num_experts_per_tok``, ``decoder_sparse_step``,
  ``mlp_only_layers`` (layer i is MoE iff i not in mlp_only_layers and
  (i + 1) % decoder_sparse_step == 0; transformers ``Qwen3MoeDecoderLayer``).
- DeepSeek-V2/V3, GLM4-MoE: ``n_routed_experts``, ``num_experts_per_tok``,
  ``first_k_dense_replace``, ``moe_layer_freq`` (layer i is MoE iff
  i >= first_k_dense_replace and i % moe_layer_freq == 0), ``scoring_func``.
- Mixtral, gpt-oss: ``num_local_experts``, ``num_experts_per_tok`` (or
  ``experts_per_token``); every layer is MoE.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from routereplay.errors import SchemaError

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RoutingSchema:
    """Shape and meaning of routing data for one model.

    Attributes:
        num_hidden_layers: decoder layers in the model (dense and MoE).
        moe_layer_ids: sorted decoder-layer indices (0-based) that are MoE layers.
        top_k: experts per token per MoE layer.
        num_experts: logical routed experts per MoE layer (shared experts excluded).
        score_function: router score function, "softmax" or "sigmoid".
    """

    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    top_k: int
    num_experts: int
    score_function: str = "softmax"

    def __post_init__(self):
        object.__setattr__(self, "moe_layer_ids", tuple(int(i) for i in self.moe_layer_ids))
        if not self.moe_layer_ids:
            raise SchemaError("model has no MoE layers: routing replay needs at least one MoE layer")
        if list(self.moe_layer_ids) != sorted(set(self.moe_layer_ids)):
            raise SchemaError(f"moe_layer_ids must be sorted and distinct, got {self.moe_layer_ids}")
        if self.moe_layer_ids[0] < 0 or self.moe_layer_ids[-1] >= self.num_hidden_layers:
            raise SchemaError(
                f"moe_layer_ids {self.moe_layer_ids} out of range for "
                f"num_hidden_layers={self.num_hidden_layers}")
        if not (1 <= self.top_k <= self.num_experts):
            raise SchemaError(f"need 1 <= top_k <= num_experts, got top_k={self.top_k}, "
                              f"num_experts={self.num_experts}")
        if self.num_experts > 65536:
            raise SchemaError(f"num_experts={self.num_experts} exceeds the uint16 id range")
        if self.score_function not in SCORE_FUNCTIONS:
            raise SchemaError(f"score_function must be one of {SCORE_FUNCTIONS}, "
                              f"got {self.score_function!r}")

    @property
    def num_moe_layers(self) -> int:
        """L_moe, the number of MoE layers (the record's layer axis)."""
        return len(self.moe_layer_ids)

    @property
    def id_dtype(self) -> np.dtype:
        """uint8 up to 256 experts, else uint16 (vLLM 0.32 RoutedExpertsCapturer convention)."""
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    @property
    def id_bits(self) -> int:
        """ceil(log2(num_experts)) bits, the information width of one id."""
        return max(1, int(np.ceil(np.log2(self.num_experts))))

    def dense_layer_ids(self) -> tuple[int, ...]:
        """Decoder layers that are not MoE (their engine rows are zero fill)."""
        moe = set(self.moe_layer_ids)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; inverse of :meth:`from_dict`."""
        return {
            "num_hidden_layers": self.num_hidden_layers,
            "moe_layer_ids": list(self.moe_layer_ids),
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "score_function": self.score_function,
            "id_dtype": self.id_dtype.name,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RoutingSchema":
        """Build from :meth:`to_dict` output.

        Raises:
            SchemaError: a key is missing or has the wrong type.
        """
        try:
            schema = cls(
                num_hidden_layers=_as_int(d["num_hidden_layers"], "num_hidden_layers"),
                moe_layer_ids=tuple(_as_int(i, "moe_layer_ids") for i in d["moe_layer_ids"]),
                top_k=_as_int(d["top_k"], "top_k"),
                num_experts=_as_int(d["num_experts"], "num_experts"),
                score_function=str(d.get("score_function", "softmax")),
            )
        except (KeyError, TypeError) as e:
            raise SchemaError(f"invalid routing schema {dict(d)!r}: {e!r}") from None
        if "id_dtype" in d and d["id_dtype"] != schema.id_dtype.name:
            raise SchemaError(f"schema id_dtype {d['id_dtype']!r} does not match "
                              f"num_experts={schema.num_experts} ({schema.id_dtype.name})")
        return schema

    @classmethod
    def from_hf_config(cls, config: Any) -> "RoutingSchema":
        """Build from a Hugging Face config: a ``transformers`` config object, a dict, a path
        to ``config.json`` or to a model folder holding one.

        Raises:
            SchemaError: the config describes no MoE layers or is not recognised.
        """
        d = _config_dict(config)
        if isinstance(d.get("text_config"), Mapping):   # multimodal wrappers
            d = {**d, **d["text_config"]}
        n_layers = d.get("num_hidden_layers")
        if n_layers is None:
            raise SchemaError("config has no num_hidden_layers")
        n_layers = int(n_layers)
        top_k = d.get("num_experts_per_tok", d.get("experts_per_token", d.get("moe_topk")))
        model_type = str(d.get("model_type", ""))
        score = "sigmoid" if str(d.get("scoring_func", "softmax")) == "sigmoid" else "softmax"

        if d.get("n_routed_experts") is not None:                 # DeepSeek-V2/V3, GLM4-MoE
            num_experts = int(d["n_routed_experts"])
            first_dense = int(d.get("first_k_dense_replace", 0) or 0)
            freq = int(d.get("moe_layer_freq", 1) or 1)
            moe = [i for i in range(n_layers) if i >= first_dense and i % freq == 0]
        elif ("mlp_only_layers" in d or "decoder_sparse_step" in d
              or model_type.startswith(("qwen2_moe", "qwen3_moe"))):   # Qwen2-MoE, Qwen3-MoE
            # NOTE: transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
            num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
            step = int(d.get("decoder_sparse_step", 1) or 1)
            dense = set(int(i) for i in (d.get("mlp_only_layers") or []))
            moe = [i for i in range(n_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0]
        elif d.get("num_local_experts") is not None or d.get("num_experts") is not None:
            num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)  # Mixtral, gpt-oss
            moe = list(range(n_layers))
        else:
            raise SchemaError(
                f"config (model_type={model_type!r}) has no MoE expert count "
                "(num_experts / n_routed_experts / num_local_experts): not an MoE model")
        if num_experts <= 0 or not moe:
            raise SchemaError(f"config (model_type={model_type!r}) has no MoE layers: "
                              "routing replay needs at least one MoE layer")
        if top_k is None:
            raise SchemaError(f"config (model_type={model_type!r}) has no num_experts_per_tok")
        return cls(num_hidden_layers=n_layers, moe_layer_ids=tuple(moe), top_k=int(top_k),
                   num_experts=num_experts, score_function=score)

    def check_same(self, other: "RoutingSchema", what: str = "sidecar") -> None:
        """Raise SchemaError naming each field where ``other`` (e.g. a sidecar's schema)
        differs from this one (e.g. the model's)."""
        diffs = [f"{f.name}: model {getattr(self, f.name)!r} vs {what} {getattr(other, f.name)!r}"
                 for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise SchemaError(f"{what} routing schema does not match the model: " + "; ".join(diffs))

    def strip_dense(self, full: np.ndarray) -> np.ndarray:
        """Select the MoE layers of an engine array.

        Args:
            full: ids [T, num_hidden_layers, top_k] (vLLM 0.32 CompletionOutput.routed_experts
                layout: one slot per decoder layer, dense layers zero-filled).
        Returns:
            ids [T, L_moe, top_k], same dtype, a copy.
        Raises:
            SchemaError: the layer or top_k axis does not match the schema.
        """
        if full.ndim != 3 or full.shape[1] != self.num_hidden_layers or full.shape[2] != self.top_k:
            raise SchemaError(
                f"engine routing has shape {tuple(full.shape)}, expected "
                f"[T, num_hidden_layers={self.num_hidden_layers}, top_k={self.top_k}]")
        return np.ascontiguousarray(full[:, list(self.moe_layer_ids), :])


def _as_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {v!r}")
    return int(v)


def _config_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, "r", encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SchemaError(f"cannot read HF config {path}: {e}") from None
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise SchemaError(f"unsupported config object {type(config).__name__}")


def schema_layers_for(schema: RoutingSchema, layer_ids: Sequence[int]) -> list[int]:
    """Positions on the record's layer axis of the given decoder-layer ids.

    Raises:
        SchemaError: a layer id is not an MoE layer of the schema.
    """
    pos = {lid: i for i, lid in enumerate(schema.moe_layer_ids)}
    try:
        return [pos[int(i)] for i in layer_ids]
    except KeyError as e:
        raise SchemaError(f"decoder layer {e.args[0]} is not an MoE layer "
                          f"(moe_layer_ids={schema.moe_layer_ids})") from None
