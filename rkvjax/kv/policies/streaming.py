"""StreamingLLM: the first tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rkvjax import checks, defaults
from rkvjax.kv.policies.base import Policy, register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Streaming(Policy):
    """Keeps the first `sinks` present tokens and then the most recent ones (with fewer than
    `sinks` places to fill, only that many sinks). Reads no queries and no keys."""

    name = "streaming"
    sinks: int = defaults.SINKS  # attention sinks kept at the start

    def check(self) -> None:
        checks.check_int("sinks", self.sinks, 0)

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        w = queries.shape[2]
        cand = valid[..., : keys.shape[2] - w]  # [B, K, m]
        rank = jnp.cumsum(cand, axis=-1) - 1  # [B, K, m] position among the present candidates
        m = cand.shape[-1]
        # Sinks above every recent token, the earliest highest; then the newest first.
        return jnp.where(rank < self.sinks, m + self.sinks - rank, rank).astype(jnp.float32)
