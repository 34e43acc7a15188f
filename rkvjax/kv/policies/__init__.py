"""Cache policies: which tokens a compression keeps. `names()` lists every registered method;
`build(name, **options)` makes one; `register` adds one (see `base`)."""

from __future__ import annotations

import dataclasses

from rkvjax.kv.policies import (
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
from rkvjax.kv.policies.base import (
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
from rkvjax.kv.policies.gkv import GKV
from rkvjax.kv.policies.h2o import H2O
from rkvjax.kv.policies.keydiff import KeyDiff
from rkvjax.kv.policies.random_eviction import Random
from rkvjax.kv.policies.rkv import RKV
from rkvjax.kv.policies.snapkv import SnapKV
from rkvjax.kv.policies.streaming import Streaming
from rkvjax.kv.policies.triattention import TriAttention

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
    "changed_options",
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


def resolve(method: str | Policy, *, foreign: str = "refuse", **options) -> Policy:
    """`method` as a `Policy`: a registered name with its options, or a Policy as it is.

    `foreign`: what R-KV's options do for a method without them: "refuse" one set to anything
    but R-KV's default (a cache setting that would be ignored), or "check" them as R-KV's and
    pass over them (the one-step functions, whose signature names them for every method)."""
    if isinstance(method, Policy):
        if options:
            raise ValueError(
                f"options {sorted(options)} given with a built policy {method!r}: "
                "set them on the policy"
            )
        return method
    own = option_names(method)
    if foreign not in ("refuse", "check"):
        raise ValueError(f"foreign must be 'refuse' or 'check', got {foreign!r}")
    return build(method, **_without_unused(options, own, method, refuse=foreign == "refuse"))


def check_unused(options: dict) -> None:
    """Options given to FullKV, which has none: R-KV's at their defaults are accepted (the
    public signatures name them), anything else refused."""
    extra = sorted(set(options) - set(RKV_OPTIONS))
    if extra:
        raise ValueError(f"method 'full' has no options, got {', '.join(extra)}")
    _without_unused(options, (), "full")


def changed_options(policy: Policy, options: dict) -> dict:
    """The `options` given to `policy`'s method whose values differ from its defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(policy)}
    return {k: v for k, v in options.items() if k in defaults and v != defaults[k]}


def _without_unused(options: dict, own, method: str, *, refuse: bool = True) -> dict:
    """`options` less R-KV's options that `method` does not take: those are checked as R-KV's
    and (`refuse`) must hold R-KV's defaults, or they would be silently ignored."""
    options = dict(options)
    foreign = {k: options.pop(k) for k in RKV_OPTIONS if k in options and k not in own}
    changed = changed_options(RKV(**foreign), foreign)  # checked, not used
    if changed and refuse:
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(changed.items()))
        takes = f"its options: {', '.join(own)}" if own else "it takes none"
        raise ValueError(
            f"method {method!r} does not use {given} (an R-KV option; {takes}): it would be ignored"
        )
    return options
