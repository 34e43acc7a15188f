"""rkvjax.kv.selection against the independent NumPy loop reference in tests/reference."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rkvjax.kv import selection as C
from tests.reference import rkv_numpy as ref

SCORE_TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32 scores against the float64 loops
HEADS = [(3, 3), (6, 3), (9, 3)]  # (N, K): MHA, G=2, G=3; one key shape keeps compiles few
HEAD_IDS = ["mha", "g2", "g3"]
W = 8

# Tests on the shared input shapes run eagerly: primitives compile once per shape and are reused
# across methods and budgets. One-off shapes go through jit: one compile, not one per primitive.
_STATIC = ("method", "budget", "window", "kernel", "lam", "threshold", "retain")
J = types.SimpleNamespace(
    select=jax.jit(C.select, static_argnames=_STATIC),
    keep_indices=jax.jit(C.keep_indices, static_argnames=_STATIC),
    redundancy=jax.jit(C.redundancy, static_argnames=("window", "threshold", "retain")),
)


def _inputs(seed, *, n_q=6, k_heads=3, n=48, h=16, b=2, plant=True):
    """Random queries [B, N, W, H], keys [B, K, n, H] with near-duplicate pairs and triplets."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, n_q, W, h)).astype(np.float32)  # [B, N, W, H]
    k = rng.normal(size=(b, k_heads, n, h)).astype(np.float32)  # [B, K, n, H]
    if plant:
        # Copies of an older key with small noise: the newest copy should read as redundant-free.
        for src, dsts in [(2, [9]), (5, [17, 30]), (12, [n - W - 2]), (20, [n - 3])]:
            for dst in dsts:
                noise = 0.05 * rng.normal(size=(b, k_heads, h))  # [B, K, H]
                k[:, :, dst] = 1.7 * k[:, :, src] + noise
    return q, k


def _cos(k):
    """Cosine matrix of keys [..., n, H] -> [..., n, n], float64, diagonal 0."""
    x = np.asarray(k, np.float64)
    x = x / np.linalg.norm(x, axis=-1, keepdims=True)
    s = x @ np.swapaxes(x, -1, -2)  # [..., n, n]
    idx = np.arange(s.shape[-1])
    s[..., idx, idx] = 0.0
    return s


def _all_valid(k):
    return jnp.ones(k.shape[:3], dtype=bool)  # [B, K, n]


