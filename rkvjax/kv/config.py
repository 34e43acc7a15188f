"""The KV cache's config (`CompressionConfig`): which policy, budget, buffer, window and storage
type a generation compiles with. Frozen and hashable, the static half of every jitted function."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rkvjax import checks
from rkvjax.defaults import ANSWER_SLOTS, BUFFER, SHARE, WINDOW
from rkvjax.kv import policies, quantization

# The built-in methods ("full" and the compressing ones); `method_names()` has every registered
# one, plug-ins included.
COMPRESSING_METHODS = policies.BUILTINS
METHODS = ("full", *COMPRESSING_METHODS)


def method_names() -> tuple[str, ...]:
    """Every method a cache takes: "full" and each registered policy."""
    return ("full", *policies.names())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """KV-cache policy of one generation (RKV_SPEC.md). Static: part of the compiled program.

    `policy` holds the method's hyperparameters (`rkvjax.kv.policies`); built from `method` with
    its defaults when not given."""

    method: str = "full"  # "full" or a registered policy's name
    budget: int = 0  # tokens kept per (layer, KV head, row) after a compression, window included
    buffer: int = BUFFER  # decoded tokens appended between compressions
    window: int = WINDOW  # W: its queries score the other tokens; its K/V are always kept
    policy: policies.Policy | None = None  # the method and its options (None for "full")
    share: str = SHARE  # kept sets per (layer, KV head), or shared: `checks.check_share`
    think_end_id: int | None = None  # stop compressing a row once it emits this token
    answer_slots: int = 0  # extra slots for the answer after think_end_id (think-only mode)
    pallas: bool | None = None  # Pallas kernels: None = auto (`scores.use_pallas`), or force
    # What the compression is compiled for (a `kernels.tuning.Target`): a runtime sets it from
    # its devices; None (a call of its own) reads the process's default device when traced.
    target: Any = None
    # The cache's storage type (`quantization.KV_DTYPES`; None: the model's dtype), for every
    # method: int8 and float8_e4m3fn keep a float32 scale per (token, head) beside the codes.
    kv_dtype: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "kv_dtype", quantization.check_kv_dtype(self.kv_dtype))
        if self.method == "full":
            if self.policy is not None:
                raise ValueError(f"method 'full' takes no policy, got {self.policy!r}")
            return
        if self.policy is None:
            object.__setattr__(self, "policy", policies.build(self.method))
        elif not isinstance(self.policy, policies.Policy) or self.policy.name != self.method:
            raise ValueError(f"policy {self.policy!r} is not method {self.method!r}")
        checks.check_int("window", self.window, 1)
        checks.check_budget(self.budget, self.window)
        checks.check_int("buffer", self.buffer, 1)
        checks.check_int("answer_slots", self.answer_slots, 0)
        checks.check_share(self.share)
        if self.pallas not in (None, True, False):
            raise ValueError(f"pallas must be None, True or False, got {self.pallas!r}")
        if self.answer_slots and self.think_end_id is None:
            raise ValueError("answer_slots only applies with think_end_id (think-only mode)")

    @property
    def compressing(self) -> bool:
        return self.method != "full"

    @property
    def state(self) -> str | None:
        """The per-key state the cache carries for the policy (`Policy.state`), or None."""
        return None if self.policy is None else self.policy.state

    @property
    def trigger(self) -> int:
        """Slots at which a (thinking) row is compressed back to `budget`."""
        return self.budget + self.buffer

    @property
    def capacity(self) -> int:
        """Static slots per (layer, KV head, row) of a compressing cache."""
        return self.budget + self.buffer + self.answer_slots


def check_context(cc: CompressionConfig, max_positions: int) -> None:
    """Refuses a compressing cache larger than the model's context: its rows could never fill,
    and each would hold (and allocate) that many slots for nothing."""
    if cc.compressing and cc.budget + cc.buffer > max_positions:
        fits = max_positions - cc.buffer
        hint = f"a budget of at most {fits} fits" if fits > cc.window else "use FullKV"
        raise ValueError(
            f"budget={cc.budget} + buffer={cc.buffer} cache slots exceed the model's context of "
            f"{max_positions} positions: no row ever holds that many tokens ({hint})"
        )


def compression_config(
    method: str = "rkv",
    budget: int | float | None = None,
    *,
    prompt_len: int = 0,
    max_new_tokens: int = 0,
    buffer: int = BUFFER,
    window: int = WINDOW,
    think_end_id: int | None = None,
    answer_slots: int | None = None,
    pallas: bool | None = None,
    share: str = SHARE,
    kv_dtype: str | None = None,
    **options,
) -> CompressionConfig:
    """The one place user-facing cache settings become a validated `CompressionConfig`.

    `budget=None` or `method="full"` means FullKV. A float budget in (0, 1] is a fraction of
    `prompt_len + max_new_tokens` (the longest prompt and longest generation of a run),
    rounded, and at least `window + 1`. `options` are the method's hyperparameters (R-KV's
    kernel, lam, threshold, retain; `rkvjax.kv.policies.option_names(method)`): checked even when
    the cache is FullKV; R-KV's are taken for every method (the public signature names them)
    and checked as R-KV's. `kv_dtype` is the cache's storage type for every method, FullKV
    included: "float32", "bfloat16", "int8" or "float8_e4m3fn" (None: the model's dtype).

    Raises:
      ValueError: naming the first bad setting.
    """
    if method not in method_names():
        raise ValueError(f"method must be one of {method_names()}, got {method!r}")
    checks.check_share(share)
    kv_dtype = quantization.check_kv_dtype(kv_dtype)
    if method == "full":
        policies.check_unused(options)
        policy = None
    else:
        policy = policies.resolve(method, **options)
    if budget is None and policy is not None:
        changed = policies.changed_options(policy, options)
        if changed:
            given = ", ".join(f"{k}={v!r}" for k, v in sorted(changed.items()))
            raise ValueError(
                f"{given} would be ignored: without a budget the cache is FullKV, which never "
                f"compresses; give {method!r} a budget"
            )
    if budget is None or method == "full":
        return CompressionConfig(method="full", kv_dtype=kv_dtype)
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise ValueError(f"budget must be an int (tokens) or a float in (0, 1], got {budget!r}")
    if isinstance(budget, (float, np.floating)):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a float budget is a fraction in (0, 1], got {budget}")
        if prompt_len + max_new_tokens < 1:
            raise ValueError("a fractional budget needs the prompt and generation lengths")
        budget = max(round(budget * (prompt_len + max_new_tokens)), window + 1)
    if think_end_id is None and answer_slots:
        raise ValueError("answer_slots needs think_end_id (think-only mode)")
    return CompressionConfig(
        method=method,
        budget=int(budget),
        buffer=buffer,
        window=window,
        policy=policy,
        share=share,
        think_end_id=think_end_id,
        answer_slots=(ANSWER_SLOTS if answer_slots is None else answer_slots)
        if think_end_id is not None
        else 0,
        pallas=pallas,
        kv_dtype=kv_dtype,
    )
