"""Statistics of a model's queries for TriAttention (`rkvjax calibrate`): per (layer, query
head, RoPE frequency pair), the mean of the pre-RoPE query as a complex number and the mean of
its modulus, over every token of a set of prompts.

A query's frequency pair f is q_f = q[f] + i q[f + H/2] (the rotate-half layout RoPE rotates).
The model's forward gives each layer's post-RoPE queries (after Qwen3's q_norm, as attention
reads them); rotating them back by their positions gives the pre-RoPE ones. The file is a
`.npz` of float32 arrays `q_mean_real`, `q_mean_imag`, `q_abs_mean` [L, N, H/2] and `inv_freq`
[H/2] (the RoPE frequencies), and `metadata`, a JSON string: the model's shape, where it was
loaded from, and the norm of each layer's query/key/value weight (`weight_norms`), which tells
another model of the same shape apart (`check_model`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax import layers

FORMAT = "rkvjax-triattention-stats"
VERSION = 1
ARRAYS = ("q_mean_real", "q_mean_imag", "q_abs_mean", "inv_freq")


@dataclasses.dataclass(frozen=True, eq=False)
class Stats:
    """Query statistics of one model.

    Attributes:
      q_mean: complex128 [L, N, F] the mean pre-RoPE query pair per (layer, query head, f).
      q_abs_mean: float64 [L, N, F] the mean modulus of those pairs.
      inv_freq: float32 [F] the model's RoPE inverse frequencies (scaling applied).
      meta: model shape (arch, num_layers, q_heads, kv_heads, head_dim), tokens, prompts and
        source of the run, the model's folder and `weight_norms`.
    """

    q_mean: np.ndarray
    q_abs_mean: np.ndarray
    inv_freq: np.ndarray
    meta: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return self.q_mean.shape[0]

    @property
    def q_heads(self) -> int:
        return self.q_mean.shape[1]

    @property
    def kv_heads(self) -> int:
        return int(self.meta["kv_heads"])

    @property
    def head_dim(self) -> int:
        return 2 * self.q_mean.shape[2]


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

# Weights of one model in float32 and in bfloat16 differ in norm by about 1e-3; another model's
# (another checkpoint, a fine-tune) by far more.
_NORM_RTOL = 1e-2


@jax.jit
def _weight_norms(decoder) -> jax.Array:
    """[L] float32: the Frobenius norm of each layer's fused query/key/value weight."""
    return jnp.stack(
        [jnp.linalg.norm(b.attn.wqkv[...].astype(jnp.float32)) for b in decoder.layers]
    )


def weight_norms(model) -> list[float]:
    """The norm of each layer's query/key/value weight: a fingerprint of the weights that the
    statistics depend on, read the same from a float32 or a bfloat16 load."""
    from rkvjax import sharding

    return [float(x) for x in sharding.to_host(_weight_norms(model.decoder))]


def check_model(stats: Stats, model, where: str) -> None:
    """Raises ValueError, in one line naming `where`, unless `stats` were calibrated on a model
    like `model`: its layers, heads and head_dim, its RoPE frequencies (another `rope_theta`
    or scaling moves every score) and, when the file records them, its weights' norms."""
    cfg = model.config
    again = "they are of another model; run `rkvjax calibrate` with this one"
    got = (stats.num_layers, stats.q_heads, stats.kv_heads, stats.head_dim)
    want = (cfg.num_layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim)
    if got != want:
        raise ValueError(
            f"{where}: hold {got[0]} layers of {got[1]} query heads over {got[2]} KV heads of "
            f"dimension {got[3]}, the model has {want[0]} of {want[1]} over {want[2]} of "
            f"dimension {want[3]}: {again}"
        )
    inv_freq = layers.rope_inv_freq(cfg)
    if not np.allclose(stats.inv_freq, inv_freq, rtol=1e-5, atol=0):
        worst = int(np.argmax(np.abs(stats.inv_freq / inv_freq - 1)))
        raise ValueError(
            f"{where}: RoPE frequency {worst} is {stats.inv_freq[worst]:.6g}, the model's is "
            f"{inv_freq[worst]:.6g} (another rope_theta or scaling): {again}"
        )
    recorded = stats.meta.get("weight_norms")
    if recorded is not None:
        mine = np.asarray(weight_norms(model))
        off = np.abs(np.asarray(recorded, np.float64) / mine - 1)
        if (off > _NORM_RTOL).any():
            layer = int(np.argmax(off))
            raise ValueError(
                f"{where}: calibrated on other weights ({stats.meta.get('model') or 'a model'}"
                f"; layer {layer}'s query/key/value weight has norm {recorded[layer]:.6g} there "
                f"and {mine[layer]:.6g} here): {again}"
            )


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
    from rkvjax import requests, sharding
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


