"""Random eviction: the prompt, and a uniformly random choice among the generated tokens."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rkvjax.kv.policies.base import Policy, register


def mix32(x):
    """A 32-bit integer hash (Wellons' lowbias32) of uint32 x; elementwise, jnp or NumPy."""
    u32 = x.dtype.type  # Python ints above 2^31 would not pass as jnp operands
    x = x ^ (x >> u32(16))
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> u32(15))
    x = x * u32(0x846CA68B)
    return x ^ (x >> u32(16))


def uniform(seed, time, position):
    """[0, 1) float32 drawn for (request seed, compression time, key position), all uint32
    (broadcast together). A counter-based hash rather than `jax.random`: the draw of a key
    depends on nothing else (not on the slot, the batch or the device), and a NumPy reference
    reproduces it bit for bit."""
    h = mix32(mix32(mix32(seed) ^ time) ^ position)
    return (h >> h.dtype.type(8)).astype(jnp.float32) * (1.0 / (1 << 24))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Random(Policy):
    """Random eviction (arXiv 2609.03430): the prompt is kept and the other candidates are
    kept at random, drawn afresh at each compression from the request's seed, the row's
    position (when the compression happens) and each key's position. So a request's kept sets
    are the same whatever slot, batch or device it runs on, and every layer and KV head holding
    the same positions keeps the same ones (one kept set per row, as token eviction means).
    The n samples of a request share its prompt's compression; after it, sample i draws from
    the seed plus i * 0x9E3779B9 (sample 0 from the request's seed itself).

    With `keep_prompt` the prompt's tokens rank above every generated one (in position order,
    so a prompt longer than the budget keeps its first tokens); without it they are drawn like
    the rest. As for every method, the last `window` tokens are always kept."""

    name = "random"
    context = True
    keep_prompt: bool = True  # the prompt's tokens are never evicted before generated ones

    def check(self) -> None:
        if not isinstance(self.keep_prompt, bool):
            raise ValueError(f"keep_prompt must be True or False, got {self.keep_prompt!r}")

    def scores(self, queries, keys, valid, *, impl=None, target=None, context):
        m = keys.shape[2] - queries.shape[2]
        positions = context.positions[..., :m]  # [B, K, m]
        draw = uniform(
            context.seed[:, None, None].astype(jnp.uint32),
            context.pos[:, None, None].astype(jnp.uint32),
            positions.astype(jnp.uint32),
        )  # [B, K, m] in [0, 1)
        if not self.keep_prompt:
            return draw
        in_prompt = positions < context.prompt[:, None, None]  # [B, K, m]
        # Above every draw, earlier prompt tokens first: 2 - position / 2^24 stays in (1, 2].
        first = 2.0 - positions.astype(jnp.float32) * (1.0 / (1 << 24))
        return jnp.where(in_prompt, first, draw)
