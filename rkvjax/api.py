"""The public functions: generate, score, logits. Each builds requests and drives the runtime."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rkvjax import runtime
from rkvjax.defaults import BUFFER, WINDOW
from rkvjax.kv.config import CompressionConfig, compression_config
from rkvjax.models.loading import DEFAULT_MODEL, Model, as_dtype, load
from rkvjax.runtime import programs, requests, sizing
from rkvjax.runtime.results import GenerationResult, GenerationStats, ScoreResult
from rkvjax.sampling.params import SamplingParams

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_MODEL",
    "GenerationResult",
    "GenerationStats",
    "Model",
    "ScoreResult",
    "as_dtype",
    "engine_for",
    "generate",
    "load",
    "logits",
    "per_prompt_sampling",
    "score",
]

DEFAULT_MAX_NEW_TOKENS = 256


def per_prompt_sampling(n_prompts: int, **kw) -> list[SamplingParams]:
    """SamplingParams fields (generate()'s shorthand keywords, the command line's flags) as one
    SamplingParams per prompt. Prompt i samples with seed + i, so the prompts of a batch draw
    differently and each prompt's draws are the same alone or in any batch."""
    seed = kw.pop("seed")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return [SamplingParams(seed=(int(seed) + i) % 2**32, **kw) for i in range(n_prompts)]


def _sampling_list(sampling, n_prompts: int) -> list[SamplingParams]:
    if isinstance(sampling, SamplingParams):
        return [sampling] * n_prompts
    if isinstance(sampling, Sequence) and not isinstance(sampling, str):
        sampling = list(sampling)
        if len(sampling) != n_prompts or not all(isinstance(s, SamplingParams) for s in sampling):
            raise ValueError(
                f"sampling must be one SamplingParams or one per prompt ({n_prompts}), got "
                f"{len(sampling)} items"
            )
        return sampling
    raise ValueError(f"sampling must be a SamplingParams or a list of them, got {sampling!r}")


def _think_end_id(model: Model, token: str | int) -> int:
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        return requests.token_id(token, model.config.vocab_size, "think_end_token")
    if model.tokenizer is None:
        raise ValueError("think_only needs a tokenizer to find the end-of-thinking token")
    ids = model.tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"think_end_token {token!r} is not a single token of this tokenizer ({ids}); "
            "think-only mode needs a model with a dedicated end-of-thinking token"
        )
    return ids[0]


def _stop_width(model: Model, params: list[SamplingParams]) -> int:
    eos = model.eos_token_ids
    most = max(len(sp.min_tokens_stop_ids(eos)) for sp in params)
    return max(1, 1 << (max(most, 1) - 1).bit_length())


def cache_config(
    model: Model,
    *,
    prompt_len: int,
    max_new: int,
    method: str = "rkv",
    budget: int | float | None = None,
    think_only: bool = False,
    think_end_token: str | int = "</think>",
    answer_slots: int | None = None,
    pallas: bool | None = None,
    **kw,
) -> CompressionConfig:
    """The engine's CompressionConfig from `generate`'s cache keywords: a fractional budget is
    a fraction of prompt_len + max_new; think-only mode finds the end-of-thinking token."""
    return compression_config(
        method,
        budget,
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        think_end_id=_think_end_id(model, think_end_token) if think_only else None,
        answer_slots=answer_slots,
        pallas=pallas,
        **kw,
    )


