"""Many small arrays as one flat buffer per dtype: fewer transfers between host and device.

A transfer or a fetch costs the host tens of microseconds per array, whatever its size, and the
runtime's arrays are small and many: an insert sends 19 (its rows' settings and its prompts) and
a decode chunk returns 21 (`programs.Tokens`). Packed, each is one buffer per dtype (two or
three): the host packs what it sends and unpacks what it fetches as NumPy views, and a program
unpacks and packs with static slices, which XLA fuses into its own copies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a tree sits in its dtype's buffer (static: programs are keyed on it)."""

    treedef: Any
    leaves: tuple[tuple[str, int, tuple[int, ...]], ...]  # (dtype, offset, shape) per leaf
    sizes: tuple[tuple[str, int], ...]  # (dtype, elements) per buffer

    def unpack(self, buffers: dict[str, Any]) -> Any:
        """The tree from its buffers: NumPy views of NumPy buffers, slices inside a program."""
        leaves = [
            buffers[d][off : off + math.prod(shape)].reshape(shape) for d, off, shape in self.leaves
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def layout_of(tree: Any) -> Layout:
    """The layout of a tree of arrays (NumPy, jax, tracers or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    return _layout(leaves, treedef)


def _layout(leaves: list, treedef) -> Layout:
    sizes: dict[str, int] = {}
    where = []
    for x in leaves:
        d = np.dtype(x.dtype).name
        where.append((d, sizes.get(d, 0), tuple(x.shape)))
        sizes[d] = sizes.get(d, 0) + math.prod(x.shape)
    return Layout(treedef, tuple(where), tuple(sizes.items()))


def packed(tree: Any) -> Packed:
    """`tree` as a `Packed`: its leaves raveled and concatenated per dtype in leaf order (NumPy
    for NumPy leaves, on the host; jax arrays inside a program), and its layout."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = _layout(leaves, treedef)
    xp = np if all(isinstance(x, np.ndarray | np.generic) for x in leaves) else jnp
    buffers = {
        d: xp.concatenate(
            [xp.ravel(x) for x, (dt, _, _) in zip(leaves, layout.leaves, strict=True) if dt == d]
        )
        for d, _ in layout.sizes
    }
    return Packed(buffers, layout)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A program's output tree as its buffers (on device until fetched) and its layout."""

    buffers: dict[str, Any]
    layout: Layout

    def tree_flatten(self):
        return (self.buffers,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def unpack(self) -> Any:
        return self.layout.unpack(self.buffers)


def unpacked(tree: Any) -> Any:
    """`tree` with every `Packed` in it replaced by the tree it holds (after a fetch: views)."""
    return jax.tree.map(
        lambda x: x.unpack() if isinstance(x, Packed) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Packed),
    )
