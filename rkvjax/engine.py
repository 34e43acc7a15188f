"""Prefill, decode loop and full forward: the only `jax.jit` boundaries of the engine.

The model arrives as a pytree argument (a Flax NNX module; its config is static pytree metadata),
never as a static argument or a closure. Decode runs as chunks of a `lax.while_loop` on device: the
host sees the state once per chunk (progress, early stop), never once per token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import monitoring

from rkvjax import cache as kv
from rkvjax import layers, policy, sharding
from rkvjax.config import CompressionConfig
from rkvjax.sampling import SamplingConfig, sample

# Incremented at trace time only: tests use it to prove a generation compiled each step once.
TRACES: collections.Counter[str] = collections.Counter()
_COMPILE_S = [0.0]


def _on_jax_event(name: str, secs: float, **_) -> None:
    if name.startswith("/jax/core/compile/"):  # tracing, lowering and XLA compilation
        _COMPILE_S[0] += secs


monitoring.register_event_duration_secs_listener(_on_jax_event)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far; timing code subtracts deltas of it."""
    return _COMPILE_S[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePlan:
    """Everything static about one generation: part of the compiled program's identity."""

    sampling: SamplingConfig
    compression: CompressionConfig
    stop_ids: tuple[int, ...]  # token ids that end a row
    capacity: int  # C, cache slots per (layer, KV head, row)
    max_new: int  # M, tokens generated (or teacher-forced) per row
    teacher: bool = False  # tokens are given: score them instead of sampling
    keep_dists: bool = False  # teacher mode: also keep every step's log-probabilities [V]
    record_kept: bool = False  # log the positions each compression kept, per layer and KV head
    # On a mesh (the caller runs under `jax.set_mesh`): how the cache and the compression are
    # split over it. None = one device, with no sharding constraint and no shard_map.
    rules: sharding.ShardingRules | None = None

    @property
    def max_events(self) -> int:
        """Compressions a row can run at most: the prompt's, then one per `buffer` new tokens."""
        cc = self.compression
        return 2 + self.max_new // cc.buffer if self.record_kept and cc.compressing else 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: kv.KVCache
    tokens: jax.Array  # [B, M] int32 generated (or given) tokens, 0 past a row's end
    num: jax.Array  # [B] int32 tokens generated per row (the stop token included)
    done: jax.Array  # [B] bool
    step: jax.Array  # [] int32 column of `tokens` to fill next
    key: jax.Array  # PRNG key of the run; step s samples with fold_in(key, s)
    thinking: jax.Array  # [B] bool: think-only mode compresses a row only while this holds
    compressions: jax.Array  # [B] int32 compressions run per row (prefill included)
    peak: jax.Array  # [B] int32 most occupied slots a row has had
    logprob: jax.Array  # [B, M] f32 teacher mode: log p(token); [B, 0] otherwise
    top1: jax.Array  # [B, M] int32 teacher mode: the argmax prediction; [B, 0] otherwise
    dists: jax.Array  # [B, M, V] f32 log-probs with keep_dists; [B, 0, 0] otherwise
    kept: jax.Array  # [B, E, L, K, budget] int32 positions kept by each compression (record_kept)


def _constrain(s: DecodeState, rules: sharding.ShardingRules | None) -> DecodeState:
    """Pins every leaf of the state (rows on "data", the cache also on "model"). Prefill and
    each decode chunk end with it, so every chunk receives the shardings the previous one
    returned and decode compiles once per generation on a mesh too."""
    if rules is None:
        return s

    def rows(x):  # [B, ...]: rows split, the rest whole
        return sharding.constrain(x, rules, "batch", *[None] * (x.ndim - 1))

    return DecodeState(
        cache=kv.constrain(s.cache, rules),
        tokens=rows(s.tokens),
        num=rows(s.num),
        done=rows(s.done),
        step=sharding.constrain(s.step, rules),
        key=sharding.constrain(s.key, rules),
        thinking=rows(s.thinking),
        compressions=rows(s.compressions),
        peak=rows(s.peak),
        logprob=rows(s.logprob),
        top1=rows(s.top1),
        dists=rows(s.dists),
        kept=rows(s.kept),
    )


def _causal_attend(positions: jax.Array):
    """attend() for a full forward over a (left-padded) prompt; collects each layer's q/K/V."""
    mask = layers.causal_mask(positions, positions)  # [B, T, T]

    def attend(i, q, k, v, qkvs):
        return layers.attention(q, k, v, mask, kv_axis=1), (*qkvs, (q, k, v))

    return attend


def _cache_attend(i, q, k, v, cache: kv.KVCache, rules: sharding.ShardingRules | None = None):
    """attend() for decode: append this token to the cache, then attend over the cache."""
    cache = kv.write(cache, i, q, k, v, rules)
    out = layers.attention(q, cache.keys(i), cache.values(i), cache.attend_mask(i), kv_axis=2)
    return out, cache


@jax.jit
def forward_logits(model, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens, positions [B, T] -> logits [B, T, V] float32 (no cache)."""
    TRACES["forward_logits"] += 1
    x, _ = model.hidden(tokens, positions, _causal_attend(positions), ())
    return model.head(x)


def _is_stop(tok: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32))


def _next_token(logits, s_tokens, step, key, plan: DecodePlan):
    """logits [B, V] -> (token [B], logprob [B] or None, top1 [B] or None, dist [B, V] or None)."""
    if not plan.teacher:
        return sample(logits, jax.random.fold_in(key, step), plan.sampling), None, None, None
    tok = jnp.take(s_tokens, step, axis=1)  # [B] the given token
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(logp, tok[:, None], axis=1)[:, 0]
    top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, chosen, top1, logp if plan.keep_dists else None


def _record(s_field, value, step):
    """Writes value [B, ...] into column `step` of s_field [B, M, ...] (no-op when unused)."""
    if value is None:
        return s_field
    return jax.lax.dynamic_update_slice_in_dim(
        s_field, value[:, None].astype(s_field.dtype), step, 1
    )


@functools.partial(jax.jit, static_argnames=("plan",))
def prefill(
    model, tokens: jax.Array, positions: jax.Array, given: jax.Array, key: jax.Array, *, plan
) -> DecodeState:
    """Runs the prompt, fills the cache (compressing it if longer than the budget), emits token 0.

    Args:
      model: the decoder (pytree).
      tokens, positions: [B, P] int32, left-padded; positions are -1 at pads.
      given: [B, M] int32 tokens to score in teacher mode (ignored otherwise).
      key: PRNG key of the run.
      plan: static DecodePlan.
    """
    TRACES["prefill"] += 1
    cc = plan.compression
    x, qkvs = model.hidden(tokens, positions, _causal_attend(positions), ())
    logits = model.head(x[:, -1:])[:, 0]  # [B, V]; left padding puts every row's last token here
    qs, ks, vs = (tuple(t) for t in zip(*qkvs, strict=True))
    cache, squeezed = policy.prefill_cache(ks, vs, qs, positions, cc, plan.capacity, plan.rules)
    b, m = tokens.shape[0], plan.max_new
    buf = given if plan.teacher else jnp.zeros((b, m), jnp.int32)
    first, logp, top1, dist = _next_token(logits, buf, 0, key, plan)
    v = logits.shape[-1]
    state = DecodeState(
        cache=cache,
        tokens=buf.at[:, 0].set(first),
        num=jnp.ones((b,), jnp.int32),
        done=(_is_stop(first, plan.stop_ids) & (not plan.teacher))
        | (m == 1)
        | (plan.teacher & (buf[:, min(1, m - 1)] < 0)),
        step=jnp.asarray(1, jnp.int32),
        key=key,
        thinking=~_is_stop(first, _think_end(cc)),
        compressions=squeezed.astype(jnp.int32),
        peak=cache.length,
        logprob=_record(jnp.zeros((b, m if plan.teacher else 0), jnp.float32), logp, 0),
        top1=_record(jnp.zeros((b, m if plan.teacher else 0), jnp.int32), top1, 0),
        dists=_record(jnp.zeros((b, m, v) if plan.keep_dists else (b, 0, 0), jnp.float32), dist, 0),
        kept=_log_kept(
            jnp.full((b, plan.max_events, len(ks), ks[0].shape[2], cc.budget), -1, jnp.int32),
            cache,
            squeezed,
            jnp.zeros((b,), jnp.int32),
            cc.budget,
        ),
    )
    return _constrain(state, plan.rules)


def _log_kept(kept: jax.Array, cache: kv.KVCache, fired: jax.Array, count: jax.Array, budget):
    """Writes the positions now in the first `budget` slots of the fired rows into event
    `count[b]` of kept [B, E, L, K, budget] (nothing when recording is off)."""
    if kept.shape[1] == 0:
        return kept
    now = jnp.stack([sp[:, :, :budget] for sp in cache.slot_pos], axis=1)  # [B, L, K, budget]

    def row(buf, new, at, on):  # buf [E, L, K, budget]
        return jnp.where(on, jax.lax.dynamic_update_slice_in_dim(buf, new[None], at, 0), buf)

    return jax.lax.cond(
        jnp.any(fired), lambda k: jax.vmap(row)(k, now, count, fired), lambda k: k, kept
    )


def _think_end(cc: CompressionConfig) -> tuple[int, ...]:
    return () if cc.think_end_id is None else (cc.think_end_id,)


def _decode_step(model, s: DecodeState, plan: DecodePlan) -> DecodeState:
    cache, fired = policy.maybe_compress(
        s.cache, plan.compression, s.thinking, plan.rules, active=~s.done
    )
    last = jnp.take(s.tokens, s.step - 1, axis=1)  # [B]
    attend = functools.partial(_cache_attend, rules=plan.rules)
    x, cache = model.hidden(last[:, None], cache.pos[:, None], attend, cache)
    # Pinned every step, so the loop carry keeps the prefill's [B->data, K->model] layout.
    cache = kv.constrain(kv.advance(cache), plan.rules)
    tok, logp, top1, dist = _next_token(model.head(x)[:, 0], s.tokens, s.step, s.key, plan)
    tok = jnp.where(s.done, 0, tok)
    # Teacher mode: a row whose continuation has no token at step + 1 (-1 pad) is done.
    nxt = jnp.take(s.tokens, jnp.minimum(s.step + 1, plan.max_new - 1), axis=1)  # [B]
    ended = (nxt < 0) & (s.step + 1 < plan.max_new) if plan.teacher else False
    return DecodeState(
        cache=cache,
        tokens=_record(s.tokens, tok, s.step),
        num=s.num + ~s.done,
        done=s.done | (_is_stop(tok, plan.stop_ids) & (not plan.teacher)) | ended,
        step=s.step + 1,
        key=s.key,
        thinking=s.thinking & ~_is_stop(tok, _think_end(plan.compression)),
        compressions=s.compressions + fired,
        peak=jnp.where(s.done, s.peak, jnp.maximum(s.peak, cache.length)),
        logprob=_record(s.logprob, logp, s.step),
        top1=_record(s.top1, top1, s.step),
        dists=_record(s.dists, dist, s.step),
        kept=_log_kept(s.kept, cache, fired, s.compressions, plan.compression.budget),
    )


@functools.partial(jax.jit, static_argnames=("steps", "plan"), donate_argnames=("state",))
def decode(model, state: DecodeState, *, steps: int, plan: DecodePlan) -> DecodeState:
    """Up to `steps` decode steps on device; stops early once every row is done or M is reached."""
    TRACES["decode"] += 1
    end = jnp.minimum(state.step + steps, plan.max_new)

    def cond(s: DecodeState) -> Any:
        return (s.step < end) & ~jnp.all(s.done)

    state = jax.lax.while_loop(cond, lambda s: _decode_step(model, s, plan), state)
    return _constrain(state, plan.rules)
