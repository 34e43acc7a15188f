"""rkvjax: a JAX/Flax decoding engine for reasoning models with decode-time KV-cache compression.

The public names load on first use (PEP 562): `import rkvjax` alone imports no JAX, so the parts
that need none (request checks, the scheduler, job files) start at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rkvjax.lazy import attribute_loader

if TYPE_CHECKING:
    from rkvjax import compression, evaluation, jobs, policies
    from rkvjax.api import generate, logits, score
    from rkvjax.config import CompressionConfig, compression_config
    from rkvjax.loading import Model, load
    from rkvjax.models.config import ModelConfig
    from rkvjax.results import (
        GenerationResult,
        GenerationStats,
        RunStats,
        ScoreResult,
        StreamDelta,
    )
    from rkvjax.runtime import Engine
    from rkvjax.sampling_params import SamplingParams

_HOMES = {
    "CompressionConfig": "rkvjax.config",
    "Engine": "rkvjax.runtime",
    "GenerationResult": "rkvjax.results",
    "GenerationStats": "rkvjax.results",
    "Model": "rkvjax.loading",
    "ModelConfig": "rkvjax.models.config",
    "RunStats": "rkvjax.results",
    "SamplingParams": "rkvjax.sampling_params",
    "ScoreResult": "rkvjax.results",
    "StreamDelta": "rkvjax.results",
    "compression_config": "rkvjax.config",
    "generate": "rkvjax.api",
    "load": "rkvjax.loading",
    "logits": "rkvjax.api",
    "score": "rkvjax.api",
}
_SUBMODULES = ("compression", "evaluation", "jobs", "policies")

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
    "StreamDelta",
    "compression",
    "compression_config",
    "evaluation",
    "generate",
    "jobs",
    "load",
    "logits",
    "policies",
    "score",
]


__getattr__ = attribute_loader(__name__, _HOMES, _SUBMODULES)
