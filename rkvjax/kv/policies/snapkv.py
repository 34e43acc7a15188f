"""SnapKV: the candidates the window's queries attend to most (R-KV's importance alone)."""

from __future__ import annotations

import dataclasses

from rkvjax import checks, defaults
from rkvjax.kv import scores
from rkvjax.kv.policies.base import Policy, register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(Policy):
    """SnapKV at decode time: attention of the window's queries, group-max over GQA, averaged
    over the window and max-pooled (RKV_SPEC.md step 1)."""

    name = "snapkv"
    kernel: int = defaults.KERNEL  # max-pool width (odd)

    def check(self) -> None:
        checks.check_kernel(self.kernel)

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        return scores.importance(queries, keys, valid, kernel=self.kernel)
