"""The host's record of one sample: what the scheduler places (its row), what the output
processor fills (its tokens and counters), and what the engine turns into a result."""

from __future__ import annotations

import dataclasses

import numpy as np

from rkvjax.runtime.requests import Request
from rkvjax.text.detokenize import StopWatcher, TextStream


@dataclasses.dataclass(eq=False)
class Sample:
    """One sample of one request, from submission to its result.

    Compared by identity: a row of the device state names the Sample it holds.
    """

    request: Request
    index: int  # which of the request's n samples (its sampling key depends on it)
    submitted: float  # perf_counter at submission
    compile_at_submit: float  # the engine's compile seconds then (time to first token less them)
    watcher: StopWatcher | None  # stop strings, when the request has them
    text: TextStream | None = None  # a streamed sample's text as it comes (`StreamDelta`)
    row: int | None = None  # its row of the device state while it has one (the scheduler's)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_ids: list[np.ndarray] = dataclasses.field(default_factory=list)  # [n, N] per chunk
    top_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)  # [n, N]
    top1: list[int] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    dists: list[np.ndarray] = dataclasses.field(default_factory=list)
    kept: list[np.ndarray] = dataclasses.field(default_factory=list)
    compressions: int = 0
    peak: int = 0
    stalls: int = 0
    ttft: float | None = None
    reason: str | None = None  # set once finished ("abort": `Engine.abort`)
    unsent: str = ""  # streamed text not yet in a delta
    sent: int = 0  # tokens in deltas so far
    sent_tops: int = 0  # blocks of top_ids / top_logprobs in deltas so far

    @property
    def finished(self) -> bool:
        return self.reason is not None


@dataclasses.dataclass(eq=False)
class Pending:
    """A queued request's samples not yet in a row, and its prefilled group once it has one
    (kept while some of its samples wait for rows)."""

    samples: list[Sample]
    group: int | None = None  # the executor's id of the prefilled group
    src: int = 0  # the request's row in that group
