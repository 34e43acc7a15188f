"""When and how the KV cache is filled and compressed: prompt placement and `maybe_compress`.

Scoring and selection live in `rkvjax.compression` (one code path for the engine and the public
`keep_indices`); this module applies the selected slots to the cache, per layer and per row.
On a mesh (`rules` given) selection and compaction run per device under `shard_map`: each device
owns whole rows and whole KV heads with their query groups, so they need no collectives, whereas
the automatic partitioner would all-gather the scores for `top_k`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rkvjax import cache as kv
from rkvjax import compression, layers, sharding
from rkvjax.config import CompressionConfig


def _select(cc: CompressionConfig, q_win, k, slot_pos, budget: int) -> jax.Array:
    """Kept slots [B, K, budget] of one layer, real tokens first in position order."""
    idx = compression.select(
        cc.method,
        q_win,
        k,
        slot_pos >= 0,
        budget=budget,
        window=cc.window,
        kernel=cc.kernel,
        lam=cc.lam,
        threshold=cc.threshold,
        retain=cc.retain,
        impl=cc.kernels,
    )
    return kv.valid_first(idx, slot_pos)


def prefill_cache(
    ks: tuple[jax.Array, ...],
    vs: tuple[jax.Array, ...],
    qs: tuple[jax.Array, ...],
    positions: jax.Array,
    cc: CompressionConfig,
    capacity: int,
    rules: sharding.ShardingRules | None = None,
) -> tuple[kv.KVCache, jax.Array]:
    """Places a left-padded prompt into a fresh cache, compressing rows longer than the budget.

    Pads are dropped (each row's tokens move to the front of its slots), so rows of different
    lengths start at different fill levels. A compressing method whose prompt bucket exceeds the
    budget runs one compression on the prompt (observation = its last W queries); rows no longer
    than the budget keep every token, since a selection never evicts while the candidates fit.

    Args:
      ks, vs: L x [B, P, K, H] post-RoPE keys and values of the prompt.
      qs: L x [B, P, N, H] post-RoPE queries (only the last W are used, by compressing methods).
      positions: [B, P] int32, -1 at pads.
      cc: the compression settings (static).
      capacity: C, static slots of the cache.
      rules: sharding rules when running on a mesh (None: one device).

    Returns:
      (cache, compressed [B] bool: rows whose prompt was compressed).
    """
    b, p, kh, _ = ks[0].shape
    sp = jnp.broadcast_to(positions[:, None, :], (b, kh, p)).astype(jnp.int32)  # [B, K, P]
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)  # [B]
    w = cc.window
    q_win = tuple(jnp.swapaxes(q[:, p - w :], 1, 2) for q in qs) if cc.compressing else ()
    squeeze = cc.compressing and p > cc.budget
    if squeeze:
        squeezed = sharding.local(
            lambda q, k, v, sp: kv.gather_slots(
                layers.as_storage(k), layers.as_storage(v), sp, _select(cc, q, k, sp, cc.budget)
            ),
            rules,
            (kv.QWIN_AXES, kv.KV_AXES, kv.KV_AXES, kv.SLOT_AXES),
            (kv.KV_AXES, kv.KV_AXES, kv.SLOT_AXES),
        )
    else:  # keep every token: only move the pads out
        order = jnp.argsort(sp < 0, axis=-1, stable=True)  # [B, K, P]
    k_out, v_out, sp_out = [], [], []
    for i in range(len(ks)):
        k, v = jnp.swapaxes(ks[i], 1, 2), jnp.swapaxes(vs[i], 1, 2)  # [B, K, P, H]
        if squeeze:
            gk, gv, gsp = squeezed(q_win[i], k, v, sp)
        else:
            gk, gv, gsp = kv.gather_slots(layers.as_storage(k), layers.as_storage(v), sp, order)
        k_out.append(kv.pad_slots(gk, capacity))
        v_out.append(kv.pad_slots(gv, capacity))
        sp_out.append(kv.pad_slots(gsp, capacity, -1))
    kept = jnp.minimum(lengths, cc.budget) if squeeze else lengths
    cache = kv.KVCache(
        k=tuple(k_out),
        v=tuple(v_out),
        slot_pos=tuple(sp_out),
        q_win=q_win,
        length=kept,
        pos=lengths,
        dtype=ks[0].dtype,
    )
    return cache, kept < lengths


def maybe_compress(
    cache: kv.KVCache,
    cc: CompressionConfig,
    thinking: jax.Array,
    rules: sharding.ShardingRules | None = None,
    *,
    active: jax.Array | None = None,
) -> tuple[kv.KVCache, jax.Array]:
    """Compresses the rows whose cache is full, before the append that would overflow.

    A row is full at `budget + buffer` slots while it is thinking; in think-only mode a row that
    has finished thinking is compressed only when it reaches the whole capacity (its answer
    would otherwise overflow). The compression itself runs under `lax.cond`, so steps without a
    full row cost one comparison; when it runs, rows that are not full are left as they are.

    Args:
      cache: the cache.
      cc: compression settings (static); FullKV never compresses.
      thinking: [B] bool, rows still compressing at the normal trigger.
      rules: sharding rules when running on a mesh (None: one device).
      active: [B] bool, rows still generating (None: all); finished rows never compress, so
        their stats and kept-position logs stay those of the row alone.

    Returns:
      (cache, fired [B] bool: rows compressed this step).
    """
    if not cc.compressing:
        return cache, jnp.zeros(cache.length.shape, bool)
    limit = jnp.where(thinking, cc.trigger, cache.capacity)  # [B]
    full = cache.length >= limit  # [B]
    if active is not None:
        full = full & active
    cache = jax.lax.cond(
        jnp.any(full), lambda c: _compress_rows(c, full, cc, rules), lambda c: c, cache
    )
    return cache, full


def _compress_rows(
    cache: kv.KVCache,
    rows: jax.Array,
    cc: CompressionConfig,
    rules: sharding.ShardingRules | None = None,
) -> kv.KVCache:
    """Brings every row in `rows` [B] back to `budget` slots; other rows are unchanged."""
    budget, c, n = cc.budget, cache.capacity, len(cache.k)

    def body(ks_in, vs_in, sps_in, qs_in, rows, length):  # on a mesh: one device's block
        ks, vs, sps = [], [], []
        # select() reads the last W slots as the observation window. A row compressed below
        # the capacity (think-only: trigger < capacity) holds its newest tokens at
        # [length - W, length): rotate it to end at slot C - 1 first (empty slots go first).
        roll = (jnp.arange(c)[None, :] + length[:, None]) % c if c > cc.trigger else None
        for k, v, sp, q in zip(ks_in, vs_in, sps_in, qs_in, strict=True):
            rk, rv, rsp = k, v, sp
            if roll is not None:
                rk, rv, rsp = kv.gather_slots(k, v, sp, jnp.broadcast_to(roll[:, None], sp.shape))
            keys = layers.from_storage(rk, cache.dtype)
            idx = _select(cc, q, keys, rsp, budget)  # [B, K, budget]
            gk, gv, gsp = kv.gather_slots(rk, rv, rsp, idx)
            on = rows[:, None, None]  # [B, 1, 1]
            ks.append(jnp.where(on[..., None], kv.pad_slots(gk, c), k))
            vs.append(jnp.where(on[..., None], kv.pad_slots(gv, c), v))
            sps.append(jnp.where(on, kv.pad_slots(gsp, c, -1), sp))
        # [B], equal for all (L, K): so each device's own first head gives every device the
        # same count, and `length` stays replicated over the model axis without a collective.
        kept = jnp.sum(sps[0][:, 0] >= 0, axis=-1).astype(jnp.int32)
        return tuple(ks), tuple(vs), tuple(sps), jnp.where(rows, kept, length)

    run = sharding.local(
        body,
        rules,
        (
            (kv.KV_AXES,) * n,
            (kv.KV_AXES,) * n,
            (kv.SLOT_AXES,) * n,
            (kv.QWIN_AXES,) * n,
            kv.ROW_AXES,
            kv.ROW_AXES,
        ),
        ((kv.KV_AXES,) * n, (kv.KV_AXES,) * n, (kv.SLOT_AXES,) * n, kv.ROW_AXES),
    )
    ks, vs, sps, length = run(cache.k, cache.v, cache.slot_pos, cache.q_win, rows, cache.length)
    return dataclasses.replace(cache, k=ks, v=vs, slot_pos=sps, length=length)
