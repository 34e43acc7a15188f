"""Argument checks shared by configs, scores and kernels: each rule and its message, once."""

from __future__ import annotations

import numbers

import numpy as np


def check_int(name: str, value, low: int) -> None:
    """Raises ValueError unless value is an int (not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_number(name: str, value, low: float, high: float, what: str = "") -> None:
    """Raises ValueError unless value is a real number (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} {what}must be in [{low:g}, {high:g}], got {value}")


def check_kernel(kernel) -> None:
    """A max-pool width: a positive odd int (centred, stride 1)."""
    check_int("kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a centred max-pool), got {kernel}")


def check_cosine(name: str, value) -> None:
    check_number(name, value, -1.0, 1.0, "is a cosine and ")


def check_window(window, n: int | None = None) -> None:
    """The observation window: an int >= 1, at most the n keys when they are known."""
    check_int("window", window, 1)
    if n is not None and window > n:
        raise ValueError(f"window={window} is larger than the n={n} keys")


SHARES = ("none", "heads", "layers", "all")


def check_share(share) -> None:
    """Which kept sets a compression shares: "none" (one per layer and KV head), "heads" (one
    per layer, from the scores averaged over its KV heads), "layers" (one per KV head, from the
    scores summed over the layers) or "all" (one per row)."""
    if share not in SHARES:
        raise ValueError(f"share must be one of {', '.join(SHARES)}, got {share!r}")


def check_budget(budget, window, n: int | None = None) -> None:
    """Keys kept per (row, KV head), the window's included: window < budget (<= n)."""
    check_int("budget", budget, 1)
    if budget <= window:
        raise ValueError(
            f"budget={budget} must be larger than window={window}: the window's tokens are "
            "always kept, so a smaller budget leaves nothing to select"
        )
    if n is not None and budget > n:
        raise ValueError(f"budget={budget} is larger than the n={n} keys")


def check_redundancy(threshold, retain) -> None:
    """Key redundancy's hyperparameters (`scores.redundancy` and the Pallas kernel)."""
    check_cosine("threshold", threshold)
    check_int("retain", retain, 1)


def check_inputs(queries, keys, valid, *, window=None) -> None:
    """Shape checks of a compression step's inputs; None means "not given".

    Args:
      queries: [B, N, W, H] observation queries (or None).
      keys: [B, K, n, H] keys.
      valid: [B, K, n] bool (or None).
      window: W, when the caller states it (checked against the queries and n).
    """
    if keys.ndim != 4:
        raise ValueError(f"keys must be [B, K, n, H], got shape {keys.shape}")
    b, k, n, h = keys.shape
    if valid is not None:
        if valid.shape != (b, k, n):
            raise ValueError(f"valid must be [B, K, n] = {(b, k, n)}, got shape {valid.shape}")
        if valid.dtype != np.bool_:
            raise ValueError(f"valid must be bool, got {valid.dtype}")
    if queries is not None:
        if queries.ndim != 4:
            raise ValueError(f"queries must be [B, N, W, H], got shape {queries.shape}")
        if queries.shape[0] != b or queries.shape[3] != h:
            raise ValueError(
                f"queries {queries.shape} and keys {keys.shape} disagree on B or H "
                "(queries [B, N, W, H], keys [B, K, n, H])"
            )
        if queries.shape[1] % k:
            raise ValueError(
                f"query heads N={queries.shape[1]} must be a multiple of KV heads K={k} "
                f"(queries {queries.shape}, keys {keys.shape})"
            )
        if window is not None and queries.shape[2] != window:
            raise ValueError(
                f"queries {queries.shape} hold W={queries.shape[2]} observation queries, "
                f"but window={window}"
            )
        if queries.shape[2] > n:
            raise ValueError(
                f"queries {queries.shape} hold W={queries.shape[2]} observation queries, "
                f"more than the n={n} keys"
            )
    if window is not None:
        check_window(window, n)
