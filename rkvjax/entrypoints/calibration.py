"""Statistics of a model's queries for TriAttention (`rkvjax calibrate`): per (layer, query
head, RoPE frequency pair), the mean of the pre-RoPE query as a complex number and the mean of
its modulus, over every token of a set of prompts.

A query's frequency pair f is q_f = q[f] + i q[f + H/2] (the rotate-half layout RoPE rotates).
The model's forward gives each layer's post-RoPE queries (after Qwen3's q_norm, as attention
reads them); rotating them back by their positions gives the pre-RoPE ones. The statistics
file's format, its checks and its match to a model are `rkvjax.kv.policies.triattention_stats`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.kv.policies.triattention_stats import FORMAT, VERSION, Stats, weight_norms
from rkvjax.models import layers


def _query_sums(decoder, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens, positions [B, T] (-1 at pads) -> float32 [L, 3, N, F]: per layer the sums over
    the real tokens of the pre-RoPE query pairs' real parts, imaginary parts and moduli."""
    cfg = decoder.cfg
    mask = layers.causal_mask(positions, positions)  # [B, T, T]
    cos, sin = layers.rope_tables(positions, cfg)  # [B, T, H]
    real = (positions >= 0)[:, :, None, None]  # [B, T, 1, 1]

    def attend(i, q, k, v, sums):
        out = layers.attention(q, k, v, mask, kv_axis=1)
        # A rotation by minus the position's angles undoes RoPE.
        pre = layers.apply_rope(q.astype(jnp.float32), cos, -sin)  # [B, T, N, H]
        x1, x2 = jnp.split(jnp.where(real, pre, 0.0), 2, axis=-1)  # [B, T, N, F]
        modulus = jnp.sqrt(x1 * x1 + x2 * x2)
        s = jnp.stack([jnp.sum(x, axis=(0, 1)) for x in (x1, x2, modulus)])  # [3, N, F]
        return out, (*sums, s)

    _, sums = decoder.hidden(tokens, positions, attend, ())
    return jnp.stack(sums)  # [L, 3, N, F]


_query_sums_jit = jax.jit(_query_sums)


def calibrate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    progress: bool | Callable[[int, int], None] = False,
    source: str = "",
) -> Stats:
    """The query statistics of `model` over `prompts`, every token weighing the same.

    Each prompt runs alone through the model's forward, left-padded to its length bucket (a
    power of two, so each bucket compiles once); the sums are float32 per prompt and float64
    across prompts.

    Args:
      model: from `rkvjax.load`.
      prompts: token ids, one list per prompt (`encode_prompts`).
      progress: a progress bar on stderr (True), or a function called with (done, total)
        after each prompt.
      source: where the prompts came from, recorded in the metadata.

    Raises:
      ValueError: for no prompts, an empty one or one longer than the model's context.
    """
    from rkvjax.models import sharding
    from rkvjax.runtime import requests
    from rkvjax.runtime.executor import device_rows, on_mesh

    cfg = model.config
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    for i, ids in enumerate(prompts):
        if not len(ids):
            raise ValueError(f"prompt {i}: is empty")
        if len(ids) > cfg.max_positions:
            raise ValueError(
                f"prompt {i}: {len(ids)} tokens, more than the model's {cfg.max_positions}"
            )
    total = np.zeros((cfg.num_layers, 3, cfg.q_heads, cfg.head_dim // 2))  # float64
    tokens = 0
    report, bar = _progress(progress, len(prompts))
    try:
        with on_mesh(model):
            for i, ids in enumerate(prompts):
                tok, pos = requests.pad_left([list(ids)], 1, cfg.max_positions)
                # Whole on every device (one row): every process passes the same prompt.
                sums = _query_sums_jit(
                    model.decoder, device_rows(model, tok), device_rows(model, pos)
                )
                total += np.float64(sharding.to_host(sums))
                tokens += len(ids)
                report(i + 1)
    finally:
        if bar is not None:
            bar.close()
    real, imag, modulus = (total[:, j] / tokens for j in range(3))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "arch": cfg.arch,
        "num_layers": cfg.num_layers,
        "q_heads": cfg.q_heads,
        "kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "tokens": tokens,
        "prompts": len(prompts),
        "model": str(getattr(model, "path", "")),
        "source": source,
        "weight_norms": weight_norms(model),
    }
    return Stats(real + 1j * imag, modulus, layers.rope_inv_freq(cfg), meta)


def _progress(progress, total: int):
    """-> (called with the prompts done, the tqdm bar to close or None)."""
    if callable(progress):
        return (lambda done: progress(done, total)), None
    if not progress:
        return (lambda done: None), None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="prompt", desc="calibrate", dynamic_ncols=True, file=sys.stderr)
    return (lambda done: bar.update(done - bar.n)), bar


def read_prompts(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    instruction: str | None = None,
    chat: bool | None = None,
) -> list[tuple[str, Any, bool | None]]:
    """The prompts of a JSONL file, each line checked before any work -> (where, prompt, chat)
    per prompt, for `encode_prompts`.

    Two shapes are read: a problem file as `rkvjax eval` reads it (`problem` or `question`,
    and `answer`, as in MATH-500), each problem the chat `rkvjax eval` sends (the problem, then
    `instruction`; with `chat` False, that text alone); or the lines of `rkvjax batch`
    (`prompt`, `messages` or `prompt_token_ids`), text getting the chat template unless `chat`
    is False, as in `generate`.
    """
    from rkvjax.entrypoints import evaluation, jobs
    from rkvjax.entrypoints.evaluation.problems import PROBLEM_FIELDS
    from rkvjax.entrypoints.jobs.inputs import json_line

    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    first = None
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    first = json_line(raw, f"{p}:{n}")
                    break
    if isinstance(first, dict) and any(k in first for k in PROBLEM_FIELDS):
        instruction = evaluation.R1_INSTRUCTION if instruction is None else instruction
        out = []
        for x in evaluation.read_problems(p, limit):
            (message,) = evaluation.prompt_of(x, instruction)
            out.append((f"{p}:{x.line}", message["content"] if chat is False else [message], chat))
        return out
    reqs = jobs.read_requests(p)[:limit]
    return [(f"{p}:{r.line}", r.prompt, False if r.chat is False else chat) for r in reqs]


def encode_prompts(model, prompts: Sequence[tuple[str, Any, bool | None]]) -> list[list[int]]:
    """`read_prompts`' prompts as token ids (`requests.encode`: a chat always gets the chat
    template, text unless its chat flag is False)."""
    from rkvjax.runtime import requests

    return [
        requests.encode(model.tokenizer, prompt, chat, where) for where, prompt, chat in prompts
    ]