def save(stats: Stats, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Writes `stats` to `path` (the name as given, no suffix added); an existing file is
    replaced only with `overwrite`. The file appears whole or not at all."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give the file to write")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path}: exists; pass --overwrite (overwrite=True) to replace it")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    arrays = {
        "q_mean_real": stats.q_mean.real,
        "q_mean_imag": stats.q_mean.imag,
        "q_abs_mean": stats.q_abs_mean,
        "inv_freq": stats.inv_freq,
    }
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                **{k: np.asarray(v, np.float32) for k, v in arrays.items()},
                metadata=np.asarray(json.dumps(stats.meta)),
            )
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def load(path: str | os.PathLike) -> Stats:
    """Reads and checks a statistics file (`save`).

    Raises:
      ValueError: in one line naming the file, for a missing, unreadable or malformed one.
    """
    where = f"calibration statistics {path}"
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "no such file"
        raise ValueError(f"{where}: {what} (write it with `rkvjax calibrate DATA.jsonl OUT`)")
    try:
        with np.load(p, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
    except Exception as e:  # not a zip, truncated, an object array: all the same to the user
        raise ValueError(
            f"{where}: not a file of `rkvjax calibrate` ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in (*ARRAYS, "metadata") if k not in data]
    if missing:
        raise ValueError(f"{where}: not a file of `rkvjax calibrate` (no {', '.join(missing)})")
    try:
        meta = json.loads(str(data["metadata"][()]))
    except (ValueError, TypeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{where}: not a file of `rkvjax calibrate` (its metadata is not ours)")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{where}: format version {meta.get('version')!r}, this rkvjax reads {VERSION}; "
            "run `rkvjax calibrate` again"
        )
    shape = data["q_abs_mean"].shape
    want = (meta.get("num_layers"), meta.get("q_heads"), _half(meta.get("head_dim")))
    bad = [k for k in ARRAYS[:3] if data[k].shape != shape] or (
        [] if shape == want and data["inv_freq"].shape == shape[2:] else ["shapes"]
    )
    kv = meta.get("kv_heads")
    if bad or not isinstance(kv, int) or kv < 1 or shape[1] % kv:
        raise ValueError(
            f"{where}: arrays of shapes {[data[k].shape for k in ARRAYS]} do not agree with "
            f"its metadata {want} / kv_heads {kv!r}"
        )
    arrays = [np.float64(data[k]) for k in ARRAYS[:3]]
    if not all(np.isfinite(a).all() for a in arrays) or not np.isfinite(data["inv_freq"]).all():
        raise ValueError(f"{where}: holds values that are not finite")
    real, imag, modulus = arrays
    inv_freq = np.float64(data["inv_freq"])
    if not ((inv_freq > 0) & (inv_freq <= 1)).all():
        raise ValueError(
            f"{where}: `inv_freq` holds {inv_freq[(inv_freq <= 0) | (inv_freq > 1)][0]:.6g}; "
            "RoPE's inverse frequencies lie in (0, 1]"
        )
    if (modulus < 0).any():
        raise ValueError(f"{where}: `q_abs_mean` holds negative values (it is a mean of moduli)")
    # A mean's modulus never exceeds the mean of the moduli (float32 rounding aside).
    if (np.hypot(real, imag) > modulus * (1 + 1e-4) + 1e-6).any():
        raise ValueError(
            f"{where}: a mean query pair is longer than the mean of their moduli, which no data "
            "gives: the file was not written by `rkvjax calibrate`"
        )
    norms = meta.get("weight_norms")
    if norms is not None and not (
        isinstance(norms, list)
        and len(norms) == shape[0]
        and all(isinstance(x, int | float) and x > 0 for x in norms)
    ):
        raise ValueError(
            f"{where}: its metadata's weight_norms are not {shape[0]} positive numbers"
        )
    return Stats(real + 1j * imag, modulus, np.float32(data["inv_freq"]), meta)


def _half(head_dim) -> int | None:
    return head_dim // 2 if isinstance(head_dim, int) and head_dim % 2 == 0 else None


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
    from rkvjax import evaluation, jobs
    from rkvjax.evaluation.problems import PROBLEM_FIELDS
    from rkvjax.jobs.inputs import json_line

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
    from rkvjax import requests

    return [
        requests.encode(model.tokenizer, prompt, chat, where) for where, prompt, chat in prompts
    ]
