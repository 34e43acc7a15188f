"""Score primitives of the cache policies: attention importance, key redundancy, top-k, in
float32 jnp (with the Pallas redundancy and top-k kernels where they pay).

The policies (`rkvjax.kv.policies`) combine them into scores; `rkvjax.kv.selection` turns scores
into kept positions. Every function here is pure and traceable; hyperparameters are static numbers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rkvjax import checks
from rkvjax.defaults import KERNEL, RETAIN, THRESHOLD, WINDOW
from rkvjax.kv import kernels
from rkvjax.kv.kernels import tuning
from rkvjax.models.layers import masked_softmax, unit_vectors

# Scores decide a discrete keep set, so they are computed in true float32: the default matmul
# precision on TPU (bf16 passes) and on GPU (TF32) moves cosines across the threshold.
HIGHEST = jax.lax.Precision.HIGHEST


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


def importance(queries, keys, valid, *, kernel=KERNEL):
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
    checks.check_inputs(queries, keys, valid)
    checks.check_kernel(kernel)
    b, n_q, w, h = queries.shape
    k_heads, n = keys.shape[1], keys.shape[2]
    q = queries.astype(jnp.float32).reshape(b, k_heads, n_q // k_heads, w, h)  # [B, K, G, W, H]
    cand = keys[:, :, : n - w].astype(jnp.float32)  # [B, K, n-W, H]
    logits = jnp.einsum("BKGWH,BKnH->BKGWn", q, cand, precision=HIGHEST) / math.sqrt(h)
    # GQA: max over the group's raw logits, before the softmax (reference order).
    logits = jnp.max(logits, axis=2)  # [B, K, W, n-W]
    attn = masked_softmax(logits, valid[:, :, None, : n - w])  # [B, K, W, n-W]
    return _pool(jnp.mean(attn, axis=2), valid[..., : n - w], kernel)


def redundancy(keys, valid, *, window=WINDOW, threshold=THRESHOLD, retain=RETAIN):
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
    checks.check_inputs(None, keys, valid, window=window)
    checks.check_redundancy(threshold, retain)
    n = keys.shape[2]
    k = unit_vectors(keys)  # [B, K, n, H]
    s = jnp.einsum("BKiH,BKjH->BKij", k, k, precision=HIGHEST)  # [B, K, n, n]
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


def use_pallas(flag: bool | None = None, *, dense_bytes: int = 0, target=None) -> bool:
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
      target: the `tuning.Target` it runs on (default: the process's default device).
    """
    if flag is None:
        target = target or tuning.Target.default()
        return target.backend != "cpu" and dense_bytes > target.dense_limit_bytes
    if not isinstance(flag, bool):
        raise ValueError(f"impl must be True, False or None, got {flag!r}")
    return flag


def _interpret(target) -> bool:
    # Only GPU (Triton) and TPU (Mosaic) compile Pallas; anything else interprets.
    return (target.backend if target is not None else tuning.backend()) == "cpu"


def redundancy_scores(
    keys, valid, *, window=WINDOW, threshold=THRESHOLD, retain=RETAIN, impl=None, target=None
):
    """`redundancy` on the backend that `use_pallas(impl)` picks: the fused kernel (O(n)
    memory), or this module's jnp path (not the kernel file's reference, which is the kernel's
    test oracle: the engine keeps one jnp implementation).

    Args:
      keys: [B, K, n, H] post-RoPE keys.
      valid: [B, K, n] bool (None: all valid).
      window, threshold, retain: see `redundancy`.
      impl: None (auto: the kernel only when the jnp path's n x n matrix would be large),
        True (Pallas) or False (jnp).
      target: the `tuning.Target` it runs on (default: the process's default device).

    Returns:
      float32 [B, K, n - window].
    """
    kw = dict(window=window, threshold=threshold, retain=retain)
    b, k, n, _ = keys.shape
    dense = b * k * n * n * 4  # the float32 [B, K, n, n] similarity
    if use_pallas(impl, dense_bytes=dense, target=target):
        return kernels.redundancy_pallas(keys, valid, **kw, interpret=_interpret(target))
    if valid is None:
        valid = jnp.ones(keys.shape[:3], bool)
    return redundancy(keys, valid, **kw)


def topk_positions(scores, k, *, impl=None, target=None):
    """`jnp.sort(lax.top_k(scores, k)[1], -1)` on the backend that `use_pallas(impl)` picks.

    Args:
      scores: [B, K, m] float scores, -inf for invalid candidates.
      k: static number kept, 1 <= k <= m.
      impl: None (auto: jnp, as `lax.top_k` holds no large intermediate), True (Pallas) or
        False (jnp).

    Returns:
      int32 [B, K, k] ascending positions (ties towards the lower position).
    """
    if use_pallas(impl, target=target):
        return kernels.topk_pallas(scores, k, interpret=_interpret(target))
    return kernels.topk_reference(scores, k)
