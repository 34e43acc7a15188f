"""Next-token sampling with per-request settings, for a continuous-batching runtime.

Each batch row (slot) holds a different request. Its settings live in arrays (`SlotSampling`), so
requests with different settings share one compiled step and nothing recompiles when they change.
The fields and their meanings are vLLM's (`vllm.SamplingParams`), and so is the order in which
`sample_rows` applies them (`vllm/v1/sample/sampler.py`):

1. min_tokens: each row's stop tokens (its `stop_token_ids` and EOS) get -inf logits until it has
   made `min_tokens` tokens (vLLM's `MinTokensLogitsProcessor`, applied before the penalties).
2. Penalties (`vllm/model_executor/layers/utils.py`, `apply_penalties`): the repetition penalty on
   tokens seen in the prompt or the output (positive logits divided by it, others multiplied),
   then `logits -= frequency_penalty * count` and `logits -= presence_penalty * (count > 0)` over
   the output tokens, as the OpenAI API defines them.
3. Greedy rows (temperature < 1e-5, vLLM's `_SAMPLING_EPS`) take the argmax of these logits.
4. Other rows: divide by the temperature, then min_p (`MinPLogitsProcessor`: drop tokens whose
   probability is below `min_p` times the largest), then top-k, then top-p over what top-k kept
   (`apply_top_k_top_p`), then draw from the softmax of what is left.

Top-k and top-p are exact without sorting the vocabulary. Each finds a threshold and keeps every
logit at or above it, so tokens tied at the threshold are all kept, as in vLLM's threshold-based
`apply_top_k_only`: top-k keeps the logits >= the k-th largest; top-p keeps the logits >= the
largest t whose kept mass `sum(p_i for x_i >= t)` is at least `top_p`, renormalised over what
top-k kept (the smallest set of the most likely tokens that reaches `top_p`: vLLM's sort-based
rule in `apply_top_k_top_p`, with ties kept). The threshold is read off the 64 largest logits
when it lies among them (`k <= 64`, or a nucleus within them, the usual case for a language
model); otherwise it is searched: a bisection over the int32 image of the float32 bits, which is
monotone in the value, so it ends on one of the row's values exactly. It bisects the whole row
until few tokens are left in its bracket, then only the chunks holding those (`_largest_feasible`).
Which way a row takes depends on that row alone, and each step is skipped (`lax.cond`) when no row
of the batch needs it: a greedy or plain-temperature batch runs none of them.

The draw is a Gumbel-max in two levels with the row's own key: a 128-token chunk of the
vocabulary with probability proportional to its mass, then a token within it. That is the same
distribution as one Gumbel-max over the vocabulary, with V / 128 + 128 noise draws instead of V.
A row's randomness comes from `token_keys(seed, sample_index, token_index)` only, so its tokens
do not depend on its slot, its neighbours or the global step; and every step treats rows apart,
so a row's token is the same whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.sampling.params import (  # noqa: F401 (SamplingParams: its long-standing home)
    MAX_SEED,
    MAX_TEMPERATURE,
    SAMPLING_EPS,
    SamplingParams,
    is_int,
)

CANDIDATES = 64  # the largest logits, where top-k and top-p look first
TOP_CHUNK = 32  # tokens per chunk when finding the candidates
SEARCH_CHUNK = 64  # the search gathers chunks of this many tokens...
SEARCH_GATHER = 64  # ...at most this many, once its bracket holds about half as many tokens
DRAW_CHUNK = 128  # tokens per chunk of the two-level draw
ARGMAX_CHUNK = 128  # tokens per chunk of the greedy argmax
ROW_BLOCK = 8  # on CPU, a larger batch that splits into blocks of this many is sampled by blocks

_NEG_INF_KEY = -2139095041  # _float_key(-inf), the smallest non-NaN key: 0xFF800000 ^ 0x7FFFFFFF


# --------------------------------------------------------------------------------------------
# Slots: SlotSampling, keys, static config
# --------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Every slot's sampling settings as arrays, one row per slot.

    A runtime keeps one of B rows beside its other slot state and writes each admitted request
    into its slot with `set_rows`; the shapes never change, so the compiled step serves any mix
    of settings. An empty row is greedy with every filter and penalty off, so it never makes the
    batch run a search.
    """

    temperature: jax.Array  # [B] float32, < SAMPLING_EPS = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32, 1 = off
    presence_penalty: jax.Array  # [B] float32, 0 = off
    frequency_penalty: jax.Array  # [B] float32, 0 = off
    min_tokens: jax.Array  # [B] int32
    seed: jax.Array  # [B] uint32
    sample_index: jax.Array  # [B] int32: which of its prompt's n samples the row makes

    @classmethod
    def empty(cls, batch: int) -> SlotSampling:
        """`batch` empty rows.

        Args:
          batch: rows.

        Returns:
          The SlotSampling, on the default device.
        """
        return cls.from_params([], batch=batch)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        batch: int | None = None,
        sample_indices: Sequence[int] | None = None,
        rng: np.random.Generator | None = None,
        host: bool = False,
    ) -> SlotSampling:
        """Rows from requests. A `seed=None` row gets a fresh random 32-bit seed.

        Args:
          params: one request per row (repeat a request for each of its n samples).
          batch: rows in all, >= len(params); the rest are empty rows (default len(params)).
          sample_indices: each row's sample index in [0, its n) (default 0).
          rng: where fresh seeds come from (default the OS's entropy).
          host: keep the columns as NumPy arrays (a runtime sends them to the device with the
            rest of an insert, in one transfer); default: on the default device.

        Returns:
          The SlotSampling.
        """
        batch = len(params) if batch is None else batch
        if batch < len(params):
            raise ValueError(f"batch ({batch}) must be >= the number of rows ({len(params)})")
        indices = [0] * len(params) if sample_indices is None else list(sample_indices)
        if len(indices) != len(params):
            raise ValueError(f"sample_indices has {len(indices)} entries for {len(params)} rows")
        for p, i in zip(params, indices, strict=True):
            if not is_int(i) or not 0 <= i < p.n:
                raise ValueError(f"sample index must be an int in [0, n={p.n}), got {i!r}")

        def column(values, fill, dtype):  # -> [batch]
            col = np.array(list(values) + [fill] * (batch - len(params)), dtype)
            return col if host else jnp.asarray(col)

        int32_max = np.iinfo(np.int32).max  # a top_k or min_tokens past it means the same

        def fresh() -> int:
            return int(rng.integers(0, MAX_SEED + 1)) if rng is not None else secrets.randbits(32)

        seeds = [fresh() if p.seed is None else p.seed for p in params]
        return cls(
            temperature=column((p.temperature for p in params), 0.0, np.float32),
            top_k=column((min(p.top_k, int32_max) for p in params), 0, np.int32),
            top_p=column((p.top_p for p in params), 1.0, np.float32),
            min_p=column((p.min_p for p in params), 0.0, np.float32),
            repetition_penalty=column((p.repetition_penalty for p in params), 1.0, np.float32),
            presence_penalty=column((p.presence_penalty for p in params), 0.0, np.float32),
            frequency_penalty=column((p.frequency_penalty for p in params), 0.0, np.float32),
            min_tokens=column((min(p.min_tokens, int32_max) for p in params), 0, np.int32),
            seed=column(seeds, 0, np.uint32),
            sample_index=column(indices, 0, np.int32),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def set_rows(self, slots: jax.Array, rows: SlotSampling) -> SlotSampling:
        """These settings with `rows` written into `slots` (jittable).

        Args:
          slots: [N] int32 the slot of each row; slots outside [0, B), negative ones too, are
            dropped. With a slot twice, which row lands is unspecified.
          rows: N rows.

        Returns:
          The updated SlotSampling.
        """
        slots = jnp.asarray(slots, jnp.int32)  # [N]
        # .at[] would wrap a negative index around; send it past the end to be dropped instead.
        slots = jnp.where(slots < 0, self.batch_size, slots)  # [N]
        return jax.tree.map(
            lambda old, new: old.at[slots].set(new.astype(old.dtype), mode="drop"), self, rows
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """What a compiled step computes besides the tokens, fixed at compile time (a change
    recompiles, so a runtime picks it for the requests it serves: `for_requests`).

    Attributes:
      penalties: the step keeps `output_counts` ([B, V] int32) and `prompt_mask` ([B, V] bool)
        per slot and passes them to `sample_rows`; without, it passes None and keeps neither.
      logprobs: None = no logprobs; N >= 0 = `token_logprobs(logits, tokens, N)` each step.
    """

    penalties: bool = False
    logprobs: int | None = None
    row_blocks: bool | None = None  # `sample_rows`' row blocks: a runtime sets it (CPU: True)

    def __post_init__(self):
        if not isinstance(self.penalties, bool):
            raise ValueError(f"penalties must be a bool, got {self.penalties!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")

    @classmethod
    def for_requests(cls, params: Sequence[SamplingParams]) -> SamplerConfig:
        """The smallest config that serves `params`.

        Args:
          params: the requests.

        Returns:
          penalties if any request uses one; logprobs the largest requested, or None.
        """
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            penalties=any(p.uses_penalties for p in params),
            logprobs=max(wanted) if wanted else None,
        )


def token_keys(seed: jax.Array, sample_index: jax.Array, token_index: jax.Array) -> jax.Array:
    """Each row's key for one token: fold_in(fold_in(key(seed), sample_index), token_index).

    Args:
      seed: [B] uint32 the request's seed.
      sample_index: [B] int32 which of the prompt's n samples.
      token_index: [B] int32 the token's index in the output (0 = the first generated token).

    Returns:
      [B] typed PRNG keys (the default implementation, threefry2x32).
    """

    def one(s, i, t):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), t)

    return jax.vmap(one)(seed, sample_index, token_index)


