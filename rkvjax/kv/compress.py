"""When and how the KV cache is filled and compressed: prompt placement (`prefill_cache`) and
the compression lanes (`compress_lanes`).

Scoring and selection live in `rkvjax.kv.selection` (one code path for the engine and the public
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

from rkvjax.kv import cache as kv
from rkvjax.kv import policies, quantization, selection
from rkvjax.kv.config import CompressionConfig
from rkvjax.models import sharding


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
    score, state = selection.scores_and_state(
        cc.policy,
        q_win,
        k,
        slot_pos >= 0,
        window=cc.window,
        impl=cc.pallas,
        target=cc.target,
        context=_context(rows, slot_pos, acc, layer, heads_axis),
    )
    idx = selection.keep(score, budget, cc.window, impl=cc.pallas, target=cc.target)
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
        selection.scores_and_state(
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
    idx = [selection.keep(x, budget, **kw) for x in scores]
    if len(idx) == 1:
        idx = idx * len(sps)
    return [kv.valid_first(i, sp) for i, sp in zip(idx, sps, strict=True)], states


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
    The keys, values and queries are stored as `cc.kv_dtype` says first, and a compression
    scores what is stored (an 8-bit cache's dequantized keys), as every later one does.

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
    dtype = quantization.cache_dtype(cc.kv_dtype, ks[0].dtype)
    sp = jnp.broadcast_to(positions[:, None, :], (b, kh, p)).astype(jnp.int32)  # [B, K, P]
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)  # [B]
    seeds = jnp.zeros((b,), jnp.uint32) if seeds is None else seeds.astype(jnp.uint32)
    rows = Rows(lengths, lengths, seeds)
    w = cc.window
    q_win, q_scale = (), ()
    if cc.compressing:
        stored = [kv.store_queries(jnp.swapaxes(_last_queries(q, w), 1, 2), dtype) for q in qs]
        q_win = tuple(x for x, _ in stored)  # L x [B, N, W, H]
        q_scale = tuple(x for _, x in stored) if quantization.is_quantized(dtype) else ()
    accs = tuple(weights)  # L x [B, K, P] or ()
    if cc.state is not None and not accs:  # a state the compressions write: none yet
        accs = tuple(jnp.zeros((b, kh, p), jnp.float32) for _ in range(n))
    per_layer = []
    for i in range(n):
        k, k_scale = kv.store(jnp.swapaxes(ks[i], 1, 2), dtype)  # [B, K, P, H], [B, K, P]
        v, v_scale = kv.store(jnp.swapaxes(vs[i], 1, 2), dtype)
        per_layer.append(kv.Layer(k, v, sp, accs[i] if accs else None, k_scale, v_scale))
    per_layer = tuple(per_layer)
    layer_axes = tuple(map(kv.layer_axes, per_layer))

    def squeeze_all(q_win, q_scale, per_layer, rows):
        queries = kv.read_queries(q_win, q_scale, dtype)
        keys = [kv.read(x.k, x.k_scale, dtype) for x in per_layer]
        idx, states = _select_layers(
            cc,
            queries,
            keys,
            [x.slot_pos for x in per_layer],
            cc.budget,
            rows,
            [x.acc for x in per_layer],
            rules and rules.kv_heads,
        )
        return tuple(
            kv.gather_layer(x._replace(acc=a), i, capacity)
            for x, a, i in zip(per_layer, states, idx, strict=True)
        )

    squeeze = cc.compressing and p > cc.budget
    if squeeze:  # every layer under one shard_map: a shared set reads them all
        per_layer = sharding.local(
            squeeze_all,
            rules,
            (
                (kv.QWIN_AXES,) * n,
                (kv.QSCALE_AXES,) * len(q_scale),
                layer_axes,
                (kv.ROW_AXES,) * 3,
            ),
            layer_axes,
        )(q_win, q_scale, per_layer, tuple(rows))
    else:  # keep every token: only move the pads out
        order = jnp.argsort(sp < 0, axis=-1, stable=True)  # [B, K, P]
        per_layer = tuple(kv.gather_layer(x, order, capacity) for x in per_layer)
    kept = jnp.minimum(lengths, cc.budget) if squeeze else lengths
    cache = kv.KVCache(
        k=(),
        v=(),
        slot_pos=(),
        q_win=q_win,
        acc=(),
        length=kept,
        pos=lengths,
        prompt=lengths,
        seed=seeds,
        dtype=dtype,
        q_scale=q_scale,
    )
    return kv.with_layers(cache, per_layer), kept < lengths


def _last_queries(q: jax.Array, w: int) -> jax.Array:
    """The observation ring of a prompt: its last w queries [B, w, N, H] of q [B, P, N, H],
    zeros first where the prompt bucket is shorter than the window.

    A prompt shorter than the window leaves queries of padding (or zeros) in the ring. None of
    them is ever read: a row's first compression comes when its cache holds budget + buffer
    tokens, and every decode step before it pushes one of its own queries in, more than w of
    them since budget > w."""
    p = q.shape[1]
    if p >= w:
        return q[:, p - w :]
    return jnp.pad(q, ((0, 0), (w - p, 0), (0, 0), (0, 0)))


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
    per_layer = tuple(kv.layer_leaves(cache, i) for i in range(n))
    layer_axes = tuple(map(kv.layer_axes, per_layer))

    def body(per_layer, qs, q_scales, full, length, num, rows, start):  # on a mesh: a device's
        b = full.shape[0]
        offset = 0 if rules is None or rules.batch is None else jax.lax.axis_index(rules.batch) * b
        order = (jnp.arange(b) + start % b) % b  # [B] rows in priority order
        pick = jnp.nonzero(full[order], size=lanes, fill_value=b)[0]  # [lanes]
        picked_rows = jnp.where(pick < b, order[jnp.minimum(pick, b - 1)], b)  # b = no row

        def run(args):
            per_layer, length = args
            at = jnp.minimum(picked_rows, b - 1)
            take = functools.partial(jax.tree.map, lambda x: x[at])
            heads = rules.kv_heads if rules is not None else None
            new_layers, kept = _compress_block(
                take(per_layer),
                take(qs),
                take(q_scales),
                length[at],
                Rows(*(x[at] for x in rows)),
                cc,
                cache.dtype,
                heads,
            )
            put = functools.partial(
                jax.tree.map, lambda x, new: x.at[picked_rows].set(new, mode="drop")
            )
            return put(per_layer, new_layers), length.at[picked_rows].set(kept, mode="drop")

        per_layer, length = jax.lax.cond(jnp.any(full), run, lambda args: args, (per_layer, length))
        fired = jnp.zeros((b,), bool).at[picked_rows].set(True, mode="drop")
        at = jnp.minimum(picked_rows, b - 1)
        log = jnp.stack([x.slot_pos[at, :, :budget] for x in per_layer], axis=1)
        lane_rows = jnp.where(picked_rows < b, picked_rows + offset, jnp.iinfo(jnp.int32).max)
        lane_num = jnp.where(picked_rows < b, num[at], 0)
        return per_layer, length, fired, lane_rows.astype(jnp.int32), lane_num, log

    run = sharding.local(
        body,
        rules,
        (
            layer_axes,
            (kv.QWIN_AXES,) * n,
            (kv.QSCALE_AXES,) * len(cache.q_scale),
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            (kv.ROW_AXES,) * 3,
            (),
        ),
        (
            layer_axes,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            kv.ROW_AXES,
            ("batch", None, "kv_heads", None),
        ),
    )
    rows = (cache.pos, cache.prompt, cache.seed)
    per_layer, length, fired, lane_rows, lane_num, log = run(
        per_layer, cache.q_win, cache.q_scale, full, cache.length, num, rows, start
    )
    cache = dataclasses.replace(kv.with_layers(cache, per_layer), length=length)
    return cache, fired, lane_rows, lane_num, log


def _compress_block(per_layer, qs, q_scales, length, rows: Rows, cc, dtype, heads_axis=None):
    """Brings every row of a block back to `budget` slots.

    Args:
      per_layer: L x the rows' `cache.Layer` ([R, K, C, ...], keys and values as stored).
      qs: L x [R, N, W, H] their observation queries (as stored).
      q_scales: L x [R, N, W] the queries' scales (8-bit caches), or ().
      length: [R] int32 occupied slots.
      rows: the rows' positions, prompt lengths and seeds.
      cc: compression settings (static).
      dtype: what the cache stores (static): scoring reads `cache.read` of it, float32
        dequantized for an 8-bit cache.
      heads_axis: the mesh axis of the KV heads inside `shard_map` (for kept sets shared
        over heads).

    Returns:
      (L x `cache.Layer` compacted, each row's kept tokens first in position order, the new
      length [R] (equal for every layer and KV head)).
    """
    c = per_layer[0].k.shape[2]
    # select() reads the last W slots as the observation window. A row compressed below the
    # capacity (think-only: trigger < capacity) holds its newest tokens at
    # [length - W, length): rotate it to end at slot C - 1 first (empty slots go first).
    roll = None
    if c > cc.trigger:
        roll = (jnp.arange(c)[None, :] + length[:, None]) % c  # [R, C]

    def rolled(x: kv.Layer) -> kv.Layer:
        if roll is None:
            return x
        return kv.gather_layer(x, jnp.broadcast_to(roll[:, None], x.slot_pos.shape))

    queries = kv.read_queries(qs, q_scales, dtype)
    out = []
    if cc.share == "none":  # layer by layer: one layer's temporaries live at a time
        for i, (x, q) in enumerate(zip(per_layer, queries, strict=True)):
            x = rolled(x)
            keys = kv.read(x.k, x.k_scale, dtype)
            idx, a = _select(cc, q, keys, x.slot_pos, cc.budget, rows, x.acc, i, heads_axis)
            out.append(kv.gather_layer(x._replace(acc=a), idx, c))
    else:  # every layer's scores first
        per_layer = [rolled(x) for x in per_layer]
        keys = [kv.read(x.k, x.k_scale, dtype) for x in per_layer]
        sps, accs = [x.slot_pos for x in per_layer], [x.acc for x in per_layer]
        idxs, states = _select_layers(cc, queries, keys, sps, cc.budget, rows, accs, heads_axis)
        for x, a, idx in zip(per_layer, states, idxs, strict=True):
            out.append(kv.gather_layer(x._replace(acc=a), idx, c))
    kept = jnp.sum(out[0].slot_pos[:, 0] >= 0, axis=-1).astype(jnp.int32)  # [R]
    return tuple(out), kept
