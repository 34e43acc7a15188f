"""Independent NumPy loop reference for R-KV / SnapKV / StreamingLLM scoring, from RKV_SPEC.md."""

from __future__ import annotations

import numpy as np

SINKS = 4


def _softmax(x):
    e = np.exp(x - np.max(x))  # [m]
    return e / np.sum(e)


def importance(queries, keys, *, kernel=7):
    """queries [B, N, W, H], keys [B, K, n, H] (all present) -> float64 [B, K, n - W]."""
    q = np.asarray(queries, np.float64)
    k = np.asarray(keys, np.float64)
    b_size, n_q, w, h = q.shape
    k_heads, n = k.shape[1], k.shape[2]
    g = n_q // k_heads
    m = n - w
    out = np.zeros((b_size, k_heads, m))  # [B, K, n-W]
    for b in range(b_size):
        for kv in range(k_heads):
            logits = np.full((w, n), -np.inf)  # [W, n]
            for head in range(n_q):
                if head // g != kv:
                    continue
                logits = np.maximum(logits, q[b, head] @ k[b, kv].T / np.sqrt(h))
            attn = np.zeros(m)  # [n-W]
            for t in range(w):
                attn += _softmax(logits[t, :m])
            attn /= w
            half = kernel // 2
            for j in range(m):
                out[b, kv, j] = max(attn[max(0, j - half) : min(m, j + half + 1)])
    return out


def redundancy(keys, *, window=8, threshold=0.5, retain=1):
    """keys [B, K, n, H] (all present) -> float64 [B, K, n - W].

    Row i zeroes the columns holding the `retain` largest values of j * [S[i, j] > threshold]:
    its `retain` newest matches, plus column 0 when it has fewer than `retain` matches.
    """
    k = np.asarray(keys, np.float64)
    b_size, k_heads, n, _ = k.shape
    out = np.zeros((b_size, k_heads, n - window))  # [B, K, n-W]
    for b in range(b_size):
        for kv in range(k_heads):
            x = k[b, kv]  # [n, H]
            x = x / (np.sqrt(np.sum(x * x, axis=-1, keepdims=True)) + 1e-8)
            s = x @ x.T  # [n, n]
            for i in range(n):
                s[i, i] = 0.0
            for i in range(n):
                matches = [j for j in range(n) if s[i, j] > threshold]
                zero = matches[-retain:]
                if len(matches) < retain:
                    zero.append(0)
                for j in zero:
                    s[i, j] = 0.0
            red = np.zeros(n)  # [n]
            for i in range(n):
                red += s[i]
            red /= n
            out[b, kv] = _softmax(red)[: n - window]
    return out


def rkv_scores(queries, keys, *, kernel=7, lam=0.1, threshold=0.5, retain=1):
    """Joint score lam * I - (1 - lam) * R, float64 [B, K, n - W]."""
    w = queries.shape[2]
    i = importance(queries, keys, kernel=kernel)
    r = redundancy(keys, window=w, threshold=threshold, retain=retain)
    return lam * i - (1 - lam) * r


def keep(method, queries, keys, *, budget, window=8, kernel=7, lam=0.1, threshold=0.5, retain=1):
    """Kept positions, int64 [B, K, budget], ascending: top budget - W candidates plus window."""
    b_size, k_heads, n, _ = keys.shape
    m = n - window
    n_sel = budget - window
    out = np.zeros((b_size, k_heads, budget), np.int64)  # [B, K, budget]
    if method == "rkv":
        score = rkv_scores(
            queries, keys, kernel=kernel, lam=lam, threshold=threshold, retain=retain
        )
    elif method == "snapkv":
        score = importance(queries, keys, kernel=kernel)
    for b in range(b_size):
        for kv in range(k_heads):
            if method == "streaming":
                sinks = list(range(min(SINKS, n_sel)))
                chosen = sinks + list(range(m - (n_sel - len(sinks)), m))
            else:
                chosen = sorted(range(m), key=lambda j: (-score[b, kv, j], j))[:n_sel]
            out[b, kv] = sorted(chosen) + list(range(m, n))
    return out
