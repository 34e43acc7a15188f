"""R-KV key redundancy (RKV_SPEC.md step 2) as two tiled Pallas passes, never forming S (n x n).

Semantics are exactly `rkvjax.kv.scores.redundancy(keys, valid, window, threshold, retain)`.
S is the cosine matrix of the valid keys with a zero diagonal. Row i drops (zeroes) its
`retain` newest matches (largest j with S[i, j] > threshold); with fewer matches it drops all
of them and the first valid column. Column means over valid rows, a softmax over valid keys,
and the first n - W entries give the score.

Both passes tile S into [block_r, block_c] blocks computed on the fly from unit keys:
  1. `_match_kernel`, grid (B*K, row tiles): each program sweeps the column tiles of its rows
     and keeps, per row i, c(i) = the retain-th largest matching column (-1 if fewer): O(n).
  2. `_colsum_kernel`, grid (B*K, column tiles): each program sweeps the row tiles against its
     columns, zeroes the dropped entries using c(i), and sums over rows: O(n) out.
Splitting by columns in pass 2 (rather than fusing both passes per row tile) means no program
adds into another's output: no per-row-tile partials (n^2 / block_r floats) to reduce, no
atomics, and every grid axis is parallel on GPU and TPU alike. The price is computing each S
tile twice, the same as the fused variant. HBM traffic is O(n H) keys per program plus O(n).

The keys are normalised once in float32 in the wrapper, with the same expression as the jnp
path, so both see bit-identical unit vectors; invalid keys are set to zero vectors, so every
S entry touching them is 0 without a mask (only matching needs one, for thresholds below 0).
Dots run at HIGHEST precision (IEEE f32 on Triton, multi-pass on TPU): the keep set is
discrete, and TF32 / bf16 passes move cosines across the threshold.

This module never imports `rkvjax.kv.selection` (which dispatches to it); the two share the
normalisation, the masked softmax and the int checks through `rkvjax.models.layers` and
`rkvjax.kv.config`, and the tests keep `_validate` in step with compression's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from rkvjax import checks
from rkvjax.defaults import RETAIN, THRESHOLD, WINDOW
from rkvjax.kv.kernels import tuning
from rkvjax.models.layers import masked_softmax, unit_vectors

_HIGHEST = lax.Precision.HIGHEST


def _check_tile(name, value, floor):
    checks.check_int(name, value, floor)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles), got {value}")


def _validate(keys, valid, *, window, threshold, retain, block_r=None, block_c=None, floor=8):
    """Shape, dtype and argument checks of both paths; tiles only when given."""
    checks.check_inputs(None, keys, valid, window=window)
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise ValueError(f"keys must be floating point, got {keys.dtype}")
    checks.check_redundancy(threshold, retain)
    if block_r is not None:
        _check_tile("block_r", block_r, floor)
    if block_c is not None:
        _check_tile("block_c", block_c, floor)


def _unit_keys(keys, valid):
    """keys [B, K, n, H] -> float32 unit keys [B, K, n, H], zero vectors where not valid."""
    return jnp.where(valid[..., None], unit_vectors(keys), 0.0)


def _similarity(a, b, a0, b0):
    """Cosines of unit keys a [Ta, H] and b [Tb, H] at global offsets a0, b0.

    Returns (s [Ta, Tb] float32 with 0 where the global indices agree, ia, ib [Ta, Tb] int32
    global indices). Both passes build their tiles here, so they agree on every entry.
    """
    s = lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )  # [Ta, Tb]
    ia = a0 + lax.broadcasted_iota(jnp.int32, s.shape, 0)  # [Ta, Tb]
    ib = b0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)  # [Ta, Tb]
    return jnp.where(ia == ib, 0.0, s), ia, ib


def _match_kernel(rows_ref, keys_ref, vcol_ref, c_ref, *, threshold, retain, block_c):
    """Pass 1: c(i), the retain-th largest column j with S[i, j] > threshold, -1 if fewer."""
    # rows_ref: [Br, Hp] f32 unit keys of this row tile (zero vectors where invalid)
    # keys_ref: [Np, Hp] f32 unit keys of the whole (row, KV head), read a column tile at a time
    # vcol_ref: [1, Np] int32 1 where the key is valid
    # c_ref:    [Br, 1] int32 out: c(i) per row of the tile
    br = rows_ref.shape[0]
    n_tiles = keys_ref.shape[0] // block_c
    i0 = pl.program_id(1) * br
    rows = rows_ref[...]  # [Br, Hp]

    def tile(t):
        j0 = pl.multiple_of(t * block_c, block_c)
        s, _, j = _similarity(rows, keys_ref[pl.ds(j0, block_c), :], i0, j0)  # [Br, Bc]
        # Invalid columns have cosine 0, which still exceeds a negative threshold. Invalid
        # rows need no mask: their S row is zero, so whatever they drop changes nothing.
        return (s > threshold) & (vcol_ref[:, pl.ds(j0, block_c)] > 0), j  # [Br, Bc] x2

    if retain == 1:

        def newest(t, best):  # best [Br, 1]: largest matching column so far
            match, j = tile(t)
            return jnp.maximum(best, jnp.max(jnp.where(match, j, -1), axis=1, keepdims=True))

        c = lax.fori_loop(0, n_tiles, newest, jnp.full((br, 1), -1, jnp.int32))
    else:
        # Tiles newest first. A match's recency rank is the number of matches at or right of
        # it: the count in the tiles already seen plus an in-tile suffix count, done as a
        # matmul with a triangular 0/1 matrix (exact in f32; Mosaic TPU has no cumsum).
        ii = lax.broadcasted_iota(jnp.int32, (block_c, block_c), 0)
        jj = lax.broadcasted_iota(jnp.int32, (block_c, block_c), 1)
        suffix = (ii >= jj).astype(jnp.float32)  # [Bc, Bc] suffix[j', j] = j' >= j

        def ranked(t, carry):
            seen, c = carry  # [Br, 1] x2: matches in the newer tiles, c(i) once found
            match, j = tile(n_tiles - 1 - t)
            inside = lax.dot(match.astype(jnp.float32), suffix, precision=_HIGHEST)
            rank = seen + inside.astype(jnp.int32)  # [Br, Bc] matches at columns >= j
            hit = match & (rank == retain)  # at most one per row over all tiles
            c = jnp.maximum(c, jnp.max(jnp.where(hit, j, -1), axis=1, keepdims=True))
            return seen + jnp.sum(match.astype(jnp.int32), axis=1, keepdims=True), c

        start = (jnp.zeros((br, 1), jnp.int32), jnp.full((br, 1), -1, jnp.int32))
        c = lax.fori_loop(0, n_tiles, ranked, start)[1]
    c_ref[...] = c


def _colsum_kernel(cols_ref, keys_ref, c_ref, first_ref, out_ref, *, threshold, block_r):
    """Pass 2: column sums over all rows of S with the dropped entries zeroed."""
    # cols_ref:  [Bc, Hp] f32 unit keys of this column tile
    # keys_ref:  [Np, Hp] f32 unit keys of the whole (row, KV head), read a row tile at a time
    # c_ref:     [1, Np] int32 pass 1's c(i) of every row, lane-major
    # first_ref: [1, 1] int32 position of the first valid key
    # out_ref:   [Bc, 1] f32 out: sum over rows i of the thinned S[i, j], per column j
    bc = cols_ref.shape[0]
    n_tiles = keys_ref.shape[0] // block_r
    j0 = pl.program_id(1) * bc
    cols = cols_ref[...]  # [Bc, Hp]
    first = first_ref[...]  # [1, 1]

    def rows(t, acc):  # acc [Bc, 1]
        i0 = pl.multiple_of(t * block_r, block_r)
        # The transposed tile S^T (columns on sublanes, rows on lanes): c(i) is then read
        # lane-major and the sum over rows is a lane reduction. S is symmetric, so this is
        # the same product as pass 1's tile with its operands swapped.
        s, j, _ = _similarity(cols, keys_ref[pl.ds(i0, block_r), :], j0, i0)  # [Bc, Br]
        c = c_ref[:, pl.ds(i0, block_r)]  # [1, Br]
        # Row i drops the columns j >= c(i) that match. Column c(i) itself is dropped by
        # index, not by re-testing the threshold, so a cosine that lands on the other side
        # of it in this pass's rounding cannot undo pass 1's choice.
        drop = (j == c) | ((j > c) & (s > threshold)) | ((c < 0) & (j == first))
        return acc + jnp.sum(jnp.where(drop, 0.0, s), axis=1, keepdims=True)

    out_ref[...] = lax.fori_loop(0, n_tiles, rows, jnp.zeros((bc, 1), jnp.float32))


@functools.partial(
    jax.jit,
    static_argnames=("window", "threshold", "retain", "block_r", "block_c", "interpret"),
)
def redundancy(
    keys,
    valid,
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    retain: int = RETAIN,
    block_r: int | None = None,
    block_c: int | None = None,
    interpret: bool = False,
):
    """Key redundancy of the candidates, in float32, without materialising S.

    A drop-in for `rkvjax.kv.scores.redundancy` (same arguments and result).

    Args:
      keys: [B, K, n, H] post-RoPE keys, any float dtype (scored in float32).
      valid: [B, K, n] bool, or None for all valid; invalid keys are neither rows nor columns.
      window: W, trailing observation keys: part of S, not returned.
      threshold: cosine above which two keys match, in [-1, 1].
      retain: newest matches per row that are not counted (1 in the reference); any >= 1.
      block_r: rows per S tile (power of two); None: the backend default, shrunk for small n.
      block_c: columns per S tile (power of two); None: as for block_r.
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      float32 [B, K, n - W], not renormalised after dropping the window. 0 at invalid keys.
    """
    floor = 8 if interpret or tuning.backend() != "gpu" else 16  # tl.dot needs sides >= 16
    kw = dict(window=window, threshold=threshold, retain=retain)
    _validate(keys, valid, **kw, block_r=block_r, block_c=block_c, floor=floor)
    b, kh, n, h = keys.shape
    g = b * kh
    if valid is None:
        valid = jnp.ones((b, kh, n), dtype=bool)
    default_r, default_c = tuning.REDUNDANCY_TILES["cpu" if interpret else tuning.backend()]
    block_r = block_r or tuning.fit(default_r, n, 16)
    block_c = block_c or tuning.fit(default_c, n, 16)
    # Both tile sizes are powers of two, so the larger is a multiple of the smaller.
    n_pad = -(-n // max(block_r, block_c)) * max(block_r, block_c)
    pad = ((0, 0), (0, n_pad - n))

    # Zero lanes past H change no cosine; they make any head dim (80, 96) a power of two,
    # which Triton needs for every loaded tile. 64 and 128 are unchanged.
    hp = max(16, 1 << (h - 1).bit_length())
    unit = _unit_keys(keys, valid).reshape(g, n, h)
    unit = jnp.pad(unit, (*pad, (0, hp - h)))  # [G, Np, Hp]
    vcol = jnp.pad(valid.reshape(g, 1, n), ((0, 0), *pad)).astype(jnp.int32)  # [G, 1, Np]
    # argmax of an all-False row is 0: such a row has zero keys, so nothing is dropped.
    first = jnp.argmax(valid, axis=-1).astype(jnp.int32).reshape(g, 1, 1)  # [G, 1, 1]

    # The whole (row, KV head) of keys stays resident per program ([Np, Hp] f32: 4 MiB at
    # n = 8192, H = 128); its block index is constant along the tile axis, so TPU fetches it
    # once per (row, KV head), and on GPU the column tiles are streamed from L2.
    whole = pl.BlockSpec((None, n_pad, hp), lambda i, t: (i, 0, 0))
    lanes = pl.BlockSpec((None, 1, n_pad), lambda i, t: (i, 0, 0))
    c = pl.pallas_call(
        functools.partial(_match_kernel, threshold=threshold, retain=retain, block_c=block_c),
        grid=(g, n_pad // block_r),
        in_specs=[pl.BlockSpec((None, block_r, hp), lambda i, t: (i, t, 0)), whole, lanes],
        out_specs=pl.BlockSpec((None, block_r, 1), lambda i, t: (i, t, 0)),
        out_shape=jax.ShapeDtypeStruct((g, n_pad, 1), jnp.int32),
        compiler_params=tuning.compiler_params(interpret, 2),
        interpret=interpret,
        name="rkv_redundancy_match",
    )(unit, unit, vcol)  # [G, Np, 1]
    colsum = pl.pallas_call(
        functools.partial(_colsum_kernel, threshold=threshold, block_r=block_r),
        grid=(g, n_pad // block_c),
        in_specs=[
            pl.BlockSpec((None, block_c, hp), lambda i, t: (i, t, 0)),
            whole,
            lanes,
            pl.BlockSpec((None, 1, 1), lambda i, t: (i, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_c, 1), lambda i, t: (i, t, 0)),
        out_shape=jax.ShapeDtypeStruct((g, n_pad, 1), jnp.float32),
        compiler_params=tuning.compiler_params(interpret, 2),
        interpret=interpret,
        name="rkv_redundancy_colsum",
    )(unit, unit, c.reshape(g, 1, n_pad), first)  # [G, Np, 1]; the reshape is free

    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)  # [B, K, 1]
    red = colsum[:, :n, 0].reshape(b, kh, n) / count  # [B, K, n] invalid columns are 0
    return masked_softmax(red, valid)[..., : n - window]


def redundancy_reference(keys, valid, *, window=WINDOW, threshold=THRESHOLD, retain=RETAIN):
    """The specification of `redundancy`: pure jnp in float32 over the full n x n matrix.

    Args and Returns as `redundancy`. Written in the kernel's terms (c(i), the retain-th
    largest matching column) rather than the cumulative-count form of
    `rkvjax.kv.scores.redundancy`, so the tests check the two formulations agree.
    """
    _validate(keys, valid, window=window, threshold=threshold, retain=retain)
    b, kh, n, _ = keys.shape
    if valid is None:
        valid = jnp.ones((b, kh, n), dtype=bool)
    u = _unit_keys(keys, valid)  # [B, K, n, H]
    s = jnp.einsum("BKiH,BKjH->BKij", u, u, precision=_HIGHEST)  # [B, K, n, n]
    s = jnp.where(jnp.eye(n, dtype=bool), 0.0, s)
    match = (s > threshold) & valid[..., :, None] & valid[..., None, :]  # [B, K, n, n]
    j = jnp.arange(n, dtype=jnp.int32)  # [n]
    if retain > n:  # no row can have that many matches
        c = jnp.full((b, kh, n, 1), -1, jnp.int32)
    else:
        # The retain-th largest of j where matching (-1 elsewhere): -1 with fewer matches.
        c = lax.top_k(jnp.where(match, j, -1), retain)[0][..., retain - 1 :]  # [B, K, n, 1]
    first = jnp.argmax(valid, axis=-1)[..., None, None]  # [B, K, 1, 1]
    drop = (match & (j >= c)) | ((c < 0) & (j == first))  # [B, K, n, n]
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)  # [B, K, 1]
    red = jnp.sum(jnp.where(drop, 0.0, s), axis=-2) / count  # [B, K, n]
    return masked_softmax(red, valid)[..., : n - window]
