"""KeyDiff: keys least similar to the mean key direction are kept (reads no queries)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rkvjax.kv import scores
from rkvjax.kv.policies.base import Policy, register
from rkvjax.models.layers import unit_vectors


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDiff(Policy):
    """KeyDiff (arXiv 2504.15364), as NVIDIA kvpress scores it (`keydiff_press.py`): the anchor
    `a` is the mean of the unit keys of every cached token (the window's included), and a key's
    score is -cos(k_i, a), so the keys most unlike the common direction are kept. The paper
    evicts block by block while prefilling; at decode time each compression is one such block.
    Attention-free: it needs no queries, so it also suits kernels that never form attention
    weights. No hyperparameters."""

    name = "keydiff"

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        w = queries.shape[2]
        k = unit_vectors(keys)  # [B, K, n, H]
        present = valid[..., None]  # [B, K, n, 1]
        count = jnp.maximum(jnp.sum(valid, axis=-1), 1)[..., None, None]  # [B, K, 1, 1]
        anchor = jnp.sum(jnp.where(present, k, 0.0), axis=2, keepdims=True) / count  # [B,K,1,H]
        cos = jnp.einsum("BKnH,BKxH->BKn", k, unit_vectors(anchor), precision=scores.HIGHEST)
        return -cos[..., : keys.shape[2] - w]  # [B, K, n - W]
