"""One Flax NNX decoder covering Llama, Qwen2 and Qwen3 (flags in ModelConfig).

The model knows nothing about caches: each attention layer hands its post-RoPE q/k/v to an
`attend` callback supplied by the engine (causal attention over the prompt, or write-then-attend
over the KV cache), threading an opaque state through the layers. Layers are kept as a Python list
(unrolled in the trace) rather than stacked for `lax.scan`: on CPU a scanned stack slices every
layer's weights out of the stacked buffer each step, which costs bandwidth in the decode step, and
30 unrolled layers compile in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rkvjax import layers
from rkvjax.config import ModelConfig

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
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, n, k, h = cfg.embed, cfg.q_heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.wq = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.wo = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), dtype)
        if cfg.qkv_bias:
            self.bq = _param(rngs, (n, h), ("q_heads", "head_dim"), dtype)
            self.bk = _param(rngs, (k, h), ("kv_heads", "head_dim"), dtype)
            self.bv = _param(rngs, (k, h), ("kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.bo = _param(rngs, (d,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = _ones(rngs, (h,), ("head_dim",), dtype)
            self.k_norm = _ones(rngs, (h,), ("head_dim",), dtype)

    def __call__(self, x, rope, attend: Callable, state):
        """x [B, T, D], rope = (cos, sin) [B, T, H] -> ([B, T, D], state)."""
        cfg = self.cfg
        q = jnp.einsum("BTD,DNH->BTNH", x, self.wq[...])
        k = jnp.einsum("BTD,DKH->BTKH", x, self.wk[...])
        v = jnp.einsum("BTD,DKH->BTKH", x, self.wv[...])
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if cfg.qk_norm:
            q = layers.rms_norm(q, self.q_norm[...], cfg.rms_eps)
            k = layers.rms_norm(k, self.k_norm[...], cfg.rms_eps)
        q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
        o, state = attend(q, k, v, state)  # [B, T, N, H]
        # Contract over the flattened (N, H): with "BTNH,NHD->BTD" XLA:CPU transposes the whole
        # wo weight into an [H, N, D] layout on every decode step.
        b, t, n, h = o.shape
        wo = self.wo[...]
        out = jnp.einsum("BTE,ED->BTD", o.reshape(b, t, n * h), wo.reshape(n * h, wo.shape[-1]))
        if cfg.o_bias:
            out = out + self.bo[...]
        return out, state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, f = cfg.embed, cfg.ffw
        self.gate = _param(rngs, (d, f), ("embed", "ffw"), dtype)
        self.up = _param(rngs, (d, f), ("embed", "ffw"), dtype)
        self.down = _param(rngs, (f, d), ("ffw", "embed"), dtype)

    def __call__(self, x):
        """x [B, T, D] -> [B, T, D] (SwiGLU)."""
        g = jnp.einsum("BTD,DF->BTF", x, self.gate[...])
        u = jnp.einsum("BTD,DF->BTF", x, self.up[...])
        return jnp.einsum("BTF,FD->BTD", jax.nn.silu(g) * u, self.down[...])


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.attn_norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, rope, attend: Callable, state):
        eps = self.cfg.rms_eps
        h, state = self.attn(layers.rms_norm(x, self.attn_norm[...], eps), rope, attend, state)
        x = x + h
        return x + self.mlp(layers.rms_norm(x, self.mlp_norm[...], eps)), state


class Decoder(nnx.Module):
    """Token ids -> hidden states -> logits. Weights are in `dtype`; norms and softmax in f32."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"), dtype)
        self.layers = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = _ones(rngs, (cfg.embed,), ("embed",), dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.embed, cfg.vocab_size), ("embed", "vocab"), dtype)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: Attend, state):
        """tokens, positions [B, T] int32 -> (final-normed hidden [B, T, D], state)."""
        x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]
        rope = layers.rope_tables(positions, self.cfg)
        for i, block in enumerate(self.layers):
            x, state = block(x, rope, lambda q, k, v, s, i=i: attend(i, q, k, v, s), state)
        return layers.rms_norm(x, self.norm[...], self.cfg.rms_eps), state

    def head(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> logits [B, T, V] in float32."""
        if self.cfg.tie_embeddings:
            x, w = layers.f32_dot_operands(x, self.embed[...])
            return jnp.einsum("BTD,VD->BTV", x, w, preferred_element_type=jnp.float32)
        x, w = layers.f32_dot_operands(x, self.lm_head[...])
        return jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)


def abstract_decoder(cfg: ModelConfig, dtype=jnp.float32) -> Decoder:
    """The decoder's structure with ShapeDtypeStructs for leaves (no memory allocated)."""
    return Decoder(cfg, dtype=dtype, rngs=None)
