"""The jit boundaries of the slot runtime: prefill a group, insert it into slots, decode a chunk.

The unit of work is a slot: a row of the batch that holds one request's cache, counters and
sampling settings as arrays (`SlotState`), so requests with different prompts, lengths and
settings share one compiled program. Between decode chunks the host prefills new requests
(`prefill`, bucketed in rows and prompt length) and scatters them into free slots (`insert`);
`decode` then runs up to `steps` steps as a `lax.while_loop` on device and returns the chunk's
new tokens and counters (`Tokens`). Only rows whose cache is full run a compression, in a fixed
number of lanes per step (`compress.compress_lanes`). `rkvjax.runtime` drives these programs;
nothing here knows about requests.

The model arrives as a pytree argument (a Flax NNX module; its config is static pytree metadata),
never as a static argument or a closure. Each block of a step runs under a `jax.named_scope`
("attention", "mlp" in the model; "compress", "cache_append", "sample" here), so a profile of a
decode step reads as the step does.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import monitoring

from rkvjax.kv import cache as kv
from rkvjax.kv import compress, quantization
from rkvjax.kv.config import CompressionConfig
from rkvjax.models import layers, sharding
from rkvjax.runtime import packing
from rkvjax.sampling.sampler import (
    SamplerConfig,
    SlotSampling,
    sample_rows,
    token_keys,
    token_logprobs,
    token_mask,
    update_output_counts,
)

# Incremented at trace time only: tests use it to prove a run compiled each function once.
TRACES: collections.Counter[str] = collections.Counter()
_COMPILE_S = [0.0]
_NONE = jnp.iinfo(jnp.int32).max  # a row index that scatters drop
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # one per program compiled


@dataclasses.dataclass
class CompileLog:
    """Compilation done on behalf of one owner (a runtime's executor): seconds spent tracing,
    lowering and compiling, and programs compiled."""

    seconds: float = 0.0
    programs: int = 0


_SINK = threading.local()  # the CompileLog of the code compiling on this thread, if any


def _on_jax_event(name: str, secs: float, **_) -> None:
    # JAX records these on the thread that compiles, inside the call that needed the program,
    # so the thread's current log is the caller's: two runtimes in one process (even taking
    # turns in one thread) each count only their own programs.
    if name.startswith("/jax/core/compile/"):  # tracing, lowering and XLA compilation
        _COMPILE_S[0] += secs
        log = getattr(_SINK, "log", None)
        if log is not None:
            log.seconds += secs
            log.programs += name == _BACKEND_COMPILE


monitoring.register_event_duration_secs_listener(_on_jax_event)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far; timing code subtracts deltas of it."""
    return _COMPILE_S[0]


@contextlib.contextmanager
def compiling_for(log: CompileLog) -> Iterator[CompileLog]:
    """Counts the compilation this thread does inside the block into `log`."""
    outer = getattr(_SINK, "log", None)
    _SINK.log = log
    try:
        yield log
    finally:
        _SINK.log = outer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about a runtime besides array shapes: part of each program's identity.

    Slots, cache capacity, stop-id width and the teacher-forcing length are read from the state's
    shapes; per-request values (lengths, sampling, stop ids) are arrays of the state.
    """

    compression: CompressionConfig
    lanes: int = 1  # compressions per decode step (per data shard)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    teacher: bool = False  # score given tokens instead of sampling
    keep_dists: bool = False  # teacher mode: also return every step's log-probabilities [V]
    record_kept: bool = False  # return the positions each compression kept
    # On a mesh (the caller runs under `jax.set_mesh`): how the cache and the compression are
    # split over it. None = one device, with no sharding constraint and no shard_map.
    rules: sharding.ShardingRules | None = None
    # Batch-invariant mode (0: off): a row's numbers do not depend on the rows beside it. Each
    # prompt is prefilled alone and every weight product of a decode step runs on this many
    # columns at a time (`layers.fixed_columns`). Off, XLA picks each product's algorithm by
    # its width, which changes a row's numbers in the last bits; an 8-bit cache can round such
    # a difference to another code.
    invariant_columns: int = 0

    def __post_init__(self):
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if self.invariant_columns < 0:
            raise ValueError(f"invariant_columns must be >= 0, got {self.invariant_columns}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """The running batch: one request (or nothing) per row."""

    cache: kv.KVCache
    last: jax.Array  # [B] int32 the token fed at the next step
    num: jax.Array  # [B] int32 tokens emitted for the row's request so far
    active: jax.Array  # [B] bool the row holds a request that is still generating
    max_tokens: jax.Array  # [B] int32 the request's token budget
    stop_ids: jax.Array  # [B, S] int32 token ids that end the request (-1 = none)
    block_ids: jax.Array  # [B, S] int32 token ids blocked until min_tokens (-1 = none)
    sampling: SlotSampling  # [B] per-row sampling settings
    thinking: jax.Array  # [B] bool think-only mode compresses a row only while this holds
    compressions: jax.Array  # [B] int32 compressions run (the prompt's included)
    peak: jax.Array  # [B] int32 most occupied slots the row has had
    stalls: jax.Array  # [B] int32 steps the row waited for a compression lane
    counts: jax.Array  # [B, V] int32 output token counts (penalties; [B, 0] otherwise)
    seen: jax.Array  # [B, V] bool the prompt's tokens (penalties; [B, 0] otherwise)
    given: jax.Array  # [B, M] int32 teacher mode: the continuation to score ([B, 0] otherwise)
    step: jax.Array  # [] int32 decode steps run: the compression lanes rotate with it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefilled group of k prompts, ready to be inserted into slots."""

    cache: kv.KVCache  # k rows at the slots' capacity
    logits: jax.Array  # [k, V] float32 after each prompt's last token
    squeezed: jax.Array  # [k] bool the prompt was compressed
    kept: jax.Array  # [k, L, K, budget] int32 what that compression kept (record_kept)
    seen: jax.Array  # [k, V] bool the prompt's tokens (penalties; [k, 0] otherwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NewRows:
    """Per-destination values of an insert: R rows, each a request's sample."""

    max_tokens: jax.Array  # [R] int32
    stop_ids: jax.Array  # [R, S] int32 (-1 = none)
    block_ids: jax.Array  # [R, S] int32 (-1 = none)
    sampling: SlotSampling  # [R]
    given: jax.Array  # [R, M] int32 (teacher mode; [R, 0] otherwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokens emitted per row, T at most: a decode chunk's (T = steps) or an insert's (T = 1).

    Row b's tokens are `tokens[b, :count[b]]`; with logprobs, teacher forcing or kept-set
    recording the matching entries follow the same layout.
    """

    tokens: jax.Array  # [B, T] int32 (-1 past count)
    count: jax.Array  # [B] int32
    logprob: jax.Array  # [B, T] f32 of each token (logprobs or teacher mode; [B, 0] otherwise)
    top_ids: jax.Array  # [B, T, N] int32 the N most likely tokens ([B, 0, 0] without logprobs)
    top_logprobs: jax.Array  # [B, T, N] f32
    top1: jax.Array  # [B, T] int32 teacher mode: the argmax prediction ([B, 0] otherwise)
    rank: jax.Array  # [B, T] int32 teacher mode: the given token's rank, 1 = most likely
    dists: jax.Array  # [B, T, V] f32 teacher mode with keep_dists ([B, 0, 0] otherwise)
    # Rows' state at the end, for the requests that finished.
    active: jax.Array  # [B] bool
    compressions: jax.Array  # [B] int32
    peak: jax.Array  # [B] int32
    stalls: jax.Array  # [B] int32
    # The row's peak and stalls as of each of its tokens: a stop string the host finds ends a
    # sample before the row's last step on device.
    peak_at: jax.Array  # [B, T] int32
    stalls_at: jax.Array  # [B, T] int32
    # Decode chunks only (zeros after an insert): the run's counters.
    kept_rows: jax.Array  # [T, D * lanes] int32 the row each lane compressed (max int = none)
    kept_num: jax.Array  # [T, D * lanes] int32 tokens that row had emitted when it compressed
    kept: jax.Array  # [T, D * lanes, L, K, budget] int32 (record_kept; [T, 0, 0, 0, 0] else)
    steps: jax.Array  # [] int32 decode steps run
    busy: jax.Array  # [] int32 active row-steps (slot occupancy)
    fired: jax.Array  # [] int32 rows compressed
    stalled: jax.Array  # [] int32 row-steps that waited for a lane


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Flat:
    """A model as its flat list of weights and the tree structure they came from (static).

    Every program call flattens its arguments. Flattening the NNX decoder walks its modules in
    Python (0.7 ms for the default model's 212 weights, on every decode chunk and insert);
    flattening a list is a C++ loop. Programs take either form (`_model`).
    """

    leaves: list
    treedef: Any = dataclasses.field(metadata=dict(static=True))


def flat(model) -> Flat:
    """The model (an NNX decoder) as a `Flat`, once, for a runtime that calls it often."""
    leaves, treedef = jax.tree.flatten(model)
    return Flat(leaves, treedef)


def _model(model):
    """The decoder a program runs: rebuilt from a `Flat` at trace time, or given as is."""
    return jax.tree.unflatten(model.treedef, model.leaves) if isinstance(model, Flat) else model


def _per_row(s: SlotState) -> SlotState:
    """The leaves with a leading row axis: all but the cache (rows of its own) and the step."""
    return dataclasses.replace(s, cache=None, step=None)


def _rows(x, rules):
    return sharding.constrain(x, rules, "batch", *[None] * (x.ndim - 1))


def _state_axes(s: SlotState) -> SlotState:
    """The logical axes of every leaf of a state: rows on "batch" (the cache's heads on
    "model", `kv.axes`), the step replicated."""
    rest = jax.tree.map(lambda x: ("batch", *[None] * (x.ndim - 1)), _per_row(s))
    return dataclasses.replace(rest, cache=kv.axes(s.cache), step=())


def _constrain_state(s: SlotState, rules: sharding.ShardingRules | None) -> SlotState:
    """Pins every leaf of the state (rows on "data", the cache also on "model"). Every jit
    boundary ends with it, so each call receives the shardings the previous one returned and
    nothing recompiles on a mesh either."""
    if rules is None:
        return s
    return jax.tree.map(lambda x, a: sharding.constrain(x, rules, *a), s, _state_axes(s))


def _causal_attend(positions: jax.Array, weights: bool = False):
    """attend() for a full forward over a (left-padded) prompt; collects each layer's q/K/V
    and, with `weights`, the attention each key received [B, K, T] (`layers.attention`)."""
    mask = layers.causal_mask(positions, positions)  # [B, T, T]

    def attend(i, q, k, v, qkvs):
        if not weights:
            return layers.attention(q, k, v, mask, kv_axis=1), (*qkvs, (q, k, v))
        out, w = layers.attention(q, k, v, mask, kv_axis=1, weights=True)
        return out, (*qkvs, (q, k, v, w))

    return attend


def _cache_attend(i, q, k, v, cache: kv.KVCache, rules=None, go=None, received=False):
    """attend() for decode: append this token to the cache (rows in `go`), then attend (and,
    with `received`, add the weights to the keys' sums: `Policy.state == "attention"`)."""
    with jax.named_scope("cache_append"):
        cache = kv.write(cache, i, q, k, v, rules, go)
    k, v, k_scale, v_scale = cache.attend_kv(i)
    args = (q, k, v, cache.attend_mask(i))
    kw = dict(kv_axis=2, k_scale=k_scale, v_scale=v_scale)
    if not received:
        return layers.attention(*args, **kw), cache
    out, w = layers.attention(*args, **kw, weights=True)
    return out, kv.add_attention(cache, i, w, go)


@jax.jit
def forward_logits(model, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens, positions [B, T] -> logits [B, T, V] float32 (no cache)."""
    TRACES["forward_logits"] += 1
    model = _model(model)
    x, _ = model.hidden(tokens, positions, _causal_attend(positions), ())
    return model.head(x)


@functools.partial(
    jax.jit, static_argnames=("slots", "capacity", "stop_width", "given_len", "plan")
)
def init_state(model, *, slots, capacity, stop_width, given_len, plan: Plan) -> SlotState:
    """An empty state of `slots` rows (no request in any), laid out as every call returns it."""
    TRACES["init_state"] += 1
    model = _model(model)
    cfg, cc = model.cfg, plan.compression
    dtype = quantization.cache_dtype(cc.kv_dtype, model.embed[...].dtype)
    cache = kv.empty(
        cfg, slots, capacity, dtype, cc.window if cc.compressing else 0, cc.state is not None
    )
    v = cfg.vocab_size if plan.sampler.penalties else 0
    zeros = functools.partial(jnp.zeros, (slots,), jnp.int32)
    state = SlotState(
        cache=cache,
        last=zeros(),
        num=zeros(),
        active=jnp.zeros((slots,), bool),
        max_tokens=zeros(),
        stop_ids=jnp.full((slots, stop_width), -1, jnp.int32),
        block_ids=jnp.full((slots, stop_width), -1, jnp.int32),
        sampling=SlotSampling.empty(slots),
        thinking=jnp.ones((slots,), bool),
        compressions=zeros(),
        peak=zeros(),
        stalls=zeros(),
        counts=jnp.zeros((slots, v), jnp.int32),
        seen=jnp.zeros((slots, v), bool),
        given=jnp.zeros((slots, given_len), jnp.int32),
        step=jnp.zeros((), jnp.int32),
    )
    return _constrain_state(state, plan.rules)


@functools.partial(jax.jit, static_argnames=("capacity", "plan"))
def prefill(
    model,
    tokens: jax.Array,
    positions: jax.Array,
    seeds: jax.Array | None = None,
    *,
    capacity: int,
    plan: Plan,
):
    """Runs a group of prompts and builds their cache rows (compressing prompts longer than the
    budget), ready for `insert`.

    Args:
      model: the decoder (pytree).
      tokens, positions: [k, P] int32, left-padded; positions are -1 at pads.
      seeds: [k] uint32 each prompt's request seed (policies that draw at random; None: 0).
      capacity: C, the slots' cache capacity (static).
      plan: static Plan.

    Returns:
      A Prefilled group of k rows.
    """
    TRACES["prefill"] += 1
    model = _model(model)
    cc = plan.compression
    received = cc.state == "attention"
    logits, qkvs = _prompt_forward(model, tokens, positions, received, plan)
    qs, ks, vs, *ws = (tuple(t) for t in zip(*qkvs, strict=True))
    if seeds is None:
        seeds = jnp.zeros(tokens.shape[:1], jnp.uint32)
    cache, squeezed = compress.prefill_cache(
        ks, vs, qs, positions, cc, capacity, plan.rules, seeds=seeds, weights=ws[0] if ws else ()
    )
    k = tokens.shape[0]
    if plan.record_kept and cc.compressing:
        kept = jnp.stack([sp[:, :, : cc.budget] for sp in cache.slot_pos], axis=1)
    else:
        kept = jnp.zeros((k, 0, 0, 0), jnp.int32)
    seen = jnp.zeros((k, 0), bool)
    if plan.sampler.penalties:
        seen = token_mask(jnp.where(positions >= 0, tokens, -1), model.cfg.vocab_size)
    pre = Prefilled(cache=cache, logits=logits, squeezed=squeezed, kept=kept, seen=seen)
    if plan.rules is None:
        return pre
    rows = functools.partial(_rows, rules=plan.rules)
    return dataclasses.replace(
        jax.tree.map(rows, dataclasses.replace(pre, cache=None)),
        cache=kv.constrain(cache, plan.rules),
    )


def _prompt_forward(model, tokens, positions, received: bool, plan: Plan):
    """The prompts' forward: logits [k, V] after each last token (left padding puts it at the
    end) and every layer's (q, k, v[, attention received]) [k, P, ...].

    In batch-invariant mode each prompt runs alone, one after another (`lax.map`): a group's
    prompts share a length bucket, so a prompt's shapes, and with them its numbers, are the
    ones it has when prefilled by itself."""

    def forward(tokens, positions):
        x, qkvs = model.hidden(tokens, positions, _causal_attend(positions, received), ())
        return model.head(x[:, -1:])[:, 0], qkvs

    if not plan.invariant_columns:
        return forward(tokens, positions)

    def alone(row):
        logits, qkvs = forward(row[0][None], row[1][None])
        return jax.tree.map(lambda a: a[0], (logits, qkvs))

    return jax.lax.map(alone, (tokens, positions))


def _is_stop(tok: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tok [B] int32, stop_ids [B, S] -> [B] bool."""
    return jnp.any(tok[:, None] == stop_ids, axis=-1)


def _think_end(cc: CompressionConfig, tok: jax.Array) -> jax.Array:
    if cc.think_end_id is None:
        return jnp.zeros(tok.shape, bool)
    return tok == cc.think_end_id


def _block(logits: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens ids [B, S] (-1 = none) of the rows [B] bool at -inf:
    min_tokens' block on stop tokens, as a scatter of B x S entries."""
    b, v = logits.shape
    ids = jnp.where(rows[:, None] & (ids >= 0), ids, v)  # [B, S], v: dropped
    return logits.at[jnp.arange(b)[:, None], ids].set(-jnp.inf, mode="drop")


def _choose(logits, s_sampling, num, block_ids, given, counts, seen, plan: Plan):
    """The next token of each row from its logits [B, V].

    Returns:
      (token [B] int32, logprob [B] or None, top (ids, logprobs) [B, N] or None, top1 [B] or
      None, rank [B] or None, dist [B, V] or None). Logprobs are of the raw logits, before
      penalties and temperature (what `score` reports and vLLM returns by default).
    """
    if plan.teacher:
        tok = jnp.take_along_axis(given, jnp.minimum(num, given.shape[1] - 1)[:, None], axis=1)
        tok = tok[:, 0]  # [B] the given token
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
        chosen = jnp.take_along_axis(logp, tok[:, None], axis=1)[:, 0]
        top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        rank = 1 + jnp.sum(logp > chosen[:, None], axis=-1, dtype=jnp.int32)  # [B]
        top = None
        if plan.sampler.logprobs:  # the most likely tokens too (a server's echoed prompt)
            top_lp, top_ids = jax.lax.top_k(logp, plan.sampler.logprobs)  # [B, N]
            top = (top_ids.astype(jnp.int32), top_lp)
        return tok, chosen, top, top1, rank, logp if plan.keep_dists else None
    keys = token_keys(s_sampling.seed, s_sampling.sample_index, num)
    blocked = _block(logits.astype(jnp.float32), block_ids, num < s_sampling.min_tokens)
    tok = sample_rows(
        blocked,
        s_sampling,
        keys,
        output_counts=counts if plan.sampler.penalties else None,
        prompt_mask=seen if plan.sampler.penalties else None,
        num_generated=num,
        row_blocks=plan.sampler.row_blocks,
    )
    if plan.sampler.logprobs is None:
        return tok, None, None, None, None, None
    chosen, top_ids, top_lp = token_logprobs(logits, tok, plan.sampler.logprobs)
    return tok, chosen, (top_ids, top_lp), None, None, None


def _empty_tokens(b: int, t: int, v: int, lanes: int, kept_shape, plan: Plan) -> Tokens:
    """Output buffers of a call emitting up to t tokens per row."""
    n = plan.sampler.logprobs or 0
    has_lp = plan.teacher or plan.sampler.logprobs is not None
    return Tokens(
        tokens=jnp.full((b, t), -1, jnp.int32),
        count=jnp.zeros((b,), jnp.int32),
        logprob=jnp.zeros((b, t if has_lp else 0), jnp.float32),
        top_ids=jnp.zeros((b, t, n) if n else (b, 0, 0), jnp.int32),
        top_logprobs=jnp.zeros((b, t, n) if n else (b, 0, 0), jnp.float32),
        top1=jnp.zeros((b, t if plan.teacher else 0), jnp.int32),
        rank=jnp.zeros((b, t if plan.teacher else 0), jnp.int32),
        dists=jnp.zeros((b, t, v) if plan.keep_dists else (b, 0, 0), jnp.float32),
        active=jnp.zeros((b,), bool),
        compressions=jnp.zeros((b,), jnp.int32),
        peak=jnp.zeros((b,), jnp.int32),
        stalls=jnp.zeros((b,), jnp.int32),
        peak_at=jnp.zeros((b, t), jnp.int32),
        stalls_at=jnp.zeros((b, t), jnp.int32),
        kept_rows=jnp.full((t, lanes), _NONE, jnp.int32),
        kept_num=jnp.zeros((t, lanes), jnp.int32),
        kept=jnp.zeros(kept_shape, jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        busy=jnp.zeros((), jnp.int32),
        fired=jnp.zeros((), jnp.int32),
        stalled=jnp.zeros((), jnp.int32),
    )


# The [B, ...] outputs of Tokens, written per row each step.
_ROW_OUT = ("tokens", "count", "logprob", "top_ids", "top_logprobs", "top1", "rank", "dists")


def _emit(bufs: dict, col, go, tok, logp, top, top1, rank, dist) -> dict:
    """Writes this step's outputs of the rows in `go` at their column `col` [B] of the
    `_ROW_OUT` buffers."""
    b, t = bufs["tokens"].shape
    rows = jnp.arange(b)
    col = jnp.where(go, col, t)  # out of range: dropped

    def put(buf, value):
        if value is None or buf.shape[1] == 0:
            return buf
        return buf.at[rows, col].set(value.astype(buf.dtype), mode="drop")

    return dict(
        tokens=put(bufs["tokens"], tok),
        count=bufs["count"] + go,
        logprob=put(bufs["logprob"], logp),
        top_ids=put(bufs["top_ids"], None if top is None else top[0]),
        top_logprobs=put(bufs["top_logprobs"], None if top is None else top[1]),
        top1=put(bufs["top1"], top1),
        rank=put(bufs["rank"], rank),
        dists=put(bufs["dists"], dist),
    )


def _row_outputs(o: Tokens) -> dict:
    return {name: getattr(o, name) for name in _ROW_OUT}


def _next_tokens(logits, s_sampling, num, block_ids, given, counts, seen, go, col, bufs, plan):
    """A step's per-row work: choose each row's token, record it, count it.

    Every input and output is [B, ...] and rows never mix, so on a mesh this runs per data
    shard under shard_map: the automatic partitioner all-gathered the rows for the sampler's
    top-k and for the scatters into the output buffers.

    Returns:
      (token [B], counts [B, V], the `_ROW_OUT` buffers).
    """

    def body(logits, s_sampling, num, block_ids, given, counts, seen, go, col, bufs):
        with jax.named_scope("sample"):
            tok, logp, top, top1, rank, dist = _choose(
                logits, s_sampling, num, block_ids, given, counts, seen, plan
            )
            bufs = _emit(bufs, col, go, tok, logp, top, top1, rank, dist)
            return tok, _count(counts, tok, go, plan), bufs

    args = (logits, s_sampling, num, block_ids, given, counts, seen, go, col, bufs)
    if plan.rules is None:
        return body(*args)

    def rows(x):  # logical axes of a [B, ...] array: rows split, the rest whole
        return ("batch", *[None] * (x.ndim - 1))

    out_axes = jax.tree.map(rows, jax.eval_shape(body, *args))
    return sharding.local(body, plan.rules, jax.tree.map(rows, args), out_axes)(*args)


def _count(counts, tok, go, plan: Plan):
    """Output token counts after the rows in `go` emitted `tok` (penalties only)."""
    if not plan.sampler.penalties:
        return counts
    return update_output_counts(counts, tok, go)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def insert(
    state: SlotState, group: Prefilled, src: jax.Array, dst: jax.Array, new: NewRows, *, plan
) -> tuple[SlotState, Tokens]:
    """Admits R new rows: prefilled row src[r] of `group` goes into slot dst[r] (>= B: none).

    A prompt's n samples are n destinations of one prefilled row. Each row's first token is
    chosen here from the prefill logits with the row's own settings and key (token index 0),
    so a sample does not depend on the slot it lands in.

    Returns:
      (state, Tokens [R, 1]: each new row's first token, in src/dst order).
    """
    TRACES["insert"] += 1
    cc = plan.compression
    r = src.shape[0]
    cache = kv.take_rows(group.cache, src)
    # A request's n samples share its prompt's compression but draw their own afterwards
    # (random eviction): sample i's seed is the request's plus i times 2^32 / golden ratio.
    step = new.sampling.sample_index.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    cache = dataclasses.replace(cache, seed=new.sampling.seed.astype(jnp.uint32) + step)
    logits = group.logits[src]  # [R, V]
    num = jnp.zeros((r,), jnp.int32)
    seen = group.seen[src]
    counts = jnp.zeros(seen.shape, jnp.int32)
    go = dst < state.active.shape[0]
    v = logits.shape[-1]
    out = _empty_tokens(r, 1, v, 0, (1, 0, 0, 0, 0), plan)
    tok, counts, bufs = _next_tokens(
        logits,
        new.sampling,
        num,
        new.block_ids,
        new.given,
        counts,
        seen,
        go,
        num,
        _row_outputs(out),
        dataclasses.replace(plan, rules=None),
    )
    num = num + 1
    stop = _is_stop(tok, new.stop_ids) & (num >= new.sampling.min_tokens) & (not plan.teacher)
    active = go & ~stop & (num < new.max_tokens)
    compressions = group.squeezed[src].astype(jnp.int32)

    def put(x, y):
        return x.at[dst].set(y.astype(x.dtype), mode="drop")

    state = dataclasses.replace(
        state,
        cache=kv.put_rows(state.cache, dst, cache),
        last=put(state.last, tok),
        num=put(state.num, num),
        active=put(state.active, active),
        max_tokens=put(state.max_tokens, new.max_tokens),
        stop_ids=put(state.stop_ids, new.stop_ids),
        block_ids=put(state.block_ids, new.block_ids),
        sampling=state.sampling.set_rows(dst, new.sampling),
        thinking=put(state.thinking, ~_think_end(cc, tok)),
        compressions=put(state.compressions, compressions),
        peak=put(state.peak, cache.length),
        stalls=put(state.stalls, jnp.zeros((r,), jnp.int32)),
        counts=put(state.counts, counts) if plan.sampler.penalties else state.counts,
        seen=put(state.seen, seen) if plan.sampler.penalties else state.seen,
        given=put(state.given, new.given) if plan.teacher else state.given,
    )
    out = dataclasses.replace(
        out,
        **bufs,
        active=active,
        compressions=compressions,
        peak=cache.length,
        peak_at=cache.length[:, None],
        stalls_at=jnp.zeros((r, 1), jnp.int32),
    )
    return _constrain_state(state, plan.rules), out


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def release(state: SlotState, rows: jax.Array, *, plan) -> SlotState:
    """Ends the requests in rows [B] bool (the host found a stop string): they stop generating
    and compressing, and their slots are free."""
    TRACES["release"] += 1
    return _constrain_state(dataclasses.replace(state, active=state.active & ~rows), plan.rules)


@functools.partial(jax.jit, static_argnames=("plan",))
def take_rows(state: SlotState, rows: jax.Array, *, plan) -> SlotState:
    """A narrower state: the rows of `state` that rows [W] int32 name, in that order, so that
    the tail of a run decodes only the rows it still has (`plan` is the narrow width's).

    On a mesh each data shard takes W / D rows of its own (`rows` is split like the batch and
    holds indices into the shard's rows), so no row moves between devices: gathered with
    global indices, every device held the whole narrow state."""
    TRACES["take_rows"] += 1

    def take(s, rows):
        rest = jax.tree.map(lambda x: x[rows], _per_row(s))
        return dataclasses.replace(rest, cache=kv.take_rows(s.cache, rows), step=s.step)

    axes = _state_axes(state)
    narrow = sharding.local(take, plan.rules, (axes, kv.ROW_AXES), axes)(state, rows)
    return _constrain_state(narrow, plan.rules)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("wide",))
def put_rows(wide: SlotState, narrow: SlotState, rows: jax.Array, *, plan) -> SlotState:
    """`wide` with the rows that rows [W] int32 name replaced by the W rows of `narrow`
    (`take_rows` undone into an empty state when requests arrive after a run narrowed; on a
    mesh, per data shard as there)."""
    TRACES["put_rows"] += 1

    def put(w, n, rows):
        rest = jax.tree.map(lambda x, y: x.at[rows].set(y), _per_row(w), _per_row(n))
        cache = kv.put_rows(w.cache, rows, n.cache)
        return dataclasses.replace(rest, cache=cache, step=n.step)

    axes = _state_axes(wide)
    out = sharding.local(put, plan.rules, (axes, axes, kv.ROW_AXES), axes)(wide, narrow, rows)
    return _constrain_state(out, plan.rules)


def _decode_step(model, s: SlotState, o: Tokens, i, num0, plan: Plan):
    cc = plan.compression
    cache = s.cache
    b = s.active.shape[0]
    waiting = jnp.zeros((b,), bool)
    fired = jnp.zeros((b,), bool)
    if cc.compressing:
        with jax.named_scope("compress"):
            full = compress.full_rows(cache, cc, s.thinking, s.active)
            cache, fired, lane_rows, lane_num, log = compress.compress_lanes(
                cache, full, cc, lanes=plan.lanes, start=s.step, num=s.num, rules=plan.rules
            )
        waiting = full & ~fired
        o = dataclasses.replace(
            o,
            kept_rows=jax.lax.dynamic_update_index_in_dim(o.kept_rows, lane_rows, i, 0),
            kept_num=jax.lax.dynamic_update_index_in_dim(o.kept_num, lane_num, i, 0),
            kept=jax.lax.dynamic_update_index_in_dim(o.kept, log, i, 0)
            if plan.record_kept
            else o.kept,
        )
    go = s.active & ~waiting  # [B] rows that take a decode step
    received = cc.state == "attention"
    attend = functools.partial(_cache_attend, rules=plan.rules, go=go, received=received)
    with layers.fixed_columns(plan.invariant_columns):
        x, cache = model.hidden(s.last[:, None], cache.pos[:, None], attend, cache)
        logits = model.head(x)[:, 0]  # [B, V]
    # Pinned every step, so the loop carry keeps the prefill's [B->data, K->model] layout.
    cache = kv.constrain(kv.advance(cache, go), plan.rules)
    tok, counts, bufs = _next_tokens(
        logits,
        s.sampling,
        s.num,
        s.block_ids,
        s.given,
        s.counts,
        s.seen,
        go,
        s.num - num0,
        _row_outputs(o),
        plan,
    )
    peak = jnp.where(go, jnp.maximum(s.peak, cache.length), s.peak)
    stalls = s.stalls + waiting
    # Elementwise, not a scatter: the rows stay split as they are on a mesh.
    at = (jnp.arange(o.peak_at.shape[1]) == (s.num - num0)[:, None]) & go[:, None]  # [B, T]
    o = dataclasses.replace(
        o,
        **bufs,
        peak_at=jnp.where(at, peak[:, None], o.peak_at),
        stalls_at=jnp.where(at, stalls[:, None], o.stalls_at),
    )
    num = s.num + go
    stop = _is_stop(tok, s.stop_ids) & (num >= s.sampling.min_tokens) & (not plan.teacher)
    finished = go & (stop | (num >= s.max_tokens))
    s = dataclasses.replace(
        s,
        cache=cache,
        last=jnp.where(go, tok, s.last),
        num=num,
        active=s.active & ~finished,
        thinking=s.thinking & ~(go & _think_end(cc, tok)),
        compressions=s.compressions + fired,
        peak=peak,
        stalls=stalls,
        counts=counts,
        step=s.step + 1,
    )
    o = dataclasses.replace(
        o,
        steps=o.steps + 1,
        busy=o.busy + jnp.sum(go | waiting),
        fired=o.fired + jnp.sum(fired),
        stalled=o.stalled + jnp.sum(waiting),
    )
    return s, o


@functools.partial(jax.jit, static_argnames=("steps", "plan"), donate_argnames=("state",))
def decode(
    model, state: SlotState, *, steps: int, plan: Plan, refill_at: jax.Array | None = None
) -> tuple[SlotState, Tokens]:
    """Up to `steps` decode steps on device; stops early once no row is active, or once at
    least `refill_at` rows are free (a [] int32 array, so its value never recompiles): the
    host sets it when requests wait for slots, so a freed slot is refilled at the next chunk
    instead of idling to the end of this one.

    Returns:
      (state, Tokens [B, steps]: each row's new tokens and the chunk's counters).
    """
    TRACES["decode"] += 1
    model = _model(model)
    cc = plan.compression
    b = state.active.shape[0]
    data = 1
    if plan.rules is not None and plan.rules.batch is not None:
        data = dict(jax.sharding.get_abstract_mesh().shape)[plan.rules.batch]
    lanes = plan.lanes * data if cc.compressing else 0
    cfg = model.cfg
    kept_shape = (steps, lanes, cfg.num_layers, cfg.kv_heads, cc.budget)
    if not (plan.record_kept and cc.compressing):
        kept_shape = (steps, 0, 0, 0, 0)
    out = _constrain_tokens(_empty_tokens(b, steps, cfg.vocab_size, lanes, kept_shape, plan), plan)
    num0 = state.num

    if refill_at is None:
        refill_at = jnp.int32(b + 1)  # never: at most b rows are free

    def cond(carry) -> Any:
        s, _, i = carry
        return (i < steps) & jnp.any(s.active) & (jnp.sum(~s.active) < refill_at)

    def body(carry):
        s, o, i = carry
        s, o = _decode_step(model, s, o, i, num0, plan)
        return s, o, i + 1

    state, out, _ = jax.lax.while_loop(cond, body, (state, out, jnp.zeros((), jnp.int32)))
    out = dataclasses.replace(
        out,
        active=state.active,
        compressions=state.compressions,
        peak=state.peak,
        stalls=state.stalls,
    )
    return _constrain_state(state, plan.rules), _constrain_tokens(out, plan)


def _constrain_tokens(o: Tokens, plan: Plan) -> Tokens:
    """Output buffers split like the rows they hold (lanes follow their data shard, kept
    positions their KV head)."""
    rules = plan.rules
    if rules is None:
        return o
    names = (*_ROW_OUT, "active", "compressions", "peak", "stalls", "peak_at", "stalls_at")
    fields = {name: _rows(getattr(o, name), rules) for name in names}
    kept_rows = sharding.constrain(o.kept_rows, rules, None, "batch")
    kept_num = sharding.constrain(o.kept_num, rules, None, "batch")
    kept = o.kept
    if kept.shape[1]:  # [T, D * lanes, L, K, budget]
        kept = sharding.constrain(kept, rules, None, "batch", None, "kv_heads", None)
    return dataclasses.replace(o, **fields, kept_rows=kept_rows, kept_num=kept_num, kept=kept)


# -- the runtime's calls: host data packed -----------------------------------------------------
# The executor calls these, not the programs above: on one device (`plan.rules` None) each takes
# its host arrays as one `packing.Packed` (a buffer per dtype) and returns its tokens packed, so
# a call moves two or three buffers each way instead of about twenty (`packing`). On a mesh the
# arrays go as they are, each with its own sharding. The tokens, states and compilations are the
# programs' own: each wrapper traces one of them and compiles as that one program.


def _for_host(tree, plan: Plan):
    """A program's output for the host: packed on one device, as it is on a mesh."""
    return packing.packed(tree) if plan.rules is None else tree


@functools.partial(jax.jit, static_argnames=("capacity", "plan"))
def prefill_packed(model, host, *, capacity: int, plan: Plan) -> Prefilled:
    """`prefill` of host {"tokens", "positions", "seeds"} (a `packing.Packed` on one device)."""
    h = packing.unpacked(host)
    return prefill(model, h["tokens"], h["positions"], h["seeds"], capacity=capacity, plan=plan)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def insert_packed(state: SlotState, group: Prefilled, host, *, plan: Plan):
    """`insert` of host {"src", "dst", "new"} (packed on one device); the first tokens packed
    on one device."""
    h = packing.unpacked(host)
    state, first = insert(state, group, h["src"], h["dst"], h["new"], plan=plan)
    return state, _for_host(first, plan)


@functools.partial(jax.jit, static_argnames=("steps", "plan"), donate_argnames=("state",))
def decode_packed(model, state: SlotState, *, steps: int, plan: Plan, refill_at=None):
    """`decode`, its tokens packed on one device."""
    state, out = decode(model, state, steps=steps, plan=plan, refill_at=refill_at)
    return state, _for_host(out, plan)