@pytest.mark.parametrize("n_q,k_heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("retain", [1, 2])
def test_scores_match_reference(n_q, k_heads, retain):
    q, k = _inputs(0, n_q=n_q, k_heads=k_heads)
    cos = _cos(k)  # [B, K, n, n]
    # The planted copies really cross the threshold, and the retain paths are all exercised:
    # rows with no match (column-0 rule), exactly one match, and several.
    assert (cos[:, :, 5, [17, 30]] > 0.9).all() and (cos[:, :, 17, 30] > 0.9).all()
    assert (cos[:, :, 2, 9] > 0.9).all()
    matches = (cos > 0.5).sum(-1)  # [B, K, n]
    assert (matches == 0).any() and (matches == 1).any() and (matches >= 2).any()
    valid = _all_valid(k)
    got_i = C.importance(jnp.asarray(q), jnp.asarray(k), valid)
    got_r = C.redundancy(jnp.asarray(k), valid, window=W, retain=retain)
    got_z = C.rkv_scores(jnp.asarray(q), jnp.asarray(k), valid, lam=0.1, retain=retain)
    assert got_i.dtype == got_r.dtype == got_z.dtype == jnp.float32
    assert got_z.shape == (2, k_heads, k.shape[2] - W)
    np.testing.assert_allclose(got_i, ref.importance(q, k), **SCORE_TOL)
    np.testing.assert_allclose(got_r, ref.redundancy(k, window=W, retain=retain), **SCORE_TOL)
    want_z = ref.rkv_scores(q, k, lam=0.1, retain=retain)
    np.testing.assert_allclose(got_z, want_z, **SCORE_TOL)


def test_newest_duplicate_is_least_redundant():
    # Orthonormal background keys, plus 10 and 15 as near-copies of 3: only the triplet matches.
    basis = np.linalg.qr(np.random.default_rng(1).normal(size=(32, 32)))[0]  # [H, H]
    k = basis[:24].astype(np.float32)  # [n, H]
    k[10] = basis[3] + 0.05 * basis[10]
    k[15] = basis[3] + 0.05 * basis[15]
    k = k[None, None]  # [1, 1, n, H]
    assert (
        (_cos(k)[0, 0] > 0.5).sum(-1) == [2 if i in (3, 10, 15) else 0 for i in range(24)]
    ).all()
    r = np.asarray(J.redundancy(jnp.asarray(k), _all_valid(k), window=W))[0, 0]  # [n-W]
    # Rows 3 and 10 zero their newest match 15, row 15 zeroes 10: column sums ~0 < ~1 < ~2.
    assert r[15] < r[10] < r[3]
    np.testing.assert_allclose(r, ref.redundancy(k, window=W)[0, 0], **SCORE_TOL)


@pytest.mark.parametrize("n_q,k_heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming"])
@pytest.mark.parametrize("budget", [9, 20, 40])
def test_keep_matches_reference(n_q, k_heads, method, budget):
    q, k = _inputs(2, n_q=n_q, k_heads=k_heads)
    n = k.shape[2]
    got = np.asarray(C.keep_indices(method, jnp.asarray(q), jnp.asarray(k), budget=budget))
    assert got.dtype == np.int32 and got.shape == (2, k_heads, budget)
    np.testing.assert_array_equal(got, ref.keep(method, q, k, budget=budget))
    assert (np.diff(got, axis=-1) > 0).all()  # ascending, distinct
    np.testing.assert_array_equal(
        got[..., -W:], np.broadcast_to(np.arange(n - W, n), got[..., -W:].shape)
    )


@pytest.mark.parametrize("retain,threshold,lam", [(2, 0.5, 0.1), (1, 0.3, 0.07), (3, 0.5, 0.0)])
def test_keep_matches_reference_settings(retain, threshold, lam):
    q, k = _inputs(3, n_q=9, k_heads=3)
    kw = dict(budget=24, retain=retain, threshold=threshold, lam=lam)
    got = C.keep_indices("rkv", jnp.asarray(q), jnp.asarray(k), **kw)
    np.testing.assert_array_equal(got, ref.keep("rkv", q, k, **kw))


def test_column_zero_rule():
    """Rows without a match zero column 0: red_j = mean of S with diag and column 0 zeroed."""
    rng = np.random.default_rng(4)
    k = rng.normal(size=(1, 1, 16, 128)).astype(np.float32)  # [B, K, n, H]
    k[0, 0, 1:] += 0.25 * k[0, 0, 0]  # every key leans towards key 0, below the threshold
    s = _cos(k)[0, 0]  # [n, n]
    assert (s < 0.5).all() and (s[1:, 0] > 0.1).all()
    z = s.copy()
    z[:, 0] = 0.0
    want = np.exp(z.mean(0)) / np.exp(z.mean(0)).sum()  # [n]
    got = J.redundancy(jnp.asarray(k), _all_valid(k), window=W)[0, 0]
    np.testing.assert_allclose(got, want[: 16 - W], **SCORE_TOL)
    unzeroed = np.exp(s.mean(0)) / np.exp(s.mean(0)).sum()
    assert not np.allclose(want, unzeroed, **SCORE_TOL)  # the rule changes the answer


