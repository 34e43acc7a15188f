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
class Experts:
    """A mixture-of-experts MLP (Qwen3-MoE): a router picks `top_k` of `count` SwiGLU experts
    per token, and the token's output is their outputs weighted by the router's softmax."""

    count: int  # E
    top_k: int  # k
    ffw: int  # F: one expert's hidden size
    norm_top_k: bool  # the chosen experts' weights renormalised to sum to one
    layers: tuple[int, ...]  # the layers whose MLP is the experts; the others are dense (ffw)

    def __post_init__(self):
        if not 1 <= self.top_k <= self.count:
            raise ValueError(f"top_k ({self.top_k}) must lie in [1, experts={self.count}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of one decoder-only model (Llama, Qwen2, Qwen3, Qwen3-MoE families)."""

    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe": for messages; behaviour is below
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
    experts: Experts | None = None  # mixture-of-experts layers (None: every MLP dense)

    def __post_init__(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the experts."""
        return self.experts is not None and layer in self.experts.layers

    def parameters(self, *, active: bool = False) -> int:
        """The weights' element count; with `active`, those one token uses (the router and its
        top_k experts of each MoE layer, not all of them)."""
        d, h, n, k = self.embed, self.head_dim, self.q_heads, self.kv_heads
        attention = (n + 2 * k) * h * d + n * h * d + 2 * d  # q, k, v, o and the two norms
        attention += (n + 2 * k) * h * self.qkv_bias + d * self.o_bias + 2 * h * self.qk_norm
        total = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        for layer in range(self.num_layers):
            if self.sparse(layer):
                e = self.experts
                used = e.top_k if active else e.count
                total += attention + e.count * d + used * 3 * d * e.ffw
            else:
                total += attention + 3 * d * self.ffw
        return total

    def describe(self) -> str:
        """The architecture and its size, for a command's first line: "llama, 135M
        parameters", "qwen3_moe, 3.35B of 30.5B parameters active"."""

        def size(n: int) -> str:
            return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"

        total, active = self.parameters(), self.parameters(active=True)
        if active == total:
            return f"{self.arch}, {size(total)} parameters"
        return f"{self.arch}, {size(active)} of {size(total)} parameters active"

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
        if d.get("experts") is not None:
            e = dict(d["experts"])
            d["experts"] = Experts(**{**e, "layers": tuple(e["layers"])})
        return cls(**d)
