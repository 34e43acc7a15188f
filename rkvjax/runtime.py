"""The host side of the slot runtime: a request queue, admission into free slots, chunked
decode, and results streaming out as requests finish.

`Engine` owns one `engine.SlotState`: `slots` rows, each holding one sample of one request.
Each round it dispatches the next decode chunk before it parses the last one (JAX dispatches
asynchronously, so the device decodes while the host detokenizes, checks stop strings and
prefills newcomers), then admits queued requests into the slots that freed up: one prefill per
group of prompts (rows and length bucketed, so few shapes compile), whose rows an `insert`
scatters into the free slots. A prompt's `n` samples share its prefill. Nothing recompiles when
requests come and go, differ in settings, or compress.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax import engine, policy, requests, sharding
from rkvjax.config import CompressionConfig
from rkvjax.detokenize import StopWatcher, find_stop
from rkvjax.loading import Model
from rkvjax.requests import Request
from rkvjax.results import GenerationResult, GenerationStats, RunStats, ScoreResult
from rkvjax.sampling import SamplerConfig, SamplingParams, SlotSampling

# Decode steps per device call. A slot freed during a chunk is refilled after the next one (it
# is dispatched before the host parses this one), so short chunks keep slots busy.
DEFAULT_CHUNK = 16
# A run narrows only while its longest row may still run this many chunks: fewer steps than
# that would not pay for compiling the narrower program on a first run.
NARROW_MIN_CHUNKS = 4
DEFAULT_STOP_WIDTH = 8  # stop token ids per row (eos included)


@dataclasses.dataclass(eq=False)
class _Sample:
    """Host-side record of one sample: its tokens so far and what the device reported."""

    request: Request
    index: int
    submitted: float  # perf_counter at submission
    compile_at_submit: float
    watcher: StopWatcher | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    top1: list[int] = dataclasses.field(default_factory=list)
    dists: list[np.ndarray] = dataclasses.field(default_factory=list)
    kept: list[np.ndarray] = dataclasses.field(default_factory=list)
    compressions: int = 0
    peak: int = 0
    stalls: int = 0
    ttft: float | None = None
    reason: str | None = None  # set once finished

    @property
    def finished(self) -> bool:
        return self.reason is not None


@dataclasses.dataclass(eq=False)
class _Pending:
    """A queued request's samples not yet in a slot, and its prefill once it has one."""

    samples: list[_Sample]
    group: engine.Prefilled | None = None  # kept while some of its samples wait for slots
    src: int = 0  # the request's row in `group`


def _on_mesh(model: Model):
    """The model's mesh as the context mesh (jit traces see it; shard_map runs over it)."""
    return contextlib.nullcontext() if model.mesh is None else jax.set_mesh(model.mesh)


def device_rows(model: Model, x) -> jax.Array:
    """A host [B, ...] array on device: rows split over "data" on a mesh when they divide,
    else replicated."""
    x = np.asarray(x)
    if model.mesh is None:
        return jnp.asarray(x)
    axes = ("batch",) if x.ndim and x.shape[0] % model.data_shards == 0 else (None,)
    return sharding.host_array(x, model.rules.named(model.mesh, *axes, *[None] * (x.ndim - 1)))


def _replicated(model: Model, tree):
    """Host arrays placed whole on every device (small per-request values)."""
    if model.mesh is None:
        return jax.tree.map(jnp.asarray, tree)

    def put(x):
        x = np.asarray(x)
        return sharding.host_array(x, model.rules.named(model.mesh, *[None] * x.ndim))

    return jax.tree.map(put, tree)


