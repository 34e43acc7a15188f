"""rkvjax: a JAX/Flax decoding engine for reasoning models with decode-time KV-cache compression.

The public names load on first use (PEP 562): `import rkvjax` alone imports no JAX, so the parts
that need none (request checks, the scheduler, job files) start at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rkvjax.lazy import attribute_loader

if TYPE_CHECKING:
    from rkvjax import compression, policies
    from rkvjax.api import generate, logits, score
    from rkvjax.entrypoints import evaluation, jobs, serve
    from rkvjax.kv.config import CompressionConfig, compression_config
    from rkvjax.models import loading, sharding
    from rkvjax.models.config import ModelConfig
    from rkvjax.models.loading import Model, load
    from rkvjax.runtime import Engine
    from rkvjax.runtime.results import (
        GenerationResult,
        GenerationStats,
        RunStats,
        ScoreResult,
        StreamDelta,
    )
    from rkvjax.sampling.params import SamplingParams

_HOMES = {
    "CompressionConfig": "rkvjax.kv.config",
    "Engine": "rkvjax.runtime",
    "GenerationResult": "rkvjax.runtime.results",
    "GenerationStats": "rkvjax.runtime.results",
    "Model": "rkvjax.models.loading",
    "ModelConfig": "rkvjax.models.config",
    "RunStats": "rkvjax.runtime.results",
    "SamplingParams": "rkvjax.sampling.params",
    "ScoreResult": "rkvjax.runtime.results",
    "StreamDelta": "rkvjax.runtime.results",
    "compression_config": "rkvjax.kv.config",
    "generate": "rkvjax.api",
    "load": "rkvjax.models.loading",
    "logits": "rkvjax.api",
    "score": "rkvjax.api",
}
# Modules reached as attributes of the package (`rkvjax.jobs.run_job`): the public aliases
# `compression` and `policies`, and where the layers put the others.
_SUBMODULES = {
    "compression": "rkvjax.compression",
    "evaluation": "rkvjax.entrypoints.evaluation",
    "jobs": "rkvjax.entrypoints.jobs",
    "loading": "rkvjax.models.loading",
    "policies": "rkvjax.policies",
    "serve": "rkvjax.entrypoints.serve",
    "sharding": "rkvjax.models.sharding",
}

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
    "loading",
    "logits",
    "policies",
    "score",
    "serve",
    "sharding",
]


__getattr__ = attribute_loader(__name__, _HOMES, _SUBMODULES)
