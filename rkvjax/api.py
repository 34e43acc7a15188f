"""Public API: load a checkpoint, generate text, compute logits."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax import engine, sharding
from rkvjax.config import METHODS, CompressionConfig, ModelConfig
from rkvjax.sampling import SamplingConfig
from rkvjax.tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 256
_MIN_BUCKET = 16
_CHUNK = 64  # decode steps per device call: the host checks progress and stop strings this often


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded checkpoint: static config, weights (an NNX Decoder pytree) and tokenizer."""

    config: ModelConfig
    decoder: Any  # rkvjax.models.decoder.Decoder
    tokenizer: Tokenizer | None
    path: Path
    dtype: Any
    mesh: jax.sharding.Mesh | None = None  # ("data", "model") the weights are split over
    rules: sharding.ShardingRules | None = None  # how (set with mesh; vocab may be replicated)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else ()


def _default_dtype():
    # float32 on CPU (XLA's CPU bfloat16 matmuls are emulated), bfloat16 on accelerators.
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _resolve(path: str | Path | None) -> Path:
    """Where the Hugging Face folder of `path` lies, preparing it first if it must be converted."""
    if path is None or str(path) == DEFAULT_MODEL:
        from rkvjax.convert.default_model import default_model_dir

        return default_model_dir()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from rkvjax.convert.default_model import prepared_gguf_dir

        return prepared_gguf_dir(p)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{path}: no such model folder (give a Hugging Face checkpoint folder, a .gguf "
            f"file, or {DEFAULT_MODEL!r} for the default model)"
        )
    return p


def load(path: str | Path | None = None, *, dtype=None, mesh=None) -> Model:
    """Loads a checkpoint.

    Args:
      path: a Hugging Face folder (`config.json`, `*.safetensors`, tokenizer files), a folder
        written by `rkvjax convert` (Orbax weights, restored into any mesh), a `.gguf` file
        (converted once and cached), or None / "SmolLM2-135M-Instruct" for the default model.
      dtype: weight dtype, "float32" / "bfloat16" or a jnp dtype. Default: a converted
        folder's own dtype; otherwise float32 on CPU, bfloat16 on GPU/TPU.
      mesh: a `("data", "model")` mesh (`rkvjax.sharding.make_mesh`) to split the weights
        over: KV heads with their query heads, MLP hidden and vocab on "model"; `generate`
        then splits batch rows over "data". Each tensor is placed straight into its shards.

    Returns:
      A Model.
    """
    from rkvjax.convert import checkpoint
    from rkvjax.convert.hf_config import read_hf_config
    from rkvjax.convert.hf_safetensors import load_weights

    folder = _resolve(path)
    converted = checkpoint.is_converted(folder)
    if dtype is not None:
        dtype = _as_dtype(dtype)
    elif converted:
        dtype = _as_dtype(checkpoint.read_marker(folder)["dtype"])
    else:
        dtype = _default_dtype()
    cfg = read_hf_config(folder)
    if mesh is not None and tuple(mesh.axis_names) != sharding.MESH_AXES:
        raise ValueError(
            f"mesh axes must be {sharding.MESH_AXES}, got {tuple(mesh.axis_names)}; "
            "use rkvjax.sharding.make_mesh"
        )
    rules = None if mesh is None else sharding.check_divisible(cfg, mesh)
    read = checkpoint.restore if converted else load_weights
    decoder = read(folder, cfg, dtype, mesh=mesh, rules=rules)
    return Model(
        config=cfg,
        decoder=decoder,
        tokenizer=Tokenizer.from_dir(folder),
        path=folder,
        dtype=dtype,
        mesh=mesh,
        rules=rules,
    )


