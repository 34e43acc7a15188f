"""When and how the KV cache is filled and compressed: prompt placement and `maybe_compress`.

Scoring and selection live in `rkvjax.compression` (one code path for the engine and the public
`keep_indices`); this module applies the selected slots to the cache, per layer and per row.
On a mesh (`rules` given) selection and compaction run per device under `shard_map`: each device
owns whole rows and whole KV heads with their query groups, so they need no collectives, whereas
the automatic partitioner would all-gather the scores for `top_k`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rkvjax import cache as kv
from rkvjax import compression, layers, sharding
from rkvjax.config import CompressionConfig


def _select(cc: CompressionConfig, q_win, k, slot_pos, budget: int) -> jax.Array:
    """Kept slots [B, K, budget] of one layer, real tokens first in position order."""
    idx = compression.select(
        cc.policy,
        q_win,
        k,
        slot_pos >= 0,
        budget=budget,
        window=cc.window,
        impl=cc.pallas,
        target=cc.target,
    )
    return kv.valid_first(idx, slot_pos)


def _select_layers(cc: CompressionConfig, qs, ks, sps, budget: int, heads_axis=None) -> list:
    """Kept slots [B, K, budget] of every layer (real tokens first in position order): one set
    per (layer, KV head), or shared as `cc.share` says.

    Shared sets score every layer and head first: "layers" sums the scores over the layers
    (one set per KV head, the same in every layer), "heads" averages them over the KV heads
    (one set per layer), "all" does both (one set per row). A shared set stays shared, so the
    layers and heads of a row hold the same positions and their scores line up.

    Args:
      qs, ks, sps: L x the window's queries [B, N, W, H], keys [B, K, n, H] and slot
        positions [B, K, n].
      heads_axis: the mesh axis the KV heads are split over inside `shard_map` (None: every
        head is here): an average over heads gathers them all first.
    """
    if cc.share == "none":
        return [_select(cc, q, k, sp, budget) for q, k, sp in zip(qs, ks, sps, strict=True)]
    kw = dict(window=cc.window, impl=cc.pallas, target=cc.target)
    scores = [
        compression.candidate_scores(cc.policy, q, k, sp >= 0, **kw)
        for q, k, sp in zip(qs, ks, sps, strict=True)
    ]  # L x [B, K, n - W]
    if cc.share in ("layers", "all"):
        scores = [functools.reduce(jnp.add, scores)]
    if cc.share in ("heads", "all"):
        scores = [_mean_over_heads(x, heads_axis) for x in scores]
    idx = [compression.keep(x, budget, **kw) for x in scores]
    if len(idx) == 1:
        idx = idx * len(sps)
    return [kv.valid_first(i, sp) for i, sp in zip(idx, sps, strict=True)]


def _mean_over_heads(score: jax.Array, heads_axis) -> jax.Array:
    """[B, K, m] scores (-inf: not there) -> their mean over the KV heads, in every head.

    With the heads split over devices, each gathers all of them and sums in head order, so
    the mean is the one device's to the bit (a psum's order of addition would not be)."""
    if heads_axis is not None:
        score = jax.lax.all_gather(score, heads_axis, axis=1, tiled=True)  # [B, K_all, m]
    present = score > -jnp.inf
    total = jnp.sum(jnp.where(present, score, 0.0), axis=1, keepdims=True)  # [B, 1, m]
    count = jnp.sum(present, axis=1, keepdims=True)  # [B, 1, m]
    mean = jnp.where(count > 0, total / jnp.maximum(count, 1), -jnp.inf)
    if heads_axis is not None:
        local = score.shape[1] // jax.lax.axis_size(heads_axis)
        present = jax.lax.dynamic_slice_in_dim(
            present, jax.lax.axis_index(heads_axis) * local, local, axis=1
        )
    return jnp.where(present, mean, -jnp.inf)  # [B, K, m]


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
    shared = squeeze and cc.share != "none"
    if shared:  # one selection over every layer's scores: all layers in one call
        n = len(ks)
        heads_axis = rules.kv_heads if rules is not None else None

        def squeeze_all(q_win, ks_, vs_, sp):
            idx = _select_layers(cc, q_win, ks_, [sp] * n, cc.budget, heads_axis)
            return tuple(
                zip(
                    *[
                        kv.gather_slots(layers.as_storage(k), layers.as_storage(v), sp, i)
                        for k, v, i in zip(ks_, vs_, idx, strict=True)
                    ],
                    strict=True,
                )
            )

        shared_out = sharding.local(
            squeeze_all,
            rules,
            ((kv.QWIN_AXES,) * n, (kv.KV_AXES,) * n, (kv.KV_AXES,) * n, kv.SLOT_AXES),
            ((kv.KV_AXES,) * n, (kv.KV_AXES,) * n, (kv.SLOT_AXES,) * n),
        )(
            q_win,
            tuple(jnp.swapaxes(k, 1, 2) for k in ks),
            tuple(jnp.swapaxes(v, 1, 2) for v in vs),
            sp,
        )
    elif squeeze:
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
        if shared:
            gk, gv, gsp = (x[i] for x in shared_out)
        elif squeeze:
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


def lane_count(slots: int, cc: CompressionConfig, data_shards: int = 1) -> int:
    """Default compression lanes per data shard: about twice the full rows expected per step.

    A row fills once per `buffer` appends, so `slots / buffer` rows are full per step on
    average; rows admitted together (or prompts of one length) fill together, and a full row
    that finds no lane waits a step, so the default leaves room for bursts."""
    rows = max(1, slots // max(1, data_shards))
    return max(1, min(rows, -(-2 * rows // cc.buffer)))


def full_rows(cache: kv.KVCache, cc: CompressionConfig, thinking, active) -> jax.Array:
    """[B] bool: active rows that must compress before their next append.

    A thinking row is full at `budget + buffer` slots; in think-only mode a row that has
    finished thinking is compressed only when its answer fills the whole capacity."""
    limit = jnp.where(thinking, cc.trigger, cache.capacity)  # [B]
    return active & (cache.length >= limit)


def compress_lanes(
    cache: kv.KVCache,
    full: jax.Array,
    cc: CompressionConfig,
    *,
    lanes: int,
    start: jax.Array,
    num: jax.Array | None = None,
    rules: sharding.ShardingRules | None = None,
) -> tuple[kv.KVCache, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Compresses up to `lanes` of the full rows (per data shard) back to `budget` slots.

    The chosen rows are gathered into a [lanes]-row block, selected and compacted there, and
    scattered back: the work is `lanes` rows whatever the batch, and nothing runs when no row
    is full (`lax.cond`). Rows are taken round-robin from `start`, so a row left waiting for a
    lane is served within a few steps. A full row that got no lane must not append this step
    (the caller skips its decode step), so every row still compresses at exactly the fill level
    the reference compresses at.

    Args:
      cache: the cache.
      full: [B] bool rows to compress (`full_rows`).
      cc: compression settings (static).
      lanes: rows compressed at most per step and data shard (static).
      start: [] int32 the row that has priority this step (e.g. the global step counter).
      num: [B] int32 a per-row count to report for the rows the lanes take (the engine passes
        the tokens each row has emitted); taken where the row lives, so it costs no gather.
      rules: sharding rules when running on a mesh (None: one device).

    Returns:
      (cache, fired [B] bool rows compressed, lane_rows [D * lanes] int32 the row each lane
      compressed (int32 max = none), lane_num [D * lanes] int32 `num` of that row (0 = none),
      kept [D * lanes, L, K, budget] int32 the positions each lane's row kept per layer and KV
      head).
    """
    if num is None:
        num = jnp.zeros(full.shape, jnp.int32)
    budget, n = cc.budget, len(cache.k)

    def body(ks, vs, sps, qs, full, length, num, start):  # on a mesh: one device's block
        b = full.shape[0]
        offset = 0 if rules is None or rules.batch is None else jax.lax.axis_index(rules.batch) * b
        order = (jnp.arange(b) + start % b) % b  # [B] rows in priority order
        pick = jnp.nonzero(full[order], size=lanes, fill_value=b)[0]  # [lanes]
        rows = jnp.where(pick < b, order[jnp.minimum(pick, b - 1)], b)  # [lanes], b = no row

        def run(args):
            ks, vs, sps, length = args
            picked = [tuple(x[jnp.minimum(rows, b - 1)] for x in xs) for xs in (ks, vs, sps, qs)]
            at = jnp.minimum(rows, b - 1)
            heads = rules.kv_heads if rules is not None else None
            new_k, new_v, new_sp, kept = _compress_block(
                *picked, length[at], cc, cache.dtype, heads
            )

            def put(x, new):
                return x.at[rows].set(new, mode="drop")

            return (
                tuple(map(put, ks, new_k)),
                tuple(map(put, vs, new_v)),
                tuple(map(put, sps, new_sp)),
                length.at[rows].set(kept, mode="drop"),
            )

        ks, vs, sps, length = jax.lax.cond(
            jnp.any(full), run, lambda args: args, (ks, vs, sps, length)
        )
        fired = jnp.zeros((b,), bool).at[rows].set(True, mode="drop")
        log = jnp.stack([sp[jnp.minimum(rows, b - 1), :, :budget] for sp in sps], axis=1)
        lane_rows = jnp.where(rows < b, rows + offset, jnp.iinfo(jnp.int32).max)
        lane_num = jnp.where(rows < b, num[jnp.minimum(rows, b - 1)], 0)
        return ks, vs, sps, length, fired, lane_rows.astype(jnp.int32), lane_num, log

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
            kv.ROW_AXES,
            (),
        ),
        (
            (kv.KV_AXES,) * n,
            (kv.KV_AXES,) * n,
            (kv.SLOT_AXES,) * n,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            ("batch", None, "kv_heads", None),
        ),
    )
    ks, vs, sps, length, fired, lane_rows, lane_num, log = run(
        cache.k, cache.v, cache.slot_pos, cache.q_win, full, cache.length, num, start
    )
    cache = dataclasses.replace(cache, k=ks, v=vs, slot_pos=sps, length=length)
    return cache, fired, lane_rows, lane_num, log


