"""rkvjax: a JAX/Flax decoding engine for reasoning models with decode-time KV-cache compression."""

from rkvjax import compression
from rkvjax.api import (
    GenerationResult,
    GenerationStats,
    Model,
    ScoreResult,
    generate,
    load,
    logits,
    score,
)
from rkvjax.config import CompressionConfig, ModelConfig

__all__ = [
    "CompressionConfig",
    "GenerationResult",
    "GenerationStats",
    "Model",
    "ModelConfig",
    "ScoreResult",
    "compression",
    "generate",
    "load",
    "logits",
    "score",
]