def engine_for(
    model: Model,
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    slots: int | None = None,
    slot_cap: int | None = None,
    chunk: int = runtime.DEFAULT_CHUNK,
    lanes: int | None = None,
    record_kept: bool = False,
    prefill_by_length: bool = True,
    narrow_tail: bool = True,
    batch_invariant: bool | None = None,
    chat: bool | None = None,
    progress: bool = False,
    total: int | None = None,
    **cache,
) -> runtime.Engine:
    """The Engine `generate` would build for these requests (arguments as in `generate`;
    `cache` holds its cache-policy keywords: method, budget, buffer, window, think_only,
    think_end_token, answer_slots, pallas, kv_dtype and the method's options). A fractional budget
    and the FullKV length follow the longest prompt and max_tokens, and the engine's logprobs,
    penalties and stop-id width cover every request; `slot_cap` caps the default slot count;
    `prefill_by_length`, `narrow_tail` and `batch_invariant` as in `Engine`.
    Offline jobs build theirs here from the whole input, so a resumed job runs the same
    program."""
    ids = [list(row) for row in prompt_ids]
    max_new = max(sp.max_tokens for sp in params)
    cc = cache_config(model, prompt_len=max(map(len, ids)), max_new=max_new, **cache)
    samples = sum(sp.n for sp in params)
    penalties = any(sp.uses_penalties for sp in params)
    # FullKV holds the prompt bucket plus every new token but the last (never appended): the
    # bucket, not the longest prompt, so calls with other prompt lengths reuse the program.
    longest = max(map(len, ids))
    if cc.compressing:
        capacity = cc.capacity
    else:
        capacity = requests.bucket(longest, model.config.max_positions - max_new) + max_new - 1
    if slots is None:
        slots = sizing.default_slots(
            model, cc, samples=samples, capacity=capacity, penalties=penalties
        )
        if slot_cap is not None:
            slots = max(model.data_shards, min(slots, slot_cap))
    # At most the vocabulary: a request asking for more is refused by name when submitted.
    lps = [min(sp.logprobs, model.config.vocab_size) for sp in params if sp.logprobs is not None]
    return runtime.Engine(
        model,
        slots=slots,
        cache=cc,
        max_len=None if cc.compressing else capacity,
        chunk=chunk,
        lanes=lanes,
        logprobs=max(lps) if lps else None,
        penalties=penalties,
        stop_width=_stop_width(model, params),
        record_kept=record_kept,
        prefill_by_length=prefill_by_length,
        narrow_tail=narrow_tail,
        batch_invariant=batch_invariant,
        chat=chat,
        progress=progress,
        total=total,
    )


