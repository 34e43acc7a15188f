"""Next-token sampling on [B, V] logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """logits [B, V] float32, one key for the step -> tokens [B] int32.

    Each row draws from its own key (`fold_in(key, row)`), so a row's sample does not depend
    on how many rows share the batch.
    """
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)  # [B, V], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p (so the most likely token always stays).
        keep_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < cfg.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    rows = jnp.arange(logits.shape[0])
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
