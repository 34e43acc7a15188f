"""rkvjax: a JAX/Flax decoding engine for reasoning models with decode-time KV-cache compression."""

from rkvjax import compression, evaluation, jobs
from rkvjax.api import generate, logits, score
from rkvjax.config import CompressionConfig, ModelConfig, compression_config
from rkvjax.loading import Model, load
from rkvjax.results import GenerationResult, GenerationStats, RunStats, ScoreResult
from rkvjax.runtime import Engine
from rkvjax.sampling import SamplingParams

__all__ = [
    "CompressionConfig",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "Model",
    "ModelConfig",
    "RunStats",
    "SamplingParams",
    "ScoreResult",
    "compression",
    "compression_config",
    "evaluation",
    "generate",
    "jobs",
    "load",
    "logits",
    "score",
]
