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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rkvjax import layers, sharding
from rkvjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B, K, C, H] keys after RoPE, as_storage(dtype)
    v: tuple[jax.Array, ...]  # L x [B, K, C, H] values, as_storage(dtype)
    slot_pos: tuple[jax.Array, ...]  # L x [B, K, C] int32 logical position, -1 = empty
    q_win: tuple[jax.Array, ...]  # L x [B, N, W, H] the last W queries (empty for FullKV)
    # L x [B, K, C] float32 a policy's per-key state (`Policy.state`: attention received),
    # moved with its key; empty for methods without one.
    acc: tuple[jax.Array, ...]
    length: jax.Array  # [B] int32: occupied slots per row = where the next token is written
    pos: jax.Array  # [B] int32: logical (RoPE) position of the next token
    prompt: jax.Array  # [B] int32: the row's prompt length (policies that keep the prompt)
    seed: jax.Array  # [B] uint32: the request's seed (policies that draw at random)
    dtype: Any = dataclasses.field(metadata={"static": True})  # of the keys and values

    def __post_init__(self):
        # One spelling per dtype (jnp.bfloat16 and its np.dtype), so jit caches hit.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def capacity(self) -> int:  # C, static
        return self.k[0].shape[2]

    def keys(self, layer: int) -> jax.Array:
        """[B, K, C, H] in `dtype`."""
        return layers.from_storage(self.k[layer], self.dtype)

    def values(self, layer: int) -> jax.Array:
        """[B, K, C, H] in `dtype`."""
        return layers.from_storage(self.v[layer], self.dtype)

    def attend_mask(self, layer: int) -> jax.Array:
        """[B, K, 1, C]: slots holding a real token. Causality holds by construction in decode:
        every cached token precedes the query."""
        return (self.slot_pos[layer] >= 0)[:, :, None, :]


# Logical axes of each leaf (per layer for the tuple fields): rows on "batch", KV heads and query
# heads on the same mesh axis, slots never split (selection gathers along them).
KV_AXES = ("batch", "kv_heads", "cache_slots", "head_dim")
SLOT_AXES = ("batch", "kv_heads", "cache_slots")
QWIN_AXES = ("batch", "q_heads", "window", "head_dim")
ROW_AXES = ("batch",)


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


def gather_slots(
    k: jax.Array, v: jax.Array, slot_pos: jax.Array, idx: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """k, v [B, K, n, H], slot_pos [B, K, n], idx [B, K, m] -> the m picked slots of each."""

    def take(x):
        return jnp.take_along_axis(x, idx[..., None], axis=2)

    return take(k), take(v), take_slots(slot_pos, idx)


def take_slots(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, K, n] (slot positions, per-key state), idx [B, K, m] -> [B, K, m]."""
    return jnp.take_along_axis(x, idx, axis=-1)


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


def _append(k_buf, v_buf, sp_buf, k, v, pos, at):
    """The three per-layer appends (`_write_at`): k, v [B, K, H], pos [B, K], at [B]."""
    return _write_at(k_buf, k, at), _write_at(v_buf, v, at), _write_at(sp_buf, pos, at)


_NEW_KV_AXES = ("batch", "kv_heads", "head_dim")
_APPEND_IN = (KV_AXES, KV_AXES, SLOT_AXES, _NEW_KV_AXES, _NEW_KV_AXES, SLOT_AXES[:2], ROW_AXES)


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
    # Per device under a mesh: the automatic partitioner did not see that the scatter's rows and
    # heads follow the cache's sharding, and all-gathered the new keys, values and indices of
    # every layer on every step.
    append = sharding.local(_append, rules, _APPEND_IN, (KV_AXES, KV_AXES, SLOT_AXES))
    new_k, new_v, new_sp = append(
        cache.k[layer],
        cache.v[layer],
        cache.slot_pos[layer],
        layers.as_storage(k[:, 0].astype(cache.dtype)),  # [B, K, H]
        layers.as_storage(v[:, 0].astype(cache.dtype)),
        jnp.broadcast_to(cache.pos[:, None], (b, kh)),
        at,  # [B] each row writes at its own slot
    )
    q_win = cache.q_win
    if q_win:
        ring = q_win[layer]  # [B, N, W, H]; order inside the ring does not matter to scoring
        q_new = jnp.swapaxes(q, 1, 2).astype(ring.dtype)  # [B, N, 1, H]
        shifted = jnp.concatenate([ring[:, :, 1:], q_new], axis=2)
        if go is not None:
            shifted = jnp.where(go[:, None, None, None], shifted, ring)
        q_win = _replace_layer(q_win, layer, shifted)
    return dataclasses.replace(
        cache,
        k=_replace_layer(cache.k, layer, new_k),
        v=_replace_layer(cache.v, layer, new_v),
        slot_pos=_replace_layer(cache.slot_pos, layer, new_sp),
        q_win=q_win,
    )


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
    take = lambda xs: tuple(x[rows] for x in xs)
    return dataclasses.replace(
        cache,
        k=take(cache.k),
        v=take(cache.v),
        slot_pos=take(cache.slot_pos),
        q_win=take(cache.q_win),
        acc=take(cache.acc),
        length=cache.length[rows],
        pos=cache.pos[rows],
        prompt=cache.prompt[rows],
        seed=cache.seed[rows],
    )


def put_rows(cache: KVCache, rows: jax.Array, new: KVCache) -> KVCache:
    """`cache` with rows [R] int32 replaced by the R rows of `new`; indices >= B are dropped.

    Under `jit` with the cache donated the scatter writes in place: admitting a request into
    a slot moves only that row."""

    def put(xs, ys):
        return tuple(x.at[rows].set(y, mode="drop") for x, y in zip(xs, ys, strict=True))

    return dataclasses.replace(
        cache,
        k=put(cache.k, new.k),
        v=put(cache.v, new.v),
        slot_pos=put(cache.slot_pos, new.slot_pos),
        q_win=put(cache.q_win, new.q_win),
        acc=put(cache.acc, new.acc),
        length=cache.length.at[rows].set(new.length, mode="drop"),
        pos=cache.pos.at[rows].set(new.pos, mode="drop"),
        prompt=cache.prompt.at[rows].set(new.prompt, mode="drop"),
        seed=cache.seed.at[rows].set(new.seed, mode="drop"),
    )


def empty(
    cfg: ModelConfig, rows: int, capacity: int, dtype, window: int, state: bool = False
) -> KVCache:
    """A cache of `rows` empty rows (every slot -1); `window` 0 for methods without queries,
    `state` for methods that keep a per-key state (`Policy.state`)."""
    storage = layers.as_storage(jnp.zeros((), dtype)).dtype
    n, k, h = cfg.num_layers, cfg.kv_heads, cfg.head_dim

    def zeros(shape, dt):
        return tuple(jnp.zeros(shape, dt) for _ in range(n))  # distinct buffers: donated

    return KVCache(
        k=zeros((rows, k, capacity, h), storage),
        v=zeros((rows, k, capacity, h), storage),
        slot_pos=tuple(jnp.full((rows, k, capacity), -1, jnp.int32) for _ in range(n)),
        q_win=zeros((rows, cfg.q_heads, window, h), dtype) if window else (),
        acc=zeros((rows, k, capacity), jnp.float32) if state else (),
        length=jnp.zeros((rows,), jnp.int32),
        pos=jnp.zeros((rows,), jnp.int32),
        prompt=jnp.zeros((rows,), jnp.int32),
        seed=jnp.zeros((rows,), jnp.uint32),
        dtype=dtype,
    )
