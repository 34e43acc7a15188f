"""Independent NumPy reference for random eviction: the 32-bit hash draw of each key, the prompt
ranked first, and the common keep rule (tests/reference/keydiff_numpy.keep_by_scores)."""

from __future__ import annotations

import numpy as np

from tests.reference.keydiff_numpy import keep_by_scores

M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int, wrapped to 32 bits by hand."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def draw(seed: int, time: int, position: int) -> float:
    """The [0, 1) draw of the key at `position` in a compression at `time` of request `seed`."""
    h = _lowbias32(_lowbias32(_lowbias32(seed & M32) ^ (time & M32)) ^ (position & M32))
    return (h >> 8) / float(1 << 24)


def scores(positions, *, seed, time, prompt, keep_prompt=True):
    """positions [m] of the candidates -> float64 [m]: prompt tokens 2 - p / 2^24, others drawn."""
    out = []
    for p in positions:
        if keep_prompt and p < prompt:
            out.append(2.0 - p / float(1 << 24))
        else:
            out.append(draw(seed, time, int(p)))
    return np.asarray(out)


def keep(
    queries,
    keys,
    *,
    budget,
    window=8,
    positions=None,
    seed=0,
    time=None,
    prompt=0,
    keep_prompt=True,
):
    """Kept slot indices [B, K, budget] of keys [B, K, n, H] at `positions` [n] (default
    0..n-1; `time` defaults to n, the next position), the same context for every row."""
    assert queries.shape[2] == window
    b, kh, n, _ = keys.shape
    positions = np.arange(n) if positions is None else np.asarray(positions)
    time = n if time is None else time
    one = scores(
        positions[: n - window], seed=seed, time=time, prompt=prompt, keep_prompt=keep_prompt
    )
    score = np.broadcast_to(one, (b, kh, n - window))
    return keep_by_scores(score, budget=budget, window=window, n=n)
