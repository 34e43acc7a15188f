"""Device outcomes into samples: each row's new tokens, stop strings, the finished samples, and
their results.

The output processor reads a fetched (NumPy) `programs.Tokens` of an insert or a decode chunk
and the samples its rows held when it was dispatched (a chunk in flight still parses after the
state narrowed: it names its samples). It appends each row's tokens to its sample (a stop string
is looked for in the new text only, each token decoded once: `detokenize.StopWatcher`), and
returns the samples that finished, and whether the device still runs them. It frees nothing:
the engine tells the scheduler. Results are built from a sample and the run's numbers, which
the engine passes (`RunInfo`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rkvjax.runtime import programs
from rkvjax.runtime.results import GenerationResult, GenerationStats, ScoreResult, StreamDelta
from rkvjax.runtime.samples import Sample
from rkvjax.text.detokenize import find_stop


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a result reports about the run it was part of."""

    method: str
    budget: int | None
    kv_dtype: str  # what the cache stores
    batch_invariant: bool  # every row's numbers independent of the others'
    capacity: int  # cache slots per (layer, KV head, row)
    batch_size: int  # rows decoded together at most
    decode_s: float
    tokens_per_s: float
    compile_s: float


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the host learnt from one device output."""

    finished: list[tuple[Sample, bool]]  # (sample, the device still runs its row)
    streamed: list[Sample] = dataclasses.field(default_factory=list)  # unfinished, new tokens
    tokens: int = 0  # tokens the samples took
    steps: int = 0  # decode steps (chunks only)
    row_steps: int = 0  # rows decoded x steps
    busy: int = 0  # active row-steps
    fired: int = 0  # compressions run
    stalled: int = 0  # row-steps that waited for a compression lane


class OutputProcessor:
    """Turns device outcomes into samples' tokens and results (see the module docstring).

    Args:
      tokenizer: the model's tokenizer (None: results have no text).
      kept_shape: (L, K, budget) of a recorded compression's kept positions, or None when
        compressions are not recorded.
    """

    def __init__(self, tokenizer, *, kept_shape: tuple[int, int, int] | None):
        self.tokenizer = tokenizer
        self.kept_shape = kept_shape

    def inserted(
        self, out: programs.Tokens, kept, src, samples, *, now: float, compile_s: float
    ) -> Outcome:
        """An insert's first tokens (fetched), for `samples` in its row order; `kept` [k, L, K,
        budget] what the group's prefill compression kept (recorded runs); `now` and
        `compile_s` the engine's clock and compile seconds, for the time to first token."""
        finished, streamed, taken = [], [], 0
        for r, s in enumerate(samples):
            if s.finished:  # aborted while its insert ran
                continue
            s.ttft = (now - s.submitted) - (compile_s - s.compile_at_submit)
            s.compressions = int(out.compressions[r])
            s.peak = int(out.peak[r])
            if kept is not None and s.compressions:
                s.kept.append(kept[src[r]])
            taken += self._take(s, out, r)
            if not out.active[r] and not s.finished:
                self._finish(s, out, r)
            if s.finished:
                finished.append((s, bool(out.active[r])))
            elif s.text is not None and s.tokens:
                streamed.append(s)
        return Outcome(finished, streamed, taken)

    def chunk(self, out: programs.Tokens, owners: list[Sample | None]) -> Outcome:
        """A decode chunk (fetched), whose rows held `owners` when it was dispatched."""
        steps = int(out.steps)
        live = [s is not None and not s.finished for s in owners]  # before this chunk's tokens
        rows = np.flatnonzero(live).tolist()
        peak, stalls = out.peak.tolist(), out.stalls.tolist()
        taken = 0
        for b in rows:  # a row waiting for a lane makes no token, but its counters move
            s = owners[b]
            s.peak, s.stalls = peak[b], stalls[b]
            taken += self._take(s, out, b)
        for t, lane in zip(*np.nonzero(out.kept_rows[:steps] < len(owners)), strict=True):
            row = int(out.kept_rows[t, lane])  # compressions in step order
            # A row cut by a stop string may compress again before the device stops it: only
            # compressions before its last kept token are the sample's.
            if live[row] and out.kept_num[t, lane] < len(owners[row].tokens):
                owners[row].compressions += 1
                if out.kept.shape[1]:
                    owners[row].kept.append(out.kept[t, lane])
        finished, streamed = [], []
        for b in rows:
            s = owners[b]
            if not out.active[b] and not s.finished:
                self._finish(s, out, b)
            if s.finished:
                finished.append((s, bool(out.active[b])))
            elif s.text is not None and len(s.tokens) > s.sent:
                streamed.append(s)
        return Outcome(
            finished,
            streamed,
            taken,
            steps=steps,
            row_steps=steps * len(owners),
            busy=int(out.busy),
            fired=int(out.fired),
            stalled=int(out.stalled),
        )

    def _take(self, s: Sample, out: programs.Tokens, b: int) -> int:
        """Appends row b's new tokens to sample s, ending it at a stop string; returns how
        many it took."""
        n = int(out.count[b])
        if not n:
            return 0
        cut = s.watcher.push(out.tokens[b, :n]) if s.watcher is not None else None
        if cut is not None:  # a stop string ends the sample at its token number `cut`
            n = cut - len(s.tokens)
        new = out.tokens[b, :n].tolist()
        if cut is not None:
            # Not the row's: it ran on until the device stopped it.
            s.peak, s.stalls = int(out.peak_at[b, n - 1]), int(out.stalls_at[b, n - 1])
        s.tokens += new
        if s.text is not None and cut is None:  # else its last delta takes the result's text
            s.unsent += s.text.push(new) if s.watcher is None else s.text.push_text(s.watcher.text)
        want = s.request.sampling.logprobs
        # Every row's logprobs come back once one request asks; kept for those that use them.
        if out.logprob.shape[1] and (want is not None or s.request.continuation is not None):
            s.logprobs += out.logprob[b, :n].tolist()
        if want is not None:  # the engine keeps the most any request asks for: cut to this one's
            s.top_ids.append(out.top_ids[b, :n, :want])
            s.top_logprobs.append(out.top_logprobs[b, :n, :want])
        if out.top1.shape[1]:
            s.top1 += out.top1[b, :n].tolist()
            s.ranks += out.rank[b, :n].tolist()
        if out.dists.shape[1]:
            s.dists.append(out.dists[b, :n])
        if cut is not None:
            s.reason = "stop"
        return n

    @staticmethod
    def _finish(s: Sample, out: programs.Tokens, b: int) -> None:
        """The device ended row b's sample: a stop token, or its token budget."""
        s.peak, s.stalls = int(out.peak[b]), int(out.stalls[b])
        r = s.request
        by_token = r.continuation is None and bool(s.tokens) and s.tokens[-1] in r.stop_ids
        s.reason = "stop" if by_token else "length"

    def delta(self, s: Sample, result: GenerationResult | None = None) -> StreamDelta:
        """A streamed sample's tokens and text since its last delta; with its `result`, the
        last one (the text completed to the result's)."""
        text = s.unsent if result is None else s.unsent + s.text.rest(result.text)
        s.unsent = ""
        new = s.tokens[s.sent :]
        logprobs = top = None
        if s.request.sampling.logprobs is not None:
            logprobs = s.logprobs[s.sent :]
            top = _pairs(s.top_ids[s.sent_tops :], s.top_logprobs[s.sent_tops :])
            s.sent_tops = len(s.top_ids)
        s.sent = len(s.tokens)
        return StreamDelta(
            request_id=s.request.id,
            sample_index=s.index,
            text=text,
            token_ids=new,
            logprobs=logprobs,
            top_logprobs=top,
            result=result,
        )

    def result(self, s: Sample, run: RunInfo) -> GenerationResult | ScoreResult:
        """A finished sample's result."""
        r = s.request
        if r.continuation is not None:
            return ScoreResult(
                logprobs=np.asarray(s.logprobs, np.float32),
                top1=np.asarray(s.top1, np.int32),
                ranks=np.asarray(s.ranks, np.int32),
                dists=np.concatenate(s.dists) if s.dists else None,
                compressions=s.compressions,
                peak_cache_slots=s.peak,
                request_id=r.id,
                top_ids=np.concatenate(s.top_ids) if s.top_ids else None,
                top_logprobs=np.concatenate(s.top_logprobs) if s.top_logprobs else None,
            )
        # Decoded once, whole: the stop watcher's text holds back a last incomplete character,
        # which a full decode shows as U+FFFD, as transformers does.
        text = self.tokenizer.decode(s.tokens) if self.tokenizer is not None else ""
        if r.sampling.stop:
            cut = find_stop(text, r.sampling.stop)
            if cut is not None:
                text, s.reason = text[:cut], "stop"
        stats = GenerationStats(
            prompt_tokens=len(r.prompt_token_ids),
            generated_tokens=len(s.tokens),
            method=run.method,
            budget=run.budget,
            compressions=s.compressions,
            cache_capacity=run.capacity,
            peak_cache_slots=s.peak,
            stalled_steps=s.stalls,
            batch_size=run.batch_size,
            time_to_first_token_s=max(0.0, s.ttft or 0.0),
            decode_s=run.decode_s,
            tokens_per_s=run.tokens_per_s,
            compile_s=run.compile_s,
            kv_dtype=run.kv_dtype,
            batch_invariant=run.batch_invariant,
        )
        kept = None
        if self.kept_shape is not None:
            kept = np.stack(s.kept) if s.kept else np.zeros((0, *self.kept_shape), np.int32)
        top = None
        if r.sampling.logprobs is not None:
            top = _pairs(s.top_ids, s.top_logprobs)
        return GenerationResult(
            text=text,
            token_ids=list(s.tokens),
            finish_reason=s.reason,
            stats=stats,
            prompt_token_ids=list(r.prompt_token_ids),
            kept_positions=kept,
            request_id=r.id,
            sample_index=s.index,
            logprobs=s.logprobs if r.sampling.logprobs is not None else None,
            top_logprobs=top,
        )


_PAIR = np.dtype([("id", np.int64), ("logprob", np.float64)])


def _pairs(ids: list[np.ndarray], logprobs: list[np.ndarray]) -> list[list[tuple[int, float]]]:
    """Per token, its (token id, logprob) alternatives, from [n, N] blocks: a structured
    array's `tolist` builds the tuples in C (1.5x faster than zipping lists in Python)."""
    if not ids:
        return []
    both = np.empty((sum(len(x) for x in ids), ids[0].shape[1]), _PAIR)
    both["id"] = np.concatenate(ids)
    both["logprob"] = np.concatenate(logprobs)  # float32 values, exactly, as Python floats
    return both.tolist()