def generate(
    model: Model,
    prompts,
    *,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    slots: int | None = None,
    budget: int | float | None = None,
    method: str = "rkv",
    buffer: int = BUFFER,
    window: int = WINDOW,
    think_only: bool = False,
    think_end_token: str | int = "</think>",
    answer_slots: int | None = None,
    pallas: bool | None = None,
    kernels: bool | None = None,
    kv_dtype: str | None = None,
    batch_invariant: bool | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool | None = None,
    chat: bool | None = None,
    progress: bool = False,
    record_kept: bool = False,
    chunk: int = runtime.DEFAULT_CHUNK,
    lanes: int | None = None,
    **options,
) -> GenerationResult | list:
    """Generates completions for one prompt or many, continuously batched over `slots` rows.

    Args:
      model: from `rkvjax.load`.
      prompts: a str, token ids (list[int] or a 1-D integer array), a chat (a list of
        {"role", "content"} messages), or a list of these.
      sampling: one `SamplingParams` for every prompt or one per prompt (vLLM's names: n,
        temperature, top_p, top_k, min_p, penalties, seed, max_tokens, min_tokens, stop,
        stop_token_ids, ignore_eos, logprobs). Without it, the shorthand keywords below apply.
      slots: rows decoded at once (default: every sample, when their caches fit in half of a
        device's memory less the weights, else the largest power of two of rows that does:
        `runtime.sizing.default_slots`). A finished row takes the next prompt at once.
      budget: KV tokens kept per (layer, KV head, row) by a compressing method (window
        included): an int, or a float in (0, 1] as a fraction of the longest prompt + the
        longest max_tokens. None = FullKV.
      method: "full" or a registered cache policy ("rkv", "snapkv", "streaming", "keydiff",
        ...: `rkvjax.kv.policies.names()`); with budget=None every method is FullKV.
      buffer: decoded tokens between compressions (the cache holds budget + buffer slots).
      window: the newest tokens, always kept, whose queries score the others.
      **options: the method's hyperparameters (`rkvjax.kv.policies.option_names(method)`), e.g.
        R-KV's kernel, lam, threshold, retain (RKV_SPEC.md); unset ones take the method's
        defaults.
      think_only: stop compressing a row once it emits `think_end_token` (a string that is one
        token of the tokenizer, or a token id); the answer is then never evicted. The cache gets
        `answer_slots` (default 512) more slots for the answer, and a row is compressed again
        only if its answer fills those too.
      pallas: run compression's redundancy and top-k as Pallas kernels (True), as jnp (False),
        or auto (None; see `rkvjax.kv.scores.use_pallas`). `kernels` is its former name.
      kv_dtype: what the cache stores, for every method (FullKV included): "float32",
        "bfloat16", "int8" or "float8_e4m3fn" (None: the model's dtype). The 8-bit types keep
        a float32 scale per (token, head) beside the codes: about half of bfloat16's bytes,
        so about twice the default slots.
      batch_invariant: compute each row's numbers the same way whatever runs beside it, so a
        sample's tokens, logprobs and kept sets equal its own run alone to the bit (each
        prompt prefilled alone, decode products on a fixed number of columns; see `Engine`).
        None (default): on for an 8-bit cache, off for a float one, whose tokens match anyway
        and whose logprobs can differ in the last bits.
      max_new_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos:
        shorthand for `sampling` (defaults 256 tokens, greedy, no filters, seed 0; prompt i
        samples with seed + i). Not allowed together with `sampling`.
      chat: wrap text prompts in the model's chat template (default: when it has one).
      progress: a progress bar over samples.
      record_kept: return, for every compression, the positions each (layer, KV head) kept
        (`GenerationResult.kept_positions`), for analysis and plots.
      chunk: decode steps per device call; lanes: compressions per step (default from slots
        and buffer).

    Returns:
      A GenerationResult for a single prompt, a list for a list of prompts; a prompt with
      n > 1 samples gives a list of its n results instead of one.
    """
    prompt_list, single = requests.split_prompts(prompts)
    shorthand = dict(
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )
    if sampling is None:
        if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        defaults = dict(
            max_tokens=DEFAULT_MAX_NEW_TOKENS,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=0,
            stop=(),
            stop_token_ids=(),
            ignore_eos=False,
        )
        kw = {k: defaults[k] if v is None else v for k, v in shorthand.items()}
        params = per_prompt_sampling(len(prompt_list), **kw)
    else:
        given = sorted(k for k, v in shorthand.items() if v is not None)
        if given:
            raise ValueError(
                f"pass sampling settings either as sampling=SamplingParams(...) or as keywords, "
                f"not both (got sampling and {', '.join(given)})"
            )
        params = _sampling_list(sampling, len(prompt_list))
    if kernels is not None:
        if pallas is not None and pallas != kernels:
            raise ValueError("kernels is the former name of pallas: pass one of them")
        pallas = kernels
    ids = [
        requests.encode(model.tokenizer, p, chat, f"prompt {i}") for i, p in enumerate(prompt_list)
    ]
    eng = engine_for(
        model,
        ids,
        params,
        slots=slots,
        method=method,
        budget=budget,
        buffer=buffer,
        window=window,
        think_only=think_only,
        think_end_token=think_end_token,
        answer_slots=answer_slots,
        pallas=pallas,
        kv_dtype=kv_dtype,
        batch_invariant=batch_invariant,
        chunk=chunk,
        lanes=lanes,
        record_kept=record_kept,
        chat=chat,
        progress=progress,
        **options,
    )
    # Checked here, once (before anything compiles), naming each prompt.
    eng.submit_many(
        ids, params, ids=list(range(len(ids))), where=[f"prompt {i}" for i in range(len(ids))]
    )
    done = eng.run()
    run = eng.stats
    final = {
        "decode_s": run.wall_s - run.compile_s,
        "tokens_per_s": run.tokens_per_s,
        "compile_s": run.compile_s,
    }
    by_prompt: list[list[GenerationResult]] = [[] for _ in ids]
    for r in done:
        r = dataclasses.replace(r, stats=dataclasses.replace(r.stats, **final))
        by_prompt[r.request_id].append(r)
    out = [
        sorted(rs, key=lambda r: r.sample_index) if sp.n > 1 else rs[0]
        for rs, sp in zip(by_prompt, params, strict=True)
    ]
    return out[0] if single else out


