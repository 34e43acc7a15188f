"""Independent NumPy reference for per-request sampling, written from vLLM's definitions.

Sort-based and in float64, one row at a time: nothing here shares code or method with
rkvjax/sampling/sampler.py (which searches thresholds without sorting). Definitions:

- penalties (`vllm/model_executor/layers/utils.py` `apply_penalties`): the repetition penalty on
  tokens in the prompt or the output (logit > 0: divided by it, else multiplied), then
  `- frequency_penalty * count` and `- presence_penalty * (count > 0)` over the output;
- min_p (`MinPLogitsProcessor`): drop tokens with probability < min_p * the largest probability;
- top-k / top-p (`apply_top_k_top_p_pytorch`): sort ascending; top-k drops what is below the k-th
  largest; top-p drops the tokens whose ascending cumulative probability is <= 1 - p, but never the
  last (the most likely); tokens tied with the least likely survivor are kept too (the threshold
  rule of vLLM's `apply_top_k_only`, where a sort would split a tie arbitrarily);
- order (`vllm/v1/sample/sampler.py`): temperature (a float32 division, as vLLM divides the float32
  logits), min_p, top-k, top-p.
"""

from __future__ import annotations

import numpy as np


def softmax(x):
    """x [V] (may hold -inf) -> float64 [V]."""
    x = np.asarray(x, np.float64)
    e = np.exp(x - np.max(x))  # [V]
    return e / np.sum(e)


def log_softmax(x):
    """x [B, V] -> float64 [B, V]."""
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)  # [B, 1]
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def apply_penalties(logits, output_counts, prompt_mask, repetition, presence, frequency):
    """logits [B, V], output_counts [B, V] int, prompt_mask [B, V] bool (or None), the three
    penalties [B] -> float64 [B, V]."""
    out = np.array(logits, np.float64)  # [B, V]
    for b in range(out.shape[0]):
        counts = np.asarray(output_counts[b])  # [V]
        in_output = counts > 0  # [V]
        seen = in_output if prompt_mask is None else in_output | np.asarray(prompt_mask[b])
        row = out[b]  # [V]
        pen = np.where(seen, float(repetition[b]), 1.0)  # [V]
        row = np.where(row > 0, row / pen, row * pen)
        row = row - float(frequency[b]) * counts
        row = row - float(presence[b]) * in_output
        out[b] = row
    return out


def scale(logits, temperature):
    """[V] float32 logits / temperature, in float32 (greedy rows: / 1)."""
    t = np.float32(1.0 if temperature < 1e-5 else temperature)
    return np.asarray(logits, np.float32) / t


def min_p_keep(x, min_p):
    """[V] bool: tokens min_p keeps."""
    probs = softmax(x)  # [V]
    return ~(probs < min_p * np.max(probs))


def min_p_margin(x, min_p):
    """How close the nearest token comes to min_p's boundary, as |log(p / p_max) - log(min_p)|
    (the log-space distance: float32 logits carry an absolute error)."""
    x = np.asarray(x, np.float64)
    below_max = np.isfinite(x) & (x < np.max(x))  # the maximum and its ties always stay
    return float(np.min(np.abs(x[below_max] - np.max(x) - np.log(min_p)), initial=np.inf))


def top_k_keep(x, k):
    """[V] bool: tokens top-k keeps (all when k is 0 or >= V)."""
    x = np.asarray(x, np.float64)
    if k <= 0 or k >= x.size:
        return np.ones(x.size, bool)
    kth = np.sort(x)[::-1][k - 1]
    return x >= kth


def top_p_keep(x, p):
    """[V] bool: tokens top-p keeps, vLLM's sort-based rule with ties at the boundary kept."""
    x = np.asarray(x, np.float64)
    if p >= 1.0:
        return np.ones(x.size, bool)
    probs = softmax(x)  # [V]
    order = np.argsort(x, kind="stable")  # [V] least likely first
    cum = np.cumsum(probs[order])  # [V]
    drop = cum <= 1.0 - p  # [V]
    drop[-1] = False
    keep = np.zeros(x.size, bool)
    keep[order[~drop]] = True
    return x >= np.min(x[keep])


def top_p_margin(x, p):
    """How close the mass at or below each distinct value comes to 1 - p (inf when p is 1).

    A tie group is kept or dropped whole, so only the cumulative mass at the groups' edges
    decides anything.
    """
    if p >= 1.0:
        return np.inf
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")  # [V] ascending
    ascending = x[order]  # [V]
    below = np.cumsum(softmax(x)[order])  # [V] mass at or below each position
    # the last of each tie group; the top group is always kept, so it decides nothing
    group_end = np.append(ascending[1:] != ascending[:-1], False)  # [V]
    return float(np.min(np.abs(below[group_end] - (1.0 - p)), initial=np.inf))


def filter_row(logits, *, temperature=1.0, min_p=0.0, top_k=0, top_p=1.0):
    """One row through temperature, min_p, top-k, top-p.

    Returns:
      (filtered [V] float64 with dropped tokens at -inf, margin): margin is the smallest distance
      of a float decision to its boundary (min_p's or top-p's), to skip rows float32 can't settle.
    """
    x = scale(logits, temperature).astype(np.float64)  # [V]
    margin = np.inf
    if min_p > 0.0:
        margin = min(margin, min_p_margin(x, min_p))
        x = np.where(min_p_keep(x, min_p), x, -np.inf)
    x = np.where(top_k_keep(x, top_k), x, -np.inf)
    if top_p < 1.0:
        margin = min(margin, top_p_margin(x, top_p))
        x = np.where(top_p_keep(x, top_p), x, -np.inf)
    return x, margin


def apply_min_tokens(logits, min_tokens, num_generated, stop_ids):
    """logits [B, V], min_tokens [B], num_generated [B], stop_ids: a list of id lists ->
    float64 [B, V] with the stop ids at -inf in rows below min_tokens."""
    out = np.array(logits, np.float64)  # [B, V]
    for b, ids in enumerate(stop_ids):
        if num_generated[b] < min_tokens[b]:
            out[b, list(ids)] = -np.inf
    return out
