"""Independent NumPy reference for TriAttention in float64, as its authors' code scores keys
(`head_scores` and `kv_head_scores` of the reference spec, without tie-break noise): each cached
key is rotated back to its pre-RoPE form with its own position and scored over the offsets
one by one. Then the common keep rule with the prompt first: the last W keys kept; of the others
the prompt's tokens first (lower positions first), then the generated ones by score, ties to the
lower position."""

from __future__ import annotations

import numpy as np


def offsets(max_offset=65536):
    out, d = [], 1
    while d <= max_offset:
        out.append(float(d))
        d *= 2
    return np.array(out)


def head_scores(keys, positions, t, q_mean, q_abs_mean, omega, *, max_offset=65536):
    """keys [n, H] post-RoPE, positions [n], t the row's next position, q_mean complex [F],
    q_abs_mean [F], omega [F] float32 -> float64 [n] one query head's raw scores."""
    keys = np.asarray(keys, np.float64)
    f = keys.shape[1] // 2
    # The angles RoPE rotated by, in float32 as the model computes them.
    ang = (np.asarray(positions, np.float32)[:, None] * np.float32(omega)).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = keys[:, :f], keys[:, f:]
    kc = (x1 * c + x2 * s) + 1j * (x2 * c - x1 * s)  # [n, F] pre-RoPE key pairs
    amp = np.abs(q_mean)[None] * np.abs(kc)
    phi = np.angle(q_mean[None] * np.conj(kc))
    extra = ((q_abs_mean - np.abs(q_mean))[None] * np.abs(kc)).sum(-1)  # [n]
    delta = (t - np.asarray(positions, np.float64))[:, None] + offsets(max_offset)[None]  # [n, D]
    phase = delta[..., None] * np.float64(omega) + phi[:, None, :]  # [n, D, F]
    trig = (amp[:, None, :] * np.cos(phase)).sum(-1)  # [n, D]
    return (trig + extra[:, None]).mean(1)


def kv_head_scores(keys, positions, t, prompt, q_mean, q_abs_mean, omega, *, normalize=True, **kw):
    """keys [n, H], positions [n] of one (row, KV head)'s candidates; q_mean, q_abs_mean [G, F]
    of its query heads -> float64 [n]: each head's scores z-normalised over the generated
    candidates (positions >= prompt), then the maximum over the heads. Prompt entries: nan."""
    gen = np.asarray(positions) >= prompt
    rows = []
    for qm, qa in zip(q_mean, q_abs_mean, strict=True):
        r = head_scores(keys, positions, t, qm, qa, omega, **kw)
        if normalize and gen.any():
            r = (r - r[gen].mean()) / max(r[gen].std(), 1e-6)
        rows.append(r)
    return np.where(gen, np.max(rows, axis=0), np.nan)


def keep(keys, positions, *, t, prompt, q_mean, q_abs_mean, omega, budget, window=8, **kw):
    """Kept slots [B, K, budget] (ascending) of one layer.

    Args:
      keys: [B, K, n, H] post-RoPE keys in slot order; the last `window` are the window's.
      positions: [B, K, n] each key's position, -1 where there is none (never kept: there must
        be at least budget - window candidates that are there).
      t, prompt: [B] each row's next position and prompt length.
      q_mean: complex [N, F] and q_abs_mean [N, F]: the layer's statistics; query head h
        belongs to KV head h // (N / K).
      omega: [F] float32 the RoPE frequencies.
      kw: normalize, max_offset.
    """
    b_size, k_heads, n, _ = keys.shape
    g = q_mean.shape[0] // k_heads
    m = n - window
    out = np.zeros((b_size, k_heads, budget), np.int64)
    for b in range(b_size):
        for kv in range(k_heads):
            pos = np.asarray(positions[b, kv, :m])
            there = np.flatnonzero(pos >= 0)
            assert len(there) >= budget - window
            heads = slice(kv * g, (kv + 1) * g)
            s = kv_head_scores(
                keys[b, kv, there],
                pos[there],
                t[b],
                prompt[b],
                q_mean[heads],
                q_abs_mean[heads],
                omega,
                **kw,
            )
            in_prompt = pos[there] < prompt[b]
            order = sorted(
                range(len(there)),
                key=lambda i: (0, there[i]) if in_prompt[i] else (1, -s[i], there[i]),
            )
            chosen = sorted(there[i] for i in order[: budget - window])
            out[b, kv] = chosen + list(range(m, n))
    return out