def score(
    model: Model,
    token_ids,
    *,
    prompt_len: int | Sequence[int],
    budget: int | float | None = None,
    method: str = "rkv",
    return_dists: bool = False,
    slots: int | None = None,
    batch_invariant: bool | None = None,
    **compression,
) -> ScoreResult | list[ScoreResult]:
    """Teacher-forces continuations through the decode path with a compressed cache.

    Each sequence's prompt `ids[:prompt_len]` is prefilled (and compressed if longer than the
    budget); every later token is fed through the same compiled decode step as `generate`,
    compressions included, and its log-probability recorded. This measures the fidelity of a
    cache policy without a grader: compare against `method="full"`.

    Args:
      model: from `rkvjax.load`.
      token_ids: one sequence (list[int]) or a batch (list[list[int]]): prompt, then the
        continuation to score.
      prompt_len: prompt tokens of each sequence (one int for all, or one per sequence); >= 1.
      budget, method: the cache policy, as in `generate`.
      return_dists: also return the full log-probability row of every step ([T, V] floats).
      slots: rows scored at once (default: every sequence).
      batch_invariant: as in `generate`: each row's log-probabilities equal its own score
        alone to the bit (default: for an 8-bit cache).
      **compression: buffer, window, kv_dtype, pallas and the method's options (kernel, lam,
        threshold, retain for R-KV) as in `generate`.

    Returns:
      A ScoreResult (a list for a batch) over the T = len(ids) - prompt_len scored tokens.
    """
    seqs, single = requests.split_prompts(token_ids)
    if not all(requests._is_ids(s) for s in seqs):
        raise ValueError("token_ids must be token ids (list[int]) or a batch of them")
    seqs = [[int(t) for t in s] for s in seqs]
    lens = [prompt_len] * len(seqs) if isinstance(prompt_len, (int, np.integer)) else prompt_len
    if len(lens) != len(seqs):
        raise ValueError("token_ids must be a non-empty sequence, with one prompt_len per row")
    for r, (ids, n) in enumerate(zip(seqs, lens, strict=True)):
        if not 1 <= n < len(ids):
            raise ValueError(
                f"row {r}: prompt_len must be in [1, {len(ids) - 1}] for {len(ids)} tokens, got {n}"
            )
    conts = [ids[n:] for ids, n in zip(seqs, lens, strict=True)]
    m = max(map(len, conts))
    cc = compression_config(method, budget, prompt_len=max(lens), max_new_tokens=m, **compression)
    capacity = max(len(ids) - 1 for ids in seqs)
    eng = runtime.Engine(
        model,
        slots=slots or len(seqs),
        cache=cc,
        max_len=None if cc.compressing else capacity,
        teacher=True,
        keep_dists=return_dists,
        given_len=m,
        stop_width=1,
        batch_invariant=batch_invariant,
    )
    # Seed 0 for every row: scoring is greedy, so the seed only feeds methods that draw at
    # random, whose kept sets would otherwise differ from one call to the next.
    params = [
        SamplingParams(temperature=0.0, max_tokens=len(c), ignore_eos=True, seed=0) for c in conts
    ]
    prompts = [ids[:n] for ids, n in zip(seqs, lens, strict=True)]
    eng.submit_many(prompts, params, ids=list(range(len(seqs))), continuations=conts)
    results: list[ScoreResult | None] = [None] * len(seqs)
    for res in eng.run():
        results[res.request_id] = res
    return results[0] if single else results


def logits(model: Model, token_ids) -> jax.Array:
    """One full forward without a cache: token ids [T] or [B, T] -> logits [B, T, V] float32."""
    try:
        arr = np.asarray(token_ids)
    except ValueError:  # ragged nested lists
        arr = np.asarray([], object)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"token_ids must be a non-empty [T] or [B, T] integer array (equal lengths), "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    v, limit = model.config.vocab_size, model.config.max_positions
    if arr.min() < 0 or arr.max() >= v:
        raise ValueError(f"token ids must lie in [0, {v})")
    if arr.shape[1] > limit:
        raise ValueError(f"{arr.shape[1]} tokens exceed the model's {limit} positions")
    positions = np.broadcast_to(np.arange(arr.shape[1], dtype=np.int32), arr.shape)
    with runtime.on_mesh(model):
        return programs.forward_logits(
            model.decoder,
            runtime.device_rows(model, arr.astype(np.int32)),
            runtime.device_rows(model, positions),
        )