def token_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Which tokens appear in each row of `ids`: `prompt_mask` from prompt ids, or `stop_mask`
    from each row's `min_tokens_stop_ids`.

    Args:
      ids: [B, L] int32; entries outside [0, vocab_size) are padding and ignored.
      vocab_size: V.

    Returns:
      [B, V] bool.
    """
    ids = jnp.asarray(ids, jnp.int32)  # [B, L]
    ids = jnp.where(ids < 0, vocab_size, ids)  # [B, L]: negatives would wrap
    rows = jnp.arange(ids.shape[0])[:, None]  # [B, 1]
    mask = jnp.zeros((ids.shape[0], vocab_size), jnp.bool_)  # [B, V]
    return mask.at[rows, ids].set(True, mode="drop")


def update_output_counts(counts: jax.Array, tokens: jax.Array, stepped: jax.Array) -> jax.Array:
    """Counts each row's new token, for the penalties.

    Args:
      counts: [B, V] int32 each token's count in the row's output so far.
      tokens: [B] int32 the tokens just made.
      stepped: [B] bool rows that made a token this step (the others keep their counts).

    Returns:
      [B, V] int32.
    """
    rows = jnp.arange(counts.shape[0])  # [B]
    tokens = jnp.where(tokens < 0, counts.shape[1], tokens)  # [B]: negatives would wrap
    return counts.at[rows, tokens].add(stepped.astype(counts.dtype), mode="drop")


# --------------------------------------------------------------------------------------------
# Logit processing
# --------------------------------------------------------------------------------------------


def apply_min_tokens(
    logits: jax.Array, min_tokens: jax.Array, num_generated: jax.Array, stop_mask: jax.Array
) -> jax.Array:
    """Blocks each row's stop tokens while it has made fewer than `min_tokens` tokens.

    Args:
      logits: [B, V] float32.
      min_tokens: [B] int32.
      num_generated: [B] int32 tokens the row has made so far.
      stop_mask: [B, V] bool the row's stop tokens, EOS included.

    Returns:
      [B, V] float32 with the blocked tokens at -inf.
    """
    block = (num_generated < min_tokens)[:, None] & stop_mask  # [B, V]
    return jnp.where(block, -jnp.inf, logits)


def apply_penalties(
    logits: jax.Array,
    params: SlotSampling,
    output_counts: jax.Array,
    prompt_mask: jax.Array | None = None,
) -> jax.Array:
    """vLLM's repetition, frequency and presence penalties.

    Args:
      logits: [B, V] float32.
      params: the rows' settings.
      output_counts: [B, V] int32 each token's count in the row's output.
      prompt_mask: [B, V] bool tokens in the row's prompt (None: the output only).

    Returns:
      [B, V] float32. Rows with every penalty off are unchanged bit for bit.
    """
    in_output = output_counts > 0  # [B, V]
    seen = in_output if prompt_mask is None else in_output | prompt_mask  # [B, V]
    rep = jnp.where(seen, params.repetition_penalty[:, None], 1.0)  # [B, V]
    logits = jnp.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits = logits - params.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - params.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _float_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (-0.0 just below +0.0): flip negatives' magnitude."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_float(key: jax.Array) -> jax.Array:
    """The inverse of `_float_key`."""
    bits = jnp.where(key < 0, key ^ 0x7FFFFFFF, key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _halfway(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """floor((lo + hi) / 2) of int32 keys, without overflow."""
    return (lo & hi) + ((lo ^ hi) >> 1)


def _unsettled(bracket) -> jax.Array:
    """[B] whether a bracket (lo, hi, ...) holds more than one key."""
    lo, hi = bracket[0], bracket[1]
    return hi.astype(jnp.uint32) - lo.astype(jnp.uint32) > 1


def _mass_at(x: jax.Array, w: jax.Array | None, key: jax.Array) -> jax.Array:
    """sum(w_i for x_i >= key) per row: x, w [B, n] (w None: 1), key [B] int32 -> [B]."""
    return jnp.sum(jnp.where(x >= _key_float(key)[:, None], 1.0 if w is None else w, 0.0), -1)


def _bisect(x, w, offset, target, bracket, searching):
    """Halves the bracket of every row `searching` picks until it picks none.

    Args:
      x: [B, n] float32.
      w: [B, n] float32 weights, or None (1).
      offset: [B] float32 mass lying outside x, added to every mass.
      target: [B] float32.
      bracket: (lo, hi, mass_lo, mass_hi) [B] each: mass(lo) >= target > mass(hi).
      searching: bracket -> [B] bool.

    Returns:
      The final bracket.
    """

    def step(state):
        lo, hi, mass_lo, mass_hi = state
        mid = _halfway(lo, hi)  # [B]
        mass = offset + _mass_at(x, w, mid)  # [B]
        on = searching(state)
        up = on & (mass >= target)  # [B] the answer is >= mid
        down = on & ~(mass >= target)
        return (
            jnp.where(up, mid, lo),
            jnp.where(down, mid, hi),
            jnp.where(up, mass, mass_lo),
            jnp.where(down, mass, mass_hi),
        )

    return jax.lax.while_loop(lambda s: jnp.any(searching(s)), step, bracket)


def _gather_bracket(x, w, bracket, gather: int):
    """The SEARCH_CHUNK-token chunks holding the bracket's tokens, `gather` of them per row.

    Args:
      x: [B, Vp] float32, Vp a multiple of SEARCH_CHUNK.
      w: [B, Vp] float32 weights, or None (1).
      bracket: (lo, hi, ...) [B] int32 keys.
      gather: chunks per row, static.

    Returns:
      (x, w) of the gathered chunks [B, gather * SEARCH_CHUNK], w zero outside the bracket; and
      [B] bool whether the row's bracket fit (all its tokens were gathered, or it holds one key).
    """
    b, chunks = x.shape[0], x.shape[1] // SEARCH_CHUNK
    lo, hi = _key_float(bracket[0])[:, None], _key_float(bracket[1])[:, None]  # [B, 1]
    inside = (x >= lo) & (x < hi)  # [B, Vp]
    holds = jnp.any(inside.reshape(b, chunks, SEARCH_CHUNK), axis=-1)  # [B, chunks]
    fits = (jnp.sum(holds, axis=-1) <= gather) | ~_unsettled(bracket)  # [B]
    # float32: XLA:CPU has a fast top_k for floats only (ints: 10x slower)
    ids = jax.lax.top_k(holds.astype(jnp.float32), gather)[1]  # [B, G] the holding chunks

    def take(a):  # [B, Vp] -> [B, G * SEARCH_CHUNK]
        a = a.reshape(b, chunks, SEARCH_CHUNK)
        return jnp.take_along_axis(a, ids[:, :, None], axis=1).reshape(b, -1)

    xg = take(x)  # [B, G * SEARCH_CHUNK]
    wg = jnp.where((xg >= lo) & (xg < hi), 1.0 if w is None else take(w), 0.0)
    return xg, wg, fits


def _largest_feasible(x: jax.Array, w: jax.Array | None, target, bracket, least) -> jax.Array:
    """The largest t with mass(t) = sum(w_i for x_i >= t) >= target, per row, by bisection over
    the int32 keys of the float32 values (exact: the answer is one of the row's values).

    Plain bisection makes 32 passes over the whole row. This bisects the whole row only until
    the bracket [lo, hi) holds about SEARCH_GATHER / 2 tokens by its mass (mass / the least
    weight in it), then gathers the SEARCH_CHUNK-token chunks holding them and goes on over those
    alone, with mass(hi) as a constant: on a flat top-p row, 6 passes over the row and 20 over a
    twelfth of it. A row whose tokens lie in more chunks than were gathered (the estimate is a
    float one) goes on over the whole row instead. Each row's way and stops depend on that row
    alone, so its answer does not depend on its neighbours.

    Args:
      x: [B, V] float32.
      w: [B, V] float32 weights >= 0, or None to count (w = 1).
      target: [B] float32.
      bracket: (lo, hi, mass_lo, mass_hi): [B] int32 keys with mass(lo) >= target >
        mass(hi) and lo < hi (hi = lo + 1: nothing to search), and [B] float32 their masses.
      least: [B] float32 thresholds -> [B] float32 the least weight of a token at or above them.

    Returns:
      [B] float32.
    """
    vocab = x.shape[1]
    chunks = -(-vocab // SEARCH_CHUNK)
    gather = min(SEARCH_GATHER, chunks)
    # NaN padding is never >= anything, so never counted nor inside a bracket.
    pad = ((0, 0), (0, chunks * SEARCH_CHUNK - vocab))
    x = jnp.pad(x, pad, constant_values=jnp.nan)  # [B, Vp]
    w = None if w is None else jnp.pad(w, pad)  # [B, Vp]
    zero = jnp.zeros_like(target)  # [B]

    def wide(state):  # [B] rows whose bracket holds too many tokens to gather
        lo, _, mass_lo, mass_hi = state
        few = mass_lo - mass_hi <= 0.5 * gather * least(_key_float(lo))
        return _unsettled(state) & ~few

    bracket = _bisect(x, w, zero, target, bracket, wide)
    xg, wg, fits = _gather_bracket(x, w, bracket, gather)
    found = _bisect(xg, wg, bracket[3], target, bracket, _unsettled)[0]  # [B]

    def whole_row():  # the rows that did not fit, bisected over the whole row to the end
        rest = _bisect(x, w, zero, target, bracket, lambda s: ~fits & _unsettled(s))[0]
        return jnp.where(fits, found, rest)

    return _key_float(jax.lax.cond(jnp.all(fits), lambda: found, whole_row))


def _top_k_threshold(x: jax.Array, k: jax.Array, top: jax.Array) -> jax.Array:
    """The k-th largest value of each row, -inf where top-k is off.

    Args:
      x: [B, V] float32.
      k: [B] int32, 0 or >= V = off.
      top: [B, C] float32 the row's C largest values, in descending order.

    Returns:
      [B] float32.
    """
    vocab, c = x.shape[-1], top.shape[-1]
    on = (k > 0) & (k < vocab)  # [B]
    kk = jnp.clip(k, 1, vocab)  # [B]
    from_top = jnp.take_along_axis(top, jnp.minimum(kk, c)[:, None] - 1, axis=-1)[:, 0]  # [B]
    past = on & (kk > c)  # [B] rows whose k-th lies past the candidates

    def search():  # counts are exact, so both ways give the same threshold
        lo = jnp.full(k.shape, _NEG_INF_KEY, jnp.int32)  # [B] every token is >= -inf
        # Above the last candidate lie only candidates, fewer than k.
        hi = jnp.where(past, _float_key(top[:, -1]) + 1, lo + 1)  # [B]
        n_hi = jnp.sum(top > top[:, -1:], axis=-1).astype(jnp.float32)  # [B]
        n_lo = jnp.full(k.shape, vocab, jnp.float32)  # [B]
        ones = lambda t: jnp.ones_like(t)
        found = _largest_feasible(x, None, kk.astype(jnp.float32), (lo, hi, n_lo, n_hi), ones)
        return jnp.where(past, found, from_top)

    t = jax.lax.cond(jnp.any(past), search, lambda: from_top)  # [B]
    return jnp.where(on, t, -jnp.inf)


def _top_p_threshold(x: jax.Array, p: jax.Array, top: jax.Array) -> jax.Array:
    """The largest t with mass(x >= t) >= p per row (over the finite logits), -inf where off.

    Read off the candidates when the row's answer is among them; searched otherwise. Each row's
    way depends only on the row, so its threshold does not depend on its neighbours.

    Args:
      x: [B, V] float32 (removed tokens at -inf).
      p: [B] float32, 1 = off.
      top: [B, C] float32 the row's C largest values of x, in descending order.

    Returns:
      [B] float32.
    """
    on = p < 1.0  # [B]
    vocab = x.shape[-1]

    def threshold():
        m = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
        e = jnp.exp(x - m)  # [B, V] unnormalised probabilities
        total = jnp.sum(e, axis=-1)  # [B]
        target = p * total  # [B]
        # Mass at or above each candidate counted among the candidates: exact, but where the
        # last candidate's value goes on past the C largest, where it falls short. Falling short
        # can only send a row to the search, so `enough` is always right.
        e_top = jnp.exp(top - m)  # [B, C]
        above = top[:, None, :] >= top[:, :, None]  # [B, C, C] (j, i): candidate i >= j
        mass = jnp.sum(jnp.where(above, e_top[:, None, :], 0.0), axis=-1)  # [B, C]
        enough = mass >= target[:, None]  # [B, C]
        past = on & ~jnp.any(enough, axis=-1)  # [B] rows whose answer lies past the candidates
        from_top = jnp.max(jnp.where(enough, top, -jnp.inf), axis=-1)  # [B]

        def search():
            # Above the last candidate lie only candidates, without enough mass. And every token
            # below max - log(V / (1 - p)) - 1 together holds under (1 - p) / e of the mass, so
            # the answer is above that (checked: from -inf where float rounding says otherwise).
            hi = _float_key(top[:, -1]) + 1  # [B]
            strict = top > top[:, -1:]  # [B, C]
            mass_hi = jnp.sum(jnp.where(strict, e_top, 0.0), axis=-1)  # [B]
            lo_f = m - (math.log(vocab) - jnp.log1p(-p) + 1.0)[:, None]  # [B, 1]
            mass_lo = jnp.sum(jnp.where(x >= lo_f, e, 0.0), axis=-1)  # [B]
            lo = _float_key(lo_f[:, 0])  # [B]
            ok = (lo < hi) & (mass_lo >= target)  # [B]
            lo = jnp.where(ok, lo, _NEG_INF_KEY)
            mass_lo = jnp.where(ok, mass_lo, total)
            hi = jnp.where(past, hi, lo + 1)
            least = lambda t: jnp.exp(t - m[:, 0])  # e is exp(x - m), and exp only goes up
            found = _largest_feasible(x, e, target, (lo, hi, mass_lo, mass_hi), least)
            return jnp.where(past, found, from_top)

        return jax.lax.cond(jnp.any(past), search, lambda: from_top)  # [B]

    t = jax.lax.cond(jnp.any(on), threshold, lambda: jnp.full(p.shape, -jnp.inf))
    return jnp.where(on, t, -jnp.inf)


def _top_values(x: jax.Array, c: int) -> jax.Array:
    """The c largest values of each row, in descending order, as `lax.top_k(x, c)[0]`.

    Cheaper than lax.top_k over the whole row (a third of its time at V = 49,152): the chunks
    of TOP_CHUNK tokens with the c largest maxima hold every value above the c-th largest chunk
    maximum, and at least c values at or above it, so their c largest values are the row's.

    Args:
      x: [B, V] float32.
      c: static, <= V.

    Returns:
      [B, c] float32.
    """
    b, vocab = x.shape
    chunks = -(-vocab // TOP_CHUNK)
    if chunks < 2 * c:
        return jax.lax.top_k(x, c)[0]
    pad = ((0, 0), (0, chunks * TOP_CHUNK - vocab))
    x = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(b, chunks, TOP_CHUNK)
    ids = jax.lax.top_k(jnp.max(x, axis=-1), c)[1]  # [B, c] chunks
    held = jnp.take_along_axis(x, ids[:, :, None], axis=1).reshape(b, c * TOP_CHUNK)
    return jax.lax.top_k(held, c)[0]


def _truncate(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k, then top-p over what top-k kept. x [B, V] float32 -> [B, V] float32."""
    top = _top_values(x, min(CANDIDATES, x.shape[-1]))  # [B, C] descending
    t_k = _top_k_threshold(x, top_k, top)[:, None]  # [B, 1]
    x = jnp.where(x < t_k, -jnp.inf, x)  # [B, V]
    top = jnp.where(top < t_k, -jnp.inf, top)  # [B, C] still x's C largest
    t_p = _top_p_threshold(x, top_p, top)[:, None]  # [B, 1]
    return jnp.where(x < t_p, -jnp.inf, x)


def _min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens with p_i < min_p * p_max, in logit space: x_i - x_max < log(min_p).

    x [B, V] float32, min_p [B] -> [B, V] float32.
    """
    log_min_p = jnp.log(min_p)[:, None]  # [B, 1] -inf where off
    return jnp.where(x - jnp.max(x, axis=-1, keepdims=True) < log_min_p, -jnp.inf, x)


def filter_logits(logits: jax.Array, params: SlotSampling) -> jax.Array:
    """Temperature, min_p, top-k and top-p, in vLLM's order, on every row.

    Greedy rows are scaled by 1 (their own filters are off once normalised by SamplingParams).

    Args:
      logits: [B, V] float32, after min_tokens and the penalties.
      params: the rows' settings.

    Returns:
      [B, V] float32 the logits to draw from: scaled, removed tokens at -inf.
    """
    t = jnp.where(params.temperature < SAMPLING_EPS, 1.0, params.temperature)  # [B]
    x = logits.astype(jnp.float32) / t[:, None]  # [B, V]
    x = jax.lax.cond(jnp.any(params.min_p > 0.0), _min_p, lambda x, _: x, x, params.min_p)
    vocab = x.shape[-1]
    truncating = jnp.any(((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0))
    return jax.lax.cond(truncating, _truncate, lambda x, *_: x, x, params.top_k, params.top_p)


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row from softmax(logits), with the row's key; exact Gumbel-max in two levels.

    A chunk of DRAW_CHUNK tokens is drawn by Gumbel-max over the chunks' log-masses, then a token
    within it by Gumbel-max over its logits: P(token) = P(chunk) P(token | chunk), the same law
    as one Gumbel-max over V with far fewer noise draws. A row's draw depends only on its key and
    its logits.

    Args:
      keys: [B] typed PRNG keys.
      logits: [B, V] float32, -inf = never.

    Returns:
      [B] int32.
    """
    b, vocab = logits.shape
    chunks = -(-vocab // DRAW_CHUNK)
    x = jnp.pad(logits, ((0, 0), (0, chunks * DRAW_CHUNK - vocab)), constant_values=-jnp.inf)
    x = x.reshape(b, chunks, DRAW_CHUNK)  # [B, chunks, DRAW_CHUNK]
    m = jnp.max(x, axis=(1, 2), keepdims=True)  # [B, 1, 1]
    log_mass = jnp.log(jnp.sum(jnp.exp(x - m), axis=-1))  # [B, chunks]

    # One noise draw per row for both levels: on CPU two calls cost 3x one of their total size.
    shape = (chunks + DRAW_CHUNK,)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, shape))(keys)  # [B, chunks + CHUNK]
    chunk = jnp.argmax(log_mass + noise[:, :chunks], axis=-1)  # [B]
    within = jnp.take_along_axis(x, chunk[:, None, None], axis=1)[:, 0]  # [B, DRAW_CHUNK]
    token = jnp.argmax(within + noise[:, chunks:], axis=-1)  # [B]
    return (chunk * DRAW_CHUNK + token).astype(jnp.int32)


