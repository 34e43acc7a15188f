"""The KV cache: a static-capacity pytree with per-row fill counts and per-slot logical positions.

Every leaf keeps its shape on every step, so the decode step compiles once. Slots and logical
positions are tracked apart: a slot's RoPE position lives in `slot_pos`, so a cache whose rows were
filled to different levels, or compacted by a compression, stays exact. `slot_pos` is per KV head
because compression keeps a different token set per (layer, KV head, row).

Invariant: in every row the occupied slots `[0, length)` hold real tokens in position order, and
slots `>= length` are empty (`slot_pos == -1`). So the newest tokens are always the last occupied
slots, which is where compression finds its observation window.

Keys and values are stored as `layers.as_storage` gives them (bfloat16 as uint16 of the same
bits) and read through `keys()` / `values()`. The appends and compactions then only move
integers: XLA:CPU moved bfloat16 elements by converting the whole operand to float32 and back,
which it did to every layer's cache on every decode step (batch-8 bfloat16 decode spent 10 of
its 36 ms per step there). Views made around each append would not do: a bitcast-convert is a
copy, so the append would no longer write in place.

An 8-bit cache (`dtype` int8 or float8_e4m3fn, `rkvjax.kv.quantization`) stores codes in `k`, `v`
and `q_win` and a float32 scale per (token, head) in `k_scale`, `v_scale` and `q_scale`; a
scale is moved wherever its token's codes are, so nothing is ever requantized.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rkvjax.kv import quantization
from rkvjax.models import layers, sharding
from rkvjax.models.config import ModelConfig

Scale = jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B, K, C, H] keys after RoPE, as_storage(dtype)
    v: tuple[jax.Array, ...]  # L x [B, K, C, H] values, as_storage(dtype)
    slot_pos: tuple[jax.Array, ...]  # L x [B, K, C] int32 logical position, -1 = empty
    # L x [B, N, W, H] the last W queries, as `store_queries` keeps them (empty for FullKV)
    q_win: tuple[jax.Array, ...]
    # L x [B, K, C] float32 a policy's per-key state (`Policy.state`: attention received),
    # moved with its key; empty for methods without one.
    acc: tuple[jax.Array, ...]
    length: jax.Array  # [B] int32: occupied slots per row = where the next token is written
    pos: jax.Array  # [B] int32: logical (RoPE) position of the next token
    prompt: jax.Array  # [B] int32: the row's prompt length (policies that keep the prompt)
    seed: jax.Array  # [B] uint32: the request's seed (policies that draw at random)
    # What the keys, values and queries are stored as (static): a float type, or an 8-bit one
    # (`quantization.is_quantized`) with the scales below.
    dtype: Any = dataclasses.field(metadata={"static": True})
    # 8-bit caches only (() otherwise): float32 scales of the codes, moved with their token.
    k_scale: tuple[jax.Array, ...] = ()  # L x [B, K, C]
    v_scale: tuple[jax.Array, ...] = ()  # L x [B, K, C]
    q_scale: tuple[jax.Array, ...] = ()  # L x [B, N, W] (compressing methods)

    def __post_init__(self):
        # One spelling per dtype (jnp.bfloat16 and its np.dtype), so jit caches hit.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def capacity(self) -> int:  # C, static
        return self.k[0].shape[2]

    @property
    def quantized(self) -> bool:
        return quantization.is_quantized(self.dtype)

    def keys(self, layer: int) -> jax.Array:
        """[B, K, C, H] in `dtype`, or float32 dequantized from an 8-bit cache."""
        return read(self.k[layer], self.k_scale[layer] if self.quantized else None, self.dtype)

    def values(self, layer: int) -> jax.Array:
        """[B, K, C, H] in `dtype`, or float32 dequantized from an 8-bit cache."""
        return read(self.v[layer], self.v_scale[layer] if self.quantized else None, self.dtype)

    def attend_kv(self, layer: int) -> tuple[jax.Array, jax.Array, Scale, Scale]:
        """What attention reads of `layer`: keys and values [B, K, C, H] in `dtype` (an 8-bit
        cache's codes, never dequantized) and their scales [B, K, C] (None: not quantized)."""
        k = layers.from_storage(self.k[layer], self.dtype)
        v = layers.from_storage(self.v[layer], self.dtype)
        if not self.quantized:
            return k, v, None, None
        return k, v, self.k_scale[layer], self.v_scale[layer]

    def attend_mask(self, layer: int) -> jax.Array:
        """[B, K, 1, C]: slots holding a real token. Causality holds by construction in decode:
        every cached token precedes the query."""
        return (self.slot_pos[layer] >= 0)[:, :, None, :]


# Logical axes of each leaf (per layer for the tuple fields): rows on "batch", KV heads and query
# heads on the same mesh axis, slots never split (selection gathers along them).
KV_AXES = ("batch", "kv_heads", "cache_slots", "head_dim")
SLOT_AXES = ("batch", "kv_heads", "cache_slots")
QWIN_AXES = ("batch", "q_heads", "window", "head_dim")
QSCALE_AXES = QWIN_AXES[:3]  # an 8-bit query ring's scales
ROW_AXES = ("batch",)


def read(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """Stored keys, values or queries [..., H] as numbers: in `dtype` when `scale` is None,
    else float32 dequantized with scales [...]. A compression scores what this returns."""
    if scale is None:
        return layers.from_storage(x, dtype)
    return quantization.dequantize(x, scale, dtype)


def read_queries(q_win: tuple, q_scale: tuple, dtype) -> list[jax.Array]:
    """L x stored observation queries (and their scales, () when not quantized) as `read`
    gives them."""
    scales = q_scale or (None,) * len(q_win)
    return [read(q, s, dtype) for q, s in zip(q_win, scales, strict=True)]


def store(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Keys, values or queries [..., H] as a cache of `dtype` keeps them: (storage, None) for
    a float type, (codes, float32 scales [...]) for an 8-bit one."""
    if quantization.is_quantized(dtype):
        return quantization.quantize(x, dtype)
    return layers.as_storage(x.astype(dtype)), None


def store_queries(q: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Queries [..., H] as the observation ring keeps them: in `dtype` for a float type (the
    ring moves once per step, not per slot), or as `store` codes them for an 8-bit one."""
    if quantization.is_quantized(dtype):
        return quantization.quantize(q, dtype)
    return q.astype(dtype), None


def axes(cache: KVCache) -> KVCache:
    """The logical axes of each leaf of `cache` (what `sharding.local` and `constrain` take)."""
    n = len(cache.k)
    return dataclasses.replace(
        cache,
        k=(KV_AXES,) * n,
        v=(KV_AXES,) * n,
        slot_pos=(SLOT_AXES,) * n,
        q_win=(QWIN_AXES,) * len(cache.q_win),  # none for FullKV
        acc=(SLOT_AXES,) * len(cache.acc),
        length=ROW_AXES,
        pos=ROW_AXES,
        prompt=ROW_AXES,
        seed=ROW_AXES,
        k_scale=(SLOT_AXES,) * len(cache.k_scale),
        v_scale=(SLOT_AXES,) * len(cache.v_scale),
        q_scale=(QSCALE_AXES,) * len(cache.q_scale),
    )


def constrain(cache: KVCache, rules: sharding.ShardingRules | None) -> KVCache:
    """The cache pinned to [B->data, K->model] (q_win [B->data, N->model]); a no-op without
    rules. Decode inherits these shardings through the donated loop state."""
    if rules is None:
        return cache
    return jax.tree.map(lambda x, a: sharding.constrain(x, rules, *a), cache, axes(cache))


def valid_first(idx: jax.Array, slot_pos: jax.Array) -> jax.Array:
    """Reorders kept slot indices so real tokens come first, in slot (= position) order.

    Args:
      idx: [B, K, m] ascending slot indices into slot_pos.
      slot_pos: [B, K, n] int32, -1 at empty slots.

    Returns:
      [B, K, m]: the same indices, those of real tokens first (stable), empty ones last.
    """
    real = jnp.take_along_axis(slot_pos, idx, axis=-1) >= 0  # [B, K, m]
    return jnp.take_along_axis(idx, jnp.argsort(~real, axis=-1, stable=True), axis=-1)


class Layer(NamedTuple):
    """One layer's per-slot leaves of some rows, None where the cache keeps no such leaf.

    Whatever moves a token (prompt placement, a compression, a rotation) moves all of them
    with one index (`gather_layer`): the token's key, value, position, per-key state and
    scales stay together."""

    k: jax.Array  # [B, K, n, H] storage
    v: jax.Array  # [B, K, n, H] storage
    slot_pos: jax.Array  # [B, K, n] int32
    acc: jax.Array | None = None  # [B, K, n] float32 (`Policy.state`)
    k_scale: jax.Array | None = None  # [B, K, n] float32 (8-bit caches)
    v_scale: jax.Array | None = None  # [B, K, n] float32


def layer_leaves(cache: KVCache, i: int) -> Layer:
    """Layer i's per-slot leaves of `cache`."""

    def at(xs):
        return xs[i] if xs else None

    return Layer(
        cache.k[i],
        cache.v[i],
        cache.slot_pos[i],
        at(cache.acc),
        at(cache.k_scale),
        at(cache.v_scale),
    )


def with_layers(cache: KVCache, per_layer) -> KVCache:
    """`cache` with its per-slot leaves replaced by `per_layer` (L `Layer`s); the leaves a
    Layer holds as None stay absent."""
    cols = Layer(*(tuple(x) for x in zip(*per_layer, strict=True)))

    def present(xs):
        return () if xs[0] is None else xs

    return dataclasses.replace(
        cache,
        k=cols.k,
        v=cols.v,
        slot_pos=cols.slot_pos,
        acc=present(cols.acc),
        k_scale=present(cols.k_scale),
        v_scale=present(cols.v_scale),
    )


def layer_axes(layer: Layer) -> Layer:
    """The logical axes of each present leaf of `layer` (for `sharding.local`)."""
    return Layer(*(None if x is None else KV_AXES if x.ndim == 4 else SLOT_AXES for x in layer))


def gather_layer(layer: Layer, idx: jax.Array, capacity: int | None = None) -> Layer:
    """The picked slots idx [B, K, m] of every leaf of `layer`, padded to `capacity` slots
    when given (empty: position -1, everything else 0)."""

    def take(name, x):
        if x is None:
            return None
        x = jnp.take_along_axis(x, idx[..., None] if x.ndim == 4 else idx, axis=2)
        if capacity is None:
            return x
        return pad_slots(x, capacity, -1 if name == "slot_pos" else 0)

    return Layer(*(take(name, x) for name, x in zip(Layer._fields, layer, strict=True)))


def pad_slots(x: jax.Array, capacity: int, value=0) -> jax.Array:
    """[B, K, m, ...] -> [B, K, C, ...], padded with `value` along the slot axis, or cut to C
    slots when m > C (callers put real tokens first and only ever cut empty slots)."""
    if x.shape[2] > capacity:
        return x[:, :, :capacity]
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, capacity - x.shape[2])
    return jnp.pad(x, pad, constant_values=value)


def _write_at(buf: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
    """buf [B, K, C, ...] <- new [B, K, ...] at slot at[b] of each row b.

    One scatter with an index per (row, KV head), so B x K slots are written in place. Two
    other forms made XLA:CPU read or copy whole caches every step: a vmapped
    dynamic_update_slice became a select over the whole buffer (decode at 4K context went from
    7.6 to 9.2 tok/s without it), and a scatter with one index per row became a single
    dynamic_update_slice at batch 1, which XLA duplicated into the attention that reads it and
    then copied the layer's cache 3 times to feed both. The engine sizes the cache so
    `at < C` always holds (FullKV: prompt + max_new_tokens; compressing methods compress
    before the append that would overflow); an out-of-range slot would be dropped, not clamped
    onto another. `new` has `buf`'s dtype (the cache's storage, or int32 positions).
    """
    b, k = buf.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, k))  # [B, K]
    heads = jnp.broadcast_to(jnp.arange(k)[None, :], (b, k))
    slots = jnp.broadcast_to(at[:, None], (b, k))
    return buf.at[rows, heads, slots].set(new, mode="drop")


def _replace_layer(xs: tuple, layer: int, x) -> tuple:
    return (*xs[:layer], x, *xs[layer + 1 :])


def _append(bufs: tuple, news: tuple, at: jax.Array) -> tuple:
    """The per-layer appends (`_write_at`): each buffer [B, K, C, ...] gets its new [B, K, ...]
    at slot at[b] of row b."""
    return tuple(_write_at(buf, new, at) for buf, new in zip(bufs, news, strict=True))


_NEW_KV_AXES = ("batch", "kv_heads", "head_dim")


def write(
    cache: KVCache,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rules: sharding.ShardingRules | None = None,
    go: jax.Array | None = None,
) -> KVCache:
    """Appends one token per row to `layer`, at each row's own `length`.

    Args:
      cache: the cache.
      layer: layer index (static).
      q: [B, 1, N, H] the token's query: shifted into the observation ring if there is one.
      k, v: [B, 1, K, H] the token's key (post-RoPE) and value.
      rules: the mesh's sharding rules (None on one device).
      go: [B] bool rows that append (None: all). The others' caches and rings are left
        exactly as they are: empty slots, and rows waiting for a compression lane.
    """
    b, _, kh, _ = k.shape
    # An out-of-range slot is dropped by the scatter (`_write_at`), so a row that does not go
    # writes nothing.
    at = cache.length if go is None else jnp.where(go, cache.length, cache.capacity)
    k_new, k_scale = store(k[:, 0], cache.dtype)  # [B, K, H], [B, K] | None
    v_new, v_scale = store(v[:, 0], cache.dtype)
    bufs = [cache.k[layer], cache.v[layer], cache.slot_pos[layer]]
    news = [k_new, v_new, jnp.broadcast_to(cache.pos[:, None], (b, kh))]
    bufs_axes = [KV_AXES, KV_AXES, SLOT_AXES]
    news_axes = [_NEW_KV_AXES, _NEW_KV_AXES, SLOT_AXES[:2]]
    if cache.quantized:
        bufs += [cache.k_scale[layer], cache.v_scale[layer]]
        news += [k_scale, v_scale]
        bufs_axes += [SLOT_AXES] * 2
        news_axes += [SLOT_AXES[:2]] * 2
    # Per device under a mesh: the automatic partitioner did not see that the scatter's rows and
    # heads follow the cache's sharding, and all-gathered the new keys, values and indices of
    # every layer on every step.
    append = sharding.local(
        _append, rules, (tuple(bufs_axes), tuple(news_axes), ROW_AXES), tuple(bufs_axes)
    )
    written = append(tuple(bufs), tuple(news), at)  # each row writes at its own slot
    new_k, new_v, new_sp = written[:3]
    out = dict(
        k=_replace_layer(cache.k, layer, new_k),
        v=_replace_layer(cache.v, layer, new_v),
        slot_pos=_replace_layer(cache.slot_pos, layer, new_sp),
    )
    if cache.quantized:
        out["k_scale"] = _replace_layer(cache.k_scale, layer, written[3])
        out["v_scale"] = _replace_layer(cache.v_scale, layer, written[4])
    if cache.q_win:
        # Order inside the ring does not matter to scoring.
        q_new, q_scale = store_queries(jnp.swapaxes(q, 1, 2), cache.dtype)  # [B, N, 1, H]
        out["q_win"] = _replace_layer(
            cache.q_win, layer, _shift_in(cache.q_win[layer], q_new, go, axis=2)
        )
        if cache.quantized:
            out["q_scale"] = _replace_layer(
                cache.q_scale, layer, _shift_in(cache.q_scale[layer], q_scale, go, axis=2)
            )
    return dataclasses.replace(cache, **out)


def _shift_in(ring: jax.Array, new: jax.Array, go: jax.Array | None, axis: int) -> jax.Array:
    """ring [B, ...] with its oldest entry along `axis` dropped and `new` (size 1 there)
    appended, for the rows in `go` [B] bool (None: all)."""
    rest = jax.lax.slice_in_dim(ring, 1, ring.shape[axis], axis=axis)
    shifted = jnp.concatenate([rest, new.astype(ring.dtype)], axis=axis)
    if go is None:
        return shifted
    return jnp.where(go.reshape((-1,) + (1,) * (ring.ndim - 1)), shifted, ring)


def add_attention(cache: KVCache, layer: int, weights: jax.Array, go: jax.Array | None) -> KVCache:
    """Adds one decode step's attention weights [B, K, C] (summed over each KV head's query
    group) to `layer`'s per-key state, for the rows in `go` [B] bool (None: all); a no-op for a
    cache without one. Empty slots get no weight (attention masks them), so the slot a new
    token was just written to starts from its own weight."""
    if not cache.acc:
        return cache
    if go is not None:
        weights = jnp.where(go[:, None, None], weights, 0.0)
    acc = cache.acc[layer] + weights.astype(jnp.float32)
    return dataclasses.replace(cache, acc=_replace_layer(cache.acc, layer, acc))


def advance(cache: KVCache, go: jax.Array | None = None) -> KVCache:
    """After every layer has appended the step's token: one more slot used, next position
    (only for the rows in `go` [B] bool, when given)."""
    step = 1 if go is None else go.astype(jnp.int32)
    return dataclasses.replace(cache, length=cache.length + step, pos=cache.pos + step)


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache of rows [R] int32 (indices into B; clipped) as an R-row cache."""
    return jax.tree.map(lambda x: x[rows], cache)


def put_rows(cache: KVCache, rows: jax.Array, new: KVCache) -> KVCache:
    """`cache` with rows [R] int32 replaced by the R rows of `new`; indices >= B are dropped.

    Under `jit` with the cache donated the scatter writes in place: admitting a request into
    a slot moves only that row."""

    return jax.tree.map(lambda x, y: x.at[rows].set(y, mode="drop"), cache, new)


def empty(
    cfg: ModelConfig, rows: int, capacity: int, dtype, window: int, state: bool = False
) -> KVCache:
    """A cache of `rows` empty rows (every slot -1) storing `dtype`; `window` 0 for methods
    without queries, `state` for methods that keep a per-key state (`Policy.state`)."""
    storage = quantization.storage_dtype(dtype)
    scaled = quantization.is_quantized(dtype)
    n, k, h = cfg.num_layers, cfg.kv_heads, cfg.head_dim

    def zeros(shape, dt, present=True):
        if not present:
            return ()
        return tuple(jnp.zeros(shape, dt) for _ in range(n))  # distinct buffers: donated

    return KVCache(
        k=zeros((rows, k, capacity, h), storage),
        v=zeros((rows, k, capacity, h), storage),
        slot_pos=tuple(jnp.full((rows, k, capacity), -1, jnp.int32) for _ in range(n)),
        q_win=zeros((rows, cfg.q_heads, window, h), storage if scaled else dtype, window > 0),
        acc=zeros((rows, k, capacity), jnp.float32, state),
        length=jnp.zeros((rows,), jnp.int32),
        pos=jnp.zeros((rows,), jnp.int32),
        prompt=jnp.zeros((rows,), jnp.int32),
        seed=jnp.zeros((rows,), jnp.uint32),
        dtype=dtype,
        k_scale=zeros((rows, k, capacity), jnp.float32, scaled),
        v_scale=zeros((rows, k, capacity), jnp.float32, scaled),
        q_scale=zeros((rows, cfg.q_heads, window), jnp.float32, scaled and window > 0),
    )
