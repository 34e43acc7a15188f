"""Hugging Face `config.json` -> ModelConfig through an allow-list: unknown settings are errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rkvjax.models.config import Experts, ModelConfig, RopeScaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# A mixture of experts' keys, read for the MoE architectures only (elsewhere they are unknown).
MOE_KEYS = {
    "num_experts",
    "num_local_experts",  # transformers 5 writes the expert count under this name
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "router_aux_loss_coef",  # training only
    "output_router_logits",  # idem
}
_MOE_ARCHS = {"qwen3_moe"}

# Keys that carry no architecture (training, serialisation; see also `_is_metadata`).
_IGNORED = {
    "attention_dropout",
    "dtype",
    "initializer_range",
    "is_llama_config",  # SmolLM2
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tokenizer_class",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "max_window_layers",  # only meaningful with a sliding window, which must be off
    "sliding_window",  # idem
    "model_name",
    # Task metadata (a classification head's labels, the tuning task, pipeline defaults): the
    # causal LM that `architectures` names has no such head.
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
}


def _is_metadata(key: str) -> bool:
    """Keys that cannot change the model's math, whatever their name: transformers' private
    bookkeeping (`_name_or_path`, `_model_name_or_path`, `_commit_hash`), special-token ids
    (`eos_token_id`, `unk_token_id`, `sep_token_id`: the tokenizer's business, not the decoder's)
    and other libraries' namespaced keys (`transformers.js_config`: no model code reads a dotted
    name)."""
    return key.startswith("_") or key.endswith("_token_id") or "." in key


# Keys accepted only at one value (or one of a few): anything else changes the math.
_MUST_EQUAL: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "pretraining_tp": (1,),
    "rope_interleaved": (False,),
    "use_mrope": (False,),
}

_HANDLED = {
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "layer_types",
}

_LLAMA3_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


class ConfigError(ValueError):
    """A config.json this engine cannot run exactly."""


_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def _rope_dict(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """`raw[key]` with the legacy `type` spelled `rope_type`; {} when absent or null."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: `{key}` must be a JSON object or null, got {value!r}")
    params = dict(value)
    if "type" in params:
        legacy = params.pop("type")
        if params.setdefault("rope_type", legacy) != legacy:
            raise ConfigError(
                f"{where}: `{key}.type` = {legacy!r} and `{key}.rope_type` = "
                f"{params['rope_type']!r} disagree; keep one of them"
            )
    return params