def test_retain_two_zeroes_newest_matches_then_column_zero():
    """Hand-built keys: rows with 0, 1, 2 and 3 matches under retain=2."""
    e = np.eye(6, dtype=np.float32)  # [n, H]
    k = e.copy()
    k[2] = e[1] + 0.1 * e[2]
    k[3] = e[1] + e[3]
    k[4] = e[3] + 0.1 * e[4]
    k = k[None, None]  # [1, 1, n, H]
    s = _cos(k)[0, 0]  # [n, n]
    match = s > 0.5
    assert match.sum(-1).tolist() == [0, 2, 2, 3, 1, 0]
    want = s.copy()
    for i in range(6):
        hits = list(np.flatnonzero(match[i]))
        zero = hits[-2:] + ([0] if len(hits) < 2 else [])
        want[i, zero] = 0.0
    red = want.mean(0)
    red = np.exp(red) / np.exp(red).sum()
    got = J.redundancy(jnp.asarray(k), _all_valid(k), window=1, retain=2)[0, 0]
    np.testing.assert_allclose(got, red[:5], **SCORE_TOL)
    np.testing.assert_allclose(got, ref.redundancy(k, window=1, retain=2)[0, 0], **SCORE_TOL)


def test_top_k_breaks_ties_towards_lower_index():
    x = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, 3.0, -jnp.inf, 1.0, -jnp.inf]])
    np.testing.assert_array_equal(jax.lax.top_k(x, 8)[1], [[1, 2, 4, 0, 6, 3, 5, 7]])
    # -0.0 and +0.0 do not tie in top_k (total order): select canonicalises zeros.
    z = jnp.asarray([-0.0, 0.0])
    assert jax.lax.top_k(z, 2)[1].tolist() == [1, 0]


@pytest.mark.parametrize("method", ["rkv", "snapkv"])
def test_ties_keep_lower_positions(method):
    # Zero queries give uniform importance; with lam=1 every candidate scores the same.
    q = np.zeros((1, 2, W, 4), np.float32)  # [B, N, W, H]
    k = np.tile(np.asarray([1.0, 0.0, 0.0, 0.0], np.float32), (1, 1, 30, 1))  # [B, K, n, H]
    got = J.keep_indices(method, jnp.asarray(q), jnp.asarray(k), budget=13, lam=1.0)
    np.testing.assert_array_equal(got[0, 0], [0, 1, 2, 3, 4, *range(22, 30)])
    np.testing.assert_array_equal(got, ref.keep(method, q, k, budget=13, lam=1.0))


def test_streaming_hand_written():
    q = np.zeros((1, 2, W, 4), np.float32)
    k = np.ones((1, 2, 20, 4), np.float32)
    valid = np.ones((1, 2, 20), bool)
    valid[0, 1, :3] = False  # left padding: the sinks move to the first valid keys
    got = J.select("streaming", jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), budget=14)
    window = list(range(12, 20))
    np.testing.assert_array_equal(got[0, 0], [0, 1, 2, 3, 10, 11, *window])
    np.testing.assert_array_equal(got[0, 1], [3, 4, 5, 6, 10, 11, *window])
    # budget - window < 4: only that many sinks.
    got = J.keep_indices("streaming", jnp.asarray(q), jnp.asarray(k), budget=10)
    np.testing.assert_array_equal(got[0, 0], [0, 1, *window])


def test_fewer_valid_than_budget_hand_written():
    q = np.random.default_rng(9).normal(size=(1, 2, W, 4)).astype(np.float32)  # [B, N, W, H]
    k = np.random.default_rng(10).normal(size=(1, 2, 20, 4)).astype(np.float32)  # [B, K, n, H]
    valid = np.zeros((1, 2, 20), bool)
    valid[..., [2, 7, 9]] = True
    valid[..., 12:] = True  # the window
    for method in ("rkv", "snapkv", "streaming"):
        got = J.select(method, jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), budget=14)
        # All 3 valid candidates, then the lowest invalid slots (ties at -inf), then the window.
        np.testing.assert_array_equal(got[0, 0], [0, 1, 2, 3, 7, 9, *range(12, 20)])


