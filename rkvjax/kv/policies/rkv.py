"""R-KV (RKV_SPEC.md): attention importance, less key redundancy."""

from __future__ import annotations

import dataclasses

from rkvjax import checks, defaults
from rkvjax.kv import scores
from rkvjax.kv.policies.base import Policy, register


def rkv_scores(
    queries,
    keys,
    valid,
    *,
    kernel=defaults.KERNEL,
    lam=defaults.LAM,
    threshold=defaults.THRESHOLD,
    retain=defaults.RETAIN,
    impl=None,
    target=None,
):
    """Joint R-KV score `lam * I - (1 - lam) * R` of the candidates (RKV_SPEC.md step 3).

    Args:
      queries: [B, N, W, H] see `scores.importance`.
      keys: [B, K, n, H] see `scores.importance`.
      valid: [B, K, n] bool see `scores.importance` and `scores.redundancy`.
      kernel: importance max-pool width.
      lam: weight of importance against redundancy, in [0, 1].
      threshold: redundancy cosine threshold.
      retain: redundancy matches not counted per row.
      impl: redundancy on the fused Pallas kernel (True), jnp (False), or auto (None); see
        `scores.use_pallas`.
      target: the `tuning.Target` it runs on (default: the process's default device).

    Returns:
      float32 [B, K, n - W]; higher is kept first. 0 at invalid candidates.
    """
    checks.check_number("lam", lam, 0.0, 1.0)
    w = queries.shape[2]
    i = scores.importance(queries, keys, valid, kernel=kernel)  # [B, K, n-W]
    r = scores.redundancy_scores(
        keys, valid, window=w, threshold=threshold, retain=retain, impl=impl, target=target
    )  # [B, K, n-W]
    return lam * i - (1 - lam) * r


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class RKV(Policy):
    """R-KV: keeps tokens that are attended to (importance, as SnapKV) and not redundant (the
    mean cosine similarity of a key to the others, less its newest `retain` copies)."""

    name = "rkv"
    kernel: int = defaults.KERNEL  # importance max-pool width (odd)
    lam: float = defaults.LAM  # importance weight against redundancy, in [0, 1]
    threshold: float = defaults.THRESHOLD  # cosine above which two keys match
    retain: int = defaults.RETAIN  # newest matches of a key that are not counted

    def check(self) -> None:
        checks.check_kernel(self.kernel)
        checks.check_number("lam", self.lam, 0.0, 1.0)
        checks.check_redundancy(self.threshold, self.retain)

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        return rkv_scores(
            queries,
            keys,
            valid,
            kernel=self.kernel,
            lam=self.lam,
            threshold=self.threshold,
            retain=self.retain,
            impl=impl,
            target=target,
        )
