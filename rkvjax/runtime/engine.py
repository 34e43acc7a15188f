"""`Engine`: continuous batching over a fixed number of rows, as one owner of the runtime's
three parts (`rkvjax.runtime`).

Each round (`step`) the engine asks the scheduler whom to admit and has the executor prefill
and insert them; dispatches the next decode chunk before it parses the last one (JAX dispatches
asynchronously, so the device decodes while the host reads tokens, checks stop strings and
prefills newcomers); gives each parsed outcome to the output processor and the samples that
finished back to the scheduler; admits again into the rows that freed up; and lets the
scheduler narrow the state to the rows still busy. Nothing recompiles when requests come and
go, differ in settings, or compress.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from rkvjax.kv import compress, quantization
from rkvjax.kv.config import CompressionConfig, check_context
from rkvjax.kv.kernels import tuning
from rkvjax.models import layers
from rkvjax.models.loading import Model
from rkvjax.runtime import programs, requests
from rkvjax.runtime.executor import Executor, Inserted
from rkvjax.runtime.outputs import Outcome, OutputProcessor, RunInfo
from rkvjax.runtime.results import GenerationResult, RunStats, ScoreResult, StreamDelta
from rkvjax.runtime.samples import Sample
from rkvjax.runtime.scheduler import Insert, Scheduler, SchedulerConfig
from rkvjax.sampling.params import SamplingParams
from rkvjax.sampling.sampler import SamplerConfig
from rkvjax.text.detokenize import StopWatcher, TextStream

# Decode steps per device call. A slot freed during a chunk is refilled after the next one (it
# is dispatched before the host parses this one), so short chunks keep slots busy.
DEFAULT_CHUNK = 16
DEFAULT_STOP_WIDTH = 8  # stop token ids per row (eos included)


def _draw_seeds(count: int) -> list[int]:
    """Fresh 32-bit seeds for requests without one; the same on every process of a run."""
    seeds = np.array([secrets.randbits(32) for _ in range(count)], np.uint32)
    if count and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        seeds = np.asarray(multihost_utils.broadcast_one_to_all(seeds))
    return [int(s) for s in seeds]


def _prepared(prompts) -> bool:
    """Whether `prompts` is a list of requests `Engine.prepare` made."""
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], requests.Request)


def _batch_invariant(asked: bool | None, quantized: bool, data: int, by_length: bool) -> bool:
    """Whether an engine runs batch-invariant (`Engine`'s `batch_invariant`): as asked, or by
    default for an 8-bit cache where the mode can hold."""
    if asked is None:
        return quantized and data == 1 and by_length
    if not isinstance(asked, bool):
        raise ValueError(f"batch_invariant must be True, False or None, got {asked!r}")
    if asked and data > 1:
        raise ValueError(
            f"batch_invariant=True needs every row on one device, but this model's mesh splits "
            f"the rows over {data} 'data' shards: use a mesh with data=1, or batch_invariant=False"
        )
    if asked and not by_length:
        raise ValueError(
            "batch_invariant=True prefills each prompt in its own length bucket: it cannot be "
            "combined with prefill_by_length=False"
        )
    return asked


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _sample_indices(subset, n: int, rid) -> tuple[int, ...]:
    """The sample indices a request runs: `subset` (distinct, in [0, n)), or all n."""
    if subset is None:
        return tuple(range(n))
    idx = tuple(subset)
    ok = all(isinstance(j, (int, np.integer)) and not isinstance(j, bool) for j in idx)
    if not idx or not ok or len(set(idx)) != len(idx) or not all(0 <= j < n for j in idx):
        raise ValueError(
            f"request {rid!r}: samples must be distinct sample indices in [0, {n}), got {subset!r}"
        )
    return tuple(int(j) for j in idx)


class Engine:
    """Continuous batching over a fixed number of slots.

    Submit requests at any time; iterate `results()` (or call `run()`, or `step()` round by
    round, as a server does) to drive the device and get each sample back as soon as it
    finishes.

    Args:
      model: from `rkvjax.load`.
      slots: rows decoded together (on a mesh, rounded up to a multiple of the "data" axis).
      cache: the KV-cache policy (`rkvjax.kv.config.compression_config`); None is FullKV.
      max_len: FullKV only: cache slots per row, at least prompt + max_tokens - 1 of every
        request (compressing methods hold `budget + buffer` slots whatever the length).
      chunk: decode steps per device call.
      lanes: compressions per decode step (per data shard); default `compress.lane_count`.
      logprobs: the most `SamplingParams.logprobs` any request may ask for (None: none).
      penalties: allow repetition / presence / frequency penalties (keeps [slots, V] counts).
      stop_width: stop token ids per row at most (the model's end-of-sequence ids included).
      max_prefill_rows: prompts prefilled together at most.
      prefill_by_length: prompts admitted together are prefilled in one group per length
        bucket; False: in one group padded to the longest (as a static batch is).
      record_kept: keep the positions every compression kept (`GenerationResult.kept_positions`).
      narrow_tail: once nothing waits and at most half the slots are busy, decode the busy rows
        as a batch half as wide or narrower (a power of two rows per data shard, each shard
        keeping its own), so the tail of a run costs what its rows need; each width compiles
        its decode once. It narrows when two rounds in a row find it could, so that a
        caller submitting as requests end refills their rows first. New requests take its
        free rows; when more wait than fit, it widens as far as they need.
      batch_invariant: compute every row's numbers the same way whatever rows run beside it
        (each prompt prefilled alone, every product of a decode step on a fixed number of
        columns: `programs.Plan.invariant_columns`), so a sample's tokens, logprobs and kept
        sets are the same to the bit alone, in any batch, slot or width. None (default): on
        for an 8-bit cache, whose rounding can turn the last-bit differences of XLA's
        width-dependent products into another code; off for a float cache, where those
        differences stay in the last bits. Needs rows on one device and prefill_by_length.
      teacher, keep_dists: score given continuations (`rkvjax.score`) instead of sampling.
      chat: wrap text prompts in the model's chat template (default: when it has one).
      progress: a progress bar on stderr.
      total: requests expected, for the progress bar's total (default: those submitted).
    """

    def __init__(
        self,
        model: Model,
        *,
        slots: int,
        cache: CompressionConfig | None = None,
        max_len: int | None = None,
        chunk: int = DEFAULT_CHUNK,
        lanes: int | None = None,
        logprobs: int | None = None,
        penalties: bool = False,
        stop_width: int = DEFAULT_STOP_WIDTH,
        max_prefill_rows: int | None = None,
        prefill_by_length: bool = True,
        record_kept: bool = False,
        narrow_tail: bool = True,
        batch_invariant: bool | None = None,
        teacher: bool = False,
        keep_dists: bool = False,
        given_len: int = 0,
        chat: bool | None = None,
        progress: bool = False,
        total: int | None = None,
    ):
        optional = {"lanes": lanes, "max_prefill_rows": max_prefill_rows, "max_len": max_len}
        checks = [("slots", slots, 1), ("chunk", chunk, 1), ("stop_width", stop_width, 1)]
        checks += [("given_len", given_len, 0)]
        checks += [(name, v, 1) for name, v in optional.items() if v is not None]
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        cfg = model.config
        if logprobs is not None and logprobs > cfg.vocab_size:
            raise ValueError(
                f"logprobs={logprobs} is more tokens than the vocabulary's {cfg.vocab_size}"
            )
        cc = cache if cache is not None else CompressionConfig()
        if not isinstance(cc, CompressionConfig):
            raise ValueError(f"cache must be a CompressionConfig, got {type(cc).__name__}")
        data = model.data_shards
        slots = -(-slots // data) * data
        if cc.compressing:
            capacity = cc.capacity
        else:
            if max_len is None:
                raise ValueError(
                    "FullKV needs max_len (cache slots per row: prompt + max_tokens - 1)"
                )
            capacity = int(max_len)
        if cc.compressing:
            check_context(cc, cfg.max_positions)
            cc.policy.check_model(model)
        if lanes is None:
            lanes = compress.lane_count(slots, cc, data)
        # Decided once from the model's devices, never read from the process while tracing.
        target = tuning.Target.of(model.device)
        if cc.compressing:
            cc = dataclasses.replace(cc, target=target)
        self.model = model
        self.slots = slots
        self.capacity = capacity
        self.chunk = chunk
        self.compression = cc
        # What the cache stores: the config's kv_dtype or, by default, the model's dtype.
        kv_dtype = quantization.cache_dtype(cc.kv_dtype, model.dtype)
        self.kv_dtype = kv_dtype.name
        self.batch_invariant = _batch_invariant(
            batch_invariant, quantization.is_quantized(kv_dtype), data, prefill_by_length
        )
        self.plan = programs.Plan(
            compression=cc,
            lanes=lanes,
            sampler=SamplerConfig(
                penalties=penalties, logprobs=logprobs, row_blocks=target.backend == "cpu"
            ),
            teacher=teacher,
            keep_dists=keep_dists,
            record_kept=record_kept,
            rules=model.rules,
            invariant_columns=layers.INVARIANT_COLUMNS.get(target.backend, 128)
            if self.batch_invariant
            else 0,
        )
        self.limits = requests.Limits(
            vocab=cfg.vocab_size,
            max_positions=cfg.max_positions,
            eos=tuple(model.eos_token_ids),
            capacity=None if cc.compressing else capacity,
            logprobs=logprobs,
            penalties=penalties,
            stop_width=stop_width,
            teacher=teacher,
            given_len=given_len,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                slots=slots,
                data_shards=data,
                chunk=chunk,
                max_prefill_rows=min(slots, max_prefill_rows or slots),
                max_positions=cfg.max_positions,
                prefill_by_length=prefill_by_length,
                narrow_tail=narrow_tail,
            )
        )
        self.executor = Executor(
            model,
            self.plan,
            slots=slots,
            capacity=capacity,
            stop_width=stop_width,
            given_len=given_len,
            chunk=chunk,
        )
        record = record_kept and cc.compressing
        self.outputs = OutputProcessor(
            model.tokenizer,
            kept_shape=(cfg.num_layers, cfg.kv_heads, cc.budget) if record else None,
        )
        self._chat = chat
        self._progress = progress
        self._total = total
        self._bar = None
        self._events: collections.deque = collections.deque()  # dispatched, not yet parsed
        self._counters: collections.Counter = collections.Counter()
        self._t0: float | None = None
        self._compile0 = 0.0
        self._live: dict[Any, int] = {}  # id of each request queued or running -> samples left
        self._deltas: list[StreamDelta] = []  # streamed samples' output not yet taken
        self._next_id = 0  # default request ids: a running number, skipping ids in use

    # -- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: Any = None,
        continuation: Sequence[int] | None = None,
        stream: bool = False,
    ) -> Any:
        """Queues a request; returns its id (default: a running number).

        Args:
          prompt: a str, token ids, or a chat (list of {"role", "content"} messages).
          sampling: SamplingParams (default: greedy with the defaults' max_tokens).
          request_id: any hashable id, reported back in the results.
          continuation: teacher mode: the token ids to score after the prompt.
          stream: hand out each sample's new tokens and text after every chunk
            (`take_deltas`), besides its result when it finishes.

        Raises:
          ValueError: naming the request, for anything this engine cannot run as asked.
        """
        # One prompt by definition: straight to the queue, without `submit_many`'s sorting of
        # what a list holds (a server admits requests one by one, so this is its hot path).
        one = [None]
        return self._queue([prompt], [sampling], [request_id], [continuation], one, one, stream)[0]

    def submit_many(
        self,
        prompts,
        sampling=None,
        *,
        ids=None,
        continuations=None,
        samples=None,
        where=None,
        stream: bool = False,
    ) -> list:
        """`submit` for several requests at once, all validated before any is queued.

        Args:
          prompts: a list of prompts (or one prompt), as for `submit`; or requests this engine
            already prepared (`prepare`), which are queued as they are.
          sampling: one SamplingParams for all, or one per prompt (default: greedy).
          ids: one request id per prompt (None entries: running numbers).
          continuations: teacher mode: one continuation per prompt.
          samples: one sequence of sample indices per prompt, a subset of range(n), to run
            only those of its n samples (None entries: all n). A sample's tokens depend only on
            its seed and index, so a resumed job runs just the samples it lacks.
          where: how errors name each prompt (default "request <id>").
          stream: as in `submit`, for every request.

        Returns:
          The request ids.
        """
        if isinstance(prompts, requests.Request):
            prompts = [prompts]
        elif not _prepared(prompts):
            prompts = requests.split_prompts(prompts)[0]
        n = len(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * n
        ids = list(ids) if ids is not None else [None] * n
        conts = list(continuations) if continuations is not None else [None] * n
        subsets = list(samples) if samples is not None else [None] * n
        names = list(where) if where is not None else [None] * n
        params = list(sampling)
        if not len(ids) == len(conts) == len(params) == len(subsets) == len(names) == n:
            raise ValueError(
                f"{n} prompts need one sampling setting, id, continuation, sample subset and "
                f"name each (got {len(params)}, {len(ids)}, {len(conts)}, {len(subsets)} and "
                f"{len(names)})"
            )
        return self._queue(prompts, params, ids, conts, subsets, names, stream)

    def _queue(self, prompts, params, ids, conts, subsets, names, stream: bool) -> list:
        """Prepares (where not prepared yet), checks and queues prompts with their settings,
        one list entry per prompt (`submit_many`'s arguments, split); all or none."""
        # Ids the caller chose, which running numbers skip. Membership tests only, never a copy
        # of the live ids: admission costs the same whatever the queue holds.
        given = (
            p.id if isinstance(p, requests.Request) else rid
            for p, rid in zip(prompts, ids, strict=True)
        )
        named = {rid for rid in given if rid is not None and _hashable(rid)}
        made, indices, ids_made = [], [], set()
        for prompt, sp, rid, cont, subset, name in zip(
            prompts, params, ids, conts, subsets, names, strict=True
        ):
            if isinstance(prompt, requests.Request):
                rid = prompt.id
            elif rid is None:
                while self._next_id in self._live or self._next_id in named:
                    self._next_id += 1
                rid = self._next_id
                named.add(rid)
            if not _hashable(rid):
                raise ValueError(
                    f"request id {rid!r} is not hashable: use a str, an int or a tuple of them"
                )
            if rid in self._live or rid in ids_made:
                raise ValueError(f"request id {rid!r} is already queued or running")
            ids_made.add(rid)
            if not isinstance(prompt, requests.Request):
                prompt = self.prepare(prompt, sp, request_id=rid, continuation=cont, where=name)
            made.append(prompt)
            indices.append(_sample_indices(subset, prompt.sampling.n, rid))
        if stream and any(r.continuation is not None for r in made):
            raise ValueError("a scoring request (a continuation) cannot stream")
        if stream and self.model.tokenizer is None:
            raise ValueError("streaming needs the model's tokenizer (for the text)")
        unseeded = sum(r.sampling.seed is None for r in made)
        seeds = _draw_seeds(unseeded) if unseeded else []
        now, comp = time.perf_counter(), self.executor.compile.seconds
        live, samples = self._live, 0
        for r, idx in zip(made, indices, strict=True):
            if r.sampling.seed is None:
                r = dataclasses.replace(r, sampling=r.sampling.replace(seed=seeds.pop()))
            self.scheduler.add([self._sample(r, j, now, comp, stream) for j in idx])
            live[r.id] = len(idx)
            samples += len(idx)
        self._counters["submitted"] += len(made)
        self._counters["samples"] += samples
        return [r.id for r in made]

    def _sample(self, r: requests.Request, index: int, now: float, comp: float, stream: bool):
        tok, stop = self.model.tokenizer, r.sampling.stop
        # One incremental decoder per sample: a streamed sample with stop strings takes its
        # text from the stop watcher, which decodes every token anyway.
        watcher = StopWatcher(tok, stop, keep_text=stream) if stop else None
        text = TextStream(tok, stop, decode=watcher is None) if stream else None
        return Sample(r, index, now, comp, watcher, text)

    def abort(self, request_id: Any) -> int:
        """Stops a request: its samples waiting for rows leave the queue, and its running
        samples' rows are freed now (the chunk in flight still decodes them; their tokens are
        dropped). Aborted samples have no results, and their deltas not yet taken are
        dropped. Returns how many samples it stopped: 0 for an id that is not queued or
        running (finished, or never submitted)."""
        if request_id not in self._live:
            return 0
        queued, running, groups = self.scheduler.abort(request_id)
        for group in groups:
            self.executor.drop_group(group)
        rows = self.scheduler.take_release()
        if rows:
            with self.executor.running():
                self.executor.release(rows)
        del self._live[request_id]
        self._deltas = [d for d in self._deltas if d.request_id != request_id]
        self._counters["aborted"] += 1
        self._counters["aborted_samples"] += len(queued) + len(running)
        return len(queued) + len(running)

    def take_deltas(self) -> list[StreamDelta]:
        """The streamed samples' new tokens and text since the last call, in the order they
        came; a sample's last delta carries its result (which `step` also returns)."""
        out, self._deltas = self._deltas, []
        return out

    def prepare(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: Any = None,
        continuation: Sequence[int] | None = None,
        where: str | None = None,
    ) -> requests.Request:
        """A request encoded and checked against this engine, ready for `submit_many`
        (`requests.prepare`); nothing is queued. Raises the ValueError `submit` would raise,
        prefixed with `where`."""
        return requests.prepare(
            prompt,
            sampling or SamplingParams(temperature=0.0),
            request_id,
            tokenizer=self.model.tokenizer,
            limits=self.limits,
            chat=self._chat,
            continuation=continuation,
            where=where,
        )

    def check(self, prompt, sampling: SamplingParams | None = None, *, where: str = "request"):
        """Raises the ValueError `submit` would raise for this request (prefixed with `where`),
        without queuing it: lets a job check every line before any work."""
        self.prepare(prompt, sampling, where=where)

    # -- driving the device ---------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether requests wait or run, or device outputs wait to be parsed."""
        return self.scheduler.has_work or bool(self._events)

    def results(self) -> Iterator[GenerationResult | ScoreResult]:
        """Runs until every submitted request has finished, yielding each sample when it
        finishes (requests submitted meanwhile are picked up too)."""
        try:
            while self.has_work:
                yield from self.step()
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def run(self) -> list[GenerationResult | ScoreResult]:
        """Every submitted request to the end -> results in the order they finished."""
        return list(self.results())

    def step(self) -> list[GenerationResult | ScoreResult]:
        """One round: admit, dispatch the next chunk, parse the previous one, admit into the
        rows that freed up, release and narrow. Returns the samples that finished in it."""
        self._start()
        with self.executor.running():
            self.executor.ensure_state()
            self._admit()  # requests submitted since the last round, into rows known free
            busy = self.scheduler.busy > 0
            if busy:
                out = self.executor.dispatch(self.scheduler.refill_at())
                self._events.append(("chunk", out, list(self.scheduler.owner)))
            finished = []
            # Parse everything but the chunk just dispatched: it runs while the host works.
            keep = 1 if busy else 0
            while len(self._events) > keep:
                finished += self._parse(self._events.popleft())
            self._admit()
            rows = self.scheduler.take_release()
            if rows:
                self.executor.release(rows)
            resize = self.scheduler.narrow()
            if resize is not None:
                self.executor.resize(resize)
        self._update_bar(finished)
        return finished

    def _start(self) -> None:
        if self._t0 is None:
            self._t0, self._compile0 = time.perf_counter(), self.executor.compile.seconds
        if self._progress and self._bar is None:
            from tqdm.auto import tqdm

            total = self._total or self._samples_to_run
            self._bar = tqdm(total=total, unit="sample", desc="generate", dynamic_ncols=True)

    def _admit(self) -> None:
        admission = self.scheduler.admit()
        if admission is None:
            return
        for step, done in zip(admission.inserts, self.executor.admit(admission), strict=True):
            self._events.append(("insert", done, step))
            if step.prefill is not None:
                prompts = step.prefill.prompts
                self._counters["prefills"] += 1
                self._counters["prefill_rows"] += len(prompts)
                self._counters["prompt_tokens"] += sum(map(len, prompts))
                # Exactly the prompts the prefill compresses (`compress.prefill_cache`).
                if self.compression.compressing:
                    long = sum(len(p) > self.compression.budget for p in prompts)
                    self._counters["prompt_compressions"] += long

    def _parse(self, event) -> list:
        kind, payload, context = event
        fetch = self.executor.fetch
        if kind == "insert":
            done: Inserted = fetch(payload)
            step: Insert = context
            outcome = self.outputs.inserted(
                done.first,
                done.kept,
                step.src,
                step.samples,
                now=time.perf_counter(),
                compile_s=self.executor.compile.seconds,
            )
        else:
            outcome = self.outputs.chunk(fetch(payload), context)
        return self._settle(outcome)

    def _settle(self, outcome: Outcome) -> list:
        """Counts an outcome, frees its finished samples' rows and returns their results."""
        c = self._counters
        c["decode_steps"] += outcome.steps
        c["row_steps"] += outcome.row_steps
        c["busy"] += outcome.busy
        c["fired"] += outcome.fired
        c["stalled"] += outcome.stalled
        c["decoded"] += outcome.tokens
        self._deltas += [self.outputs.delta(s) for s in outcome.streamed]
        if not outcome.finished:
            return []
        run = self._run_info()
        done = []
        for s, running in outcome.finished:
            done.append(self.outputs.result(s, run))
            if s.text is not None:
                self._deltas.append(self.outputs.delta(s, done[-1]))
            self.scheduler.free(s, running=running)
            c["generated"] += len(s.tokens)
            rid = s.request.id
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
        return done

    def _run_info(self) -> RunInfo:
        st = self.stats
        cc = self.compression
        return RunInfo(
            method=cc.method,
            budget=cc.budget if cc.compressing else None,
            kv_dtype=self.kv_dtype,
            batch_invariant=self.batch_invariant,
            capacity=self.capacity,
            batch_size=self.scheduler.peak_busy,
            decode_s=st.wall_s - st.compile_s,
            tokens_per_s=st.tokens_per_s,
            compile_s=st.compile_s,
        )

    def warm_widths(self, prompt=None, *, narrow: bool = True) -> list[int]:
        """Compiles, ahead of time and without running them, the programs of every width the
        state may narrow or widen to (empty state, decode chunk, release, row moves, and one
        prompt's insert), so that a server's requests never wait on one when its load
        changes. Without `narrow_tail` there is one width. The live state is not touched: it
        may run on another thread while this engine serves (a server compiles the full width
        first and the narrower ones behind its first requests).

        Args:
          prompt: what a request's prompt may be (text, token ids or a chat); its prefill
            (one prompt-length bucket) is compiled too. Default: 16 token ids.
          narrow: False: the full width only.

        Returns:
          The widths, in rows.
        """
        ids = list(range(1, 17)) if prompt is None else prompt
        request = self.prepare(ids, SamplingParams(temperature=0.0, max_tokens=1))
        with self.executor.running():
            return self.executor.warm_widths(
                request.prompt_token_ids, narrow=narrow and self.scheduler.cfg.narrow_tail
            )

    def allocate(self) -> None:
        """Starts making the empty state now, on another thread, instead of at the first
        request: a server's first touch of the memory its rows hold (seconds for gigabytes on
        a CPU) then overlaps the rest of its start; the first round waits for it if need be."""
        self.executor.start_state()

    def reset_stats(self) -> None:
        """Starts the counters of `stats` afresh (a benchmark between its rounds); compiled
        programs stay. Only between runs: nothing may wait or run."""
        if self.has_work:
            raise RuntimeError("reset_stats needs an idle engine: requests wait or run")
        self._counters.clear()
        self._t0 = None
        self.scheduler.counts.clear()
        self.scheduler.peak_busy = 0

    # -- sizing and benchmarks -------------------------------------------------------------

    def state_shapes(self) -> programs.SlotState:
        """The shapes, dtypes and shardings of this engine's device state (nothing allocated):
        what its slots hold in memory."""
        return self.executor.state_shapes()

    def memory_analysis(self, *, prompt_len: int, parts=("decode",)) -> dict:
        """Compile-only memory of this engine's programs; nothing is allocated or run.

        Args:
          prompt_len: the prompt length of the "prefill" part (one group of every slot's
            prompt, or `max_prefill_rows` of them).
          parts: any of "decode" (one chunk), "prefill" (a group and its insert) and
            "compress" (one step of the compression lanes).

        Returns:
          {"state_bytes", "cache_bytes", and per part {"argument_bytes", "output_bytes",
          "alias_bytes", "temp_bytes", "peak_bytes"}}: peak = arguments + outputs not aliased
          to a donated argument + XLA's temporaries, as `Compiled.memory_analysis()` says.
        """
        return self.executor.memory_analysis(
            prompt_len=prompt_len,
            prefill_rows=self.scheduler.cfg.max_prefill_rows,
            parts=parts,
        )

    def prefilled(self) -> programs.SlotState:
        """Admits every queued request that fits and returns the device state before its first
        decode step, without running it: benchmarks time `programs.decode` from copies of it.
        The engine itself should not be driven afterwards."""
        with self.executor.running():
            self.executor.ensure_state()
            self._admit()
            jax.block_until_ready(self.executor.state)
        self._events.clear()
        return self.executor.state

    # -- reporting ------------------------------------------------------------------------

    @property
    def busy_slots(self) -> int:
        """Slots holding a request now."""
        return self.scheduler.busy

    @property
    def stats(self) -> RunStats:
        """The run's counters so far. Compile time is this engine's own (its programs' tracing
        and compilation), whatever other engines of the process compile meanwhile."""
        c = self._counters
        wall = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        compile_s = self.executor.compile.seconds - self._compile0 if self._t0 is not None else 0.0
        steps = c["decode_steps"]
        gen = c["generated"]
        busy_s = max(wall - compile_s, 1e-9)
        return RunStats(
            slots=self.slots,
            lanes=self.plan.lanes,
            requests=c["submitted"],
            samples=c["samples"],
            prefills=c["prefills"],
            prefill_rows=c["prefill_rows"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=gen,
            decode_steps=steps,
            slot_occupancy=c["busy"] / (self.slots * steps) if steps else 0.0,
            decoded_row_steps=c["row_steps"],
            narrowings=self.scheduler.counts["narrowings"],
            widenings=self.scheduler.counts["widenings"],
            compressions=c["fired"],
            rows_compressed_per_step=c["fired"] / steps if steps else 0.0,
            stalled_row_steps=c["stalled"],
            wall_s=wall,
            compile_s=compile_s,
            tokens_per_s=gen / busy_s if wall else 0.0,
            compiled_programs=self.executor.compile.programs,
            aborted=c["aborted"],
            decoded_tokens=c["decoded"],
            prompt_compressions=c["prompt_compressions"],
        )

    @property
    def _samples_to_run(self) -> int:
        c = self._counters
        return c["samples"] - c["aborted_samples"]

    def _update_bar(self, finished: list) -> None:
        if self._bar is None:
            return
        if self._total is None:
            self._bar.total = self._samples_to_run
        self._bar.update(len(finished))
        st = self.stats
        self._bar.set_postfix(
            tok_s=f"{st.tokens_per_s:.1f}",
            comp_s=f"{st.compressions / max(st.wall_s - st.compile_s, 1e-9):.1f}",
            busy=f"{self.busy_slots}/{self.slots}",
            refresh=False,
        )
