"""Top-k selection in position order: radix bisection for the k-th score, then a prefix sum.

`topk_positions(scores, k)` equals `jnp.sort(lax.top_k(scores, k)[1], -1)`: the k largest
scores per (row, KV head), ties towards the lower position, returned ascending. No sort:
  1. Scores map to int32 keys with the same order (float total order: -0.0 < +0.0, -inf
     lowest). The k-th largest key is built bit by bit, most significant first: 32 passes,
     each counting the keys >= a candidate over the row. That is a fixed, data-independent
     number of O(m) sweeps; nothing moves in memory.
  2. The kept set is every key > kth plus the first (k - count_greater) keys == kth, so the
     ties go to the lowest positions exactly as in `top_k`. An inclusive prefix sum over the
     kept mask gives each position its rank among the kept, and the r-th kept position is the
     number of positions whose rank is <= r: a [block_k, block_m] compare-and-count per tile,
     which emits the positions already in ascending order (what the engine gathers with).
Work per row: 33 count sweeps of m plus k x m compares (k <= m), all elementwise or reductions.
NaNs order as in top_k's total order: +NaN above +inf, -NaN below -inf (the same bit trick).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from rkvjax.kv.kernels import tuning

_INT_MIN = -(2**31)  # below every float's key: padding never reaches the top k
_LOW31 = 0x7FFFFFFF  # magnitude bits of an int32


def _check_tile(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 8:
        raise ValueError(f"{name} must be an int >= 8, got {value!r}")
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles), got {value}")


def _validate(scores, k, block_m=None, block_k=None):
    """Shape, dtype and argument checks of both paths; tiles only when given."""
    if scores.ndim != 3:
        raise ValueError(f"scores must be [B, K, m], got shape {scores.shape}")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores must be floating point, got {scores.dtype}")
    m = scores.shape[2]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= m:
        raise ValueError(f"k must be a static int in [1, m={m}], got {k!r}")
    if block_m is not None:
        _check_tile("block_m", block_m)
    if block_k is not None:
        _check_tile("block_k", block_k)


def _order_key(x):
    """float32 x -> int32 with the same total order (negative floats flip their magnitude)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ _LOW31, bits)


def _inclusive_cumsum(x, matmul):
    """Inclusive prefix count of bool x [1, T] along lanes -> int32 [1, T].

    matmul: a product with a triangular 0/1 matrix (exact in f32 below 2^24), for Mosaic TPU,
    which has no cumsum lowering. Otherwise jnp.cumsum, which Triton lowers to a scan (and
    whose tl.dot would need at least 16 rows).
    """
    if not matmul:
        return jnp.cumsum(x.astype(jnp.int32), axis=1)
    t = x.shape[1]
    ii = lax.broadcasted_iota(jnp.int32, (t, t), 0)
    jj = lax.broadcasted_iota(jnp.int32, (t, t), 1)
    lower = (ii <= jj).astype(jnp.float32)  # [T, T] lower[p', p] = p' <= p
    return lax.dot(x.astype(jnp.float32), lower, precision=lax.Precision.HIGHEST).astype(jnp.int32)


