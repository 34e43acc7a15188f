"""What a run returns: per-sample results and their stats, teacher-forced scores, run stats."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Per-sample numbers; the fields marked "run" describe the whole run it was part of."""

    prompt_tokens: int
    generated_tokens: int
    method: str
    budget: int | None
    compressions: int  # the prompt's compression included
    cache_capacity: int  # slots per (layer, KV head, row)
    peak_cache_slots: int  # most slots this sample's row held at once
    stalled_steps: int  # decode steps this sample waited for a compression lane
    batch_size: int  # run: rows decoded together at most (slots in use)
    time_to_first_token_s: float  # from submission to the first token, compilation excluded
    decode_s: float  # run: wall time, compilation excluded
    tokens_per_s: float  # run: generated tokens / decode_s
    compile_s: float  # run: compilation during the run (0 once shapes have been seen)
    kv_dtype: str | None = None  # run: what the cache stored (float32, bfloat16, int8, ...)
    batch_invariant: bool = False  # run: numbers independent of the batch (`Engine`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """One sample of one prompt."""

    text: str
    token_ids: list[int]  # generated ids, the stop token included
    finish_reason: str  # "stop" (stop token or string) or "length"
    stats: GenerationStats
    prompt_token_ids: list[int]
    # With record_kept: [E, L, K, budget] int32 logical positions each compression kept per
    # (layer, KV head), -1 for an empty slot; E = compressions run (the prompt's first).
    kept_positions: np.ndarray | None = None
    request_id: Any = None
    sample_index: int = 0
    # With logprobs=N: the log-probability of each generated token, and its N most likely
    # alternatives as (token id, log-probability), most likely first.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stats"] = self.stats.to_dict()
        if self.kept_positions is not None:
            d["kept_positions"] = self.kept_positions.tolist()
        return d


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one streamed sample made since its last delta (`Engine.submit(..., stream=True)`,
    `Engine.take_deltas`): its deltas' texts concatenate to its result's text, their token ids
    (and logprobs) to its result's."""

    request_id: Any
    sample_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # with logprobs=N, as in GenerationResult
    top_logprobs: list[list[tuple[int, float]]] | None = None
    result: GenerationResult | None = None  # the sample's result, on its last delta

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Teacher-forced log-probabilities of a continuation under a cache policy."""

    logprobs: np.ndarray  # [T] log p(token_t | everything before, as the cache kept it)
    top1: np.ndarray  # [T] int32 the model's argmax prediction at each step
    dists: np.ndarray | None  # [T, V] log-probabilities at each step, with return_dists
    compressions: int
    peak_cache_slots: int
    request_id: Any = None
    # With SamplingParams(logprobs=N) on an Engine(teacher=True, logprobs>=N): the N most
    # likely tokens at each step, most likely first ([T, N]; None otherwise).
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None  # [T] int32 each scored token's rank (1: the argmax)


@dataclasses.dataclass(frozen=True)
class RunStats:
    """Counters of one runtime run (`Engine.stats`)."""

    slots: int
    lanes: int  # compression lanes per step and data shard
    requests: int
    samples: int
    prefills: int  # prefill calls
    prefill_rows: int  # prompts prefilled (a prompt's n samples share one)
    prompt_tokens: int
    generated_tokens: int
    decode_steps: int
    slot_occupancy: float  # busy row-steps / (slots x decode steps)
    decoded_row_steps: int  # rows decoded x steps: below slots x decode_steps once narrowed
    narrowings: int  # times the tail moved to a narrower batch (`Engine(narrow_tail=)`)
    widenings: int  # times waiting requests moved a narrowed batch into a wider one
    compressions: int  # decode-time compressions (prompt compressions excluded)
    rows_compressed_per_step: float  # compressions / decode steps
    stalled_row_steps: int  # row-steps spent waiting for a compression lane
    wall_s: float
    compile_s: float  # this engine's own compilation during the run
    tokens_per_s: float  # generated tokens / (wall_s - compile_s)
    compiled_programs: int = 0  # programs this engine compiled (its lifetime)
    aborted: int = 0  # requests stopped by `Engine.abort` (their tokens are not counted)
    decoded_tokens: int = 0  # tokens the rows made so far, running samples' included
    prompt_compressions: int = 0  # prompts longer than the budget, compressed at prefill

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
