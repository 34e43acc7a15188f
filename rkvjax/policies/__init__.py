"""Cache policies: which tokens a compression keeps. `names()` lists every registered method;
`build(name, **options)` makes one; `register` adds one (see `base`)."""

from __future__ import annotations

from rkvjax.policies import (
    base,
    gkv,
    h2o,
    keydiff,
    random_eviction,
    rkv,
    snapkv,
    streaming,
    triattention,
)
from rkvjax.policies.base import (
    ENTRY_POINT_GROUP,
    PLUGINS_ENV,
    STATES,
    Context,
    Policy,
    build,
    get,
    names,
    option_names,
    parse_options,
    register,
    unregister,
)
from rkvjax.policies.gkv import GKV
from rkvjax.policies.h2o import H2O
from rkvjax.policies.keydiff import KeyDiff
from rkvjax.policies.random_eviction import Random
from rkvjax.policies.rkv import RKV
from rkvjax.policies.snapkv import SnapKV
from rkvjax.policies.streaming import Streaming
from rkvjax.policies.triattention import TriAttention

# R-KV first, then the paper's baselines, then the others (how help and errors list them).
BUILTINS = base.put_first(
    ("rkv", "snapkv", "streaming", "keydiff", "h2o", "gkv", "triattention", "random")
)

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "GKV",
    "H2O",
    "PLUGINS_ENV",
    "RKV",
    "RKV_OPTIONS",
    "STATES",
    "Context",
    "KeyDiff",
    "Policy",
    "Random",
    "SnapKV",
    "Streaming",
    "TriAttention",
    "build",
    "check_unused",
    "get",
    "gkv",
    "h2o",
    "keydiff",
    "names",
    "option_names",
    "parse_options",
    "random_eviction",
    "register",
    "resolve",
    "rkv",
    "snapkv",
    "streaming",
    "triattention",
    "unregister",
]

# The public signatures (`generate`, `compression_config`, `keep_indices`) name R-KV's options
# for every method, as they did before methods were plug-ins: a method without them checks them
# as R-KV would and does not use them.
RKV_OPTIONS = ("kernel", "lam", "threshold", "retain")


def resolve(method: str | Policy, **options) -> Policy:
    """`method` as a `Policy`: a registered name with its options, or a Policy as it is."""
    if isinstance(method, Policy):
        if options:
            raise ValueError(
                f"options {sorted(options)} given with a built policy {method!r}: "
                "set them on the policy"
            )
        return method
    own = option_names(method)
    return build(method, **_without_unused(options, own))


def check_unused(options: dict) -> None:
    """Options given to FullKV, which has none: R-KV's are checked, anything else refused."""
    extra = sorted(set(options) - set(RKV_OPTIONS))
    if extra:
        raise ValueError(f"method 'full' has no options, got {', '.join(extra)}")
    _without_unused(options, ())


def _without_unused(options: dict, own) -> dict:
    options = dict(options)
    foreign = {k: options.pop(k) for k in RKV_OPTIONS if k in options and k not in own}
    RKV(**foreign)  # checked, not used
    return options
