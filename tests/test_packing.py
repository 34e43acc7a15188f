"""Packing many small arrays as one buffer per dtype (`rkvjax.runtime.packing`): exact round
trips on the host and through a program, and the runtime's transfers packed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.runtime import packing


def _tree(rng: np.random.Generator) -> dict:
    """Mixed dtypes and shapes: scalars, empty arrays, nested containers."""
    return {
        "tokens": rng.integers(-1, 50_000, (4, 16)).astype(np.int32),
        "count": rng.integers(0, 16, 4).astype(np.int32),
        "active": rng.random(4) < 0.5,
        "logprob": rng.standard_normal((4, 0)).astype(np.float32),
        "top": (rng.standard_normal((4, 16, 3)).astype(np.float32), np.zeros((4, 0, 0), np.int32)),
        "seeds": rng.integers(0, 2**32, 4, dtype=np.uint32),
        "steps": np.int32(7),
    }


def _equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
        for x, y in zip(la, lb, strict=True)
    )


def test_a_tree_packs_into_one_buffer_per_dtype_and_back_exactly():
    tree = _tree(np.random.default_rng(0))
    p = packing.packed(tree)
    assert sorted(p.buffers) == ["bool", "float32", "int32", "uint32"]
    assert all(b.ndim == 1 for b in p.buffers.values())
    assert dict(p.layout.sizes)["int32"] == 4 * 16 + 4 + 0 + 1
    assert _equal(p.unpack(), tree)
    assert hash(p.layout) == hash(packing.layout_of(tree))  # a static key for programs


def test_a_program_unpacks_its_inputs_and_packs_its_outputs_exactly():
    """Through `jax.device_put` and a jitted program both ways: the layout travels as the
    pytree's static part, so the host unpacks the output without being told its shapes."""
    tree = _tree(np.random.default_rng(1))

    @jax.jit
    def double(p):
        t = p.unpack()
        return packing.packed(jax.tree.map(lambda x: x if x.dtype == jnp.bool_ else x * 2, t))

    out = double(jax.device_put(packing.packed(tree)))
    assert isinstance(out, packing.Packed) and len(jax.tree.leaves(out)) == 4
    got = packing.unpacked({"chunk": jax.device_get(out)})["chunk"]
    want = jax.tree.map(lambda x: x if x.dtype == np.bool_ else x * 2, tree)
    assert _equal(got, want)
