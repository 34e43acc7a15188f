"""Pure layer functions shared by every model: RMSNorm, RoPE, masked attention."""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # config builds cache policies, whose scores use these layers
    from rkvjax.models.config import ModelConfig


# A finite "minus infinity": a query whose keys are all masked (a pad row) gets a uniform, finite
# softmax instead of NaNs that would poison later reductions.
MASK_VALUE = float(np.finfo(np.float32).min)


def _data_shards() -> int:
    """How many ways the current mesh splits batch rows (the "data" axis; 1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("data", 1)


# Batch-invariant mode (`fixed_columns`): columns per weight product, by backend. XLA picks a
# product's algorithm from its shape: on XLA:CPU one column is a matrix-vector kernel and more
# go to YNNPACK, whose blocking over the contraction follows the column count (a row's numbers
# in a 2-column product equal those in 16 columns, not those in 32), and GPU libraries choose
# kernels, and split-K, by shape as well. A product of one fixed shape computes each column the
# same way wherever it sits and whatever its neighbours hold. The GPU and TPU widths are one
# tile of their matrix units and have not been measured.
INVARIANT_COLUMNS = {"cpu": 8, "gpu": 64, "tpu": 128}

_FIXED_COLUMNS: contextvars.ContextVar[int] = contextvars.ContextVar("fixed_columns", default=0)


@contextlib.contextmanager
def fixed_columns(columns: int):
    """While tracing inside, every `project` computes its columns `columns` at a time (0: off).

    Each product then has one shape whatever the batch width, so a row's numbers do not depend
    on how many rows run beside it: the decode step of the batch-invariant mode. Fewer columns
    are padded with zeros; more are split into tiles computed one after another (`lax.map`),
    which reads the weights once per tile.
    """
    token = _FIXED_COLUMNS.set(columns)
    try:
        yield
    finally:
        _FIXED_COLUMNS.reset(token)


def fixed_column_count() -> int:
    """The columns per product inside `fixed_columns` (0: not inside)."""
    return _FIXED_COLUMNS.get()


def _project_fixed(spec: str, w: jax.Array, x: jax.Array, columns: int) -> jax.Array:
    """`einsum(spec, w, x)` (float32) computed on tiles of exactly `columns` of x's columns."""
    operands, out = spec.split("->")
    w_spec, x_spec = operands.split(",")
    cols = x_spec[1:]  # x is [in, *columns]; the output ends with the same columns
    tile_spec = f"{w_spec},{x_spec[0]}Z->{out[: len(out) - len(cols)]}Z"
    n = math.prod(x.shape[1:])
    tiles = -(-n // columns)
    xs = jnp.pad(x.reshape(x.shape[0], n), ((0, 0), (0, tiles * columns - n)))  # [in, tiles*Z]

    def product(tile):  # [in, Z] -> [*out, Z]
        return jnp.einsum(tile_spec, w, tile, preferred_element_type=jnp.float32)

    if tiles == 1:
        o = product(xs)
    else:
        o = jax.lax.map(product, xs.reshape(x.shape[0], tiles, columns).swapaxes(0, 1))
        o = jnp.moveaxis(o, 0, -2).reshape(*o.shape[1:-1], tiles * columns)  # [*out, tiles*Z]
    return o[..., :n].reshape(*o.shape[:-1], *x.shape[1:])


def project(spec: str, w: jax.Array, x: jax.Array, *, dtype=None) -> jax.Array:
    """A weight product `einsum(spec, w, x)`, accumulated in float32, returned in `dtype`
    (default: x's).

    `w` is stored [out, in] and `x` is features-first, [in, *columns], with the columns last in
    the output too: the order in which XLA:CPU's products stream the weight matrix.

    bfloat16 operands stay bfloat16. XLA:CPU hands a bfloat16 x bfloat16 -> float32 product to
    YNNPACK, which reads the weights at half the bytes; any other bfloat16 product it widens to
    float32, and as weights are loop-invariant the widened copies were hoisted out of the decode
    loop, so a bfloat16 model decoded from float32 copies at float32 speed. YNNPACK takes no
    matrix-vector products, so where each device would see a single column (batch-1 decode, or
    one row per "data" shard) the tokens axis is padded to two. Padding every decode step
    instead cost 10% at batch 8.

    Inside `fixed_columns` the columns are computed a fixed number at a time instead.
    """
    out_dtype = x.dtype if dtype is None else dtype
    columns = _FIXED_COLUMNS.get()
    if columns:
        return _project_fixed(spec, w, x, columns).astype(out_dtype)
    pad = (
        jax.default_backend() == "cpu"
        and w.dtype == jnp.bfloat16
        and math.prod(x.shape[1:]) <= _data_shards()
    )
    t = x.shape[-1]
    if pad:
        x = jnp.concatenate([x, jnp.zeros_like(x)], axis=-1)
    out = jnp.einsum(spec, w, x, preferred_element_type=jnp.float32)[..., :t]
    return out.astype(out_dtype)


def as_storage(x: jax.Array) -> jax.Array:
    """x in the form kept for arrays that are gathered or scattered every step: floats narrower
    than 32 bits as unsigned integers of the same bits, anything else unchanged.

    XLA:CPU moves bfloat16 elements by converting the whole operand to float32 and the result
    back: for the KV cache, every layer's cache on every decode step. The integer view is itself
    a copy under `jit` unless XLA fuses it into a consumer, so arrays moved every step are
    stored this way, and float32 ones, which XLA moves as they are, are left alone.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    return x


def from_storage(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_storage` for values of `dtype`."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [V, D], ids [...] (already checked to lie in [0, V)) -> rows [..., D].

    Gathered from `as_storage(table)`: a bfloat16 gather widened the whole table to float32.
    For a bfloat16 table the view is a copy too, made once per compiled call (XLA hoists it out
    of the decode loop), but at half the size.
    """
    return from_storage(jnp.take(as_storage(table), ids, axis=0, mode="clip"), table.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """x with D features on `axis`, w [D] -> x's shape; normalises in float32 like the reference
    implementations."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    w = w.astype(jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1 - axis % x.ndim))
    return (xf * w).astype(x.dtype)


def masked_softmax(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of x [..., m] restricted to mask [..., m]; 0 where masked."""
    x = jnp.where(mask, x, -jnp.inf)  # [..., m]
    top = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]
    # A lane with nothing valid would compute -inf - -inf = nan; it gets all zeros instead.
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(mask, jnp.exp(x - top), 0.0)  # [..., m]
    total = jnp.sum(e, axis=-1, keepdims=True)  # [..., 1]
    return e / jnp.where(total > 0, total, 1.0)


def unit_vectors(x: jax.Array) -> jax.Array:
    """x [..., H] -> float32 x / (||x|| + 1e-8), the reference's cosine normalisation. Every
    path computes it with this one expression, so cosines near a threshold fall on the same
    side everywhere."""
    x = x.astype(jnp.float32)
    return x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-8)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[H/2] float32 inverse frequencies, with Llama-3.1 scaling when configured.

    Computed in NumPy at trace time: it depends only on the static config.
    """
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = cfg.rope_scaling
    if s is not None:
        # Llama-3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        low_wavelen = s.original_max_positions / s.low_freq_factor
        high_wavelen = s.original_max_positions / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * inv / s.factor + smooth * inv
        inv = np.where(
            wavelen > low_wavelen,
            inv / s.factor,
            np.where(wavelen < high_wavelen, inv, smoothed),
        )
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int32 -> (cos, sin) [B, T, H] float32 (rotate-half layout, as in HF)."""
    ang = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)  # [B, T, H/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [B, T, H]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H], cos/sin [B, T, H] -> [B, T, N, H]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    kv_axis: int,
    weights=False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
):
    """Grouped-query attention with an explicit boolean mask, softmax in float32.

    Args:
      q: [B, T, N, H] queries (post-RoPE).
      k, v: keys/values, either [B, S, K, H] (`kv_axis=1`, a full forward) or [B, K, S, H]
        (`kv_axis=2`, the cache layout); with scales, an 8-bit cache's codes.
      mask: [B, T, S] or [B, K, T, S]: True where the query may attend to the key.
      kv_axis: where the key axis S sits in k and v.
      weights: also return the attention each key received (static).
      k_scale, v_scale: [B, K, S] float32 scales of 8-bit codes (`kv_axis=2` only), or None.
        A key's scale multiplies its scores and a value's its softmax weight, so the products
        read the codes (as q's dtype, which holds every 8-bit value exactly) and no
        dequantized copy of the cache is made.

    Returns:
      [B, T, N, H] in q's dtype; with `weights`, also float32 [B, K, S]: each key's softmax
      weights summed over the queries (T) and each KV head's query group (G). A query that
      may attend to nothing (a pad) adds nothing.
    """
    b, t, n, h = q.shape
    kh = k.shape[2] if kv_axis == 1 else k.shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]; HF order: q head n uses kv head n // G
    q_spec = "BTKGH"
    if kv_axis == 1:
        # A full forward puts the queries in the scores' order first. Otherwise XLA:CPU computed
        # the scores as [K, S, T*G] and transposed them with a stride-G copy, which took 9 of the
        # 13 s of a 2048-token prefill (7.3 s now). Decode keeps its own order: there this
        # measured slower at batch 8.
        qg, q_spec = qg.transpose(0, 2, 3, 1, 4), "BKGTH"
    kv_spec = "BSKH" if kv_axis == 1 else "BKSH"
    if k_scale is not None:
        k = k.astype(q.dtype)
    logits = jnp.einsum(f"{q_spec},{kv_spec}->BKGTS", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(h))
    if k_scale is not None:
        logits = logits * k_scale[:, :, None, None, :]  # [B, K, 1, 1, S]
    m = mask[:, None, None] if mask.ndim == 3 else mask[:, :, None]  # [B, K|1, 1, T, S]
    logits = jnp.where(m, logits, MASK_VALUE)
    probs32 = jax.nn.softmax(logits, axis=-1)  # [B, K, G, T, S]
    if v_scale is None:
        probs = probs32.astype(v.dtype)
    else:
        probs = (probs32 * v_scale[:, :, None, None, :]).astype(q.dtype)
        v = v.astype(q.dtype)
    # Output in the scores' order: asked for [B, T, K, G, H] directly, XLA:CPU computed the
    # transposed product and so copied every layer's V cache into [K, H, S] on each decode step.
    out = jnp.einsum(f"BKGTS,{kv_spec}->BKGTH", probs, v, preferred_element_type=jnp.float32)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    if not weights:
        return out
    seeing = jnp.any(m, axis=-1, keepdims=True)  # [B, K|1, 1, T, 1] queries with any key
    received = jnp.sum(jnp.where(seeing, probs32, 0.0), axis=(2, 3))
    return out, received  # [B, K, S]


def causal_mask(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """q_pos [B, T], k_pos [..., S] logical positions (-1 = pad/empty) -> mask [B, (...), T, S].

    A key is visible when it holds a real token (pos >= 0) at or before the query's position.
    `k_pos` may be [B, S] (full forward) or [B, K, S] (cache slots, per KV head).
    """
    if k_pos.ndim == 2:
        return (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    return (k_pos[:, :, None, :] >= 0) & (k_pos[:, :, None, :] <= q_pos[:, None, :, None])