def _random_valid(rng, k_heads, n, counts):
    """valid [B, K, n]: per (b, k) left padding, holes and empties before the window."""
    valid = np.ones((len(counts), k_heads, n), bool)
    for b, row in enumerate(counts):
        for kv, kind in enumerate(row):
            v = valid[b, kv]
            if kind == "left":
                v[: rng.integers(1, 12)] = False
            elif kind == "holes":
                v[: n - W] = rng.random(n - W) < 0.6
            elif kind == "trailing":
                v[n - W - rng.integers(1, 10) : n - W] = False
            elif kind == "few":
                v[: n - W] = False
                v[rng.choice(n - W, size=5, replace=False)] = True
    return valid


@pytest.mark.parametrize("n_q,k_heads", HEADS[1:], ids=HEAD_IDS[1:])
@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming"])
@pytest.mark.parametrize("seed", [0, 1])
def test_masked_equals_compacted(n_q, k_heads, method, seed):
    rng = np.random.default_rng(10 + seed)
    q, k = _inputs(20 + seed, n_q=n_q, k_heads=k_heads)
    n, g, budget = k.shape[2], n_q // k_heads, 18
    kinds = ["left", "holes", "trailing", "few", "all"]
    counts = [[kinds[(b * k_heads + kv + seed) % 5] for kv in range(k_heads)] for b in range(2)]
    valid = _random_valid(rng, k_heads, n, counts)
    jq, jk, jv = jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid)
    got = np.asarray(C.select(method, jq, jk, jv, budget=budget))  # [B, K, budget]
    got_i = np.asarray(C.importance(jq, jk, jv))  # [B, K, n-W]
    got_r = np.asarray(C.redundancy(jk, jv, window=W))
    assert (np.diff(got, axis=-1) > 0).all()
    for b in range(2):
        for kv in range(k_heads):
            idx = np.flatnonzero(valid[b, kv])  # compacted -> original positions
            cq = q[b : b + 1, kv * g : (kv + 1) * g]  # [1, G, W, H]
            ck = k[b : b + 1, kv : kv + 1, idx]  # [1, 1, m, H]
            cand = idx[idx < n - W]
            np.testing.assert_allclose(
                got_i[b, kv, cand], ref.importance(cq, ck)[0, 0], **SCORE_TOL
            )
            np.testing.assert_allclose(
                got_r[b, kv, cand], ref.redundancy(ck, window=W)[0, 0], **SCORE_TOL
            )
            if len(idx) >= budget:
                want = idx[ref.keep(method, cq, ck, budget=budget)[0, 0]]
                np.testing.assert_array_equal(got[b, kv], want)
            else:
                # Too few valid candidates: all valid ones kept, the rest are invalid slots.
                kept = got[b, kv]
                np.testing.assert_array_equal(kept[valid[b, kv, kept]], idx)
    assert any(valid[b, kv].sum() < budget for b in range(2) for kv in range(k_heads))


def test_invalid_observation_slots_are_treated_as_valid():
    q, k = _inputs(5)
    valid = np.ones(k.shape[:3], bool)
    valid[..., -2:] = False  # the engine never does this; select keeps and scores them anyway
    got = C.select("rkv", jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), budget=20)
    np.testing.assert_array_equal(
        got, C.keep_indices("rkv", jnp.asarray(q), jnp.asarray(k), budget=20)
    )


def test_keep_indices_is_select_with_all_valid():
    q, k = _inputs(6, n_q=9, k_heads=3)
    jq, jk = jnp.asarray(q), jnp.asarray(k)
    for method in C.METHODS:
        a = C.keep_indices(method, jq, jk, budget=21, retain=2)
        b = C.select(method, jq, jk, _all_valid(k), budget=21, retain=2)
        np.testing.assert_array_equal(a, b)


