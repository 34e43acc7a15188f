"""TriAttention: keys ranked by the attention a model's typical query would give them over the
coming positions, from calibrated query statistics and each key's RoPE phase."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.kv import scores
from rkvjax.kv.policies import triattention_stats
from rkvjax.kv.policies.base import Policy, register

# The score of a prompt token: above any key's score, also summed over every layer
# (share="layers"), and finite, so that prompt tokens tie with one another and the keep rule
# takes the lower positions first.
PROMPT_SCORE = 1e30


def offsets(max_offset: int) -> np.ndarray:
    """float64 [D]: the future distances a score averages over, 1, 2, 4, ..., max_offset."""
    return 2.0 ** np.arange(int(max_offset).bit_length())


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TriAttention(Policy):
    """TriAttention (arXiv 2604.04921), as its authors' code scores keys (WeianMao/triattention,
    `score_keys_for_round`).

    Statistics of the model's pre-RoPE queries, per (layer, query head, RoPE frequency pair f),
    come from a calibration run (`rkvjax calibrate`): the complex mean E q_f and the mean
    modulus E|q_f|. A key k (pre-RoPE, pairs k_f = k[f] + i k[f + H/2]) at position p is scored,
    at the compression of a row whose next position is t, by each query head h as

        S_h = mean_d sum_f |E q_f| |k_f| cos(w_f (t - p + d) + arg E q_f - arg k_f)
              + sum_f (E|q_f| - |E q_f|) |k_f|,   d in 1, 2, 4, ..., max_offset,

    the attention logit the mean query would give it d tokens ahead plus the part of the
    queries' norm that the mean does not point. It is computed from the cached (post-RoPE) key
    directly, with no un-rotation: the mean over d is folded into one complex factor per
    frequency. With `normalize`, each query head's scores are z-normalised over the row's
    generated candidates (as the authors' experiments run it); a KV head takes the maximum over
    its query heads. Prompt tokens are never evicted before generated ones (the authors' code
    keeps the prompt), so a prompt longer than the budget keeps its first tokens.

    Where the authors' code differs from the engine's rules:
    - it keeps no window: every token competes on score; here the last `window` are always
      kept, and the z-normalisation runs over the other (candidate) generated tokens;
    - it breaks ties with noise of 1e-6; here ties go to the lower position;
    - its default keeps one set per KV head for every layer, from the per-layer scores averaged
      over the layers: that is `share="layers"` here (a sum over the layers, the same ranking);
      the default here keeps a set per (layer, KV head), as the authors' per-layer mode does;
    - it compresses when the cache holds budget + 128 tokens, back to the budget: the
      engine's trigger (`budget + buffer`), as for every method, with buffer=128 by default.
    """

    name = "triattention"
    context = True
    calibration: str = ""  # statistics of the model's queries, written by `rkvjax calibrate`
    max_offset: int = 65536  # the farthest future distance scored (a power of two)
    normalize: bool = True  # z-normalise each query head's scores before the group maximum

    def __post_init__(self):
        if isinstance(self.calibration, os.PathLike):  # a Path: kept as the string it names
            object.__setattr__(self, "calibration", os.fspath(self.calibration))
        super().__post_init__()

    def check(self) -> None:
        if not isinstance(self.calibration, str) or not self.calibration:
            raise ValueError(
                "method 'triattention' needs calibration statistics of the model: run "
                "`rkvjax calibrate DATA.jsonl OUT` (see --help) and pass --calibration OUT "
                "(Python: calibration=OUT)"
            )
        m = self.max_offset
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m & (m - 1):
            raise ValueError(f"max_offset must be a power of two >= 1, got {m!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
        triattention_stats.read(self.calibration)

    def check_model(self, model) -> None:
        triattention_stats.check_model(
            triattention_stats.read(self.calibration), model, self._where
        )

    @property
    def _where(self) -> str:
        return f"calibration statistics {self.calibration}"

    def scores(self, queries, keys, valid, *, impl=None, target=None, context):
        b, n_q, w, h = queries.shape
        _, k_heads, n, _ = keys.shape
        m = n - w
        g = n_q // k_heads
        stats = triattention_stats.read(self.calibration)
        total = k_heads if context.kv_heads is None else context.kv_heads
        trig, extra, omega = self._constants(stats, context.layer, total, g, h)
        if k_heads < total:  # on a mesh: this device's block of the heads
            at = context.head0 * g
            trig = jax.lax.dynamic_slice_in_dim(jnp.asarray(trig), at, n_q, axis=1)
            extra = jax.lax.dynamic_slice_in_dim(jnp.asarray(extra), at, n_q, axis=0)
        # E q_f W_f exp(i w_f t): the mean query, moved to the row's position t; its real part
        # against each post-RoPE key pair gives the folded trigonometric term.
        ang = context.pos.astype(jnp.float32)[:, None] * omega  # [B, F]
        cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]  # [B, 1, F]
        re, im = trig[0], trig[1]  # [N, F]
        u = jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1)  # [B, N, H]
        u = u.reshape(b, k_heads, g, h)  # [B, K, G, H]
        cand = keys[:, :, :m].astype(jnp.float32)  # [B, K, m, H]
        x1, x2 = jnp.split(cand, 2, axis=-1)  # [B, K, m, F]
        modulus = jnp.sqrt(x1 * x1 + x2 * x2)  # [B, K, m, F] |k_f|, as RoPE keeps it
        hi = scores.HIGHEST
        s = jnp.einsum("BKGH,BKmH->BKGm", u, cand, precision=hi)  # [B, K, G, m]
        s = s + jnp.einsum("KGF,BKmF->BKGm", extra.reshape(k_heads, g, -1), modulus, precision=hi)
        positions = context.positions[..., :m]  # [B, K, m]
        in_prompt = positions < context.prompt[:, None, None]  # [B, K, m]
        if self.normalize:
            s = _z_scores(s, (valid[..., :m] & ~in_prompt)[:, :, None])
        return jnp.where(in_prompt, PROMPT_SCORE, jnp.max(s, axis=2))  # [B, K, m]

    def _constants(
        self, stats: triattention_stats.Stats, layer: int, kv_heads: int, group: int, h: int
    ):
        """NumPy constants of one layer: the mean queries times the offsets' mean phase
        [2, N, F] (real, imaginary), E|q| - |E q| [N, F], and the frequencies [F]; checked
        against the model's shapes (`kv_heads` of `group` query heads each)."""
        where = self._where
        if layer >= stats.num_layers:
            raise ValueError(
                f"{where}: hold {stats.num_layers} layers, the model has layer {layer}"
            )
        if h != stats.head_dim:
            raise ValueError(f"{where}: are of head_dim {stats.head_dim}, the model's is {h}")
        if (stats.kv_heads, stats.q_heads) != (kv_heads, kv_heads * group):
            raise ValueError(
                f"{where}: hold {stats.q_heads} query heads over {stats.kv_heads} KV heads, the "
                f"model has {kv_heads * group} over {kv_heads}: they are of another model; run "
                "`rkvjax calibrate` with this one"
            )
        omega = stats.inv_freq.astype(np.float64)  # [F]
        phase = np.mean(np.exp(1j * offsets(self.max_offset)[:, None] * omega), axis=0)  # [F]
        mean = stats.q_mean[layer] * phase  # [N, F]
        trig = np.stack([mean.real, mean.imag]).astype(np.float32)  # [2, N, F]
        extra = (stats.q_abs_mean[layer] - np.abs(stats.q_mean[layer])).astype(np.float32)
        return trig, extra, stats.inv_freq.astype(np.float32)


def _z_scores(s: jax.Array, mask: jax.Array) -> jax.Array:
    """s [..., m] z-normalised over the entries where mask [..., m] holds (population std,
    at least 1e-6); rows with none stay finite."""
    count = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1)  # [..., 1]
    mean = jnp.sum(jnp.where(mask, s, 0.0), axis=-1, keepdims=True) / count
    dev = jnp.where(mask, s - mean, 0.0)
    std = jnp.sqrt(jnp.sum(dev * dev, axis=-1, keepdims=True) / count)
    return (s - mean) / jnp.maximum(std, 1e-6)
