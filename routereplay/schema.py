"""Routing schema: which decoder layers are MoE, top_k, num_experts, id dtype.

The schema is what turns an engine's ``[T, num_hidden_layers, top_k]`` array into a
record ``[T, L_moe, top_k]`` with dense layers stripped (engines zero-fill dense layers,
which cannot be told from expert 0), and what a trainer checks a sidecar against.

Built from a Hugging Face config (:meth:`RoutingSchema.from_hf_config`; which layers are
MoE: :func:`moe_placement`). A config whose placement cannot be determined is refused,
naming the key, rather than guessed.
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
        for name in ("num_hidden_layers", "top_k", "num_experts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SchemaError(f"{name} must be an integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        ids = self.moe_layer_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or any(
                isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
            raise SchemaError(f"moe_layer_ids must be a sequence of integers, got {ids!r}")
        object.__setattr__(self, "moe_layer_ids", tuple(int(i) for i in ids))
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
        if not isinstance(self.score_function, str) or self.score_function not in SCORE_FUNCTIONS:
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
            SchemaError: not a mapping, a key is missing or has the wrong type.
        """
        if not isinstance(d, Mapping):
            raise SchemaError(f"a routing schema must be a JSON object, got {type(d).__name__}")
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

        Expert count: ``n_routed_experts``, ``num_experts``, ``num_local_experts`` or
        ``moe_num_experts``; top_k: ``num_experts_per_tok``, ``experts_per_token``,
        ``moe_topk`` or ``moe_k``; MoE layers: :func:`moe_placement`; a text model nested in
        a multimodal config (``text_config``, ``llm_config``, ...) is found.

        Raises:
            SchemaError: the config describes no MoE layers, is not recognised, or states
                MoE placement in a way that cannot be determined (names the key).
        """
        d = _text_config(_config_dict(config))
        n_layers = d.get("num_hidden_layers")
        if n_layers is None:          # transformers 5 Nemotron-H: the length of its pattern
            n_layers = next((len(d[k]) for k in _PATTERN_KEYS + _LAYER_TYPE_KEYS[:1]
                             if isinstance(d.get(k), (str, list))), None)
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise SchemaError(f"config has no usable num_hidden_layers ({n_layers!r})")
        if n_layers > MAX_CONFIG_LAYERS:
            # NOTE: before the placement is expanded into a list
            raise SchemaError(f"config states num_hidden_layers={n_layers}, above the "
                              f"{MAX_CONFIG_LAYERS} decoder layers routereplay accepts")
        model_type = str(d.get("model_type", ""))
        num_experts = _first_int(d, ("n_routed_experts", "num_experts", "num_local_experts",
                                     "moe_num_experts"))
        if num_experts is None:
            raise SchemaError(
                f"config (model_type={model_type!r}) has no MoE expert count "
                "(num_experts / n_routed_experts / num_local_experts): not an MoE model")
        top_k = _first_int(d, ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k"))
        score = "sigmoid" if str(d.get("scoring_func", "softmax")) == "sigmoid" else "softmax"
        moe = moe_placement(d, n_layers) if num_experts > 0 else []
        if num_experts <= 0 or not moe:
            raise SchemaError(f"config (model_type={model_type!r}) has no MoE layers: "
                              "routing replay needs at least one MoE layer")
        if top_k is None:
            raise SchemaError(f"config (model_type={model_type!r}) has no num_experts_per_tok")
        return cls(num_hidden_layers=n_layers, moe_layer_ids=tuple(moe), top_k=top_k,
                   num_experts=num_experts, score_function=score)

    def check_same(self, other: "RoutingSchema", what: str = "sidecar") -> None:
        """Raise SchemaError naming each field where ``other`` (e.g. a sidecar's schema)
        differs from this one (e.g. the model's)."""
        if not isinstance(other, RoutingSchema):
            raise SchemaError(f"{what} has no routing schema (got {type(other).__name__})")
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
        if not isinstance(full, np.ndarray):
            raise SchemaError(f"engine routing must be a numpy array, got {type(full).__name__}")
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


# NOTE: model types whose configs may leave their placement keys out, and the defaults
# transformers then applies (configuration_<model>.py); every other MoE config that holds
# no placement key at all has every layer MoE (Mixtral, gpt-oss, OLMoE, Phi-MoE, ...).
_PLACEMENT_DEFAULTS: dict[str, dict[str, Any]] = {
    "jamba": {"expert_layer_period": 2, "expert_layer_offset": 1},
    "ernie4_5_moe": {"moe_layer_start_index": 1, "moe_layer_end_index": -1,
                     "moe_layer_interval": 1},
}
_NEEDS_PLACEMENT = ("nemotron_h",)          # hybrid: placement only from its pattern
_PATTERN_KEYS = ("hybrid_override_pattern",)
_LAYER_TYPE_KEYS = ("layers_block_type", "layer_types", "mlp_layer_types", "layer_block_types",
                    "block_types")
_MOE_TYPES = ("moe", "sparse", "expert", "experts", "e")
_DENSE_TYPES = ("mlp", "dense", "-", "ffn")
_MIXER_WORDS = ("attention", "attn", "mamba", "conv", "ssm", "linear", "recurrent")
_KNOWN_PLACEMENT_KEYS = set(_PATTERN_KEYS + _LAYER_TYPE_KEYS + (
    "moe_layers", "moe_layer_freq", "first_k_dense_replace", "num_dense_layers",
    "mlp_only_layers", "decoder_sparse_step", "interleave_moe_layer_step",
    "expert_layer_period", "expert_layer_offset", "moe_layer_start_index",
    "moe_layer_end_index", "moe_layer_interval"))
_PLACEMENT_WORDS = ("moe", "expert", "sparse", "dense", "mlp_only", "hybrid")
_PLACEMENT_SHAPES = ("layer", "pattern", "step", "freq", "interval", "period", "replace",
                     "skip", "index")


MAX_CONFIG_LAYERS = 1 << 16
"""Most decoder layers a model config may state (the largest public MoE models have under
100); checked before any per-layer list is built from a config."""


def moe_placement(d: Mapping[str, Any], num_hidden_layers: int) -> list[int]:
    """Decoder-layer indices (0-based, sorted) that are MoE, from an HF config dict.

    Every form in use is understood; where a config holds several, they must agree:

    - a hybrid pattern string, one character a layer, ``'E'`` = MoE
      (``hybrid_override_pattern``, NVIDIA Nemotron-H);
    - a per-layer type list (``layers_block_type``, ``layer_types``, ``mlp_layer_types``):
      entries ``"moe"``/``"sparse"`` are MoE, ``"mlp"``/``"dense"`` dense; a list naming
      attention kinds only (gpt-oss, Qwen3-Next ``layer_types``) says nothing about MoE
      and is ignored;
    - ``moe_layers`` (Llama 4), else ``interleave_moe_layer_step`` s: layers s-1, 2s-1, ...;
    - ``moe_layer_freq``: an int f (DeepSeek, Megatron): i % f == 0; a list of 0/1 per
      layer (Megatron): 1 = MoE; ANDed with ``first_k_dense_replace`` k (DeepSeek,
      GLM4-MoE, dots1) / ``num_dense_layers`` k (AFMoE, LFM2-MoE): i >= k;
    - ``mlp_only_layers`` and ``decoder_sparse_step`` s (Qwen2/3-MoE, Qwen3-Next):
      i not in mlp_only_layers and (i + 1) % s == 0;
    - ``expert_layer_period`` p, ``expert_layer_offset`` o (Jamba): i % p == o;
    - ``moe_layer_start_index``, ``moe_layer_end_index`` (-1: last),
      ``moe_layer_interval`` n (ERNIE 4.5): start <= i <= end and (i + 1) % n == 0;
    - none of these keys: every layer is MoE (Mixtral, gpt-oss, OLMoE, ...).

    Raises:
        SchemaError: naming the key: a value of the wrong type or length, an unknown layer
            kind, two keys that disagree, a key that looks like MoE placement but is not
            understood, or a hybrid model type without its pattern.
    """
    n = num_hidden_layers
    model_type = str(d.get("model_type", ""))
    d = {**_PLACEMENT_DEFAULTS.get(model_type, {}),
         **{k: v for k, v in d.items() if v is not None}}
    unknown = sorted(k for k in d if k not in _KNOWN_PLACEMENT_KEYS and not k.startswith("mtp_")
                     and any(w in k.lower() for w in _PLACEMENT_WORDS)
                     and any(w in k.lower() for w in _PLACEMENT_SHAPES))
    if unknown:
        raise SchemaError(f"config (model_type={model_type!r}) key {unknown[0]!r} looks like MoE "
                          "layer placement but is not understood: cannot tell which layers are "
                          "MoE (build the RoutingSchema explicitly)")
    found: list[tuple[str, set[int]]] = []      # (keys, MoE layers) per form present

    for key in _PATTERN_KEYS:
        if key in d:
            pat = d[key]
            if not isinstance(pat, str) or len(pat) != n:
                raise SchemaError(f"config key {key!r} must be a string of one character per "
                                  f"layer ({n}), got {str(pat)[:80]!r}")
            found.append((key, {i for i, c in enumerate(pat) if c == "E"}))
    for key in _LAYER_TYPE_KEYS:
        if key in d:
            kinds = _layer_kinds(key, d[key], n)
            if kinds is not None:
                found.append((key, kinds))
    if "moe_layers" in d:
        found.append(("moe_layers", _index_list("moe_layers", d["moe_layers"], n)))
    elif "interleave_moe_layer_step" in d:
        s = _pos_int(d, "interleave_moe_layer_step")
        found.append(("interleave_moe_layer_step", set(range(s - 1, n, s))))
    first_keys = [k for k in ("first_k_dense_replace", "num_dense_layers") if k in d]
    if first_keys or "moe_layer_freq" in d:
        layers = set(range(n))
        for k in first_keys:
            layers &= set(range(_nonneg_int(d, k), n))
        if "moe_layer_freq" in d:
            freq = d["moe_layer_freq"]
            if isinstance(freq, list):
                if len(freq) != n or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
                    raise SchemaError(f"config key 'moe_layer_freq' as a list must hold 0 or 1 "
                                      f"per layer ({n}), got {str(freq)[:80]}")
                layers &= {i for i, x in enumerate(freq) if x == 1}
            else:
                f = _pos_int(d, "moe_layer_freq")
                layers &= {i for i in range(n) if i % f == 0}
        found.append(("/".join(first_keys + (["moe_layer_freq"] if "moe_layer_freq" in d
                                             else [])), layers))
    if "mlp_only_layers" in d or "decoder_sparse_step" in d:
        dense = _index_list("mlp_only_layers", d.get("mlp_only_layers", []), n)
        s = _pos_int(d, "decoder_sparse_step") if "decoder_sparse_step" in d else 1
        found.append(("mlp_only_layers/decoder_sparse_step",
                      {i for i in range(n) if i not in dense and (i + 1) % s == 0}))
    if "expert_layer_period" in d or "expert_layer_offset" in d:
        p = _pos_int(d, "expert_layer_period") if "expert_layer_period" in d else 1
        o = _nonneg_int(d, "expert_layer_offset") if "expert_layer_offset" in d else 0
        found.append(("expert_layer_period/expert_layer_offset",
                      {i for i in range(n) if i % p == o}))
    if any(k in d for k in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")):
        a = _nonneg_int(d, "moe_layer_start_index") if "moe_layer_start_index" in d else 0
        b = d.get("moe_layer_end_index", -1)
        b = n - 1 if b == -1 else _nonneg_int(d, "moe_layer_end_index")
        s = _pos_int(d, "moe_layer_interval") if "moe_layer_interval" in d else 1
        found.append(("moe_layer_start_index/moe_layer_end_index/moe_layer_interval",
                      {i for i in range(n) if a <= i <= b and (i + 1) % s == 0}))

    if not found:
        if model_type in _NEEDS_PLACEMENT:
            raise SchemaError(f"config (model_type={model_type!r}) has no "
                              f"{' / '.join(_PATTERN_KEYS + _LAYER_TYPE_KEYS[:1])}: cannot tell "
                              "which of its hybrid layers are MoE")
        return list(range(n))
    key0, moe0 = found[0]
    for key, moe in found[1:]:
        if moe != moe0:
            raise SchemaError(f"config keys disagree on the MoE layers: {key0!r} gives "
                              f"{sorted(moe0)}, {key!r} gives {sorted(moe)}")
    return sorted(moe0)


def _layer_kinds(key: str, kinds: Any, n: int) -> set[int] | None:
    """MoE layers from a per-layer type list, or None when the list names attention kinds
    only (it then says nothing about MoE placement)."""
    if not isinstance(kinds, list) or not all(isinstance(x, str) for x in kinds):
        raise SchemaError(f"config key {key!r} must be a list of layer kinds (strings), got "
                          f"{str(kinds)[:80]}")
    low = [x.lower() for x in kinds]
    is_moe = [x in _MOE_TYPES or "moe" in x or "sparse" in x for x in low]
    is_dense = [x in _DENSE_TYPES or "dense" in x for x in low]
    if not any(is_moe) and not any(is_dense):
        return None
    for x, m, dn in zip(kinds, is_moe, is_dense):
        if not (m or dn or any(w in x.lower() for w in _MIXER_WORDS) or x in ("M", "*")):
            raise SchemaError(f"config key {key!r} holds layer kind {x[:40]!r}: neither MoE "
                              f"({'/'.join(_MOE_TYPES[:3])}), dense (mlp/dense) nor a mixer "
                              "(attention/mamba/conv)")
    if len(kinds) != n:
        raise SchemaError(f"config key {key!r} lists {len(kinds)} layer kinds for "
                          f"num_hidden_layers={n}")
    return {i for i, m in enumerate(is_moe) if m}


def _index_list(key: str, v: Any, n: int) -> set[int]:
    if not isinstance(v, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                      or not 0 <= i < n for i in v):
        raise SchemaError(f"config key {key!r} must be a list of layer indices in [0, {n}), "
                          f"got {str(v)[:80]}")
    return set(v)


def _pos_int(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SchemaError(f"config key {key!r} must be an integer >= 1, got {v!r}")
    return v


def _nonneg_int(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SchemaError(f"config key {key!r} must be an integer >= 0, got {v!r}")
    return v


def _first_int(d: Mapping[str, Any], keys: Sequence[str]) -> int | None:
    """The first of ``keys`` that is set, as an int (None when none is set).

    Raises:
        SchemaError: the value is not an integer (e.g. a per-layer list), naming the key.
    """
    for k in keys:
        v = d.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise SchemaError(f"config key {k!r} must be an integer, got {str(v)[:80]}")
        return v
    return None


_NESTED_TEXT = (("text_config",), ("llm_config",), ("language_config",),
                ("thinker_config", "text_config"))


def _text_config(d: dict) -> dict:
    """The config of the text model: ``d`` itself when it has num_hidden_layers, else the
    first nested text config (multimodal wrappers: Qwen3-VL-MoE, Llama 4, Qwen3-Omni)."""
    if "num_hidden_layers" in d or any(k in d for k in _PATTERN_KEYS + _LAYER_TYPE_KEYS[:1]):
        return d
    for path in _NESTED_TEXT:
        sub: Any = d
        for key in path:
            sub = sub.get(key) if isinstance(sub, Mapping) else None
        if isinstance(sub, Mapping):
            return dict(sub)
    return d


def schema_layers_for(schema: RoutingSchema, layer_ids: Sequence[int]) -> list[int]:
    """Positions on the record's layer axis of the given decoder-layer ids.

    Raises:
        SchemaError: a layer id is not an MoE layer of the schema.
    """
    pos = {lid: i for i, lid in enumerate(schema.moe_layer_ids)}
    out = []
    for i in layer_ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or int(i) not in pos:
            raise SchemaError(f"decoder layer {i!r} is not an MoE layer "
                              f"(moe_layer_ids={schema.moe_layer_ids})")
        out.append(pos[int(i)])
    return out
