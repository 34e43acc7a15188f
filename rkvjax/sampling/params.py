"""One request's sampling settings (`SamplingParams`): vLLM's fields, names, defaults and checks.

No JAX here: requests are prepared, validated and scheduled without it (`rkvjax.sampling.sampler`
turns them into each slot's arrays and samples).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it means greedy
MAX_TEMPERATURE = 2.0  # vLLM rejects temperatures above 2
MAX_SEED = 2**32 - 1  # seeds are uint32 in the slot arrays


def is_int(value: Any) -> bool:
    # bool is an int subclass in Python, but True as a count or a seed is a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _int_field(name: str, value: Any, lo: int, hi: int | None = None, what: str = "") -> int:
    bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int {bound}{what}, got {value!r}")
    return int(value)


def _float_field(name: str, value: Any, ok, bound: str) -> float:
    if not _is_real(value) or not math.isfinite(value) or not ok(float(value)):
        raise ValueError(f"{name} must be a finite float {bound}, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's sampling settings: vLLM's `SamplingParams` fields, names and defaults.

    Validation follows vLLM's `_verify_args` (ranges, and the same normalisations: `top_k=-1`
    and `seed=-1` mean off, `stop_token_ids` drops duplicates, and a greedy request has its
    top-p, top-k and min-p switched off). Two differences: vLLM raises a temperature in
    (0, 0.01) to 0.01, where this keeps it (float32 sampling at any temperature >= 1e-5 is
    stable here, as the logits' maximum is subtracted before anything is exponentiated); and a
    greedy request may ask for n > 1 (identical) samples, which share one prefill.

    Attributes:
      n: samples to make from the prompt, >= 1.
      temperature: in [0, 2]; below 1e-5 (0 in practice) is greedy.
      top_p: in (0, 1]: keep the most likely tokens whose mass reaches top_p; 1 = off.
      top_k: keep the k most likely tokens (ties at the k-th kept); 0 or -1 = off.
      min_p: in [0, 1]: drop tokens less likely than min_p x the most likely one; 0 = off.
      repetition_penalty: > 0, on tokens in the prompt or the output; 1 = off.
      presence_penalty: in [-2, 2], subtracted from tokens present in the output.
      frequency_penalty: in [-2, 2], times each token's count in the output.
      seed: in [0, 2**32 - 1], or None for a fresh random seed (-1 = None).
      max_tokens: tokens to make at most, >= 1. vLLM's default is 16; ours (256) is the engine's
        default length.
      min_tokens: in [0, max_tokens]: the stop tokens are blocked until this many were made.
      stop: strings that end the output (a str or a list; kept as a tuple).
      stop_token_ids: token ids that end the output, besides EOS (kept as a tuple).
      ignore_eos: keep going past EOS.
      logprobs: None = off; N >= 0 = the chosen token's logprob and the N most likely ones.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        fields = _validated(self)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (vLLM's `SamplingType.GREEDY`)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the three penalties is on (they need the per-slot token counts)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def min_tokens_stop_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens `min_tokens` blocks: `stop_token_ids` and EOS, even with `ignore_eos`
        (vLLM's `all_stop_token_ids`).

        Args:
          eos_token_ids: the model's EOS ids.

        Returns:
          The ids, without duplicates.
        """
        return tuple(dict.fromkeys((*self.stop_token_ids, *map(int, eos_token_ids))))

    def stopping_token_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens that end the output: `stop_token_ids`, and EOS unless `ignore_eos`.

        Args:
          eos_token_ids: the model's EOS ids.

        Returns:
          The ids, without duplicates.
        """
        eos = () if self.ignore_eos else tuple(map(int, eos_token_ids))
        return tuple(dict.fromkeys((*self.stop_token_ids, *eos)))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON types (tuples as lists); `SamplingParams(**d)` rebuilds it."""
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, validated again.

        Args:
          **changes: field values to change.

        Returns:
          The new SamplingParams.
        """
        return dataclasses.replace(self, **changes)


def _validated(p: SamplingParams) -> dict[str, Any]:
    """The normalised field values of `p`, or a ValueError naming the first bad field."""
    v: dict[str, Any] = {}
    v["n"] = _int_field("n", p.n, 1)
    v["temperature"] = _float_field(
        "temperature", p.temperature, lambda t: 0.0 <= t <= MAX_TEMPERATURE, "in [0, 2]"
    )
    v["top_p"] = _float_field("top_p", p.top_p, lambda t: 0.0 < t <= 1.0, "in (0, 1]")
    if not is_int(p.top_k) or p.top_k < -1:
        raise ValueError(f"top_k must be an int >= 1, or 0 or -1 for off, got {p.top_k!r}")
    v["top_k"] = max(int(p.top_k), 0)
    v["min_p"] = _float_field("min_p", p.min_p, lambda t: 0.0 <= t <= 1.0, "in [0, 1]")
    v["repetition_penalty"] = _float_field(
        "repetition_penalty", p.repetition_penalty, lambda t: t > 0.0, "> 0"
    )
    for name in ("presence_penalty", "frequency_penalty"):
        v[name] = _float_field(name, getattr(p, name), lambda t: -2.0 <= t <= 2.0, "in [-2, 2]")
    if p.seed is None or (is_int(p.seed) and p.seed == -1):
        v["seed"] = None
    else:
        v["seed"] = _int_field("seed", p.seed, 0, MAX_SEED, " or None")
    v["max_tokens"] = _int_field("max_tokens", p.max_tokens, 1)
    v["min_tokens"] = _int_field(
        "min_tokens", p.min_tokens, 0, v["max_tokens"], " (at most max_tokens)"
    )
    stop = (p.stop,) if isinstance(p.stop, str) else p.stop
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a str or a list of non-empty str, got {p.stop!r}")
    v["stop"] = tuple(stop)
    ids = p.stop_token_ids
    if (
        isinstance(ids, str)
        or not isinstance(ids, Sequence | np.ndarray)
        or not all(is_int(t) and t >= 0 for t in ids)
    ):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    v["stop_token_ids"] = tuple(dict.fromkeys(int(t) for t in ids))
    if not isinstance(p.ignore_eos, bool | np.bool_):
        raise ValueError(f"ignore_eos must be a bool, got {p.ignore_eos!r}")
    v["ignore_eos"] = bool(p.ignore_eos)
    if p.logprobs is not None and (not is_int(p.logprobs) or p.logprobs < 0):
        raise ValueError(f"logprobs must be None or an int >= 0, got {p.logprobs!r}")
    v["logprobs"] = None if p.logprobs is None else int(p.logprobs)
    if v["temperature"] < SAMPLING_EPS:
        # vLLM switches the filters off for greedy requests, so equal requests compare equal.
        v.update(top_p=1.0, top_k=0, min_p=0.0)
    return v