def test_eager_equals_jit():
    q, k = _inputs(7)
    valid = _all_valid(k).at[0, 0, :5].set(False)  # [B, K, n]
    jq, jk = jnp.asarray(q), jnp.asarray(k)
    eager = C.select("rkv", jq, jk, valid, budget=20)
    np.testing.assert_array_equal(eager, J.select("rkv", jq, jk, valid, budget=20))


def test_bf16_inputs_scored_in_f32():
    q, k = _inputs(8)
    qb, kb = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    q32, k32 = np.asarray(qb, np.float32), np.asarray(kb, np.float32)
    z = C.rkv_scores(qb, kb, _all_valid(k))
    assert z.dtype == jnp.float32
    np.testing.assert_allclose(z, ref.rkv_scores(q32, k32), **SCORE_TOL)
    for method in C.METHODS:
        got = C.keep_indices(method, qb, kb, budget=20)
        np.testing.assert_array_equal(got, ref.keep(method, q32, k32, budget=20))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"method": "full"}, "'full' never compresses"),
        ({"method": "lru"}, r"unknown method 'lru'.*'rkv', 'snapkv', 'streaming'"),
        ({"budget": 8}, "budget=8 must be larger than window=8"),
        ({"budget": 33}, "budget=33 is larger than the n=32 keys"),
        ({"budget": 12.0}, "budget must be an int"),
        ({"window": 4}, r"hold W=8 observation queries, but window=4"),
        ({"window": 40, "q_shape": (1, 4, 40, 16), "budget": 41}, "W=40 .* more than the n=32"),
        ({"q_shape": (1, 3, 8, 16)}, "N=3 must be a multiple of KV heads K=2"),
        ({"q_shape": (1, 4, 8, 12)}, r"disagree on B or H"),
        ({"q_shape": (2, 4, 8, 16)}, r"disagree on B or H"),
        ({"q_shape": (4, 8, 16)}, r"queries must be \[B, N, W, H\], got shape \(4, 8, 16\)"),
        ({"k_shape": (2, 32, 16)}, r"keys must be \[B, K, n, H\], got shape \(2, 32, 16\)"),
        ({"lam": 1.5}, r"lam must be in \[0, 1\]"),
        ({"lam": -0.1}, r"lam must be in \[0, 1\]"),
        ({"kernel": 4}, "kernel must be odd"),
        ({"kernel": 0}, "kernel must be an int >= 1"),
        ({"threshold": 1.5}, r"threshold is a cosine and must be in \[-1, 1\]"),
        ({"retain": 0}, "retain must be an int >= 1"),
    ],
)
def test_keep_indices_validation(kwargs, match):
    kwargs = dict(kwargs)
    q = jnp.zeros(kwargs.pop("q_shape", (1, 4, 8, 16)))
    k = jnp.zeros(kwargs.pop("k_shape", (1, 2, 32, 16)))
    method = kwargs.pop("method", "rkv")
    kwargs.setdefault("budget", 16)
    with pytest.raises(ValueError, match=match):
        C.keep_indices(method, q, k, **kwargs)


def test_select_validates_mask():
    q, k = jnp.zeros((1, 4, 8, 16)), jnp.zeros((1, 2, 32, 16))
    with pytest.raises(ValueError, match=r"valid must be \[B, K, n\] = \(1, 2, 32\)"):
        C.select("rkv", q, k, jnp.ones((1, 2, 31), bool), budget=16)
    with pytest.raises(ValueError, match="valid must be bool"):
        C.select("rkv", q, k, jnp.ones((1, 2, 32), jnp.int32), budget=16)
    with pytest.raises(ValueError, match="retain must be an int"):
        C.redundancy(k, jnp.ones((1, 2, 32), bool), retain=0)
    with pytest.raises(ValueError, match="kernel must be odd"):
        C.importance(q, k, jnp.ones((1, 2, 32), bool), kernel=2)
    with pytest.raises(ValueError, match="window=40 is larger than the n=32 keys"):
        C.redundancy(k, jnp.ones((1, 2, 32), bool), window=40)