def _rope_settings(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """RoPE settings merged from transformers-5 `rope_parameters`, transformers-4 `rope_scaling`
    and top-level `rope_theta`, with each setting's source key.

    Files often carry both spellings, and transformers reads each from a different one (5 lets
    `rope_scaling` replace `rope_parameters`, 4 ignores `rope_parameters`), so a setting given
    twice must have one value: otherwise which model runs depends on the reader.
    """
    sources = [(f"{key}.", _rope_dict(raw, key, where)) for key in _ROPE_KEYS]
    if raw.get("rope_theta") is not None:
        sources.append(("", {"rope_theta": raw["rope_theta"]}))
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for prefix, params in sources:
        for name, value in params.items():
            if name in merged and merged[name] != value:
                raise ConfigError(
                    f"{where}: `{origin[name]}` = {merged[name]!r} and `{prefix}{name}` = "
                    f"{value!r} disagree; give the setting once, or the same value in both"
                )
            merged.setdefault(name, value)
            origin.setdefault(name, f"{prefix}{name}")
    return merged, origin


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """RoPE from `rope_parameters`, `rope_scaling` and `rope_theta`, which must agree."""
    params, origin = _rope_settings(raw, where)
    rope_type = params.pop("rope_type", "default")
    if "rope_theta" not in params:
        raise ConfigError(
            f"{where}: no rope_theta (looked in `rope_theta`, `rope_parameters` and `rope_scaling`)"
        )
    theta = float(params.pop("rope_theta"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        missing = _LLAMA3_KEYS - params.keys()
        if missing:
            raise ConfigError(f"{where}: `{origin['rope_type']}` llama3 lacks {sorted(missing)}")
        scaling = RopeScaling(
            factor=float(params.pop("factor")),
            low_freq_factor=float(params.pop("low_freq_factor")),
            high_freq_factor=float(params.pop("high_freq_factor")),
            original_max_positions=int(params.pop("original_max_position_embeddings")),
        )
    else:
        raise ConfigError(
            f"{where}: `{origin['rope_type']}` = {rope_type!r} is not supported "
            "(supported: 'default', 'llama3')"
        )
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    if params:
        raise ConfigError(f"{where}: unsupported RoPE settings {sorted(origin[k] for k in params)}")
    return theta, scaling


def parse_hf_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Maps a Hugging Face config dict onto ModelConfig, or raises ConfigError naming the key."""
    arch = raw.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[arch]]:
        raise ConfigError(
            f"{where}: architectures {archs} is not supported for model_type {arch!r} "
            f"(expected [{ARCHITECTURES[arch]!r}])"
        )
    known = _IGNORED | _MUST_EQUAL.keys() | _HANDLED | (MOE_KEYS if arch in _MOE_ARCHS else set())
    unknown = {k for k in raw if k not in known and not _is_metadata(k)}
    if unknown:
        raise ConfigError(
            f"{where}: unsupported config key(s) {sorted(unknown)}; rkvjax refuses settings it "
            "does not implement rather than run a different model"
        )
    for key, allowed in _MUST_EQUAL.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"{where}: `{key}` = {raw[key]!r} is not supported (need {allowed})")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ConfigError(
            f"{where}: `layer_types` must all be 'full_attention' (no sliding window)"
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if key not in raw:
            raise ConfigError(f"{where}: missing required key `{key}`")
    q_heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or q_heads)
    theta, scaling = _rope(raw, where)
    bias = bool(raw.get("attention_bias", False))
    experts = _experts(raw, where) if arch in _MOE_ARCHS else None
    try:
        return ModelConfig(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            embed=int(raw["hidden_size"]),
            ffw=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // q_heads),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_positions=int(raw.get("max_position_embeddings", 2048)),
            # Qwen2 always biases q/k/v (never o); Llama and Qwen3 bias all four via attention_bias.
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            experts=experts,
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e


def _int(raw: dict[str, Any], key: str, where: str, *, low: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}: `{key}` must be an integer >= {low}, got {value!r}")
    return value


def _experts(raw: dict[str, Any], where: str) -> Experts | None:
    """Qwen3-MoE's experts: layer i is sparse unless listed in `mlp_only_layers`, when
    `(i + 1) % decoder_sparse_step == 0` (transformers' rule); None without experts."""
    count_keys = [k for k in ("num_experts", "num_local_experts") if raw.get(k) is not None]
    if not count_keys:
        raise ConfigError(f"{where}: a MoE config needs `num_experts`")
    if len({raw[k] for k in count_keys}) > 1:
        raise ConfigError(
            f"{where}: `num_experts` = {raw['num_experts']!r} and `num_local_experts` = "
            f"{raw['num_local_experts']!r} disagree; give the count once"
        )
    count = _int(raw, count_keys[0], where, low=0)
    if count == 0:
        return None  # transformers builds every layer dense
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in raw:
            raise ConfigError(f"{where}: a MoE config needs `{key}`")
    top_k = _int(raw, "num_experts_per_tok", where, low=1)
    if top_k > count:
        raise ConfigError(f"{where}: `num_experts_per_tok` = {top_k} exceeds num_experts={count}")
    layers = _int(raw, "num_hidden_layers", where, low=1)
    step = _int(raw, "decoder_sparse_step", where, low=1) if "decoder_sparse_step" in raw else 1
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense
    ):
        raise ConfigError(
            f"{where}: `mlp_only_layers` must list layer indices in [0, {layers}), got {dense!r}"
        )
    return Experts(
        count=count,
        top_k=top_k,
        ffw=_int(raw, "moe_intermediate_size", where, low=1),
        norm_top_k=bool(raw.get("norm_topk_prob", False)),
        layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def read_json_object(path: Path, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in `path`, or `error` naming the file when it is not one."""
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise error(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            "restore the file from the model's original folder"
        ) from None
    except ValueError as e:  # bytes that are no UTF-8/16/32 text
        raise error(f"{path}: not a JSON text file ({e}); restore it from the original") from None
    if not isinstance(data, dict):
        raise error(
            f"{path}: expected a JSON object ({{...}}), found a {type(data).__name__}; "
            "restore the file from the model's original folder"
        )
    return data


def read_hf_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a model folder's config.json."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    return parse_hf_config(read_json_object(path, ConfigError), where=str(path))
