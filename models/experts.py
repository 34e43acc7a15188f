"""Mixture-of-experts MLP (Qwen3-MoE): routing, and expert products whose work follows the
experts each token chose, not all of them.

A router scores the E experts for each token; the top k are run and their outputs summed, each
weighted by its softmax probability (renormalised over the k when the config says so).

The products are grouped by expert with static shapes. The A = N x k (token, expert) assignments
are sorted by expert, each expert's run of rows is padded to a multiple of a tile of m rows, and
each tile is multiplied by its one expert's weights. At most A + U (m - 1) rows are computed,
U = min(E, A) being the experts that can have rows at all, and m is the largest tile that keeps
this within 1.5 A: compiled FLOPs follow the active parameters.
On CPU the tiles run one after another, each slicing its expert's weights inside the loop
(`loops_over_tiles`); elsewhere all tiles' weights are gathered and multiplied in one batched
product.
On a mesh each device routes its own rows (no token leaves its data shard: the sort is local)
and computes its slice of every expert's hidden units, like a dense MLP's tensor parallelism.
In batch-invariant mode (`layers.fixed_columns`) the tiles have the fixed column count and are
computed one at a time on every backend, and the router's product is a fixed-column
`layers.project`, so a row's numbers do not depend on the rows routed beside it.
`jax.lax.ragged_dot` would say the same more briefly, but XLA:CPU (and XLA:GPU without a cuDNN
fusion) expands it into a product over every expert: E / k times the work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from rkvjax.models import layers

# Rows computed per assignment at most (padding of each expert's run to whole tiles).
MAX_PADDING = 1.5


def route(x: jax.Array, router: jax.Array, top_k: int, norm: bool):
    """x [N, D], router [E, D] -> (weights [N, k] in x's dtype, experts [N, k] int32).

    As transformers computes it: the router's logits in the model's dtype, the softmax in
    float32, the top k (the lower index first among equals), renormalised when `norm`."""
    logits = layers.project("ED,DN->EN", router, x.T, dtype=jnp.float32).T  # [N, E]
    probs = jax.nn.softmax(logits.astype(x.dtype).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)  # [N, k]
    if norm:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def tile_rows(assignments: int, experts: int) -> int:
    """m: the largest tile whose padding keeps the rows computed within MAX_PADDING x the
    assignments (A + U (m - 1) <= 1.5 A)."""
    used = min(experts, assignments)
    return 1 + int((MAX_PADDING - 1) * assignments) // used


def tiles(assignments: int, experts: int, m: int) -> int:
    """How many tiles of m rows the padded runs can need at most."""
    return (assignments + min(experts, assignments) * (m - 1)) // m


def layout(experts_of: jax.Array, count: int, m: int, n_tiles: int):
    """Where each assignment's row goes when runs are padded to whole tiles.

    Args:
      experts_of: [A] int32, each assignment's expert.
      count: E.
      m, n_tiles: the tile's rows and the tiles.

    Returns:
      (row [A]: each assignment's row among n_tiles x m, expert [n_tiles]: each tile's expert;
      tiles past the last run repeat the last expert and hold only zero rows).
    """
    a = experts_of.shape[0]
    order = jnp.argsort(experts_of, stable=True)  # [A] assignments by expert
    sizes = jnp.bincount(experts_of, length=count)  # [E]
    padded = (sizes + m - 1) // m * m
    ends = jnp.cumsum(padded)  # [E] each run's end among the rows
    first = jnp.cumsum(sizes) - sizes  # [E] each run's first place in `order`
    e = experts_of[order]
    rank = jnp.arange(a, dtype=jnp.int32) - first[e]  # place within its run
    row_sorted = (ends - padded)[e] + rank
    row = jnp.zeros(a, jnp.int32).at[order].set(row_sorted.astype(jnp.int32))
    tile_start = jnp.arange(n_tiles, dtype=ends.dtype) * m
    expert = jnp.minimum(jnp.searchsorted(ends, tile_start, side="right"), count - 1)
    return row, expert.astype(jnp.int32)


def _gather(w: jax.Array, index: jax.Array) -> jax.Array:
    """w[index], a tile's (or the tiles') weights. XLA:CPU gathers bfloat16 by converting the
    whole operand to float32; for weights that conversion is loop-invariant, so XLA hoists it
    out of the decode loop and holds float32 copies of every layer's experts for the whole chunk
    (3x the experts' bytes in all, which made Qwen3-30B-A3B's decode peak 178 GB). Moved as
    integers of the same bits (`layers.as_storage`) the view is still hoisted (a copy, 2x); tied
    by a barrier to the loop-dependent index (the decode loop's, and the tiles' loop's inside
    it), nothing about the weights can leave the loop and the view folds into the gather."""
    w, index = jax.lax.optimization_barrier((w, index))
    return layers.from_storage(layers.as_storage(w)[index], w.dtype)


def loops_over_tiles() -> bool:
    """Whether the tiles' products run one tile at a time (`lax.map`, each tile slicing its
    expert's weights inside the loop) rather than as one batched product over gathered weights.

    On CPU the loop is 1.2x (1 row), 1.9x (8 rows) and 6x (64 rows) faster for one layer of 128
    experts of 96 at width 256, top 8: the batched form first copies every tile's weights
    ([T, F, D] each), and XLA:CPU's batched product of those copies is slow. On an accelerator
    the loop would be 3 small kernels per tile, hundreds per layer, so there the products stay
    batched."""
    return jax.default_backend() == "cpu"


def _tile_swiglu(rows, expert, gate, up, down) -> jax.Array:
    """SwiGLU of tiles of rows on their experts: rows [..., m, D], expert [...] (one tile, or a
    leading axis of tiles), gate/up [E, F, D], down [E, D, F] -> [..., m, D] in rows' dtype.
    Products accumulate in float32 and are rounded to rows' dtype, as a dense MLP's are."""
    dtype = rows.dtype
    wg, wu, wd = (_gather(w, expert) for w in (gate, up, down))  # [..., F, D], [..., D, F]
    f32 = jnp.float32
    g = jnp.einsum("...MD,...FD->...MF", rows, wg, preferred_element_type=f32).astype(dtype)
    u = jnp.einsum("...MD,...FD->...MF", rows, wu, preferred_element_type=f32).astype(dtype)
    h = jax.nn.silu(g) * u
    return jnp.einsum("...MF,...DF->...MD", h, wd, preferred_element_type=f32).astype(dtype)


def grouped_swiglu(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """The chosen experts' SwiGLU outputs, weighted and summed per token.

    Args:
      x: [N, D] tokens.
      weights, experts: [N, k] from `route`.
      gate, up: [E, F, D]; down: [E, D, F] (Hugging Face's [out, in] per expert).

    Returns:
      [N, D] in x's dtype.
    """
    n, d = x.shape
    k = experts.shape[1]
    count = gate.shape[0]
    a = n * k
    # Batch-invariant mode (`layers.fixed_columns`): tiles of a fixed size, computed one at a
    # time, so a row's products have one shape whatever runs beside it.
    fixed = layers.fixed_column_count()
    m = fixed or tile_rows(a, count)
    n_tiles = tiles(a, count, m)
    row, expert = layout(experts.reshape(a), count, m, n_tiles)  # [A], [n_tiles]
    token = jnp.arange(a, dtype=jnp.int32) // k  # assignments are token-major
    rows = jnp.zeros((n_tiles * m, d), x.dtype).at[row].set(x[token])
    rows = rows.reshape(n_tiles, m, d)  # [T, m, D]
    if fixed or loops_over_tiles():
        out = jax.lax.map(lambda tile: _tile_swiglu(*tile, gate, up, down), (rows, expert))
    else:
        out = _tile_swiglu(rows, expert, gate, up, down)  # all tiles in one batched product
    out = out.reshape(n_tiles * m, d)[row].reshape(n, k, d)  # [N, k, D], assignment order
    # A sum over each row's k outputs (one order whatever N), not a product over all rows.
    mixed = jnp.sum(out.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=1)
    return mixed.astype(x.dtype)


def mixture(x, router, gate, up, down, *, top_k: int, norm: bool, reduce: str | None = None):
    """The MoE layer on x [B, T, D]: routing, then the chosen experts' products, summed.

    With `reduce` (a mesh axis name, inside `shard_map`), gate/up/down hold this device's slice
    of each expert's hidden units and the partial outputs are summed over that axis: one
    all-reduce of [B, T, D], as a dense MLP split the same way has.
    """
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    weights, chosen = route(tokens, router, top_k, norm)
    out = grouped_swiglu(tokens, weights, chosen, gate, up, down).reshape(b, t, d)
    return out if reduce is None else jax.lax.psum(out, reduce)


def dense_reference(x, weights, experts, gate, up, down) -> jax.Array:
    """The same as `grouped_swiglu` by running every expert on every token (E / k times the
    work): the reference the grouped products are tested against."""
    g = jnp.einsum("ND,EFD->ENF", x, gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("ND,EFD->ENF", x, up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g.astype(x.dtype)) * u.astype(x.dtype)).astype(x.dtype)
    o = jnp.einsum("ENF,EDF->END", h, down, preferred_element_type=jnp.float32).astype(x.dtype)
    hit = jax.nn.one_hot(experts, gate.shape[0], dtype=jnp.float32)  # [N, k, E]
    mix = jnp.einsum("NKE,NK->NE", hit, weights.astype(jnp.float32))
    return jnp.einsum("END,NE->ND", o.astype(jnp.float32), mix).astype(x.dtype)
