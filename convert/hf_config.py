"""Hugging Face `config.json` -> ModelConfig through an allow-list: unknown settings are errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rkvjax.config import ModelConfig, RopeScaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Keys that carry no architecture (training, serialisation, token ids read elsewhere).
_IGNORED = {
    "_name_or_path",
    "attention_dropout",
    "bos_token_id",
    "dtype",
    "eos_token_id",
    "initializer_range",
    "is_llama_config",  # SmolLM2
    "output_attentions",
    "output_hidden_states",
    "pad_token_id",
    "return_dict",
    "tokenizer_class",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "max_window_layers",  # only meaningful with a sliding window, which must be off
    "sliding_window",  # idem
    "model_name",
}

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


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """RoPE from transformers-5 `rope_parameters` or transformers-4 `rope_theta`/`rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params["rope_theta"] = raw["rope_theta"]
        key = "rope_scaling"
    else:
        key = "rope_parameters"
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if "rope_theta" not in params:
        raise ConfigError(f"{where}: no rope_theta (looked in `rope_theta` and `{key}`)")
    theta = float(params.pop("rope_theta"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        missing = _LLAMA3_KEYS - params.keys()
        if missing:
            raise ConfigError(f"{where}: `{key}` of type llama3 lacks {sorted(missing)}")
        scaling = RopeScaling(
            factor=float(params.pop("factor")),
            low_freq_factor=float(params.pop("low_freq_factor")),
            high_freq_factor=float(params.pop("high_freq_factor")),
            original_max_positions=int(params.pop("original_max_position_embeddings")),
        )
    else:
        raise ConfigError(
            f"{where}: `{key}.rope_type` = {rope_type!r} is not supported "
            "(supported: 'default', 'llama3')"
        )
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    if params:
        raise ConfigError(f"{where}: unsupported `{key}` settings {sorted(params)}")
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
    unknown = raw.keys() - _IGNORED - _MUST_EQUAL.keys() - _HANDLED
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
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e


def read_hf_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    with open(path) as f:
        return parse_hf_config(json.load(f), where=str(path))
