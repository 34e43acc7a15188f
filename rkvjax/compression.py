"""R-KV, SnapKV and StreamingLLM keep sets for one compression step: pure, traceable jnp."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rkvjax import kernels
from rkvjax.config import check_int
from rkvjax.kernels import tuning
from rkvjax.layers import masked_softmax, unit_vectors

METHODS = ("rkv", "snapkv", "streaming")  # the compressing methods; "full" never selects
SINKS = 4  # StreamingLLM attention sinks

# Scores decide a discrete keep set, so they are computed in true float32: the default matmul
# precision on TPU (bf16 passes) and on GPU (TF32) moves cosines across the threshold.
_HIGHEST = jax.lax.Precision.HIGHEST


def _validate(
    queries,
    keys,
    valid,
    *,
    method=None,
    budget=None,
    window=None,
    kernel=None,
    lam=None,
    threshold=None,
    retain=None,
):
    """Shape and argument checks shared by every public function; None means "not used here"."""
    if method is not None and method not in METHODS:
        if method == "full":
            raise ValueError(
                "method 'full' never compresses, so it has no keep set; "
                f"select() takes one of {METHODS}"
            )
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if keys.ndim != 4:
        raise ValueError(f"keys must be [B, K, n, H], got shape {keys.shape}")
    b, k, n, h = keys.shape
    if valid is not None:
        if valid.shape != (b, k, n):
            raise ValueError(f"valid must be [B, K, n] = {(b, k, n)}, got shape {valid.shape}")
        if valid.dtype != jnp.bool_:
            raise ValueError(f"valid must be bool, got {valid.dtype}")
    if queries is not None:
        if queries.ndim != 4:
            raise ValueError(f"queries must be [B, N, W, H], got shape {queries.shape}")
        if queries.shape[0] != b or queries.shape[3] != h:
            raise ValueError(
                f"queries {queries.shape} and keys {keys.shape} disagree on B or H "
                "(queries [B, N, W, H], keys [B, K, n, H])"
            )
        if queries.shape[1] % k:
            raise ValueError(
                f"query heads N={queries.shape[1]} must be a multiple of KV heads K={k} "
                f"(queries {queries.shape}, keys {keys.shape})"
            )
        if window is not None and queries.shape[2] != window:
            raise ValueError(
                f"queries {queries.shape} hold W={queries.shape[2]} observation queries, "
                f"but window={window}"
            )
        if queries.shape[2] > n:
            raise ValueError(
                f"queries {queries.shape} hold W={queries.shape[2]} observation queries, "
                f"more than the n={n} keys"
            )
    if window is not None:
        check_int("window", window, 1)
        if window > n:
            raise ValueError(f"window={window} is larger than the n={n} keys")
    if budget is not None:
        check_int("budget", budget, 1)
        if budget <= window:
            raise ValueError(f"budget={budget} must be larger than window={window}")
        if budget > n:
            raise ValueError(f"budget={budget} is larger than the n={n} keys")
    if kernel is not None:
        check_int("kernel", kernel, 1)
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (centred max-pool), got {kernel}")
    if lam is not None and not 0 <= lam <= 1:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if threshold is not None and not -1 <= threshold <= 1:
        raise ValueError(f"threshold is a cosine and must be in [-1, 1], got {threshold}")
    if retain is not None:
        check_int("retain", retain, 1)


def _pool(x, valid, kernel):
    """Max-pool x [B, K, m] over neighbours among the valid entries only, in position order.

    Valid entries are packed to the front (stable, so their order is kept), pooled with -inf
    padding, and scattered back: invalid keys neither contribute nor break the neighbourhood,
    which is exactly pooling the compacted sequence. Invalid outputs are 0.
    """
    order = jnp.argsort(~valid, axis=-1, stable=True)  # [B, K, m] valid first
    packed = jnp.take_along_axis(jnp.where(valid, x, -jnp.inf), order, axis=-1)  # [B, K, m]
    pad = kernel // 2
    pooled = jax.lax.reduce_window(
        packed, -jnp.inf, jax.lax.max, (1, 1, kernel), (1, 1, 1), ((0, 0), (0, 0), (pad, pad))
    )  # [B, K, m]
    out = jnp.put_along_axis(jnp.zeros_like(pooled), order, pooled, axis=-1, inplace=False)
    return jnp.where(valid, out, 0.0)


def importance(queries, keys, valid, *, kernel=7):
    """Attention importance of the candidate keys (RKV_SPEC.md step 1), in float32.

    Args:
      queries: [B, N, W, H] the last W queries (post-RoPE); q head h reads KV head h // G.
      keys: [B, K, n, H] post-RoPE keys; the last W are the observation tokens.
      valid: [B, K, n] bool; invalid keys behave as if absent (softmax, max-pool neighbours).
      kernel: odd max-pool width along the candidate axis (stride 1, -inf padding).

    Returns:
      float32 [B, K, n - W]: softmax over valid candidates of the group-max logits, mean over
      the W queries, max-pooled over valid neighbours. 0 at invalid candidates.
    """
    _validate(queries, keys, valid, kernel=kernel)
    b, n_q, w, h = queries.shape
    k_heads, n = keys.shape[1], keys.shape[2]
    q = queries.astype(jnp.float32).reshape(b, k_heads, n_q // k_heads, w, h)  # [B, K, G, W, H]
    cand = keys[:, :, : n - w].astype(jnp.float32)  # [B, K, n-W, H]
    logits = jnp.einsum("BKGWH,BKnH->BKGWn", q, cand, precision=_HIGHEST) / math.sqrt(h)
    # GQA: max over the group's raw logits, before the softmax (reference order).
    logits = jnp.max(logits, axis=2)  # [B, K, W, n-W]
    attn = masked_softmax(logits, valid[:, :, None, : n - w])  # [B, K, W, n-W]
    return _pool(jnp.mean(attn, axis=2), valid[..., : n - w], kernel)


def redundancy(keys, valid, *, window=8, threshold=0.5, retain=1):
    """Key redundancy of the candidate keys (RKV_SPEC.md step 2), in float32.

    Cosine similarity S over all valid keys, diagonal 0. Each valid row i zeroes its `retain`
    newest matches (largest j with S[i, j] > threshold); a row with fewer than `retain`
    matches also zeroes its first valid column. For retain=1 that is the reference's
    "column 0 when nothing matches"; in general it zeroes the columns holding the `retain`
    largest values of j * [S[i, j] > threshold], which is what the reference's index trick
    gives. Then the mean over valid rows, softmax over valid keys, first n - W entries.

    Args:
      keys: [B, K, n, H] post-RoPE keys.
      valid: [B, K, n] bool; invalid keys are neither rows nor columns, and "largest index"
        and "first column" refer to the valid keys in position order.
      window: W, the trailing observation keys: they take part in S but are not returned.
      threshold: cosine above which two keys match.
      retain: beta, the newest matches per row that are not counted (1 in the reference).

    Returns:
      float32 [B, K, n - W], not renormalised after dropping the window. 0 at invalid keys.
    """
    _validate(None, keys, valid, window=window, threshold=threshold, retain=retain)
    n = keys.shape[2]
    k = unit_vectors(keys)  # [B, K, n, H]
    s = jnp.einsum("BKiH,BKjH->BKij", k, k, precision=_HIGHEST)  # [B, K, n, n]
    pair = valid[..., :, None] & valid[..., None, :]  # [B, K, n, n]
    s = jnp.where(pair & ~jnp.eye(n, dtype=bool), s, 0.0)
    # The diagonal is zeroed before thresholding (reference order): with threshold < 0 a
    # row matches itself, and zeroing it again changes nothing.
    match = (s > threshold) & pair  # [B, K, n, n]
    # The `retain` largest matching j per row: every match at or above the retain-th largest
    # matching index (all of them when a row has fewer). A reduction, not a cumulative sum
    # over j: XLA:CPU runs cumsum as a windowed reduction, O(n) per element (a whole R-KV
    # selection of one row over 30 layers went from 77 to 60 ms on the default model).
    idx = jnp.where(match, jnp.arange(n, dtype=jnp.int32), -1)  # [B, K, n, n]
    first = jnp.argmax(valid, axis=-1)  # [B, K] the first valid key
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)  # [B, K, 1]
    if retain == 1:
        red = _column_sums_less_one_per_row(k, s, valid, jnp.max(idx, axis=-1), first) / count
    else:
        kth = jax.lax.top_k(idx, min(retain, n))[0][..., -1:]  # [B, K, n, 1]
        drop = match & (idx >= kth)  # [B, K, n, n]
        short = jnp.sum(match, axis=-1, keepdims=True) < retain  # [B, K, n, 1]
        at_first = jnp.arange(n) == first[..., None]  # [B, K, n]
        s = jnp.where(drop | (short & at_first[..., None, :]), 0.0, s)
        red = jnp.sum(s, axis=-2) / count  # [B, K, n] invalid rows are all 0
    return masked_softmax(red, valid)[..., : n - window]


def _column_sums_less_one_per_row(k, s, valid, newest, first):
    """Column sums of the masked similarity s with one entry per valid row zeroed: its newest
    match (`newest` >= 0) or else its first valid column (retain = 1).

    The sums over valid rows i != j come from the unit keys, k_j . sum_i k_i - k_j . k_j, and
    the one zeroed entry per row is gathered and taken off its column: O(n H + n) instead of
    another pass over the n x n matrix.

    Args:
      k: [B, K, n, H] unit keys; s: [B, K, n, n] their masked similarity (0 off valid pairs
        and on the diagonal); valid: [B, K, n] bool; newest: [B, K, n] int32 each row's newest
        matching column or -1; first: [B, K] the first valid key.

    Returns:
      float32 [B, K, n] (0 at invalid columns).
    """
    kv = jnp.where(valid[..., None], k, 0.0)  # [B, K, n, H]
    total = jnp.sum(kv, axis=2, keepdims=True)  # [B, K, 1, H]
    diag = jnp.sum(kv * kv, axis=-1)  # [B, K, n]
    cols = jnp.sum(kv * total, axis=-1) - diag  # [B, K, n] sum over valid i != j
    zeroed = jnp.where(newest >= 0, newest, first[..., None])  # [B, K, n] column per row
    value = jnp.take_along_axis(s, zeroed[..., None], axis=-1)[..., 0]  # [B, K, n]
    value = jnp.where(valid, value, 0.0)
    b, kh, n = valid.shape
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kh)[None, :, None]
    taken = jnp.zeros((b, kh, n), jnp.float32).at[rows, heads, zeroed].add(value)
    return jnp.where(valid, cols - taken, 0.0)


def rkv_scores(queries, keys, valid, *, kernel=7, lam=0.1, threshold=0.5, retain=1, impl=None):
    """Joint R-KV score `lam * I - (1 - lam) * R` of the candidates (RKV_SPEC.md step 3).

    Args:
      queries: [B, N, W, H] see `importance`.
      keys: [B, K, n, H] see `importance`.
      valid: [B, K, n] bool see `importance` and `redundancy`.
      kernel: importance max-pool width.
      lam: weight of importance against redundancy, in [0, 1].
      threshold: redundancy cosine threshold.
      retain: redundancy matches not counted per row.
      impl: redundancy on the fused Pallas kernel (True), this module's jnp (False), or
        auto (None); see `use_pallas`.

    Returns:
      float32 [B, K, n - W]; higher is kept first. 0 at invalid candidates.
    """
    w = queries.shape[2]
    i = importance(queries, keys, valid, kernel=kernel)  # [B, K, n-W]
    r = redundancy_scores(
        keys, valid, window=w, threshold=threshold, retain=retain, impl=impl
    )  # [B, K, n-W]
    return lam * i - (1 - lam) * r


def use_pallas(flag: bool | None = None, *, dense_bytes: int = 0) -> bool:
    """Whether to run a Pallas kernel instead of its jnp path.

    Auto picks a kernel only where it pays. On an H200 the redundancy kernel was 26-40x slower
    than XLA's fused jnp path at n = 1K-4K (`bench/kernel_redundancy.py`) while holding O(n)
    instead of O(n^2) bytes, so it is the path for inputs whose dense similarity matrix would
    take a large share of device memory (long-prompt prefill), and jnp serves the rest,
    decode-time compressions over budget + buffer slots included. On CPU Pallas only
    interprets, so auto never picks it there.

    Args:
      flag: None for auto; True forces Pallas (interpreted on CPU); False forces jnp.
      dense_bytes: bytes the jnp path's dense intermediate would take (0 for paths without
        one, where auto keeps jnp).
    """
    if flag is None:
        return tuning.backend() != "cpu" and dense_bytes > tuning.dense_limit_bytes()
    if not isinstance(flag, bool):
        raise ValueError(f"impl must be True, False or None, got {flag!r}")
    return flag


def _interpret() -> bool:
    # Only GPU (Triton) and TPU (Mosaic) compile Pallas; anything else interprets.
    return tuning.backend() == "cpu"


def redundancy_scores(keys, valid, *, window=8, threshold=0.5, retain=1, impl=None):
    """`redundancy` on the backend that `use_pallas(impl)` picks: the fused kernel (O(n)
    memory), or this module's jnp path (not the kernel file's reference, which is the kernel's
    test oracle: the engine keeps one jnp implementation).

    Args:
      keys: [B, K, n, H] post-RoPE keys.
      valid: [B, K, n] bool (None: all valid).
      window, threshold, retain: see `redundancy`.
      impl: None (auto: the kernel only when the jnp path's n x n matrix would be large),
        True (Pallas) or False (jnp).

    Returns:
      float32 [B, K, n - window].
    """
    kw = dict(window=window, threshold=threshold, retain=retain)
    b, k, n, _ = keys.shape
    if use_pallas(impl, dense_bytes=b * k * n * n * 4):  # the float32 [B, K, n, n] similarity
        return kernels.redundancy_pallas(keys, valid, **kw, interpret=_interpret())
    if valid is None:
        valid = jnp.ones(keys.shape[:3], bool)
    return redundancy(keys, valid, **kw)


def topk_positions(scores, k, *, impl=None):
    """`jnp.sort(lax.top_k(scores, k)[1], -1)` on the backend that `use_pallas(impl)` picks.

    Args:
      scores: [B, K, m] float scores, -inf for invalid candidates.
      k: static number kept, 1 <= k <= m.
      impl: None (auto: jnp, as `lax.top_k` holds no large intermediate), True (Pallas) or
        False (jnp).

    Returns:
      int32 [B, K, k] ascending positions (ties towards the lower position).
    """
    if use_pallas(impl):
        return kernels.topk_pallas(scores, k, interpret=_interpret())
    return kernels.topk_reference(scores, k)


def _streaming_scores(cand):
    """StreamingLLM as a score over candidates cand [B, K, m]: sinks first, then recency."""
    rank = jnp.cumsum(cand, axis=-1) - 1  # [B, K, m] position among the valid candidates
    m = cand.shape[-1]
    return jnp.where(rank < SINKS, m + SINKS - rank, rank).astype(jnp.float32)


def select(
    method,
    queries,
    keys,
    valid,
    *,
    budget,
    window=8,
    kernel=7,
    lam=0.1,
    threshold=0.5,
    retain=1,
    impl=None,
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
      method: "rkv", "snapkv" (importance only) or "streaming" (the first 4 valid keys plus
        the most recent ones; with budget - window < 4 only that many sinks).
      queries: [B, N, W, H] the last W queries, post-RoPE, q head h -> KV head h // G.
      keys: [B, K, n, H] post-RoPE keys in slot order.
      valid: [B, K, n] bool, False for keys that are not there.
      budget: keys kept per (row, KV head), the window included.
      window: W, observation tokens; must equal queries.shape[2].
      kernel: importance max-pool width (odd).
      lam: R-KV mix, `lam * importance - (1 - lam) * redundancy`.
      threshold: redundancy cosine threshold.
      retain: redundancy matches not counted per row (1 in the reference).
      impl: Pallas kernels for redundancy and top-k (True), jnp (False) or auto (None: the
        redundancy kernel on GPU/TPU when the dense n x n matrix would be large; see
        `use_pallas`).

    All hyperparameters are static Python numbers.

    Returns:
      int32 [B, K, budget]: kept key positions, ascending, the window last. The top
      `budget - window` candidates by score, ties broken towards the lower position.

    Raises:
      ValueError: for "full", unknown methods, mismatched shapes and invalid settings.
    """
    _validate(
        queries,
        keys,
        valid,
        method=method,
        budget=budget,
        window=window,
        kernel=kernel,
        lam=lam,
        threshold=threshold,
        retain=retain,
    )
    b, k_heads, n, _ = keys.shape
    n_cand = n - window
    valid = valid | (jnp.arange(n) >= n_cand)  # [B, K, n]
    cand = valid[..., :n_cand]  # [B, K, n-W]
    if method == "rkv":
        score = rkv_scores(
            queries,
            keys,
            valid,
            kernel=kernel,
            lam=lam,
            threshold=threshold,
            retain=retain,
            impl=impl,
        )
    elif method == "snapkv":
        score = importance(queries, keys, valid, kernel=kernel)
    else:
        score = _streaming_scores(cand)
    # Defensive: top_k orders floats totally (-0.0 < +0.0), which would break "lower position
    # first" between equal scores; `where` survives jit, where `+ 0.0` is folded away.
    score = jnp.where(score == 0, 0.0, score)  # [B, K, n-W]
    score = jnp.where(cand, score, -jnp.inf)
    # Ascending positions of the top scores, ties towards the lower index (tested).
    top = topk_positions(score, budget - window, impl=impl)  # [B, K, budget-W]
    obs = jnp.broadcast_to(jnp.arange(n_cand, n), (b, k_heads, window))  # [B, K, W]
    return jnp.concatenate([top, obs], axis=-1).astype(jnp.int32)


def keep_indices(
    method,
    queries,
    keys,
    *,
    budget,
    window=8,
    kernel=7,
    lam=0.1,
    threshold=0.5,
    retain=1,
):
    """Kept positions of one compression step (public API; `select` with every key valid).

    Args:
      method: "rkv", "snapkv" or "streaming" ("full" never compresses and is rejected).
      queries: [B, N, W, H] the last `window` queries, post-RoPE.
      keys: [B, K, n, H] post-RoPE keys; the observation tokens are the last `window`.
      budget: keys kept per (row, KV head), the window included: window < budget <= n.
      window: observation tokens, always kept.
      kernel: importance max-pool width (odd).
      lam: R-KV mix in [0, 1].
      threshold: redundancy cosine threshold in [-1, 1].
      retain: redundancy matches not counted per row.

    Returns:
      int32 [B, K, budget]: kept positions along the key axis, ascending, the window included.

    Raises:
      ValueError: for "full", unknown methods, mismatched shapes and invalid settings.
    """
    valid = jnp.ones(keys.shape[:3], dtype=bool)  # [B, K, n]
    return select(
        method,
        queries,
        keys,
        valid,
        budget=budget,
        window=window,
        kernel=kernel,
        lam=lam,
        threshold=threshold,
        retain=retain,
    )
