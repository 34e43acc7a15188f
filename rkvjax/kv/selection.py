"""One compression step: a cache policy's scores turned into kept positions. Pure, traceable jnp.

The keep rule is every method's: the last `window` keys are kept, and of the others the
`budget - window` with the highest scores of the method (`rkvjax.kv.policies`), ties towards the
lower position, keys that are not there last. `select` is the engine's path (with a validity
mask); `keep_indices` is the public one (every key present).
"""

from __future__ import annotations

import jax.numpy as jnp

from rkvjax import checks
from rkvjax.defaults import SINKS, WINDOW
from rkvjax.kv import policies
from rkvjax.kv.policies.rkv import rkv_scores
from rkvjax.kv.scores import importance, redundancy, redundancy_scores, topk_positions, use_pallas

# R-KV and the paper's baselines; `rkvjax.kv.policies.names()` lists every registered method.
METHODS = ("rkv", "snapkv", "streaming")
__all__ = [
    "METHODS",
    "SINKS",
    "candidate_scores",
    "importance",
    "keep",
    "keep_indices",
    "redundancy",
    "redundancy_scores",
    "rkv_scores",
    "scores_and_state",
    "select",
    "topk_positions",
    "use_pallas",
]


def select(
    method,
    queries,
    keys,
    valid,
    *,
    budget,
    window=WINDOW,
    impl=None,
    target=None,
    context=None,
    **options,
):
    """Keep set of one compression step over keys with a validity mask.

    The result equals running the method on the valid keys alone (same order) and mapping the
    kept positions back: invalid keys (empty slots, left padding) are excluded from every
    softmax, from the similarity matrix and from max-pool neighbourhoods, and are selected
    only when fewer than `budget - window` valid candidates exist; then every valid candidate
    is kept and the remaining slots hold the lowest-position invalid indices, which the
    caller marks empty.
    The last `window` keys are the observation tokens: they are always kept and always
    treated as valid (the engine guarantees they are); this is not checked on values.

    Args:
      method: a registered method's name ("rkv", "snapkv", "streaming", "keydiff", ...; see
        `rkvjax.kv.policies.names()`) with its `options`, or a built `rkvjax.kv.policies.Policy`.
      queries: [B, N, W, H] the last W queries, post-RoPE, q head h -> KV head h // G.
      keys: [B, K, n, H] post-RoPE keys in slot order.
      valid: [B, K, n] bool, False for keys that are not there.
      budget: keys kept per (row, KV head), the window included.
      window: W, observation tokens; must equal queries.shape[2].
      impl: Pallas kernels for redundancy and top-k (True), jnp (False) or auto (None: the
        redundancy kernel on GPU/TPU when the dense n x n matrix would be large; see
        `use_pallas`).
      target: the `tuning.Target` it runs on (default: the process's default device).
      context: a `rkvjax.kv.policies.Context` for methods that read one (positions, prompt
        lengths, seeds, per-key state); None: `Context.plain(keys)`.
      **options: the method's hyperparameters (static numbers), e.g. R-KV's kernel, lam,
        threshold, retain; R-KV's names are taken (and checked) for every method.

    Returns:
      int32 [B, K, budget]: kept key positions, ascending, the window last. The top
      `budget - window` candidates by score, ties broken towards the lower position.

    Raises:
      ValueError: for "full", unknown methods or options, mismatched shapes and invalid
        settings.
    """
    # In the order a caller fixes them; R-KV's options are named for every method here.
    policy = policies.resolve(method, foreign="check", **options)
    checks.check_inputs(queries, keys, valid, window=window)
    checks.check_budget(budget, window, keys.shape[2])
    score = candidate_scores(
        policy, queries, keys, valid, window=window, impl=impl, target=target, context=context
    )
    return keep(score, budget, window, impl=impl, target=target)


def candidate_scores(
    method, queries, keys, valid, *, window=WINDOW, impl=None, target=None, context=None, **options
):
    """The method's scores of the n - W candidates as the keep rule reads them: float32
    [B, K, n - W], -inf at keys that are not there (arguments as in `select`). Scores of
    several layers or heads may be combined (summed, averaged) before `keep`, for kept sets
    shared across them."""
    return scores_and_state(
        method,
        queries,
        keys,
        valid,
        window=window,
        impl=impl,
        target=target,
        context=context,
        **options,
    )[0]


