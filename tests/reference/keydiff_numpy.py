"""Independent NumPy loop reference for KeyDiff (kvpress `KeyDiffPress.score`) and the common keep
rule: the last W keys kept, the top budget - W others by score, ties to the lower position."""

from __future__ import annotations

import numpy as np


def scores(keys, *, window):
    """keys [B, K, n, H] (all present) -> float64 [B, K, n - W]: -cos(k_i, mean of unit keys)."""
    k = np.asarray(keys, np.float64)
    b_size, k_heads, n, _ = k.shape
    out = np.zeros((b_size, k_heads, n - window))
    for b in range(b_size):
        for kv in range(k_heads):
            units = [x / (np.sqrt(np.sum(x * x)) + 1e-8) for x in k[b, kv]]
            anchor = sum(units) / n
            anchor = anchor / (np.sqrt(np.sum(anchor * anchor)) + 1e-8)
            for i in range(n - window):
                out[b, kv, i] = -float(units[i] @ anchor)
    return out


def keep_by_scores(score, *, budget, window, n):
    """[B, K, n - W] scores -> int64 [B, K, budget] kept positions, ascending."""
    b_size, k_heads, m = score.shape
    out = np.zeros((b_size, k_heads, budget), np.int64)
    for b in range(b_size):
        for kv in range(k_heads):
            chosen = sorted(range(m), key=lambda j: (-score[b, kv, j], j))[: budget - window]
            out[b, kv] = sorted(chosen) + list(range(m, n))
    return out


def keep(queries, keys, *, budget, window=8):
    """KeyDiff's kept positions [B, K, budget]; queries are not read (only their count W)."""
    assert queries.shape[2] == window
    n = keys.shape[2]
    return keep_by_scores(scores(keys, window=window), budget=budget, window=window, n=n)
