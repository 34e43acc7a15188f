"""TriAttention's statistics file: a model's query statistics as `rkvjax calibrate` writes them,
read, checked and matched to the model that uses them (numpy, and JAX for the weights' norms: no
part of the engine that runs a model).

The file is a `.npz` of float32 arrays `q_mean_real`, `q_mean_imag`, `q_abs_mean` [L, N, H/2] and
`inv_freq` [H/2] (the RoPE frequencies), and `metadata`, a JSON string: the model's shape, where
it was loaded from, and the norm of each layer's query/key/value weight (`weight_norms`), which
tells another model of the same shape apart (`check_model`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.models import layers, sharding

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


def read(path: str) -> Stats:
    """The statistics of a file (`load`), read once per version of it (a file rewritten with
    `--overwrite` is read again)."""
    try:
        st = os.stat(path)
    except OSError:
        return load(path)  # its one-line error
    return _read(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.cache
def _read(path: str, mtime_ns: int, size: int) -> Stats:
    return load(path)