def _tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _draw_seeds(count: int) -> list[int]:
    """Fresh 32-bit seeds for requests without one; the same on every process of a run."""
    seeds = np.array([secrets.randbits(32) for _ in range(count)], np.uint32)
    if count and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        seeds = np.asarray(multihost_utils.broadcast_one_to_all(seeds))
    return [int(s) for s in seeds]


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

    Submit requests at any time; iterate `results()` (or call `run()`) to drive the device and
    get each sample back as soon as it finishes.

    Args:
      model: from `rkvjax.load`.
      slots: rows decoded together (on a mesh, rounded up to a multiple of the "data" axis).
      cache: the KV-cache policy (`rkvjax.config.compression_config`); None is FullKV.
      max_len: FullKV only: cache slots per row, at least prompt + max_tokens - 1 of every
        request (compressing methods hold `budget + buffer` slots whatever the length).
      chunk: decode steps per device call.
      lanes: compressions per decode step (per data shard); default `policy.lane_count`.
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
        if logprobs is not None and logprobs > model.config.vocab_size:
            raise ValueError(
                f"logprobs={logprobs} is more tokens than the vocabulary's "
                f"{model.config.vocab_size}"
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
        if lanes is None:
            lanes = policy.lane_count(slots, cc, data)
        self.model = model
        self.slots = slots
        self.capacity = capacity
        self.chunk = chunk
        self.compression = cc
        self.plan = engine.Plan(
            compression=cc,
            lanes=lanes,
            sampler=SamplerConfig(penalties=penalties, logprobs=logprobs),
            teacher=teacher,
            keep_dists=keep_dists,
            record_kept=record_kept,
            rules=model.rules,
        )
        self._stop_width = stop_width
        self._given_len = given_len
        self._max_prefill = min(slots, max_prefill_rows or slots)
        self._prefill_by_length = prefill_by_length
        self._narrow_tail = narrow_tail
        self._narrow_wish: int | None = None  # rows per data shard the last round could narrow to
        self._chat = chat
        self._progress = progress
        self._total = total
        self._bar = None
        self._queue: collections.deque[_Pending] = collections.deque()
        # Row b of the state holds _owner[b]; a narrowed state has fewer rows than slots.
        self._owner: list[_Sample | None] = [None] * slots
        self._events: collections.deque = collections.deque()  # dispatched, not yet parsed
        self._release: set[int] = set()
        self._state: engine.SlotState | None = None
        self._counters = collections.Counter()
        self._t0: float | None = None
        self._compile0 = 0.0
        self._batch_peak = 0
        self._live: dict[Any, int] = {}  # id of each request queued or running -> samples left
        self._next_id = 0  # default request ids: a running number, skipping ids in use

    # -- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: Any = None,
        continuation: Sequence[int] | None = None,
    ) -> Any:
        """Queues a request; returns its id (default: a running number).

        Args:
          prompt: a str, token ids, or a chat (list of {"role", "content"} messages).
          sampling: SamplingParams (default: greedy with the defaults' max_tokens).
          request_id: any hashable id, reported back in the results.
          continuation: teacher mode: the token ids to score after the prompt.

        Raises:
          ValueError: naming the request, for anything this engine cannot run as asked.
        """
        return self.submit_many(
            [prompt], [sampling], ids=[request_id], continuations=[continuation]
        )[0]

    def submit_many(
        self, prompts, sampling=None, *, ids=None, continuations=None, samples=None
    ) -> list:
        """`submit` for several requests at once, all validated before any is queued.

        Args:
          prompts: a list of prompts (or one prompt), as for `submit`.
          sampling: one SamplingParams for all, or one per prompt (default: greedy).
          ids: one request id per prompt (None entries: running numbers).
          continuations: teacher mode: one continuation per prompt.
          samples: one sequence of sample indices per prompt, a subset of range(n), to run
            only those of its n samples (None entries: all n). A sample's tokens depend only on
            its seed and index, so a resumed job runs just the samples it lacks.

        Returns:
          The request ids.
        """
        prompts = requests.split_prompts(prompts)[0]
        n = len(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * n
        ids = list(ids) if ids is not None else [None] * n
        conts = list(continuations) if continuations is not None else [None] * n
        subsets = list(samples) if samples is not None else [None] * n
        params = list(sampling)
        if not len(ids) == len(conts) == len(params) == len(subsets) == n:
            raise ValueError(
                f"{n} prompts need one sampling setting, id, continuation and sample subset "
                f"each (got {len(params)}, {len(ids)}, {len(conts)} and {len(subsets)})"
            )
        taken = set(self._live) | {rid for rid in ids if _hashable(rid) and rid is not None}
        made, indices = [], []
        for prompt, sp, rid, cont, subset in zip(prompts, params, ids, conts, subsets, strict=True):
            if rid is None:
                while self._next_id in taken:
                    self._next_id += 1
                rid = self._next_id
                taken.add(rid)
            elif not _hashable(rid):
                raise ValueError(
                    f"request id {rid!r} is not hashable: use a str, an int or a tuple of them"
                )
            elif rid in self._live or any(r.id == rid for r in made):
                raise ValueError(f"request id {rid!r} is already queued or running")
            made.append(self._request(prompt, sp or SamplingParams(temperature=0.0), rid, cont))
            indices.append(_sample_indices(subset, made[-1].sampling.n, rid))
        seeds = _draw_seeds(sum(r.sampling.seed is None for r in made))
        now, comp = time.perf_counter(), engine.compile_seconds()
        for r, idx in zip(made, indices, strict=True):
            if r.sampling.seed is None:
                r = dataclasses.replace(r, sampling=r.sampling.replace(seed=seeds.pop()))
            self._queue.append(_Pending([_Sample(r, j, now, comp, self._watcher(r)) for j in idx]))
        self._counters["submitted"] += n
        self._counters["samples"] += sum(map(len, indices))
        self._live.update((r.id, len(idx)) for r, idx in zip(made, indices, strict=True))
        return [r.id for r in made]

    def check(self, prompt, sampling: SamplingParams | None = None, *, where: str = "request"):
        """Raises the ValueError `submit` would raise for this request (prefixed with `where`),
        without queuing it: lets a job check every line before any work."""
        self._request(prompt, sampling or SamplingParams(temperature=0.0), None, None, where)

    def _request(self, prompt, sp: SamplingParams, rid, continuation, where=None) -> Request:
        where = where or f"request {rid!r}"
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"{where}: sampling must be a SamplingParams, got {type(sp).__name__}")
        model, cfg, cc = self.model, self.model.config, self.compression
        ids = requests.encode(model.tokenizer, prompt, self._chat, where)
        if continuation is not None:
            if not self.plan.teacher:
                raise ValueError(
                    f"{where}: a continuation needs a scoring engine (Engine(teacher=True))"
                )
            continuation = tuple(int(t) for t in continuation)
            if not continuation:
                raise ValueError(f"{where}: an empty continuation has nothing to score")
            if len(continuation) > self._given_len:
                raise ValueError(
                    f"{where}: a continuation of {len(continuation)} tokens is longer than "
                    f"this engine's given_len={self._given_len}"
                )
            bad = [t for t in continuation if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"{where}: continuation token id(s) {bad[:5]} outside the vocabulary"
                )
        elif self.plan.teacher:
            raise ValueError(f"{where}: a scoring engine needs a continuation")
        req = Request(rid, tuple(ids), sp, continuation)
        requests.validate_ids(
            ids,
            vocab=cfg.vocab_size,
            max_positions=cfg.max_positions,
            max_tokens=req.max_tokens,
            where=where,
        )
        if cc.compressing and len(ids) < cc.window:
            raise ValueError(
                f"{where}: a prompt of {len(ids)} tokens is shorter than window={cc.window}: "
                "compression needs that many observation queries"
            )
        if not cc.compressing and len(ids) + req.max_tokens - 1 > self.capacity:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens + max_tokens={req.max_tokens} need "
                f"{len(ids) + req.max_tokens - 1} FullKV cache slots; this engine has "
                f"max_len={self.capacity}"
            )
        if sp.logprobs is not None and sp.logprobs > cfg.vocab_size:
            raise ValueError(
                f"{where}: logprobs={sp.logprobs} asks for more tokens than the vocabulary's "
                f"{cfg.vocab_size}"
            )
        if sp.logprobs is not None and (
            self.plan.sampler.logprobs is None or sp.logprobs > self.plan.sampler.logprobs
        ):
            raise ValueError(
                f"{where}: logprobs={sp.logprobs} exceeds this engine's "
                f"logprobs={self.plan.sampler.logprobs} (Engine(logprobs=...))"
            )
        if sp.uses_penalties and not self.plan.sampler.penalties:
            raise ValueError(f"{where}: penalties need Engine(penalties=True)")
        if continuation is not None:
            return req  # teacher forcing: nothing is sampled or stopped
        if sp.stop and model.tokenizer is None:
            raise ValueError(f"{where}: stop strings need a tokenizer; use stop_token_ids")
        for text in sp.stop:
            requests.check_unicode(text, f"{where}: stop string")
        self._stop_ids(sp, where)  # checks the ids against the vocabulary
        stop_ids = sp.min_tokens_stop_ids(model.eos_token_ids)
        if len(stop_ids) > self._stop_width:
            raise ValueError(
                f"{where}: {len(stop_ids)} stop token ids (end-of-sequence included) exceed "
                f"this engine's stop_width={self._stop_width}"
            )
        return req

    def _stop_ids(self, sp: SamplingParams, where: str = "request") -> tuple[int, ...]:
        """The ids that end sp's samples, checked against the vocabulary."""
        vocab = self.model.config.vocab_size
        for t in sp.stop_token_ids:
            requests.token_id(t, vocab, f"{where}: stop_token_ids")
        return sp.stopping_token_ids(self.model.eos_token_ids)

    def _watcher(self, r: Request) -> StopWatcher | None:
        return StopWatcher(self.model.tokenizer, r.sampling.stop) if r.sampling.stop else None

    def state_shapes(self) -> engine.SlotState:
        """The shapes, dtypes and shardings of this engine's device state (nothing allocated):
        what its slots hold in memory."""
        with _on_mesh(self.model):
            return jax.eval_shape(
                lambda d: engine.init_state(
                    d,
                    slots=self.slots,
                    capacity=self.capacity,
                    stop_width=self._stop_width,
                    given_len=self._given_len,
                    plan=self.plan,
                ),
                self.model.decoder,
            )

    def prefilled(self) -> engine.SlotState:
        """Admits every queued request that fits and returns the device state before its first
        decode step, without running it: benchmarks time `engine.decode` from copies of it.
        The engine itself should not be driven afterwards."""
        with _on_mesh(self.model):
            self._ensure_state()
            self._admit()
            jax.block_until_ready(self._state)
        self._events.clear()
        return self._state

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
        state = self.state_shapes()
        out = {"state_bytes": _tree_bytes(state), "cache_bytes": _tree_bytes(state.cache)}
        k = self._max_prefill
        tokens = jax.ShapeDtypeStruct((k, requests.bucket(prompt_len, prompt_len)), jnp.int32)
        with _on_mesh(self.model):
            for name in parts:
                if name == "decode":
                    lowered = engine.decode.lower(
                        self.model.decoder, state, steps=self.chunk, plan=self.plan
                    )
                elif name == "prefill":
                    lowered = engine.prefill.lower(
                        self.model.decoder, tokens, tokens, capacity=self.capacity, plan=self.plan
                    )
                elif name == "compress":
                    full = jax.ShapeDtypeStruct((self.slots,), jnp.bool_)
                    lowered = jax.jit(self._compress_step).lower(state.cache, full)
                else:
                    raise ValueError(f"unknown part {name!r}: decode, prefill or compress")
                ma = lowered.compile().memory_analysis()
                part = {
                    "argument_bytes": ma.argument_size_in_bytes,
                    "output_bytes": ma.output_size_in_bytes,
                    "alias_bytes": ma.alias_size_in_bytes,
                    "temp_bytes": ma.temp_size_in_bytes,
                }
                part["peak_bytes"] = sum(part.values()) - 2 * part["alias_bytes"]
                out[name] = part
        return out

    def _compress_step(self, cache, full):
        """One step of this engine's compression lanes (for `memory_analysis`)."""
        plan = self.plan
        return policy.compress_lanes(
            cache, full, self.compression, lanes=plan.lanes, start=jnp.int32(0), rules=plan.rules
        )

    # -- driving the device ---------------------------------------------------------------

    def results(self) -> Iterator[GenerationResult | ScoreResult]:
        """Runs until every submitted request has finished, yielding each sample when it
        finishes (requests submitted meanwhile are picked up too)."""
        self._start()
        try:
            while self._queue or any(s is not None for s in self._owner) or self._events:
                yield from self._pump()
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def run(self) -> list[GenerationResult | ScoreResult]:
        """Every submitted request to the end -> results in the order they finished."""
        return list(self.results())

    def _start(self) -> None:
        if self._t0 is None:
            self._t0, self._compile0 = time.perf_counter(), engine.compile_seconds()
        if self._progress and self._bar is None:
            from tqdm.auto import tqdm

            total = self._total or self._counters["samples"]
            self._bar = tqdm(total=total, unit="sample", desc="generate", dynamic_ncols=True)

    def _pump(self) -> list:
        """One round: dispatch the next chunk, parse the previous one, admit, release."""
        with _on_mesh(self.model):
            self._ensure_state()
            self._admit()  # requests submitted since the last round, into slots known free
            busy = any(s is not None for s in self._owner)
            if busy:
                self._dispatch_chunk()
            finished = []
            # Parse everything but the chunk just dispatched: it runs while the host works.
            keep = 1 if busy else 0
            while len(self._events) > keep:
                finished += self._parse(self._events.popleft())
            self._admit()
            self._flush_release()
            self._narrow()
        self._update_bar(finished)
        return finished

    def _empty_state(self, width: int | None = None) -> engine.SlotState:
        """Nothing in any row: every slot, or `width` rows of a narrowed run."""
        width = self.slots if width is None else width
        return engine.init_state(
            self.model.decoder,
            slots=width,
            capacity=self.capacity,
            stop_width=self._stop_width,
            given_len=self._given_len,
            plan=self._plan_of(width),
        )

    def _ensure_state(self) -> None:
        if self._state is None:
            self._state = self._empty_state()

    def _plan_of(self, width: int) -> engine.Plan:
        """The plan of a `width`-row state: the engine's, with no more lanes than rows."""
        if width == self.slots:
            return self.plan
        lanes = max(1, min(self.plan.lanes, width // self.model.data_shards))
        return dataclasses.replace(self.plan, lanes=lanes)

    def _narrow(self) -> None:
        """Moves the busy rows into a state at most half as wide (`narrow_tail`). On a mesh
        each data shard keeps its own busy rows (`engine.take_rows`), the same number each."""
        # Only when the last round could narrow too, and to the wider of the two widths: a
        # caller that submits a request as each one ends (a server) refills the freed row
        # first, instead of the state narrowing and widening again on every request. A batch
        # run narrows a round (a chunk) later.
        wish, self._narrow_wish = self._narrow_wish, None
        if not self._narrow_tail or self._queue:
            return
        busy = [s for s in self._owner if s is not None]
        if not busy:
            return
        # Host tokens lag the chunk in flight: an upper bound on the steps left either way.
        left = max(s.request.max_tokens - len(s.tokens) for s in busy)
        shards = self._shard_rows()
        per = len(shards[0])
        most = max(sum(s is not None for s in rows) for rows in shards)
        w = requests.row_bucket(most, per)  # rows per data shard
        if w > per // 2 or left < NARROW_MIN_CHUNKS * self.chunk:
            return
        if wish is None:
            self._narrow_wish = w
            return
        w = max(w, wish)
        assert not self._release  # flushed: its row indices are the wide state's
        local, owner = [], []
        for rows in shards:
            # Idle rows pad a shard's block: they are inactive on the device.
            keep = [j for j, s in enumerate(rows) if s is not None]
            keep += [j for j, s in enumerate(rows) if s is None][: w - len(keep)]
            local += keep
            owner += [rows[j] for j in keep]
        self._state = engine.take_rows(
            self._state,
            device_rows(self.model, np.asarray(local, np.int32)),
            plan=self._plan_of(w * len(shards)),
        )
        # The chunk in flight still parses: it names its samples, which `_free` finds by
        # identity in the new layout.
        self._owner = owner
        self._counters["narrowings"] += 1

    def _widen(self, waiting: int) -> None:
        """Widens a narrowed state for `waiting` new samples, to the narrowest width whose
        free rows take them all (a power of two rows per data shard, at most every slot):
        one request arriving after the run narrowed does not bring back every idle slot.
        Each data shard's rows go to the first rows of its block of the wider state."""
        # Flushed at the end of the last round; `_admit`'s second call never widens (the
        # first left the queue empty or the state full width).
        assert not self._release
        shards = self._shard_rows()
        d, w = len(shards), len(shards[0])
        full = self.slots // d
        need = min(-(-(self.busy_slots + waiting) // d), full)  # rows per data shard
        per = requests.row_bucket(need, full)
        rows = device_rows(self.model, np.tile(np.arange(w, dtype=np.int32), d))
        plan = self._plan_of(per * d)
        self._state = engine.put_rows(self._empty_state(per * d), self._state, rows, plan=plan)
        self._owner = [s for block in shards for s in block + [None] * (per - w)]
        self._narrow_wish = None  # a width of the narrower state
        self._counters["widenings"] += 1

    def _shard_rows(self) -> list[list[_Sample | None]]:
        """`_owner` cut into the data shards' blocks of rows."""
        d = self.model.data_shards
        per = len(self._owner) // d
        return [self._owner[i * per : (i + 1) * per] for i in range(d)]

    def _dispatch_chunk(self) -> None:
        self._state, out = engine.decode(
            self.model.decoder,
            self._state,
            steps=self.chunk,
            plan=self._plan_of(len(self._owner)),
            refill_at=self._refill_at(),
        )
        self._events.append(("chunk", out, list(self._owner)))

    def _refill_at(self) -> np.int32:
        """Free rows at which the next chunk stops early: with requests waiting, as soon as a
        few slots free up (1 in 16 of them, at least one), so they are refilled a chunk
        sooner; with nothing waiting, never. Chunks stay long when slots free up one by one
        in a large batch, and the host keeps one chunk in flight either way."""
        need = max(1, self.slots // 16)
        waiting = self._waiting(need)
        at = min(waiting, need) if waiting else self.slots + 1
        return np.int32(at)  # a value, not a shape: never recompiles

    def _waiting(self, enough: int) -> int:
        """Samples waiting in the queue, counted up to at least `enough` of them: every queued
        request has a sample left, so its first `enough` entries tell, without a pass over a
        long queue on every chunk."""
        return sum(len(p.samples) for p in itertools.islice(self._queue, enough))

    def _flush_release(self) -> None:
        rows = [b for b in self._release if self._owner[b] is None]
        self._release.clear()
        if rows:
            mask = np.zeros(len(self._owner), bool)
            mask[rows] = True
            plan = self._plan_of(len(mask))
            self._state = engine.release(self._state, device_rows(self.model, mask), plan=plan)

    def _admit(self) -> None:
        """Fills free slots from the queue: a prompt prefilled earlier whose other samples are
        waiting goes first (its prefill is kept, not repeated); then the next new prompts, as
        many whole requests as fit and part of the next, prefilled by length bucket."""
        if len(self._owner) < self.slots:
            free = sum(s is None for s in self._owner)
            waiting = self._waiting(self.slots)  # enough to size the wider state
            if waiting > free:  # the narrow state's free rows are too few
                self._widen(waiting)
        while self._queue:
            free = [b for b, s in enumerate(self._owner) if s is None]
            if not free:
                return
            head = self._queue[0]
            if head.group is not None:
                take = head.samples[: len(free)]
                del head.samples[: len(take)]
                if not head.samples:
                    self._queue.popleft()
                self._insert(head.group, [head.src] * len(take), take, free)
                continue
            entries, need = [], 0
            while self._queue and self._queue[0].group is None and need < len(free):
                if len(entries) == self._max_prefill:
                    break
                entries.append(self._queue.popleft())
                need += len(entries[-1].samples)
            takes, left = [], len(free)  # slots in queue order: only the last entry may wait
            for e in entries:
                takes.append(e.samples[:left])
                left -= len(takes[-1])
            for members in self._prefill_groups(entries):
                group = self._prefill([entries[i].samples[0].request for i in members])
                src, samples = [], []
                for j, i in enumerate(members):
                    e = entries[i]
                    del e.samples[: len(takes[i])]
                    src += [j] * len(takes[i])
                    samples += takes[i]
                    if e.samples:  # the rest of its samples wait for slots, prefilled
                        e.group, e.src = group, j
                        self._queue.appendleft(e)
                self._insert(group, src, samples, free)
                free = [b for b in free if self._owner[b] is None]

    def _prefill_groups(self, entries: list[_Pending]) -> list[list[int]]:
        """Which of the prompts admitted together share a prefill: those of one length
        bucket (a group pads every prompt to its longest, so a 40-token prompt beside a
        400-token one would cost as much as the long one), or all of them."""
        if not self._prefill_by_length:
            return [list(range(len(entries)))]
        limit = self.model.config.max_positions
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            n = len(e.samples[0].request.prompt_token_ids)
            groups.setdefault(requests.bucket(n, limit), []).append(i)
        return list(groups.values())

    def _prefill(self, reqs: list[Request]) -> engine.Prefilled:
        """One prefill call for a group of prompts (rows and length bucketed)."""
        model, cfg = self.model, self.model.config
        k = requests.row_bucket(len(reqs), self._max_prefill, model.data_shards)
        tokens, positions = requests.pad_left(
            [r.prompt_token_ids for r in reqs], k, cfg.max_positions
        )
        self._counters["prefills"] += 1
        self._counters["prefill_rows"] += len(reqs)
        self._counters["prompt_tokens"] += sum(len(q.prompt_token_ids) for q in reqs)
        return engine.prefill(
            model.decoder,
            device_rows(model, tokens),
            device_rows(model, positions),
            capacity=self.capacity,
            plan=self.plan,
        )

    def _insert(
        self, group: engine.Prefilled, src: list[int], samples: list[_Sample], free: list[int]
    ) -> None:
        """Scatters prefilled rows src[i] of `group` into free rows for samples[i] (`_place`),
        in the state as wide as it is now."""
        model, width = self.model, len(self._owner)
        dst_slots = self._place(samples, free)
        r = requests.row_bucket(len(samples), width)
        dst = dst_slots + [width] * (r - len(samples))
        src_rows = src + [0] * (r - len(samples))
        new = self._new_rows([s.request for s in samples], [s.index for s in samples], r)
        self._state, first = engine.insert(
            self._state,
            group,
            _replicated(model, np.asarray(src_rows, np.int32)),
            _replicated(model, np.asarray(dst, np.int32)),
            new,
            plan=self._plan_of(width),
        )
        for slot, s in zip(dst_slots, samples, strict=True):
            self._owner[slot] = s
        kept = group.kept if self.plan.record_kept and self.compression.compressing else None
        self._events.append(("insert", (first, kept, src), samples))
        self._batch_peak = max(self._batch_peak, sum(s is not None for s in self._owner))

    def _place(self, samples: list[_Sample], free: list[int]) -> list[int]:
        """Free rows for `samples`, spread over the data shards so that the tail can narrow:
        the longest sample first, each into the shard with the fewest rows that may outlive
        it (then the fewest busy rows). Token budgets stand in for lengths. One device: the
        first free rows."""
        shards = self._shard_rows()
        if len(shards) == 1:
            return free[: len(samples)]
        per = len(shards[0])
        open_rows = [[b for b in free if b // per == d] for d in range(len(shards))]
        left = [
            [s.request.max_tokens - len(s.tokens) for s in rows if s is not None] for rows in shards
        ]
        rows = {}
        for i in sorted(range(len(samples)), key=lambda i: -samples[i].request.max_tokens):
            n = samples[i].request.max_tokens
            d = min(
                (d for d in range(len(shards)) if open_rows[d]),
                key=lambda d: (sum(m >= n for m in left[d]), len(left[d]), d),
            )
            rows[i] = open_rows[d].pop(0)
            left[d].append(n)
        return [rows[i] for i in range(len(samples))]

    def _new_rows(self, reqs: list[Request], indices: list[int], r: int) -> engine.NewRows:
        """Per-destination arrays of an insert, padded to r rows."""
        stop = np.full((r, self._stop_width), -1, np.int32)
        block = np.full((r, self._stop_width), -1, np.int32)
        max_tokens = np.ones(r, np.int32)
        given = np.zeros((r, self._given_len), np.int32)
        eos = self.model.eos_token_ids
        for i, q in enumerate(reqs):
            max_tokens[i] = q.max_tokens
            if q.continuation is not None:  # teacher forcing: no stop ids
                given[i, : len(q.continuation)] = q.continuation
                continue
            ids = self._stop_ids(q.sampling)
            stop[i, : len(ids)] = ids
            ids = q.sampling.min_tokens_stop_ids(eos)
            block[i, : len(ids)] = ids
        rows = SlotSampling.from_params([q.sampling for q in reqs], batch=r, sample_indices=indices)
        new = engine.NewRows(
            max_tokens=max_tokens, stop_ids=stop, block_ids=block, sampling=rows, given=given
        )
        return _replicated(self.model, new)

    # -- parsing device output ------------------------------------------------------------

    def _parse(self, event) -> list:
        kind, payload, owners = event
        if kind == "insert":
            first, kept, src = payload
            return self._parse_insert(first, kept, src, owners)
        return self._parse_chunk(payload, owners)

    def _parse_insert(self, first, kept, src, samples: list[_Sample]) -> list:
        out = sharding.to_host(first)
        kept = None if kept is None else sharding.to_host(kept)
        now, comp = time.perf_counter(), engine.compile_seconds()
        done = []
        for r, s in enumerate(samples):
            s.ttft = (now - s.submitted) - (comp - s.compile_at_submit)
            s.compressions = int(out.compressions[r])
            s.peak = int(out.peak[r])
            if kept is not None and s.compressions:
                s.kept.append(kept[src[r]])
            self._take(s, out, r)
            if not out.active[r] and not s.finished:
                self._finish(s, out, r)
            if s.finished:
                done.append(self._result(s))
                self._free(s, release=bool(out.active[r]))
        return done

    def _parse_chunk(self, out: engine.Tokens, owners: list[_Sample | None]) -> list:
        out = sharding.to_host(out)
        steps = int(out.steps)
        self._counters["decode_steps"] += steps
        self._counters["row_steps"] += steps * len(owners)
        self._counters["busy"] += int(out.busy)
        self._counters["fired"] += int(out.fired)
        self._counters["stalled"] += int(out.stalled)
        live = [s is not None and not s.finished for s in owners]  # before this chunk's tokens
        for b, s in enumerate(owners):
            if live[b]:
                s.peak, s.stalls = int(out.peak[b]), int(out.stalls[b])
                self._take(s, out, b)
        for t in range(steps):  # compressions in step order
            for lane, row in enumerate(out.kept_rows[t]):
                # A row cut by a stop string may compress again before the device stops it:
                # only compressions before its last kept token are the sample's.
                if (
                    row < len(owners)
                    and live[row]
                    and out.kept_num[t, lane] < len(owners[row].tokens)
                ):
                    owners[row].compressions += 1
                    if out.kept.shape[1]:
                        owners[row].kept.append(out.kept[t, lane])
        done = []
        for b, s in enumerate(owners):
            if not live[b]:
                continue
            if not out.active[b] and not s.finished:
                self._finish(s, out, b)
            if s.finished:
                done.append(self._result(s))
                self._free(s, release=bool(out.active[b]))
        return done

    def _take(self, s: _Sample, out: engine.Tokens, b: int) -> None:
        """Appends row b's new tokens to sample s, ending it at a stop string."""
        n = int(out.count[b])
        if not n:
            return
        new = out.tokens[b, :n].tolist()
        cut = s.watcher.push(new) if s.watcher is not None else None
        if cut is not None:  # a stop string ends the sample at its token number `cut`
            n = cut - len(s.tokens)
            new = new[:n]
            # Not the row's: it ran on until the device stopped it.
            s.peak, s.stalls = int(out.peak_at[b, n - 1]), int(out.stalls_at[b, n - 1])
        s.tokens += new
        if out.logprob.shape[1]:
            s.logprobs += out.logprob[b, :n].tolist()
        want = s.request.sampling.logprobs
        if want is not None:  # the engine keeps the most any request asks for: cut to this one's
            ids, lps = out.top_ids[b, :n, :want], out.top_logprobs[b, :n, :want]
            s.top += [
                list(zip(i.tolist(), p.tolist(), strict=True))
                for i, p in zip(ids, lps, strict=True)
            ]
        if out.top1.shape[1]:
            s.top1 += out.top1[b, :n].tolist()
        if out.dists.shape[1]:
            s.dists += list(out.dists[b, :n])
        if cut is not None:
            s.reason = "stop"

    def _finish(self, s: _Sample, out: engine.Tokens, b: int) -> None:
        """The device ended row b's sample: a stop token, or its token budget."""
        s.peak, s.stalls = int(out.peak[b]), int(out.stalls[b])
        stop_ids = set(self._stop_ids(s.request.sampling))
        by_token = s.request.continuation is None and bool(s.tokens) and s.tokens[-1] in stop_ids
        s.reason = "stop" if by_token else "length"

    def _free(self, s: _Sample, *, release: bool) -> None:
        """Frees s's slot; `release` when the device still runs it (a stop string)."""
        for b, owner in enumerate(self._owner):
            if owner is s:
                self._owner[b] = None
                if release:
                    self._release.add(b)
        self._counters["generated"] += len(s.tokens)
        rid = s.request.id
        self._live[rid] -= 1
        if not self._live[rid]:
            del self._live[rid]

    def _result(self, s: _Sample) -> GenerationResult | ScoreResult:
        r = s.request
        if r.continuation is not None:
            return ScoreResult(
                logprobs=np.asarray(s.logprobs, np.float32),
                top1=np.asarray(s.top1, np.int32),
                dists=np.stack(s.dists) if s.dists else None,
                compressions=s.compressions,
                peak_cache_slots=s.peak,
                request_id=r.id,
            )
        tok = self.model.tokenizer
        text = tok.decode(s.tokens) if tok is not None else ""
        if r.sampling.stop:
            cut = find_stop(text, r.sampling.stop)
            if cut is not None:
                text, s.reason = text[:cut], "stop"
        run = self.stats
        stats = GenerationStats(
            prompt_tokens=len(r.prompt_token_ids),
            generated_tokens=len(s.tokens),
            method=self.compression.method,
            budget=self.compression.budget if self.compression.compressing else None,
            compressions=s.compressions,
            cache_capacity=self.capacity,
            peak_cache_slots=s.peak,
            stalled_steps=s.stalls,
            batch_size=self._batch_peak,
            time_to_first_token_s=max(0.0, s.ttft or 0.0),
            decode_s=run.wall_s - run.compile_s,
            tokens_per_s=run.tokens_per_s,
            compile_s=run.compile_s,
        )
        kept = np.stack(s.kept) if self.plan.record_kept and s.kept else None
        if self.plan.record_kept and kept is None and self.compression.compressing:
            cfg = self.model.config
            kept = np.zeros((0, cfg.num_layers, cfg.kv_heads, self.compression.budget), np.int32)
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
            top_logprobs=s.top if r.sampling.logprobs is not None else None,
        )

    # -- reporting ------------------------------------------------------------------------

    @property
    def busy_slots(self) -> int:
        """Slots holding a request now."""
        return sum(s is not None for s in self._owner)

    @property
    def stats(self) -> RunStats:
        """The run's counters so far."""
        c = self._counters
        now = time.perf_counter()
        wall = now - self._t0 if self._t0 is not None else 0.0
        compile_s = engine.compile_seconds() - self._compile0 if self._t0 is not None else 0.0
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
            narrowings=c["narrowings"],
            widenings=c["widenings"],
            compressions=c["fired"],
            rows_compressed_per_step=c["fired"] / steps if steps else 0.0,
            stalled_row_steps=c["stalled"],
            wall_s=wall,
            compile_s=compile_s,
            tokens_per_s=gen / busy_s if wall else 0.0,
        )

    def _update_bar(self, finished: list) -> None:
        if self._bar is None:
            return
        if self._total is None:
            self._bar.total = self._counters["samples"]
        self._bar.update(len(finished))
        st = self.stats
        busy = self.busy_slots
        self._bar.set_postfix(
            tok_s=f"{st.tokens_per_s:.1f}",
            comp_s=f"{st.compressions / max(st.wall_s - st.compile_s, 1e-9):.1f}",
            busy=f"{busy}/{self.slots}",
            refresh=False,
        )
