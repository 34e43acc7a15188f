"""H2O: heavy hitters, the keys that have received the most attention, and the recent window."""

from __future__ import annotations

import dataclasses

from rkvjax.kv.policies.base import Policy, register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(Policy):
    """H2O (arXiv 2306.14048) as its authors' code scores keys (`H2OKVCache_LayerWise` in
    FMInference/H2O): a key's score is the attention it has received, summed over every query
    since it entered the cache (the prompt's queries and one per decode step), and the keys with
    the most are kept beside the recent ones.

    The engine carries the sums in the cache (`state = "attention"`): each decode step adds its
    softmax weights, a compression moves a key's sum with it, and a new key starts from its own
    query's weight. Where the authors' code differs from the engine's rules:
    - it evicts one key per step once the cache is full; here, as for every method, a row is
      compressed from `budget + buffer` back to `budget` keys, the last `window` always kept;
    - it scores each query head (its models have no grouped queries); here a KV head's key sums
      the weights of every query head of its group, one kept set per KV head.
    R-KV's and TriAttention's `h2o` baselines score only the last query at each compression
    (no accumulation); that is SnapKV with a window of one, not H2O, so this follows the paper.
    No hyperparameters: the recent part is the engine's `window`."""

    name = "h2o"
    context = True
    state = "attention"

    def scores(self, queries, keys, valid, *, impl=None, target=None, context):
        w = queries.shape[2]
        return context.state[..., : keys.shape[2] - w]  # [B, K, n - W]
