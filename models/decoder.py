"""One Flax NNX decoder covering Llama, Qwen2, Qwen3 and Qwen3-MoE (flags in ModelConfig).

The model knows nothing about caches: each attention layer hands its post-RoPE q/k/v to an
`attend` callback supplied by the engine (causal attention over the prompt, or write-then-attend
over the KV cache), threading an opaque state through the layers. Layers are kept as a Python list
(unrolled in the trace) rather than stacked for `lax.scan`: on CPU a scanned stack slices every
layer's weights out of the stacked buffer each step, which costs bandwidth in the decode step, and
30 unrolled layers compile in seconds.

Inside the blocks the residual stream is features-major, x [D, B, T], and every weight is stored
[out, in] (Hugging Face's own layout), so each projection is `W @ x`. For the few-row matrices of
a decode step XLA:CPU's dots run much faster that way round than as `x @ W` with [in, out]
weights: a bare chain of the default model's matmuls went from 14.5 to 20 steps/s at batch 8
(and 30 to 33 at batch 1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from rkvjax.models import experts, layers, sharding
from rkvjax.models.config import ModelConfig

# attend(layer, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], state) -> (out [B,T,N,H], state)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str, ...], dtype, scale=0.02):
    """A parameter with logical axis names (`axes`) that sharding maps onto a mesh; with no
    `rngs`, an abstract one (a ShapeDtypeStruct: loaders fill it)."""
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype), axes=axes)
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


def _ones(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str, ...], dtype):
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype), axes=axes)
    return nnx.Param(jnp.ones(shape, dtype), axes=axes)


class Attention(nnx.Module):
    """Grouped-query attention. The q, k and v projections are one weight, wqkv [K, G + 2, H, D]:
    for each KV head its G query heads, then its key and its value head. One product streams it
    (XLA:CPU reads one [(N + 2K) * H, D] matrix much faster than three small ones: batch-1
    float32 decode went from about 29 to 32 tokens/s), and splitting on the KV-head axis keeps
    each KV head's query group on its device, as the separate weights did."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, n, k, h = cfg.embed, cfg.q_heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        g = n // k
        self.wqkv = _param(rngs, (k, g + 2, h, d), ("kv_heads", None, "head_dim", "embed"), dtype)
        self.wo = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
        if cfg.qkv_bias:
            self.bqkv = _param(rngs, (k, g + 2, h), ("kv_heads", None, "head_dim"), dtype)
        if cfg.o_bias:
            self.bo = _param(rngs, (d,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = _ones(rngs, (h,), ("head_dim",), dtype)
            self.k_norm = _ones(rngs, (h,), ("head_dim",), dtype)

    def __call__(self, x, rope, attend: Callable, state):
        """x [D, B, T], rope = (cos, sin) [B, T, H] -> ([D, B, T], state)."""
        cfg = self.cfg
        g = cfg.q_heads // cfg.kv_heads
        qkv = layers.project("KCHD,DBT->KCHBT", self.wqkv[...], x)  # [K, G + 2, H, B, T]
        if cfg.qkv_bias:
            qkv = qkv + self.bqkv[...][..., None, None]
        # The barrier keeps XLA from folding the transposes below into the product, which it did
        # by copying the weight into [in, out] order on every step.
        qkv = jax.lax.optimization_barrier(qkv).transpose(3, 4, 0, 1, 2)  # [B, T, K, G + 2, H]
        b, t = qkv.shape[:2]
        q = qkv[:, :, :, :g].reshape(b, t, cfg.q_heads, cfg.head_dim)  # HF order: n = k * G + g
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, T, K, H]
        if cfg.qk_norm:
            q = layers.rms_norm(q, self.q_norm[...], cfg.rms_eps)
            k = layers.rms_norm(k, self.k_norm[...], cfg.rms_eps)
        q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
        o, state = attend(q, k, v, state)  # [B, T, N, H]
        # Contract over the flattened (N, H): contracting two dims made XLA:CPU copy the whole
        # wo weight into another layout on every decode step.
        b, t, n, h = o.shape
        wo = self.wo[...]
        o = o.reshape(b, t, n * h).transpose(2, 0, 1)  # [E, B, T], features first
        out = layers.project("DE,EBT->DBT", wo.reshape(wo.shape[0], n * h), o)
        if cfg.o_bias:
            out = out + self.bo[...][:, None, None]
        return out, state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, f = cfg.embed, cfg.ffw
        self.gate = _param(rngs, (f, d), ("ffw", "embed"), dtype)
        self.up = _param(rngs, (f, d), ("ffw", "embed"), dtype)
        self.down = _param(rngs, (d, f), ("embed", "ffw"), dtype)

    def __call__(self, x):
        """x [D, B, T] -> [D, B, T] (SwiGLU)."""
        g = layers.project("FD,DBT->FBT", self.gate[...], x)
        u = layers.project("FD,DBT->FBT", self.up[...], x)
        return layers.project("DF,FBT->DBT", self.down[...], jax.nn.silu(g) * u)


class MoE(nnx.Module):
    """A mixture-of-experts MLP (`rkvjax.models.experts`): a router [E, D] and E SwiGLU experts
    stacked, [E, F, D] and [E, D, F]. Each expert's hidden units are split over the mesh like a
    dense MLP's, so the layer has the dense layer's one all-reduce."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        e, d, f = cfg.experts.count, cfg.embed, cfg.experts.ffw
        self.cfg = cfg
        self.router = _param(rngs, (e, d), ("experts", "embed"), dtype)
        self.gate = _param(rngs, (e, f, d), ("experts", "expert_ffw", "embed"), dtype)
        self.up = _param(rngs, (e, f, d), ("experts", "expert_ffw", "embed"), dtype)
        self.down = _param(rngs, (e, d, f), ("experts", "embed", "expert_ffw"), dtype)

    def __call__(self, x):
        """x [D, B, T] -> [D, B, T]."""
        spec, rules = self.cfg.experts, _local_rules(x.shape[1])
        fn = functools.partial(
            experts.mixture,
            top_k=spec.top_k,
            norm=spec.norm_top_k,
            reduce=None if rules is None else rules.mesh_axis("expert_ffw"),
        )
        ffw = (None, "expert_ffw", None)
        fn = sharding.local(
            fn,
            rules,
            in_axes=(("batch", None, None), (None, None), ffw, ffw, (None, None, "expert_ffw")),
            out_axes=("batch", None, None),
        )
        out = fn(x.transpose(1, 2, 0), self.router[...], self.gate[...], self.up[...],
                 self.down[...])  # fmt: skip
        return out.transpose(2, 0, 1)


def _local_rules(rows: int) -> sharding.ShardingRules | None:
    """How a MoE layer splits under the current mesh (None: no mesh). The routing sorts tokens,
    which the automatic partitioner would gather from every data shard: under `shard_map` each
    device sorts its own rows. Rows that do not divide over "data" are whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    data = dict(mesh.shape).get("data", 1)
    return dataclasses.replace(sharding.DEFAULT_RULES, batch="data" if rows % data == 0 else None)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, layer: int, dtype, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.attn_norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        kind = MoE if cfg.sparse(layer) else MLP
        self.mlp = kind(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, rope, attend: Callable, state):
        """x [D, B, T] -> ([D, B, T], state)."""
        eps = self.cfg.rms_eps
        with jax.named_scope("attention"):
            h, state = self.attn(
                layers.rms_norm(x, self.attn_norm[...], eps, axis=0), rope, attend, state
            )
        x = x + h
        with jax.named_scope("mlp"):
            return x + self.mlp(layers.rms_norm(x, self.mlp_norm[...], eps, axis=0)), state


class Decoder(nnx.Module):
    """Token ids -> hidden states -> logits. Weights are in `dtype`; norms and softmax in f32."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"), dtype)
        self.layers = nnx.List(
            [Block(cfg, layer=i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"), dtype)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: Attend, state):
        """tokens, positions [B, T] int32 -> (final-normed hidden [B, T, D], state)."""
        x = layers.embed_lookup(self.embed[...], tokens).transpose(2, 0, 1)  # [D, B, T]
        rope = layers.rope_tables(positions, self.cfg)
        for i, block in enumerate(self.layers):
            x, state = block(x, rope, lambda q, k, v, s, i=i: attend(i, q, k, v, s), state)
        x = x.transpose(1, 2, 0)  # [B, T, D]
        return layers.rms_norm(x, self.norm[...], self.cfg.rms_eps), state

    def head(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> logits [B, T, V] in float32."""
        w = self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]  # [V, D]
        if x.shape[1] > 1:  # a full forward: [V, B, T] logits would cost a transposed copy
            return jnp.einsum("BTD,VD->BTV", x, w, preferred_element_type=jnp.float32)
        # One token per row (decode, the prefill's last token): the projections' own path.
        logits = layers.project("VD,DBT->VBT", w, x.transpose(2, 0, 1), dtype=jnp.float32)
        return logits.transpose(1, 2, 0)


def abstract_decoder(cfg: ModelConfig, dtype=jnp.float32) -> Decoder:
    """The decoder's structure with ShapeDtypeStructs for leaves (no memory allocated)."""
    return Decoder(cfg, dtype=dtype, rngs=None)