def argmax(logits: jax.Array) -> jax.Array:
    """The first index of each row's maximum, as `jnp.argmax`, in a fifth of its time on CPU.

    XLA:CPU's argmax is a (value, index) reduction that does not vectorise; a max per chunk of
    ARGMAX_CHUNK tokens does, and the argmax then runs over the chunk maxima and one chunk.

    Args:
      logits: [B, V].

    Returns:
      [B] int32.
    """
    b, vocab = logits.shape
    chunks = -(-vocab // ARGMAX_CHUNK)
    if chunks < 2:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    pad = ((0, 0), (0, chunks * ARGMAX_CHUNK - vocab))
    x = jnp.pad(logits, pad, constant_values=-jnp.inf).reshape(b, chunks, ARGMAX_CHUNK)
    chunk = jnp.argmax(jnp.max(x, axis=-1), axis=-1)  # [B] the first chunk holding the max
    within = jnp.take_along_axis(x, chunk[:, None, None], axis=1)[:, 0]  # [B, ARGMAX_CHUNK]
    return (chunk * ARGMAX_CHUNK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def sample_rows(
    logits: jax.Array,
    params: SlotSampling,
    keys: jax.Array,
    *,
    output_counts: jax.Array | None = None,
    prompt_mask: jax.Array | None = None,
    num_generated: jax.Array | None = None,
    stop_mask: jax.Array | None = None,
    row_blocks: bool | None = None,
) -> jax.Array:
    """The next token of every row, each with its own settings and key.

    Order as vLLM's sampler: min_tokens, penalties, greedy argmax, then temperature, min_p, top-k,
    top-p and the draw for the other rows. A row's token depends only on its own logits, settings,
    state and key, never on the other rows. Steps no row needs are skipped (`lax.cond`).

    Args:
      logits: [B, V] float32 (other float types are converted).
      params: the rows' settings.
      keys: [B] typed PRNG keys, from `token_keys`.
      output_counts: [B, V] int32 token counts of each row's output, for the penalties (None = no
        penalties).
      prompt_mask: [B, V] bool tokens of each row's prompt, for the repetition penalty.
      num_generated: [B] int32 tokens each row has made, for min_tokens.
      stop_mask: [B, V] bool each row's stop tokens incl. EOS, for min_tokens (None = skip it).
      row_blocks: draw in blocks of ROW_BLOCK rows (`_by_row_blocks`; a runtime decides it
        from its devices: on CPU); None: when the process's default backend is the CPU.

    Returns:
      [B] int32.
    """
    x = logits.astype(jnp.float32)  # [B, V]
    if row_blocks is None:
        row_blocks = jax.default_backend() == "cpu"
    if stop_mask is not None:
        if num_generated is None:
            raise ValueError("stop_mask needs num_generated (tokens each row has made)")
        x = apply_min_tokens(x, params.min_tokens, num_generated, stop_mask)
    if output_counts is not None:
        penalised = (
            (params.repetition_penalty != 1.0)
            | (params.presence_penalty != 0.0)
            | (params.frequency_penalty != 0.0)
        )
        x = jax.lax.cond(
            jnp.any(penalised),
            lambda x: apply_penalties(x, params, output_counts, prompt_mask),
            lambda x: x,
            x,
        )
    greedy = params.temperature < SAMPLING_EPS  # [B]

    def sampled():
        drawn = _by_row_blocks(
            lambda x, p, k: draw(k, filter_logits(x, p)), row_blocks, x, params, keys
        )
        return jax.lax.cond(
            jnp.any(greedy), lambda: jnp.where(greedy, argmax(x), drawn), lambda: drawn
        )

    return jax.lax.cond(jnp.all(greedy), lambda: argmax(x), sampled)


def _by_row_blocks(fn, enabled: bool, *rows):
    """fn over blocks of ROW_BLOCK rows in turn (`lax.map`) on CPU, when the batch splits into
    several: each block's [ROW_BLOCK, V] working set stays in the cache, where a whole batch-64
    working set would not (2.3x faster at batch 64). Elsewhere, where no cache is to be won,
    blocks in turn would only serialise the work. fn must treat rows independently, so the
    blocks change no result.

    Args:
      fn: pytrees of [b, ...] rows -> [b].
      *rows: pytrees of [B, ...] arrays.

    Returns:
      [B].
    """
    b = jax.tree.leaves(rows)[0].shape[0]
    if not enabled or b <= ROW_BLOCK or b % ROW_BLOCK:
        return fn(*rows)

    def split(a):  # [B, ...] -> [B / ROW_BLOCK, ROW_BLOCK, ...]
        return a.reshape(b // ROW_BLOCK, ROW_BLOCK, *a.shape[1:])

    return jax.lax.map(lambda r: fn(*r), jax.tree.map(split, rows)).reshape(b)


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """vLLM's default (`raw_logprobs`) logprobs: log_softmax of the raw logits, before penalties,
    temperature and filters.

    Args:
      logits: [B, V] the model's logits.
      tokens: [B] int32 the chosen tokens.
      n: how many of the most likely tokens to return (static, >= 0).

    Returns:
      chosen [B] float32 the chosen tokens' logprobs, top_ids [B, n] int32 and top_logprobs
      [B, n] float32 the n most likely tokens, most likely first.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if n == 0:
        b = logits.shape[0]
        return chosen, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, n)  # [B, n]
    return chosen, top_ids.astype(jnp.int32), top_logprobs
