"""G-KV: a decayed running maximum of window attention, less R-KV's key redundancy."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rkvjax import checks, defaults
from rkvjax.kv import scores
from rkvjax.kv.policies.base import Policy, register
from rkvjax.models.layers import masked_softmax


def _max_normalised(x, valid):
    """x [B, K, m] >= 0 divided by its maximum over the valid entries (1 where that is 0)."""
    top = jnp.max(jnp.where(valid, x, 0.0), axis=-1, keepdims=True)  # [B, K, 1]
    return x / jnp.where(top > 0, top, 1.0)


def window_attention(queries, keys, valid):
    """G-KV's local score of the candidates: float32 [B, K, n - W].

    Each window query's softmax runs over every present key, the window's own keys included
    (causally: window query i sees window keys 0..i); the group's query heads are pooled by the
    max of their probabilities; the candidates' columns are averaged over the W queries and
    divided by their maximum (`compression_score.compute_attention_scores` and
    `ScoreBasedKV.update_kv` in microsoft/G-KV)."""
    b, n_q, w, h = queries.shape
    k_heads, n = keys.shape[1], keys.shape[2]
    m = n - w
    q = queries.astype(jnp.float32).reshape(b, k_heads, n_q // k_heads, w, h)  # [B, K, G, W, H]
    logits = jnp.einsum(
        "BKGWH,BKnH->BKGWn", q, keys.astype(jnp.float32), precision=scores.HIGHEST
    ) / math.sqrt(h)
    causal = jnp.arange(n)[None, :] - m <= jnp.arange(w)[:, None]  # [W, n]
    see = valid[:, :, None, None, :] & causal  # [B, K, 1, W, n]
    probs = jnp.max(masked_softmax(logits, see), axis=2)  # [B, K, W, n]
    local = jnp.mean(probs[..., :m], axis=2)  # [B, K, m]
    return _max_normalised(local, valid[..., :m])


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class GKV(Policy):
    """G-KV (arXiv 2512.00504) as its authors' recipe runs it (microsoft/G-KV `score_based.py`
    with `--suppressing_redundancy --enable_score_cache --smooth_method max`): each key keeps a
    global score g, at every compression g <- max(alpha * g, a) with `a` the window's attention
    (`window_attention`), and the candidates are ranked by `lam * g - (1 - lam) * r` with r
    R-KV's redundancy divided by its maximum. Kept keys carry their g to the next compression;
    a key that has none yet (decoded since, or just out of the window) starts from its a.

    Where this follows a source over another: the paper describes a global score mixing local
    and historical attention, the code a decayed running max refreshed only at compressions,
    which is what this does. Redundancy is R-KV's exact definition (the code's `raw` path); its
    Triton path zeroes the newest match per block of 64 keys, an approximation of it. The
    recipe's window is 16 and its budget 2048; here the engine's `window` and `budget` apply."""

    name = "gkv"
    context = True
    state = "score"
    lam: float = 0.5  # weight of the global attention score against redundancy, in [0, 1]
    alpha: float = 0.8  # decay of a key's global score per compression, in [0, 1]
    threshold: float = defaults.THRESHOLD  # redundancy: cosine above which two keys match
    retain: int = defaults.RETAIN  # redundancy: newest matches of a key that are not counted

    def check(self) -> None:
        checks.check_number("lam", self.lam, 0.0, 1.0)
        checks.check_number("alpha", self.alpha, 0.0, 1.0)
        checks.check_redundancy(self.threshold, self.retain)

    def scores(self, queries, keys, valid, *, impl=None, target=None, context):
        w = queries.shape[2]
        m = keys.shape[2] - w
        cand = valid[..., :m]  # [B, K, m]
        local = window_attention(queries, keys, valid)  # [B, K, m]
        glob = jnp.maximum(self.alpha * context.state[..., :m], local)  # [B, K, m]
        r = scores.redundancy_scores(
            keys,
            valid,
            window=w,
            threshold=self.threshold,
            retain=self.retain,
            impl=impl,
            target=target,
        )  # [B, K, m]
        score = self.lam * glob - (1 - self.lam) * _max_normalised(r, cand)
        # The window's keys have no global score until they leave it.
        state = jnp.concatenate(
            [jnp.where(cand, glob, 0.0), jnp.zeros_like(valid[..., m:], jnp.float32)], -1
        )
        return score, state  # [B, K, m], [B, K, n]
