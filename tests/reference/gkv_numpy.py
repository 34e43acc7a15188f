"""Independent NumPy reference for G-KV in the engine's schedule: one layer of one row replayed
compression by compression, each key's global score carried between them."""

from __future__ import annotations

import numpy as np

from tests.reference.keydiff_numpy import keep_by_scores
from tests.reference.rkv_numpy import redundancy


def local_scores(queries, keys, *, window):
    """queries [G, W, H] (the window's, oldest first), keys [n, H] -> [n - W]: the softmax of
    each window query over every key (its own window's causally), the group's max, the mean
    over the W queries, divided by the largest."""
    _, w, h = queries.shape
    n = keys.shape[0]
    m = n - window
    logits = np.einsum("gwh,nh->gwn", queries, keys) / np.sqrt(h)
    for i in range(w):
        logits[:, i, m + i + 1 :] = -np.inf  # window query i sees window keys 0..i
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = (e / e.sum(axis=-1, keepdims=True)).max(axis=0)  # [W, n]
    a = probs[:, :m].mean(axis=0)
    return a / a.max()


def simulate(
    q, k, prompt, events, *, budget, buffer, window, lam=0.5, alpha=0.8, threshold=0.5, retain=1
):
    """Replays one layer of one row -> [events, K, budget] kept positions, ascending.

    The cache starts with the prompt (compressed at once if longer than `budget`) and grows by
    one position per decode step; a cache of `budget + buffer` keys is compressed. Each
    compression: g = max(alpha * g_old, a) over the candidates (g_old = 0 for keys without one),
    score = lam * g - (1 - lam) * r / max(r), the kept candidates keep their g.

    Args:
      q, k: [T, N, H], [T, K, H] queries and keys by position.
      prompt: the prompt's length; events: compressions to replay.
    """
    kh = k.shape[1]
    grp = q.shape[1] // kh
    held = [list(range(prompt)) for _ in range(kh)]
    glob = [{} for _ in range(kh)]
    out = []

    def compress():
        kept = []
        for h in range(kh):
            pos = held[h]
            n, m = len(pos), len(pos) - window
            keys = k[pos, h]  # [n, H]
            queries = np.swapaxes(q[pos[m:], h * grp : (h + 1) * grp], 0, 1)  # [G, W, H]
            a = local_scores(queries, keys, window=window)
            g = np.maximum(alpha * np.asarray([glob[h].get(p, 0.0) for p in pos[:m]]), a)
            r = redundancy(keys[None, None], window=window, threshold=threshold, retain=retain)
            r = r[0, 0] / (r[0, 0].max() if r[0, 0].max() > 0 else 1.0)
            score = lam * g - (1 - lam) * r
            idx = keep_by_scores(score[None, None], budget=budget, window=window, n=n)[0, 0]
            glob[h] = {pos[i]: g[i] for i in idx if i < m}
            held[h] = [pos[i] for i in idx]
            kept.append(held[h])
        out.append(np.asarray(kept))

    if prompt > budget:
        compress()
    t = prompt
    while len(out) < events:
        grow = budget + buffer - len(held[0])
        held = [x + list(range(t, t + grow)) for x in held]
        t += grow
        compress()
    return np.stack(out)
