"""Pallas kernels (interpret mode on CPU) against their jnp references, rkvjax.kv.selection and
the NumPy loop reference; the same tests compile the kernels for real on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rkvjax.kv import selection as C
from rkvjax.kv.kernels.redundancy import redundancy as redundancy_pallas
from rkvjax.kv.kernels.redundancy import redundancy_reference
from rkvjax.kv.kernels.topk import topk_positions, topk_reference
from tests.reference import rkv_numpy as ref

SCORE_TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32 scores, as in test_compression
W = 8
# Interpret mode compiles each configuration (about 3 s for redundancy on 2 cores), so the
# cases are few and each packs several masks into its B x K grid of (row, KV head) lanes.
INTERPRET = [True, pytest.param(False, marks=pytest.mark.gpu)]

_RED = ("window", "threshold", "retain")
ref_jit = jax.jit(redundancy_reference, static_argnames=_RED)
compression_jit = jax.jit(C.redundancy, static_argnames=_RED)
topk_ref_jit = jax.jit(topk_reference, static_argnames="k")


def _keys(seed, *, n, h, dtype, b=2, k_heads=3):
    """keys [B, K, n, H] with planted near-duplicate pairs and triplets (scaled copies)."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(b, k_heads, n, h)).astype(np.float32)  # [B, K, n, H]
    plants = [(1, [6]), (4, [13, n // 2]), (9, [n - W - 2]), (15, [n - 3]), (n // 3, [n - 1])]
    for src, dsts in plants:
        for dst in dsts:
            k[:, :, dst] = 1.7 * k[:, :, src] + 0.05 * rng.normal(size=(b, k_heads, h))
    return jnp.asarray(k, dtype)


def _valid(n, *, mode):
    """valid [2, 3, n]: a different mask per (row, KV head) lane."""
    v = np.ones((2, 3, n), bool)
    if mode == "mixed":
        v[0, 1, :3] = False  # left padding
        v[0, 2, :7] = False
        v[1, 0, n - 5 :] = False  # trailing empty slots
        v[1, 1, n // 2 : n // 2 + 4] = False  # a hole (evicted slots)
    elif mode == "edge":
        v[0, 0] = False  # nothing valid: all zeros, no nan
        v[0, 1, :] = False
        v[0, 1, 5] = True  # a single valid key
        v[1, 2, :4] = False
        v[1, 2, n - 6 :] = False
    return jnp.asarray(v)


def _numpy_redundancy(keys, valid, *, threshold, retain):
    """The NumPy loops on each lane's valid keys alone, scattered back (0 elsewhere)."""
    k = np.asarray(keys.astype(jnp.float32), np.float64)
    v = np.asarray(valid)
    b, kh, n, _ = k.shape
    out = np.zeros((b, kh, n))  # [B, K, n]
    for i in range(b):
        for j in range(kh):
            idx = np.flatnonzero(v[i, j])
            if idx.size:
                lane = k[i : i + 1, j : j + 1, idx]  # [1, 1, n_valid, H]
                red = ref.redundancy(lane, window=0, threshold=threshold, retain=retain)
                out[i, j, idx] = red[0, 0]
    return out[..., : n - W]


def _matching_pairs(keys, valid, threshold):
    """Number of valid off-diagonal pairs with cosine > threshold (the planted ones)."""
    k = np.asarray(keys.astype(jnp.float32), np.float64)
    u = k / np.linalg.norm(k, axis=-1, keepdims=True)
    s = np.einsum("bkih,bkjh->bkij", u, u)
    v = np.asarray(valid)
    pair = v[..., :, None] & v[..., None, :] & ~np.eye(k.shape[2], dtype=bool)
    return int(np.sum((s > threshold) & pair))


RED_CASES = {
    # n, H, dtype, mask, threshold, retain, (block_r, block_c); n never a tile multiple
    # None: the dispatcher with impl=True and the default tiles, shrunk to one 64 x 64 tile
    "n40_f32_mixed_dispatch": (40, 64, jnp.float32, "mixed", 0.5, 1, None),
    "n72_bf16_mixed": (72, 128, jnp.bfloat16, "mixed", 0.5, 1, (32, 16)),
    "n136_h96_retain2": (136, 96, jnp.float32, "none", 0.5, 2, (16, 32)),  # H padded to 128
    "n40_negative_retain3_edge": (40, 64, jnp.float32, "edge", -0.25, 3, (16, 16)),
}


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case", list(RED_CASES))
def test_redundancy_matches_references(case, interpret):
    n, h, dtype, mode, threshold, retain, tiles = RED_CASES[case]
    keys = _keys(n, n=n, h=h, dtype=dtype)
    valid = _valid(n, mode=mode)
    assert _matching_pairs(keys, valid, 0.5) >= 20  # the planted near-duplicates are live
    kw = dict(window=W, threshold=threshold, retain=retain)
    if tiles is None:
        got = C.redundancy_scores(keys, valid, **kw, impl=True)  # interprets on CPU only
    else:
        block_r, block_c = tiles
        got = redundancy_pallas(
            keys, valid, **kw, block_r=block_r, block_c=block_c, interpret=interpret
        )
    assert got.shape == (2, 3, n - W) and got.dtype == jnp.float32
    spec = ref_jit(keys, valid, **kw)
    np.testing.assert_allclose(got, spec, **SCORE_TOL)
    np.testing.assert_allclose(got, compression_jit(keys, valid, **kw), **SCORE_TOL)
    loops = _numpy_redundancy(keys, valid, threshold=threshold, retain=retain)
    np.testing.assert_allclose(got, loops, **SCORE_TOL)
    assert np.all(np.asarray(got)[~np.asarray(valid)[..., : n - W]] == 0)
    assert np.all(np.isfinite(np.asarray(got)))


def test_redundancy_memory_is_linear_in_n():
    """The compiled kernel holds O(n H) bytes: far below one n x n float32 matrix."""
    n = 1024
    keys, valid = jnp.zeros((1, 1, n, 64), jnp.bfloat16), jnp.ones((1, 1, n), bool)
    fn = lambda k, v: redundancy_pallas(k, v, block_r=128, block_c=128, interpret=True)
    temp = jax.jit(fn).lower(keys, valid).compile().memory_analysis().temp_size_in_bytes
    assert temp < n * n * 4 / 2, temp


def test_redundancy_dispatch_jnp():
    """impl=False, and auto on CPU, run the engine's one jnp path (compression.redundancy)."""
    keys, valid = _keys(40, n=40, h=64, dtype=jnp.float32), _valid(40, mode="mixed")
    spec = C.redundancy(keys, valid, window=W, threshold=0.5, retain=1)
    # Auto: the kernel where Pallas compiles (GPU, TPU), jnp on CPU where it would interpret.
    assert C.use_pallas(None) == (jax.default_backend() in ("gpu", "tpu"))
    assert C.use_pallas(True) and not C.use_pallas(False)
    np.testing.assert_allclose(C.redundancy_scores(keys, valid, window=W), spec, **SCORE_TOL)
    np.testing.assert_array_equal(C.redundancy_scores(keys, valid, window=W, impl=False), spec)


def test_auto_picks_the_kernel_only_for_large_dense_matrices(monkeypatch):
    from rkvjax.kv.kernels import tuning

    assert tuning.dense_limit_bytes() > 0
    assert not C.use_pallas(None, dense_bytes=1 << 60) or tuning.backend() != "cpu"
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "dense_limit_bytes", lambda: 1000)
    assert not C.use_pallas(None, dense_bytes=1000)
    assert C.use_pallas(None, dense_bytes=1001)
    assert not C.use_pallas(None)  # top-k: no dense intermediate, jnp
    assert not C.use_pallas(False, dense_bytes=1 << 60)


def _tied_scores(seed, m):
    """scores [2, 3, m] with exact ties, -0.0 next to +0.0, -inf tails, an all -inf lane."""
    rng = np.random.default_rng(seed)
    s = np.round(rng.normal(size=(2, 3, m)), 1).astype(np.float32)  # ~40 values: many ties
    s[0, 0, :6] = [0.0, -0.0, 0.0, -0.0, 0.0, -0.0]
    s[0, 1, m - 15 :] = -np.inf  # empty slots
    s[1, 0, :] = -np.inf  # nothing valid: the lowest positions, like top_k
    s[1, 1, ::3] = 2.5  # a tie spanning the cut for every k
    s[1, 2, m // 2 :] = -np.inf
    return jnp.asarray(s)


def _numpy_topk(scores, k):
    """Sorted positions of the k largest in top_k's total order (-0.0 < +0.0)."""
    s = np.asarray(scores, np.float32)
    out = np.zeros((*s.shape[:2], k), np.int64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            row = s[i, j]
            order = sorted(range(row.size), key=lambda p: (-row[p], bool(np.signbit(row[p])), p))
            out[i, j] = sorted(order[:k])
    return out


TOPK_CASES = {
    # m, k, (block_m, block_k), matmul_scan; m never a chunk multiple
    "cumsum": (50, 20, (16, 8), False),
    "matmul_scan": (50, 20, (16, 8), True),
    "k1": (37, 1, (8, 8), False),
    "k_eq_m": (37, 37, (16, 16), False),
}


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case", list(TOPK_CASES))
def test_topk_matches_references(case, interpret):
    m, k, (block_m, block_k), matmul = TOPK_CASES[case]
    if matmul and not interpret:
        pytest.skip("the matmul scan is the TPU path; tl.dot needs >= 16 rows")
    scores = _tied_scores(m, m)
    got = topk_positions(
        scores, k, block_m=block_m, block_k=block_k, matmul_scan=matmul, interpret=interpret
    )
    assert got.dtype == jnp.int32 and got.shape == (2, 3, k)
    np.testing.assert_array_equal(got, topk_ref_jit(scores, k))
    np.testing.assert_array_equal(got, _numpy_topk(scores, k))


def test_topk_dispatch_default_tiles_and_bf16():
    scores = _tied_scores(3, 50).astype(jnp.bfloat16)
    spec = topk_ref_jit(scores, 20)
    np.testing.assert_array_equal(C.topk_positions(scores, 20, impl=True), spec)
    np.testing.assert_array_equal(C.topk_positions(scores, 20, impl=False), spec)


def test_topk_selects_like_compression_select():
    """Kernel top-k on the engine's R-KV scores gives `select`'s candidate positions."""
    rng = np.random.default_rng(5)
    keys = _keys(5, n=40, h=64, dtype=jnp.float32)
    queries = jnp.asarray(rng.normal(size=(2, 6, W, 64)), jnp.float32)  # [B, N, W, H]
    valid = _valid(40, mode="mixed") | (jnp.arange(40) >= 40 - W)

    @jax.jit
    def engine_path(queries, keys, valid):  # one compile instead of op-by-op dispatch
        score = C.rkv_scores(queries, keys, valid)  # [B, K, n-W]
        score = jnp.where(valid[..., : 40 - W], jnp.where(score == 0, 0.0, score), -jnp.inf)
        return score, C.select("rkv", queries, keys, valid, budget=20, window=W)

    score, kept = engine_path(queries, keys, valid)  # [B, K, n-W], [B, K, 20]
    got = topk_positions(score, 20 - W, block_m=16, block_k=8, interpret=True)
    np.testing.assert_array_equal(got, kept[..., : 20 - W])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda k: redundancy_pallas(k[0], None, window=8, block_r=12, interpret=True), "power"),
        (lambda k: redundancy_pallas(k[0], None, window=8, block_c=4, interpret=True), ">= 8"),
        (lambda k: redundancy_pallas(k[0], None, window=41, interpret=True), "window"),
        (lambda k: redundancy_pallas(k[0], None, retain=0, interpret=True), "retain"),
        (lambda k: redundancy_pallas(k[0], None, threshold=1.5, interpret=True), "cosine"),
        (lambda k: redundancy_pallas(k[0], k[1], interpret=True), "valid must be bool"),
        (lambda k: redundancy_pallas(k[0][0], None, interpret=True), r"\[B, K, n, H\]"),
        (lambda k: redundancy_reference(k[1][..., None], None), "floating"),
        (lambda k: topk_positions(k[2], 11, interpret=True), r"\[1, m=10\]"),
        (lambda k: topk_positions(k[2], 0, interpret=True), r"\[1, m=10\]"),
        (lambda k: topk_positions(k[2], 2, block_m=24, interpret=True), "power"),
        (lambda k: topk_reference(k[2][0], 2), r"\[B, K, m\]"),
        (lambda k: C.topk_positions(k[2], 2, impl="yes"), "impl"),
    ],
)
def test_invalid_arguments(call, match):
    args = (jnp.zeros((1, 2, 40, 16)), jnp.ones((1, 2, 40), jnp.int32), jnp.zeros((1, 2, 10)))
    with pytest.raises(ValueError, match=match):
        call(args)


def test_engine_results_unchanged_with_kernels(tiny_checkpoint):
    """The whole decode loop, compressions included, gives the same tokens and kept sets
    whether compression runs the Pallas kernels (interpreted here) or the jnp path."""
    import rkvjax

    model = rkvjax.load(tiny_checkpoint("qwen2_gqa3")[0])
    prompts = [list(range(3, 33)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7]]
    kw = dict(method="rkv", budget=16, buffer=8, max_new_tokens=24, ignore_eos=True)
    runs = [
        rkvjax.generate(model, prompts, kernels=k, record_kept=True, **kw) for k in (False, True)
    ]
    for jnp_row, kernel_row in zip(*runs, strict=True):
        assert kernel_row.stats.compressions == jnp_row.stats.compressions >= 2
        assert kernel_row.token_ids == jnp_row.token_ids
        np.testing.assert_array_equal(kernel_row.kept_positions, jnp_row.kept_positions)