def scores_and_state(
    method, queries, keys, valid, *, window=WINDOW, impl=None, target=None, context=None, **options
):
    """`candidate_scores` and, for a method that rewrites its per-key state at each compression
    (`Policy.state == "score"`), that new state [B, K, n] float32 (None for any other)."""
    policy = policies.resolve(method, foreign="check", **options)
    checks.check_inputs(queries, keys, valid, window=window)
    n = keys.shape[2]
    n_cand = n - window
    valid = valid | (jnp.arange(n) >= n_cand)  # [B, K, n]
    cand = valid[..., :n_cand]  # [B, K, n-W]
    kw = dict(impl=impl, target=target)
    if policy.context:
        kw["context"] = policies.Context.plain(keys) if context is None else context
        if policy.state is not None and kw["context"].state is None:
            raise ValueError(
                f"method {policy.name!r} {policies.STATES[policy.state]}, a state only the "
                "engine keeps: run it through rkvjax.generate or rkvjax.Engine, not on keys alone"
            )
    out = policy.scores(queries, keys, valid, **kw)  # [B, K, n-W] (, [B, K, n])
    state = None
    if policy.state == "score":
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"method {policy.name!r} (state 'score') must return (scores, state), got "
                f"{type(out).__name__}"
            )
        out, state = out
        if state.shape != keys.shape[:3]:
            raise ValueError(
                f"method {policy.name!r} returned a state of shape {state.shape}, expected "
                f"[B, K, n] = {keys.shape[:3]}"
            )
        state = state.astype(jnp.float32)
    score = out
    if not hasattr(score, "shape") or score.shape != cand.shape:
        raise ValueError(
            f"method {policy.name!r} scored shape {getattr(score, 'shape', score)}, expected "
            "[B, K, n - W] = "
            f"{cand.shape}"
        )
    score = score.astype(jnp.float32)
    # Defensive: top_k orders floats totally (-0.0 < +0.0), which would break "lower position
    # first" between equal scores; `where` survives jit, where `+ 0.0` is folded away.
    score = jnp.where(score == 0, 0.0, score)  # [B, K, n-W]
    return jnp.where(cand, score, -jnp.inf), state


def keep(score, budget, window, *, impl=None, target=None):
    """The keep rule: the top `budget - window` candidates by score (ties towards the lower
    position, -inf last) and then the window's W positions.

    Args:
      score: [B, K, n - W] float32 (`candidate_scores`).
      budget, window: as in `select` (static).

    Returns:
      int32 [B, K, budget] ascending positions, the window last.
    """
    b, k_heads, n_cand = score.shape
    n = n_cand + window
    checks.check_budget(budget, window, n)
    top = topk_positions(score, budget - window, impl=impl, target=target)  # [B, K, budget-W]
    obs = jnp.broadcast_to(jnp.arange(n_cand, n), (b, k_heads, window))  # [B, K, W]
    return jnp.concatenate([top, obs], axis=-1).astype(jnp.int32)


def keep_indices(method, queries, keys, *, budget, window=WINDOW, **options):
    """Kept positions of one compression step (public API; `select` with every key valid).

    Args:
      method: a registered method ("rkv", "snapkv", "streaming", "keydiff", ...; "full" never
        compresses and is rejected), or a built `rkvjax.kv.policies.Policy`.
      queries: [B, N, W, H] the last `window` queries, post-RoPE.
      keys: [B, K, n, H] post-RoPE keys; the observation tokens are the last `window`.
      budget: keys kept per (row, KV head), the window included: window < budget <= n.
      window: observation tokens, always kept.
      **options: the method's hyperparameters, e.g. R-KV's kernel (importance max-pool
        width, odd), lam (mix in [0, 1]), threshold (redundancy cosine in [-1, 1]) and retain
        (redundancy matches not counted per row), at the method's defaults when not given.

    Returns:
      int32 [B, K, budget]: kept positions along the key axis, ascending, the window included.

    Raises:
      ValueError: for "full", unknown methods or options, mismatched shapes and invalid
        settings.
    """
    valid = jnp.ones(keys.shape[:3], dtype=bool)  # [B, K, n]
    return select(method, queries, keys, valid, budget=budget, window=window, **options)
