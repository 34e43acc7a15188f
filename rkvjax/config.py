"""Frozen, hashable configs: the static half of every jitted function."""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any

import numpy as np


def check_int(name: str, value, low: int) -> None:
    """Raises ValueError unless value is an int (not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


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


COMPRESSING_METHODS = ("rkv", "snapkv", "streaming")
METHODS = ("full", *COMPRESSING_METHODS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """KV-cache policy of one generation (RKV_SPEC.md). Static: part of the compiled program."""

    method: str = "full"  # "full" | "rkv" | "snapkv" | "streaming"
    budget: int = 0  # tokens kept per (layer, KV head, row) after a compression, window included
    buffer: int = 128  # decoded tokens appended between compressions
    window: int = 8  # W: the newest tokens' queries score importance; their K/V are always kept
    kernel: int = 7  # importance max-pool width
    lam: float = 0.1  # score = lam * importance - (1 - lam) * redundancy
    threshold: float = 0.5  # cosine above which two keys are redundant
    retain: int = 1  # newest redundant copies not counted (the reference keeps 1)
    think_end_id: int | None = None  # stop compressing a row once it emits this token
    answer_slots: int = 0  # extra slots for the answer after think_end_id (think-only mode)
    pallas: bool | None = None  # Pallas kernels: None = auto (`compression.use_pallas`), or force

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not self.compressing:
            return
        for name in ("budget", "buffer", "window", "kernel", "retain", "answer_slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.budget <= self.window:
            raise ValueError(
                f"budget ({self.budget}) must be larger than window ({self.window}): the window's "
                "tokens are always kept, so a smaller budget leaves nothing to select"
            )
        if self.buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {self.buffer}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd int, got {self.kernel}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine and must be in [-1, 1], got {self.threshold}")
        if self.retain < 1:
            raise ValueError(f"retain must be >= 1, got {self.retain}")
        if self.answer_slots < 0:
            raise ValueError(f"answer_slots must be >= 0, got {self.answer_slots}")
        if self.pallas not in (None, True, False):
            raise ValueError(f"pallas must be None, True or False, got {self.pallas!r}")
        if self.answer_slots and self.think_end_id is None:
            raise ValueError("answer_slots only applies with think_end_id (think-only mode)")

    @property
    def compressing(self) -> bool:
        return self.method != "full"

    @property
    def trigger(self) -> int:
        """Slots at which a (thinking) row is compressed back to `budget`."""
        return self.budget + self.buffer

    @property
    def capacity(self) -> int:
        """Static slots per (layer, KV head, row) of a compressing cache."""
        return self.budget + self.buffer + self.answer_slots


def compression_config(
    method: str = "rkv",
    budget: int | float | None = None,
    *,
    prompt_len: int = 0,
    max_new_tokens: int = 0,
    buffer: int = 128,
    window: int = 8,
    kernel: int = 7,
    lam: float = 0.1,
    threshold: float = 0.5,
    retain: int = 1,
    think_end_id: int | None = None,
    answer_slots: int | None = None,
    pallas: bool | None = None,
) -> CompressionConfig:
    """The one place user-facing cache settings become a validated `CompressionConfig`.

    `budget=None` or `method="full"` means FullKV. A float budget in (0, 1] is a fraction of
    `prompt_len + max_new_tokens` (the longest prompt and longest generation of a run),
    rounded, and at least `window + 1`.

    Raises:
      ValueError: naming the first bad setting.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if budget is None or method == "full":
        return CompressionConfig(method="full")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise ValueError(f"budget must be an int (tokens) or a float in (0, 1], got {budget!r}")
    if isinstance(budget, (float, np.floating)):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a float budget is a fraction in (0, 1], got {budget}")
        if prompt_len + max_new_tokens < 1:
            raise ValueError("a fractional budget needs the prompt and generation lengths")
        budget = max(round(budget * (prompt_len + max_new_tokens)), window + 1)
    if think_end_id is None and answer_slots:
        raise ValueError("answer_slots needs think_end_id (think-only mode)")
    return CompressionConfig(
        method=method,
        budget=int(budget),
        buffer=buffer,
        window=window,
        kernel=kernel,
        lam=lam,
        threshold=threshold,
        retain=retain,
        think_end_id=think_end_id,
        answer_slots=(512 if answer_slots is None else answer_slots) if think_end_id else 0,
        pallas=pallas,
    )