def _kernel(scores_ref, out_ref, *, m, k, block_m, block_k, matmul):
    """One (row, KV head): the positions of its k largest scores, ascending."""
    # scores_ref: [1, Mp] f32 scores of this (row, KV head); lanes >= m are padding
    # out_ref:    [Kp, 1] int32 out: kept positions ascending; entries >= k are unspecified
    n_chunks = scores_ref.shape[1] // block_m
    n_out = out_ref.shape[0] // block_k

    def keys(c):  # [1, Bm] int32 order keys of chunk c, INT_MIN on the padding
        p0 = pl.multiple_of(c * block_m, block_m)
        pos = p0 + lax.broadcasted_iota(jnp.int32, (1, block_m), 1)
        return jnp.where(pos < m, _order_key(scores_ref[:, pl.ds(p0, block_m)]), _INT_MIN)

    def count(pred):  # [1, 1] int32 number of keys x with pred(x)
        def body(c, total):
            return total + jnp.sum(pred(keys(c)).astype(jnp.int32), axis=1, keepdims=True)

        return lax.fori_loop(0, n_chunks, body, jnp.zeros((1, 1), jnp.int32))

    # kth = the largest t with count(keys >= t) >= k, found bit by bit in the biased
    # (unsigned) order. The sign bit first: biased 0x80000000 is signed 0. Below it, setting a
    # bit of a signed int32 raises it in both orders, so plain `|` works.
    kth = jnp.where(count(lambda x: x >= 0) >= k, jnp.int32(0), jnp.int32(_INT_MIN))  # [1, 1]

    def bisect(i, kth):
        cand = kth | jnp.left_shift(jnp.int32(1), 30 - i)  # [1, 1]
        return jnp.where(count(lambda x: x >= cand) >= k, cand, kth)

    kth = lax.fori_loop(0, 31, bisect, kth)
    ties = k - count(lambda x: x > kth)  # [1, 1] >= 1: keys == kth kept, lowest positions

    def emit(o, carry):
        r0 = pl.multiple_of(o * block_k, block_k)
        r = r0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [Bk, 1] output ranks

        def chunk(c, acc):
            pos, n_eq, n_kept = acc  # [Bk, 1], [1, 1], [1, 1]
            x = keys(c)  # [1, Bm]
            eq = x == kth
            kept = (x > kth) | (eq & (n_eq + _inclusive_cumsum(eq, matmul) <= ties))
            rank = n_kept + _inclusive_cumsum(kept, matmul)  # [1, Bm] kept at or before p
            # The r-th kept position (0-based) is the number of positions p with rank <= r.
            pos = pos + jnp.sum((rank <= r).astype(jnp.int32), axis=1, keepdims=True)
            n_eq = n_eq + jnp.sum(eq.astype(jnp.int32), axis=1, keepdims=True)
            return pos, n_eq, n_kept + jnp.sum(kept.astype(jnp.int32), axis=1, keepdims=True)

        zero = jnp.zeros((1, 1), jnp.int32)
        start = (jnp.zeros((block_k, 1), jnp.int32), zero, zero)
        out_ref[pl.ds(r0, block_k), :] = lax.fori_loop(0, n_chunks, chunk, start)[0]
        return carry

    lax.fori_loop(0, n_out, emit, 0)


@functools.partial(jax.jit, static_argnames=("k", "block_m", "block_k", "matmul_scan", "interpret"))
def topk_positions(
    scores,
    k: int,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    matmul_scan: bool | None = None,
    interpret: bool = False,
):
    """Ascending positions of the k largest scores per (row, KV head).

    Equal to `topk_reference`: ties go to the lower position, -inf entries are taken (lowest
    positions first) only when fewer than k scores are finite.

    Args:
      scores: [B, K, m] float scores (-inf for invalid candidates), compared as float32.
      k: static number kept, 1 <= k <= m.
      block_m: score chunk width (power of two); None: the backend default, shrunk for small m.
      block_k: output positions per compaction pass (power of two); None: as for block_m.
      matmul_scan: prefix sums as triangular matmuls instead of cumsum; None: on TPU only.
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      int32 [B, K, k], ascending along the last axis.
    """
    _validate(scores, k, block_m, block_k)
    b, kh, m = scores.shape
    g = b * kh
    default_m, default_k = tuning.TOPK_TILES["cpu" if interpret else tuning.backend()]
    block_m = block_m or tuning.fit(default_m, m, 8)
    block_k = block_k or tuning.fit(default_k, k, 8)
    if matmul_scan is None:
        matmul_scan = not interpret and tuning.backend() == "tpu"
    m_pad = -(-m // block_m) * block_m
    k_pad = -(-k // block_k) * block_k
    x = scores.astype(jnp.float32).reshape(g, 1, m)  # bf16 -> f32 keeps the order exactly
    x = jnp.pad(x, ((0, 0), (0, 0), (0, m_pad - m)))  # [G, 1, Mp]; the kernel masks the pad
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, k=k, block_m=block_m, block_k=block_k, matmul=matmul_scan),
        grid=(g,),
        in_specs=[pl.BlockSpec((None, 1, m_pad), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, k_pad, 1), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((g, k_pad, 1), jnp.int32),
        compiler_params=tuning.compiler_params(interpret, 1),
        interpret=interpret,
        name="rkv_topk_positions",
    )(x)  # [G, Kp, 1]
    return out[:, :k, 0].reshape(b, kh, k)


def topk_reference(scores, k):
    """The specification of `topk_positions`: sort(top_k) in float32.

    Args:
      scores: [B, K, m] float scores.
      k: static number kept, 1 <= k <= m.

    Returns:
      int32 [B, K, k] ascending positions of the k largest (ties: lower position first).
    """
    _validate(scores, k)
    top = lax.top_k(scores.astype(jnp.float32), k)[1]  # [B, K, k] by score, ties lower first
    return jnp.sort(top, axis=-1).astype(jnp.int32)
