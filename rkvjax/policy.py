"""When and how the KV cache is filled and compressed: prompt placement (`prefill_cache`) and
the compression lanes (`compress_lanes`).

Scoring and selection live in `rkvjax.compression` (one code path for the engine and the public
`keep_indices`); this module applies the selected slots to the cache, per layer and per row.
On a mesh (`rules` given) selection and compaction run per device under `shard_map`: each device
owns whole rows and whole KV heads with their query groups, so they need no collectives, whereas
the automatic partitioner would all-gather the scores for `top_k`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rkvjax import cache as kv
from rkvjax import compression, layers, policies, sharding
from rkvjax.config import CompressionConfig


class Rows(NamedTuple):
    """Per-row values a policy's `Context` holds besides the keys' positions and state."""

    pos: jax.Array  # [B] int32 next position
    prompt: jax.Array  # [B] int32 prompt length
    seed: jax.Array  # [B] uint32 request seed


def _context(rows: Rows, slot_pos, acc, layer: int, heads_axis=None) -> policies.Context:
    """A policy's view of one layer of a block of rows; `heads_axis`: the mesh axis the KV
    heads are split over inside `shard_map` (None: every head is here)."""
    local = slot_pos.shape[1]
    if heads_axis is None:
        head0, total = 0, local
    else:
        head0 = jax.lax.axis_index(heads_axis) * local
        total = local * jax.lax.axis_size(heads_axis)
    return policies.Context(slot_pos, *rows, state=acc, head0=head0, layer=layer, kv_heads=total)


def _select(
    cc: CompressionConfig, q_win, k, slot_pos, budget: int, rows, acc, layer, heads_axis=None
):
    """Kept slots [B, K, budget] of one layer, real tokens first in position order, and the
    per-key state to move with them ([B, K, n]: the method's new one, or `acc` as it was)."""
    score, state = compression.scores_and_state(
        cc.policy,
        q_win,
        k,
        slot_pos >= 0,
        window=cc.window,
        impl=cc.pallas,
        target=cc.target,
        context=_context(rows, slot_pos, acc, layer, heads_axis),
    )
    idx = compression.keep(score, budget, cc.window, impl=cc.pallas, target=cc.target)
    return kv.valid_first(idx, slot_pos), acc if state is None else state


def _select_layers(
    cc: CompressionConfig, qs, ks, sps, budget: int, rows: Rows, accs, heads_axis=None
) -> tuple[list, list]:
    """Kept slots [B, K, budget] of every layer (real tokens first in position order), one set
    per (layer, KV head) or shared as `cc.share` says, and each layer's per-key state to move
    with them.

    Shared sets score every layer and head first: "layers" sums the scores over the layers
    (one set per KV head, the same in every layer), "heads" averages them over the KV heads
    (one set per layer), "all" does both (one set per row). A shared set stays shared, so the
    layers and heads of a row hold the same positions and their scores line up.

    Args:
      qs, ks, sps: L x the window's queries [B, N, W, H], keys [B, K, n, H] and slot
        positions [B, K, n].
      rows: the rows' positions, prompt lengths and seeds.
      accs: L x the keys' per-key state [B, K, n], or L x None.
      heads_axis: the mesh axis the KV heads are split over inside `shard_map` (None: every
        head is here): an average over heads gathers them all first.
    """
    layers_ = range(len(sps))
    if cc.share == "none":
        picked = [
            _select(cc, q, k, sp, budget, rows, a, i, heads_axis)
            for i, q, k, sp, a in zip(layers_, qs, ks, sps, accs, strict=True)
        ]
        return [x for x, _ in picked], [a for _, a in picked]
    kw = dict(window=cc.window, impl=cc.pallas, target=cc.target)
    scored = [
        compression.scores_and_state(
            cc.policy, q, k, sp >= 0, context=_context(rows, sp, a, i, heads_axis), **kw
        )
        for i, q, k, sp, a in zip(layers_, qs, ks, sps, accs, strict=True)
    ]  # L x ([B, K, n - W], [B, K, n] | None)
    scores = [x for x, _ in scored]
    states = [a if new is None else new for a, (_, new) in zip(accs, scored, strict=True)]
    if cc.share in ("layers", "all"):
        scores = [functools.reduce(jnp.add, scores)]
    if cc.share in ("heads", "all"):
        scores = [_mean_over_heads(x, heads_axis) for x in scores]
    idx = [compression.keep(x, budget, **kw) for x in scores]
    if len(idx) == 1:
        idx = idx * len(sps)
    return [kv.valid_first(i, sp) for i, sp in zip(idx, sps, strict=True)], states


def _gather(k, v, sp, acc, idx, capacity: int | None = None):
    """The picked slots idx [B, K, m] of one layer's keys, values, positions and per-key state
    (None: none), padded to `capacity` slots when given (empty: position -1, state 0)."""
    out = [*kv.gather_slots(k, v, sp, idx), None if acc is None else kv.take_slots(acc, idx)]
    if capacity is None:
        return tuple(out)
    gk, gv, gsp, ga = out
    pad = functools.partial(kv.pad_slots, capacity=capacity)
    return pad(gk), pad(gv), pad(gsp, value=-1), None if ga is None else pad(ga)


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
    *,
    seeds: jax.Array | None = None,
    weights: tuple[jax.Array, ...] = (),
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
      seeds: [B] uint32 the requests' seeds (None: 0), for policies that draw at random.
      weights: L x [B, K, P] the attention each prompt key received, for a policy that sums
        it per key (`Policy.state == "attention"`); () otherwise.

    Returns:
      (cache, compressed [B] bool: rows whose prompt was compressed).
    """
    b, p, kh, _ = ks[0].shape
    n = len(ks)
    sp = jnp.broadcast_to(positions[:, None, :], (b, kh, p)).astype(jnp.int32)  # [B, K, P]
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)  # [B]
    seeds = jnp.zeros((b,), jnp.uint32) if seeds is None else seeds.astype(jnp.uint32)
    rows = Rows(lengths, lengths, seeds)
    w = cc.window
    q_win = tuple(jnp.swapaxes(q[:, p - w :], 1, 2) for q in qs) if cc.compressing else ()
    k_in = tuple(jnp.swapaxes(k, 1, 2) for k in ks)  # L x [B, K, P, H]
    v_in = tuple(jnp.swapaxes(v, 1, 2) for v in vs)
    squeeze = cc.compressing and p > cc.budget
    accs = tuple(weights)  # L x [B, K, P] or ()
    if cc.state is not None and not accs:  # a state the compressions write: none yet
        accs = tuple(jnp.zeros((b, kh, p), jnp.float32) for _ in range(n))
    acc_axes = (kv.SLOT_AXES,) * len(accs)

    def squeeze_all(q_win, ks_, vs_, sp, accs, rows):
        per_layer = accs or (None,) * n
        idx, states = _select_layers(
            cc, q_win, ks_, [sp] * n, cc.budget, rows, per_layer, rules and rules.kv_heads
        )
        out = [
            _gather(layers.as_storage(k), layers.as_storage(v), sp, a, i)
            for k, v, a, i in zip(ks_, vs_, states, idx, strict=True)
        ]
        gk, gv, gsp, ga = (tuple(x) for x in zip(*out, strict=True))
        return gk, gv, gsp, ga if accs else ()

    if squeeze:  # every layer under one shard_map: a shared set reads them all
        gk, gv, gsp, ga = sharding.local(
            squeeze_all,
            rules,
            (
                (kv.QWIN_AXES,) * n,
                (kv.KV_AXES,) * n,
                (kv.KV_AXES,) * n,
                kv.SLOT_AXES,
                acc_axes,
                (kv.ROW_AXES,) * 3,
            ),
            ((kv.KV_AXES,) * n, (kv.KV_AXES,) * n, (kv.SLOT_AXES,) * n, acc_axes),
        )(q_win, k_in, v_in, sp, accs, tuple(rows))
    else:  # keep every token: only move the pads out
        order = jnp.argsort(sp < 0, axis=-1, stable=True)  # [B, K, P]
        out = [
            _gather(layers.as_storage(k), layers.as_storage(v), sp, a, order)
            for k, v, a in zip(k_in, v_in, accs or (None,) * n, strict=True)
        ]
        gk, gv, gsp, ga = (tuple(x) for x in zip(*out, strict=True))
        ga = ga if accs else ()
    pad = functools.partial(kv.pad_slots, capacity=capacity)
    kept = jnp.minimum(lengths, cc.budget) if squeeze else lengths
    cache = kv.KVCache(
        k=tuple(map(pad, gk)),
        v=tuple(map(pad, gv)),
        slot_pos=tuple(pad(x, value=-1) for x in gsp),
        q_win=q_win,
        acc=tuple(map(pad, ga)),
        length=kept,
        pos=lengths,
        prompt=lengths,
        seed=seeds,
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
    acc_axes = (kv.SLOT_AXES,) * len(cache.acc)

    def body(ks, vs, sps, qs, accs, full, length, num, rows, start):  # on a mesh: a device's
        b = full.shape[0]
        offset = 0 if rules is None or rules.batch is None else jax.lax.axis_index(rules.batch) * b
        order = (jnp.arange(b) + start % b) % b  # [B] rows in priority order
        pick = jnp.nonzero(full[order], size=lanes, fill_value=b)[0]  # [lanes]
        picked_rows = jnp.where(pick < b, order[jnp.minimum(pick, b - 1)], b)  # b = no row

        def run(args):
            ks, vs, sps, accs, length = args
            at = jnp.minimum(picked_rows, b - 1)
            picked = [tuple(x[at] for x in xs) for xs in (ks, vs, sps, qs, accs)]
            heads = rules.kv_heads if rules is not None else None
            new_k, new_v, new_sp, new_acc, kept = _compress_block(
                *picked, length[at], Rows(*(x[at] for x in rows)), cc, cache.dtype, heads
            )

            def put(x, new):
                return x.at[picked_rows].set(new, mode="drop")

            return (
                tuple(map(put, ks, new_k)),
                tuple(map(put, vs, new_v)),
                tuple(map(put, sps, new_sp)),
                tuple(map(put, accs, new_acc)),
                length.at[picked_rows].set(kept, mode="drop"),
            )

        ks, vs, sps, accs, length = jax.lax.cond(
            jnp.any(full), run, lambda args: args, (ks, vs, sps, accs, length)
        )
        fired = jnp.zeros((b,), bool).at[picked_rows].set(True, mode="drop")
        at = jnp.minimum(picked_rows, b - 1)
        log = jnp.stack([sp[at, :, :budget] for sp in sps], axis=1)
        lane_rows = jnp.where(picked_rows < b, picked_rows + offset, jnp.iinfo(jnp.int32).max)
        lane_num = jnp.where(picked_rows < b, num[at], 0)
        return ks, vs, sps, accs, length, fired, lane_rows.astype(jnp.int32), lane_num, log

    run = sharding.local(
        body,
        rules,
        (
            (kv.KV_AXES,) * n,
            (kv.KV_AXES,) * n,
            (kv.SLOT_AXES,) * n,
            (kv.QWIN_AXES,) * n,
            acc_axes,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            (kv.ROW_AXES,) * 3,
            (),
        ),
        (
            (kv.KV_AXES,) * n,
            (kv.KV_AXES,) * n,
            (kv.SLOT_AXES,) * n,
            acc_axes,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            ("batch", None, "kv_heads", None),
        ),
    )
    rows = (cache.pos, cache.prompt, cache.seed)
    ks, vs, sps, accs, length, fired, lane_rows, lane_num, log = run(
        cache.k,
        cache.v,
        cache.slot_pos,
        cache.q_win,
        cache.acc,
        full,
        cache.length,
        num,
        rows,
        start,
    )
    cache = dataclasses.replace(cache, k=ks, v=vs, slot_pos=sps, acc=accs, length=length)
    return cache, fired, lane_rows, lane_num, log


def _compress_block(ks, vs, sps, qs, accs, length, rows: Rows, cc, dtype, heads_axis=None):
    """Brings every row of a block back to `budget` slots.

    Args:
      ks, vs: L x [R, K, C, H] the rows' keys and values (storage dtype).
      sps: L x [R, K, C] their slot positions.
      qs: L x [R, N, W, H] their observation queries.
      accs: L x [R, K, C] their per-key state, or () without one.
      length: [R] int32 occupied slots.
      rows: the rows' positions, prompt lengths and seeds.
      cc: compression settings (static).
      dtype: the keys' dtype (static; the cache stores bfloat16 as uint16).
      heads_axis: the mesh axis of the KV heads inside `shard_map` (for kept sets shared
        over heads).

    Returns:
      (ks, vs, sps, accs) compacted, each row's kept tokens first in position order, and the
      new length [R] (equal for every layer and KV head).
    """
    c = ks[0].shape[2]
    has_acc = bool(accs)
    accs = accs or (None,) * len(ks)
    # select() reads the last W slots as the observation window. A row compressed below the
    # capacity (think-only: trigger < capacity) holds its newest tokens at
    # [length - W, length): rotate it to end at slot C - 1 first (empty slots go first).
    roll = None
    if c > cc.trigger:
        roll = (jnp.arange(c)[None, :] + length[:, None]) % c  # [R, C]

    def rolled(k, v, sp, a):
        if roll is None:
            return k, v, sp, a
        return _gather(k, v, sp, a, jnp.broadcast_to(roll[:, None], sp.shape))

    out = []
    if cc.share == "none":  # layer by layer: one layer's temporaries live at a time
        for i, (k, v, sp, q, a) in enumerate(zip(ks, vs, sps, qs, accs, strict=True)):
            k, v, sp, a = rolled(k, v, sp, a)
            keys = layers.from_storage(k, dtype)
            idx, a = _select(cc, q, keys, sp, cc.budget, rows, a, i, heads_axis)
            out.append(_gather(k, v, sp, a, idx, c))
    else:  # every layer's scores first
        all_rolled = [rolled(*x) for x in zip(ks, vs, sps, accs, strict=True)]
        ks, vs, sps, accs = (tuple(x) for x in zip(*all_rolled, strict=True))
        keys = [layers.from_storage(k, dtype) for k in ks]
        idxs, states = _select_layers(cc, qs, keys, sps, cc.budget, rows, accs, heads_axis)
        for k, v, sp, a, idx in zip(ks, vs, sps, states, idxs, strict=True):
            out.append(_gather(k, v, sp, a, idx, c))
    out_k, out_v, out_sp, out_acc = (tuple(x) for x in zip(*out, strict=True))
    kept = jnp.sum(out_sp[0][:, 0] >= 0, axis=-1).astype(jnp.int32)  # [R]
    return out_k, out_v, out_sp, out_acc if has_acc else (), kept