def _as_dtype(dtype):
    allowed = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if isinstance(dtype, str):
        if dtype not in allowed:
            raise ValueError(f"dtype must be one of {sorted(allowed)}, got {dtype!r}")
        return allowed[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    return dtype


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Per-result numbers; the timing fields describe the whole batch the result was part of."""

    prompt_tokens: int
    generated_tokens: int
    method: str
    budget: int | None
    compressions: int
    cache_capacity: int  # slots per (layer, KV head, row)
    peak_cache_slots: int  # most slots this row held at once
    batch_size: int
    time_to_first_token_s: float  # prompt processing + first token, compilation excluded
    decode_s: float  # decode wall time after the first token, compilation excluded
    tokens_per_s: float  # batch decode throughput: tokens after the first / decode_s
    compile_s: float  # compilation during this call (0 once shapes have been seen)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, the stop token included
    finish_reason: str  # "stop" (stop token or string) or "length"
    stats: GenerationStats
    prompt_token_ids: list[int]
    # With record_kept: [E, L, K, budget] int32 logical positions each compression kept per
    # (layer, KV head), -1 for an empty slot; E = compressions run (the prompt's first).
    kept_positions: np.ndarray | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stats"] = self.stats.to_dict()
        if self.kept_positions is not None:
            d["kept_positions"] = self.kept_positions.tolist()
        return d


def _bucket(n: int, limit: int) -> int:
    """Prompt length bucket: the next power of two (>= 16), so prefill compiles per bucket."""
    b = max(_MIN_BUCKET, 1 << (n - 1).bit_length())
    return min(b, max(limit, n))


def _encode_prompts(model: Model, prompts, chat: bool | None) -> tuple[list[list[int]], bool]:
    """-> (token id lists, whether the input was a single prompt)."""
    if isinstance(prompts, str):
        prompts, single = [prompts], True
    elif (
        isinstance(prompts, Sequence)
        and prompts
        and all(isinstance(t, (int, np.integer)) for t in prompts)
    ):
        return [[int(t) for t in prompts]], True
    else:
        single = False
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)) or not prompts:
        raise ValueError("prompts must be a str, a non-empty list of str, or token ids")
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise ValueError(
                    f"{model.path} has no tokenizer.json: pass token ids instead of text"
                )
            use_chat = tok.has_chat_template if chat is None else chat
            if use_chat:
                ids.append(tok.chat_ids([{"role": "user", "content": p}]))
            else:
                ids.append(tok.encode(p))
        elif isinstance(p, Sequence) and all(isinstance(t, (int, np.integer)) for t in p):
            ids.append([int(t) for t in p])
        else:
            raise ValueError(f"prompt {i}: expected a str or a list of token ids, got {type(p)}")
    return ids, single


def _validate_ids(model: Model, ids: list[list[int]], max_new: int) -> None:
    v, limit = model.config.vocab_size, model.config.max_positions
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in row if not 0 <= t < v]
        if bad:
            raise ValueError(f"prompt {i}: token id(s) {bad[:5]} outside the vocabulary [0, {v})")
        if len(row) + max_new > limit:
            raise ValueError(
                f"prompt {i}: {len(row)} prompt tokens + max_new_tokens={max_new} exceed the "
                f"model's {limit} positions"
            )


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    cut = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(cut) if cut else None


def compression_config(
    method: str,
    budget: int | float | None,
    *,
    prompt_len: int,
    max_new_tokens: int,
    buffer: int = 128,
    window: int = 8,
    kernel: int = 7,
    lam: float = 0.1,
    threshold: float = 0.5,
    retain: int = 1,
    think_end_id: int | None = None,
    answer_slots: int | None = None,
    kernels: bool | None = None,
) -> CompressionConfig:
    """Validated CompressionConfig for a generation; `budget=None` or "full" means FullKV.

    A float budget in (0, 1] is a fraction of `prompt_len + max_new_tokens` (the longest prompt
    of a batch), rounded, and at least `window + 1`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if budget is None or method == "full":
        return CompressionConfig(method="full")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise ValueError(f"budget must be an int (tokens) or a float in (0, 1], got {budget!r}")
    if isinstance(budget, (float, np.floating)):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a float budget is a fraction in (0, 1], got {budget}")
        budget = max(round(budget * (prompt_len + max_new_tokens)), window + 1)
    if think_end_id is None and answer_slots:
        raise ValueError("answer_slots needs think_end_id (think-only mode)")
    return CompressionConfig(
        method=method,
        budget=int(budget),
        buffer=buffer,
        window=window,
        kernel=kernel,
        lam=lam,
        threshold=threshold,
        retain=retain,
        think_end_id=think_end_id,
        answer_slots=(512 if answer_slots is None else answer_slots) if think_end_id else 0,
        kernels=kernels,
    )


def _pad_left(ids: list[list[int]], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to a length bucket -> tokens, positions [B, P] (positions -1 at pads)."""
    b, p = len(ids), _bucket(max(map(len, ids)), limit)
    tokens = np.zeros((b, p), np.int32)
    positions = np.full((b, p), -1, np.int32)
    for r, row in enumerate(ids):
        tokens[r, p - len(row) :] = row
        positions[r, p - len(row) :] = np.arange(len(row))
    return tokens, positions


def _plan(
    model: Model,
    ids: list[list[int]],
    cc: CompressionConfig,
    max_new: int,
    **kw,
) -> tuple[engine.DecodePlan, np.ndarray, np.ndarray]:
    _validate_ids(model, ids, max_new)
    if cc.compressing and min(map(len, ids)) < cc.window:
        raise ValueError(
            f"a prompt of {min(map(len, ids))} tokens is shorter than window={cc.window}: "
            "compression needs that many observation queries"
        )
    tokens, positions = _pad_left(_pad_rows(model, ids), model.config.max_positions - max_new)
    # FullKV holds the prompt bucket plus every new token but the last (never appended);
    # compressing methods hold budget + buffer (+ answer slots) whatever the length.
    capacity = cc.capacity if cc.compressing else tokens.shape[1] + max_new - 1
    plan = engine.DecodePlan(
        compression=cc, capacity=capacity, max_new=max_new, rules=model.rules, **kw
    )
    return plan, tokens, positions


def _pad_rows(model: Model, ids: list[list[int]]) -> list[list[int]]:
    """On a mesh, pads the batch with copies of its first prompt to a multiple of the "data"
    axis, so every device gets whole rows. Copies of a real prompt finish when it does (greedy)
    and are valid input to every step; callers read only the first len(ids) rows back."""
    if model.mesh is None or model.rules.batch is None:
        return ids
    data = model.mesh.shape[model.rules.batch]
    return ids + [ids[0]] * (-len(ids) % data)


def _on_mesh(model: Model):
    """The model's mesh as the context mesh (jit traces see it; shard_map runs over it)."""
    return contextlib.nullcontext() if model.mesh is None else jax.set_mesh(model.mesh)


def _put_rows(model: Model, x) -> jax.Array:
    """A host [B, ...] array on device: rows split over "data" on a mesh when they divide
    (generate pads to make them), else replicated."""
    x = np.asarray(x)
    if model.mesh is None:
        return jnp.asarray(x)
    data = model.mesh.shape[model.rules.batch] if model.rules.batch else 1
    axes = ("batch",) if x.shape[0] % data == 0 else (None,)
    return sharding.host_array(x, model.rules.named(model.mesh, *axes, *[None] * (x.ndim - 1)))


def _put_key(model: Model, key: jax.Array) -> jax.Array:
    """The PRNG key replicated over the mesh (a plain device array without one)."""
    if model.mesh is None:
        return key
    data = np.asarray(jax.random.key_data(key))
    rep = sharding.host_array(data, model.rules.named(model.mesh, *[None] * data.ndim))
    return jax.random.wrap_key_data(rep, impl=jax.random.key_impl(key))


def _run(model, plan, tokens, positions, key, given=None, *, progress=False, on_chunk=None):
    """Prefill + chunked decode. Returns (state, ttft_s, decode_s, compile_s)."""
    with _on_mesh(model):
        return _run_on_mesh(model, plan, tokens, positions, key, given, progress, on_chunk)


def _run_on_mesh(model, plan, tokens, positions, key, given, progress, on_chunk):
    b, m = tokens.shape[0], plan.max_new
    given = np.zeros((b, m), np.int32) if given is None else np.asarray(given, np.int32)
    if given.shape[0] < b:  # rows _pad_rows added
        given = np.concatenate([given, np.repeat(given[:1], b - given.shape[0], axis=0)])
    given, tokens, positions = (_put_rows(model, x) for x in (given, tokens, positions))
    key = _put_key(model, key)
    c0, t0 = engine.compile_seconds(), time.perf_counter()
    state = engine.prefill(model.decoder, tokens, positions, given, key, plan=plan)
    jax.block_until_ready(state.tokens)
    c1, t1 = engine.compile_seconds(), time.perf_counter()
    bar = _progress_bar(m, enabled=progress)
    step, all_done = 1, m == 1
    while step < m and not all_done:
        state = engine.decode(model.decoder, state, steps=_CHUNK, plan=plan)
        new_step, all_done = (int(x) for x in sharding.to_host((state.step, jnp.all(state.done))))
        bar.update(new_step - step)
        step = new_step
        if on_chunk is not None and not all_done:
            state = on_chunk(state)
            all_done = bool(sharding.to_host(jnp.all(state.done)))
    bar.close()
    jax.block_until_ready(state.tokens)
    c2, t2 = engine.compile_seconds(), time.perf_counter()
    return state, (t1 - t0) - (c1 - c0), (t2 - t1) - (c2 - c1), c2 - c0


def generate(
    model: Model,
    prompts,
    *,
    budget: int | float | None = None,
    method: str = "rkv",
    buffer: int = 128,
    window: int = 8,
    kernel: int = 7,
    lam: float = 0.1,
    threshold: float = 0.5,
    retain: int = 1,
    think_only: bool = False,
    think_end_token: str | int = "</think>",
    answer_slots: int | None = None,
    kernels: bool | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop: Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    chat: bool | None = None,
    progress: bool = False,
    record_kept: bool = False,
) -> GenerationResult | list[GenerationResult]:
    """Generates completions for one prompt or a batch.

    Args:
      model: from `rkvjax.load`.
      prompts: a str, a list of str, token ids (list[int]) or a batch of them (list[list[int]]).
      budget: KV tokens kept per (layer, KV head, row) by a compressing method (window
        included): an int, or a float in (0, 1] as a fraction of prompt + max_new_tokens.
        None = FullKV.
      method: "rkv", "snapkv", "streaming" or "full"; with budget=None every method is FullKV.
      buffer: decoded tokens between compressions (the cache holds budget + buffer slots).
      window, kernel, lam, threshold, retain: R-KV settings (RKV_SPEC.md).
      think_only: stop compressing a row once it emits `think_end_token` (a string that is one
        token of the tokenizer, or a token id); the answer is then never evicted. The cache gets
        `answer_slots` (default 512) more slots for the answer, and a row is compressed again
        only if its answer fills those too.
      kernels: run compression's redundancy and top-k as Pallas kernels (True), as jnp (False),
        or auto (None: the redundancy kernel on GPU/TPU only when the jnp path's n x n matrix
        would take a large share of device memory; see `rkvjax.kernels.use_pallas`).
      max_new_tokens: tokens to generate at most per prompt.
      temperature, top_p, top_k, seed: sampling; temperature 0 is greedy.
      stop: strings that end a completion (the text is cut before them).
      stop_token_ids: token ids that end a completion, besides the model's end-of-sequence ids.
      ignore_eos: keep generating past end-of-sequence tokens.
      chat: wrap text prompts in the model's chat template (default: when it has one).
      progress: show a progress bar over decode steps.
      record_kept: return, for every compression, the positions each (layer, KV head) kept
        (`GenerationResult.kept_positions`), for analysis and plots.

    Returns:
      A GenerationResult for a single prompt, a list of them for a batch.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ids, single = _encode_prompts(model, prompts, chat)
    cc = compression_config(
        method,
        budget,
        prompt_len=max(map(len, ids)),
        max_new_tokens=max_new_tokens,
        buffer=buffer,
        window=window,
        kernel=kernel,
        lam=lam,
        threshold=threshold,
        retain=retain,
        think_end_id=_think_end_id(model, think_end_token) if think_only else None,
        answer_slots=answer_slots,
        kernels=kernels,
    )
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop):
        raise ValueError("stop strings must be non-empty")
    if stop and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")
    eos = () if ignore_eos else model.eos_token_ids
    stop_ids = tuple(sorted({int(t) for t in stop_token_ids or ()} | set(eos)))
    plan, tokens, positions = _plan(
        model,
        ids,
        cc,
        max_new_tokens,
        sampling=sampling,
        stop_ids=stop_ids,
        record_kept=record_kept,
    )
    b = len(ids)
    stopped_by_string = np.zeros(tokens.shape[0], bool)  # padded rows included

    def check_stop_strings(state):
        hit = _rows_hitting_stop(model, state, stop)
        stopped_by_string[:] |= hit
        return (
            dataclasses.replace(state, done=state.done | _put_rows(model, hit))
            if hit.any()
            else state
        )

    state, ttft_s, decode_s, compile_s = _run(
        model,
        plan,
        tokens,
        positions,
        jax.random.key(seed),
        progress=progress,
        on_chunk=check_stop_strings if stop else None,
    )
    out_tokens, num, comps, peak, kept = sharding.to_host(
        (state.tokens, state.num, state.compressions, state.peak, state.kept)
    )
    decoded = int(np.sum(num[:b])) - b
    results = []
    for r in range(b):
        gen = out_tokens[r, : num[r]].tolist()
        reason = "stop" if stopped_by_string[r] or _ends_with_stop(gen, stop_ids) else "length"
        text = model.tokenizer.decode(gen) if model.tokenizer is not None else ""
        if stop:
            cut = _stop_at(text, stop)
            if cut is not None:
                text, reason = text[:cut], "stop"
        stats = GenerationStats(
            prompt_tokens=len(ids[r]),
            generated_tokens=len(gen),
            method=cc.method,
            budget=cc.budget if cc.compressing else None,
            compressions=int(comps[r]),
            cache_capacity=plan.capacity,
            peak_cache_slots=int(peak[r]),
            batch_size=b,
            time_to_first_token_s=ttft_s,
            decode_s=decode_s,
            tokens_per_s=decoded / decode_s if decode_s > 0 else 0.0,
            compile_s=compile_s,
        )
        log = kept[r, : comps[r]] if record_kept and cc.compressing else None
        results.append(GenerationResult(text, gen, reason, stats, ids[r], log))
    return results[0] if single else results


def _think_end_id(model: Model, token: str | int) -> int:
    if isinstance(token, (int, np.integer)):
        if not 0 <= token < model.config.vocab_size:
            raise ValueError(f"think_end_token id {token} is outside the vocabulary")
        return int(token)
    if model.tokenizer is None:
        raise ValueError("think_only needs a tokenizer to find the end-of-thinking token")
    ids = model.tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"think_end_token {token!r} is not a single token of this tokenizer ({ids}); "
            "think-only mode needs a model with a dedicated end-of-thinking token"
        )
    return ids[0]


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Teacher-forced log-probabilities of a continuation under a cache policy."""

    logprobs: np.ndarray  # [T] log p(token_t | everything before, as the cache kept it)
    top1: np.ndarray  # [T] int32 the model's argmax prediction at each step
    dists: np.ndarray | None  # [T, V] log-probabilities at each step, with return_dists
    compressions: int
    peak_cache_slots: int


def score(
    model: Model,
    token_ids,
    *,
    prompt_len: int | Sequence[int],
    budget: int | float | None = None,
    method: str = "rkv",
    return_dists: bool = False,
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
      prompt_len: prompt tokens of each sequence (one int for all, or one per sequence); >= 1,
        and >= window when compressing.
      budget, method: the cache policy, as in `generate`.
      return_dists: also return the full log-probability row of every step ([T, V] floats).
      **compression: buffer, window, kernel, lam, threshold, retain as in `generate`.

    Returns:
      A ScoreResult (a list for a batch) over the T = len(ids) - prompt_len scored tokens.
    """
    single = bool(token_ids) and all(isinstance(t, (int, np.integer)) for t in token_ids)
    seqs = [[int(t) for t in row] for row in ([token_ids] if single else token_ids)]
    lens = [prompt_len] * len(seqs) if isinstance(prompt_len, (int, np.integer)) else prompt_len
    if not seqs or len(lens) != len(seqs):
        raise ValueError("token_ids must be a non-empty sequence, with one prompt_len per row")
    for r, (ids, n) in enumerate(zip(seqs, lens, strict=True)):
        if not 1 <= n < len(ids):
            raise ValueError(
                f"row {r}: prompt_len must be in [1, {len(ids) - 1}] for {len(ids)} tokens, got {n}"
            )
    conts = [ids[n:] for ids, n in zip(seqs, lens, strict=True)]
    m = max(map(len, conts))
    given = np.full((len(seqs), m), -1, np.int32)  # -1: past the row's continuation
    for r, c in enumerate(conts):
        given[r, : len(c)] = c
    cc = compression_config(method, budget, prompt_len=max(lens), max_new_tokens=m, **compression)
    plan, tokens, positions = _plan(
        model,
        [ids[:n] for ids, n in zip(seqs, lens, strict=True)],
        cc,
        m,
        sampling=SamplingConfig(),
        stop_ids=(),
        teacher=True,
        keep_dists=return_dists,
    )
    state, *_ = _run(model, plan, tokens, positions, jax.random.key(0), given)
    logp, top1, dists, comps, peak = sharding.to_host(
        (state.logprob, state.top1, state.dists, state.compressions, state.peak)
    )
    results = [
        ScoreResult(
            logprobs=logp[r, : len(c)],
            top1=top1[r, : len(c)],
            dists=dists[r, : len(c)] if return_dists else None,
            compressions=int(comps[r]),
            peak_cache_slots=int(peak[r]),
        )
        for r, c in enumerate(conts)
    ]
    return results[0] if single else results


def _ends_with_stop(gen: list[int], stop_ids: tuple[int, ...]) -> bool:
    return bool(gen) and gen[-1] in stop_ids


def _rows_hitting_stop(model: Model, state: engine.DecodeState, stop: list[str]) -> np.ndarray:
    tokens, num, done = sharding.to_host((state.tokens, state.num, state.done))
    return np.array(
        [
            not done[r]
            and _stop_at(model.tokenizer.decode(tokens[r, : num[r]].tolist()), stop) is not None
            for r in range(tokens.shape[0])
        ]
    )


def _progress_bar(total: int, *, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=1, unit="tok", desc="decode", disable=not enabled)


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
    with _on_mesh(model):
        return engine.forward_logits(
            model.decoder, _put_rows(model, arr.astype(np.int32)), _put_rows(model, positions)
        )
