"""The cache's storage type (`kv_dtype`) and its 8-bit forms.

A quantized cache stores each key, value and observation query as 8-bit codes with one float32
scale per (token, head): `codes = x / scale`, `scale = max|x| / QMAX`, so the largest element of
every vector is coded exactly at the top of the range. The scale is written with its token and
moves with it wherever a compression puts the token, so eviction never requantizes anything:
a token's codes and scale are the ones its append wrote.

Nothing here dequantizes a whole cache. Attention folds the scales into the scores and the
softmax weights (`layers.attention`), so its products read the codes; a compression reads the
float32 keys of the few rows it compresses (`dequantize`), which XLA fuses into the scoring.

Per (token, head) rather than per group of channels: with head_dim 64 a scale per 32 channels
costs 4 more bytes per vector, which the 0.55x budget of the whole cache does not leave room
for, and int8's error (max|x| / 254 per element) already sits far below the noise the measured
NLL shows (bench/README.md, "Quantized cache").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rkvjax.models import layers

# The storage types a cache takes, by name (`kv_dtype=`); None means the model's dtype.
KV_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn")
# The largest code of each 8-bit type: int8 stays symmetric (-127..127) so that 0 is exact and
# the range does not depend on the sign; float8_e4m3fn's largest finite value is 448 (it has no
# infinity: anything past 448 would become NaN, hence the clip).
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def check_kv_dtype(kv_dtype) -> str | None:
    """`kv_dtype` as its canonical name (None: the model's dtype); ValueError otherwise."""
    if kv_dtype is None:
        return None
    try:
        name = jnp.dtype(kv_dtype).name
    except TypeError:
        name = None
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return name


def cache_dtype(kv_dtype: str | None, model_dtype) -> jnp.dtype:
    """The element type a cache stores: `kv_dtype`, or the model's dtype when None."""
    return jnp.dtype(model_dtype if kv_dtype is None else kv_dtype)


def is_quantized(dtype) -> bool:
    """True for the 8-bit types, which carry a scale per vector."""
    return jnp.dtype(dtype).name in QMAX


def storage_dtype(dtype) -> jnp.dtype:
    """The array type the cache keeps codes of `dtype` in (`layers.as_storage`)."""
    return layers.as_storage(jnp.zeros((), dtype)).dtype


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (codes [..., H] in `storage_dtype(dtype)`, scales [...] float32).

    A vector of zeros gets scale 0 and codes 0, which dequantize to zeros."""
    qmax = QMAX[jnp.dtype(dtype).name]
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [...]
    # A subnormal scale (max|x| below ~1e-36) has no finite inverse: such a vector is coded as
    # zeros, as it is where denormals are flushed (XLA:CPU); 0 * inf would make NaN codes.
    usable = scale >= jnp.finfo(jnp.float32).tiny
    inv = jnp.where(usable, 1.0 / jnp.where(usable, scale, 1.0), 0.0)
    y = jnp.clip(xf * inv[..., None], -qmax, qmax)
    if jnp.dtype(dtype) == jnp.int8:
        codes = jnp.round(y).astype(jnp.int8)
    else:
        codes = layers.as_storage(y.astype(dtype))
    return codes, scale


def dequantize(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes [..., H] (storage form of `dtype`), scales [...] -> float32 [..., H]."""
    return codes_as_float(codes, dtype, jnp.float32) * scale[..., None]


def codes_as_float(codes: jax.Array, dtype, to) -> jax.Array:
    """The codes as floats of type `to`, unscaled. Exact for bfloat16 and float32: every int8
    and float8_e4m3fn value is one of theirs."""
    return layers.from_storage(codes, jnp.dtype(dtype)).astype(to)