def _compress_block(ks, vs, sps, qs, length, cc: CompressionConfig, dtype, heads_axis=None):
    """Brings every row of a block back to `budget` slots.

    Args:
      ks, vs: L x [R, K, C, H] the rows' keys and values (storage dtype).
      sps: L x [R, K, C] their slot positions.
      qs: L x [R, N, W, H] their observation queries.
      length: [R] int32 occupied slots.
      cc: compression settings (static).
      dtype: the keys' dtype (static; the cache stores bfloat16 as uint16).
      heads_axis: the mesh axis of the KV heads inside `shard_map` (for kept sets shared
        over heads).

    Returns:
      (ks, vs, sps) compacted, each row's kept tokens first in position order, and the new
      length [R] (equal for every layer and KV head).
    """
    c = ks[0].shape[2]
    out_k, out_v, out_sp = [], [], []
    # select() reads the last W slots as the observation window. A row compressed below the
    # capacity (think-only: trigger < capacity) holds its newest tokens at
    # [length - W, length): rotate it to end at slot C - 1 first (empty slots go first).
    roll = (jnp.arange(c)[None, :] + length[:, None]) % c if c > cc.trigger else None
    if cc.share == "none":  # layer by layer: one layer's temporaries live at a time
        for k, v, sp, q in zip(ks, vs, sps, qs, strict=True):
            if roll is not None:
                k, v, sp = kv.gather_slots(k, v, sp, jnp.broadcast_to(roll[:, None], sp.shape))
            keys = layers.from_storage(k, dtype)
            idx = _select(cc, q, keys, sp, cc.budget)  # [R, K, budget]
            gk, gv, gsp = kv.gather_slots(k, v, sp, idx)
            out_k.append(kv.pad_slots(gk, c))
            out_v.append(kv.pad_slots(gv, c))
            out_sp.append(kv.pad_slots(gsp, c, -1))
    else:
        if roll is not None:
            rolled = [
                kv.gather_slots(k, v, sp, jnp.broadcast_to(roll[:, None], sp.shape))
                for k, v, sp in zip(ks, vs, sps, strict=True)
            ]
            ks, vs, sps = (tuple(x) for x in zip(*rolled, strict=True))
        keys = [layers.from_storage(k, dtype) for k in ks]
        idxs = _select_layers(cc, qs, keys, sps, cc.budget, heads_axis)
        for k, v, sp, idx in zip(ks, vs, sps, idxs, strict=True):
            gk, gv, gsp = kv.gather_slots(k, v, sp, idx)
            out_k.append(kv.pad_slots(gk, c))
            out_v.append(kv.pad_slots(gv, c))
            out_sp.append(kv.pad_slots(gsp, c, -1))
    kept = jnp.sum(out_sp[0][:, 0] >= 0, axis=-1).astype(jnp.int32)  # [R]
    return tuple(out_k), tuple(out_v), tuple(out_sp), kept
