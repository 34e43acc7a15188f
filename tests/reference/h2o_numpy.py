"""Independent NumPy reference for H2O in the engine's schedule: attention summed per key over
every query that saw it (a KV head's query group together), one layer replayed step by step."""

from __future__ import annotations

import numpy as np

from tests.reference.keydiff_numpy import keep_by_scores


def _received(q, keys):
    """q [G, H] one token's queries, keys [n, H] the keys they see -> [n] summed softmax."""
    logits = q @ keys.T / np.sqrt(q.shape[-1])  # [G, n]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).sum(axis=0)


def prompt_sums(q, k, length):
    """Attention each prompt key received from the prompt's queries, per KV head.

    q [T, N, H], k [T, K, H] one row's post-RoPE queries and keys by position -> [K, length]."""
    kh, g = k.shape[1], q.shape[1] // k.shape[1]
    out = np.zeros((kh, length))
    for h in range(kh):
        for i in range(length):
            out[h, : i + 1] += _received(q[i, h * g : (h + 1) * g], k[: i + 1, h])
    return out


def simulate(q, k, prompt, events, *, budget, buffer, window):
    """Replays one layer of one row -> [events, K, budget] kept positions, ascending.

    The cache starts with the prompt's keys and their prompt sums (compressed at once if
    longer than `budget`); each decode step first compresses a cache of `budget + buffer` keys,
    then appends the next position's key and adds its query's attention over the cache (its
    own key included) to every key's sum.

    Args:
      q, k: [T, N, H], [T, K, H] queries and keys by position (prompt and generated tokens).
      prompt: the prompt's length; events: compressions to replay.
    """
    kh = k.shape[1]
    g = q.shape[1] // kh
    sums = prompt_sums(q, k, prompt)
    held = [list(range(prompt)) for _ in range(kh)]
    acc = [dict(enumerate(sums[h])) for h in range(kh)]
    out = []

    def compress():
        kept = []
        for h in range(kh):
            n = len(held[h])
            score = np.asarray([acc[h][p] for p in held[h][: n - window]])[None, None]
            idx = keep_by_scores(score, budget=budget, window=window, n=n)[0, 0]
            held[h] = [held[h][i] for i in idx]
            acc[h] = {p: acc[h][p] for p in held[h]}
            kept.append(held[h])
        out.append(np.asarray(kept))

    if prompt > budget:
        compress()
    t = prompt
    while len(out) < events:
        if len(held[0]) >= budget + buffer:
            compress()
            continue
        for h in range(kh):
            held[h].append(t)
            acc[h][t] = 0.0
            w = _received(q[t, h * g : (h + 1) * g], k[held[h], h])
            for p, x in zip(held[h], w, strict=True):
                acc[h][p] += x
        t += 1
    return np.stack(out)
