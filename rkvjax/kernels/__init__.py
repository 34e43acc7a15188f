"""Pallas kernels for the R-KV hot spots, and the switch between them and their jnp references.

Each kernel file holds `_validate`, the `_kernel` bodies, a jitted wrapper (tiles and
`interpret` static) and `<name>_reference`, the pure-jnp specification. The dispatchers here
take `impl` (see `use_pallas`) and are drop-ins for the jnp path of `rkvjax.compression`.

Note: the function `redundancy` below shadows the submodule of the same name as an attribute
of this package; import the kernel module's names with
`from rkvjax.kernels.redundancy import redundancy_reference` (which always works).
"""

from __future__ import annotations

import jax.numpy as jnp

from rkvjax.kernels import tuning
from rkvjax.kernels.redundancy import redundancy as redundancy_pallas
from rkvjax.kernels.redundancy import redundancy_reference
from rkvjax.kernels.topk import topk_positions as topk_pallas
from rkvjax.kernels.topk import topk_reference

__all__ = [
    "redundancy",
    "redundancy_pallas",
    "redundancy_reference",
    "topk_pallas",
    "topk_positions",
    "topk_reference",
    "use_pallas",
]


def use_pallas(flag: bool | None = None, *, dense_bytes: int = 0) -> bool:
    """Whether to run a Pallas kernel instead of its jnp path.

    Auto picks a kernel only where it pays. On an H200 the redundancy kernel was 26-40x slower
    than XLA's fused jnp path at n = 1K-4K (`bench/kernel_redundancy.py`) while holding O(n)
    instead of O(n^2) bytes, so it is the path for inputs whose dense similarity matrix would
    take a large share of device memory (long-prompt prefill), and jnp serves the rest,
    decode-time compressions over budget + buffer slots included. On CPU Pallas only
    interprets, so auto never picks it there.

    Args:
      flag: None for auto; True forces Pallas (interpreted on CPU); False forces jnp.
      dense_bytes: bytes the jnp path's dense intermediate would take (0 for paths without
        one, where auto keeps jnp).
    """
    if flag is None:
        return tuning.backend() != "cpu" and dense_bytes > tuning.dense_limit_bytes()
    if not isinstance(flag, bool):
        raise ValueError(f"impl must be True, False or None, got {flag!r}")
    return flag


def _interpret() -> bool:
    # Only GPU (Triton) and TPU (Mosaic) compile Pallas; anything else interprets.
    return tuning.backend() == "cpu"


def redundancy(keys, valid, *, window=8, threshold=0.5, retain=1, impl: bool | None = None):
    """The R-KV redundancy score on the backend that `use_pallas(impl)` picks: the fused kernel,
    or the engine's jnp path `rkvjax.compression.redundancy` (not this file's reference: the
    engine keeps one jnp implementation, the reference is the kernel's test oracle).

    Args:
      keys: [B, K, n, H] post-RoPE keys.
      valid: [B, K, n] bool (None: all valid).
      window: trailing observation keys, not returned.
      threshold: cosine match threshold in [-1, 1].
      retain: newest matches per row not counted.
      impl: None (auto: the kernel only when the jnp path's n x n matrix would be large),
        True (Pallas) or False (jnp); see `use_pallas`.

    Returns:
      float32 [B, K, n - window].
    """
    kw = dict(window=window, threshold=threshold, retain=retain)
    b, k, n, _ = keys.shape
    if use_pallas(impl, dense_bytes=b * k * n * n * 4):  # the float32 [B, K, n, n] similarity
        return redundancy_pallas(keys, valid, **kw, interpret=_interpret())
    from rkvjax import compression  # deferred: compression imports this package

    if valid is None:
        valid = jnp.ones(keys.shape[:3], bool)
    return compression.redundancy(keys, valid, **kw)


def topk_positions(scores, k, *, impl: bool | None = None):
    """`jnp.sort(lax.top_k(scores, k)[1], -1)` on the backend that `use_pallas(impl)` picks.

    Args:
      scores: [B, K, m] float scores, -inf for invalid candidates.
      k: static number kept, 1 <= k <= m.
      impl: None (auto: jnp, as `lax.top_k` holds no large intermediate), True (Pallas) or
        False (jnp); see `use_pallas`.

    Returns:
      int32 [B, K, k] ascending positions (ties towards the lower position).
    """
    if use_pallas(impl):
        return topk_pallas(scores, k, interpret=_interpret())
    return topk_reference(scores, k)
