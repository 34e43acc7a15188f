"""The architecture of one decoder-only model: frozen and hashable, the static half of every
jitted function that runs it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of one decoder-only model (Llama, Qwen2, Qwen3 families)."""

    arch: str  # "llama" | "qwen2" | "qwen3": only for messages; behaviour is in the flags below
    vocab_size: int  # V
    embed: int  # D
    ffw: int  # F
    num_layers: int  # L
    q_heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H
    rms_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_positions: int
    qkv_bias: bool = False  # Qwen2, Llama `attention_bias`
    o_bias: bool = False  # Llama `attention_bias` also biases o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )

    @property
    def group(self) -> int:  # G: query heads per KV head
        return self.q_heads // self.kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)
