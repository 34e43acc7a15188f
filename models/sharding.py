"""Logical-axis sharding rules, the device mesh, and the one `shard_map` wrapper of the engine.

A mesh is `("data", "model")`: batch rows on `data`; query heads, KV heads, MLP hidden and vocab
on `model`. Code elsewhere names logical axes ("batch", "kv_heads", ...) and never spells a
`PartitionSpec`. Both head axes are split in contiguous blocks over the same mesh axis, so with
HF's kv-major order (q head n uses KV head n // G) a device holds each of its KV heads' query
groups: per-head work (attention, R-KV scores, top-k) is local and runs without collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from rkvjax.models.config import ModelConfig

MESH_AXES = ("data", "model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Logical axis name -> mesh axis (None = replicated). Hashable: jit keys on it."""

    batch: str | None = "data"
    embed: str | None = None
    q_heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    ffw: str | None = "model"
    vocab: str | None = "model"
    experts: str | None = None  # each expert whole on every device ...
    expert_ffw: str | None = "model"  # ... its hidden units split, as a dense MLP's are
    cache_slots: str | None = None  # must stay None: selection gathers along the slot axis
    window: str | None = None

    def mesh_axis(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name not in _LOGICAL:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(_LOGICAL)}")
        return getattr(self, name)

    def spec(self, *axes: str | None) -> PartitionSpec:
        """PartitionSpec of an array whose dimensions have these logical names (None: unnamed).

        Raises:
          ValueError: if two dimensions map to the same mesh axis (an array cannot be split
            twice over one axis).
        """
        mapped = [self.mesh_axis(a) for a in axes]
        used = [m for m in mapped if m is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {axes} use a mesh axis twice: {tuple(mapped)}")
        return PartitionSpec(*mapped)

    def named(self, mesh: Mesh, *axes: str | None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(*axes))


_LOGICAL = frozenset(f.name for f in dataclasses.fields(ShardingRules))
DEFAULT_RULES = ShardingRules()


def make_mesh(data: int = 1, model: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A `("data", "model")` mesh over `devices` (default: every device of the process).

    The axes are Auto (the compiler places intermediates; `with_sharding_constraint` pins the
    cache), which lets the model code stay free of sharding annotations.

    Raises:
      ValueError: unless data * model equals the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, n in (("data", data), ("model", model)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh axis {name} must be a positive int, got {n!r}")
    if data * model != len(devices):
        raise ValueError(
            f"a mesh data={data} x model={model} needs {data * model} devices, but there are "
            f"{len(devices)} ({devices[0].platform}); pick data * model == {len(devices)}, or "
            "pass devices= to use a subset"
        )
    return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,model=4"` -> {"data": 2, "model": 4}; omitted axes are 1."""
    out = {"data": 1, "model": 1}
    seen = set()
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in out or name in seen or not value.strip().isdigit():
            raise ValueError(
                f"bad mesh {text!r}: expected comma-separated axis=size with axes data and "
                "model, e.g. 'data=2,model=4'"
            )
        seen.add(name)
        out[name] = int(value)
        if out[name] < 1:
            raise ValueError(f"bad mesh {text!r}: {name} must be >= 1")
    return out


def _divisors(n: int, limit: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, limit + 1) if n % d == 0)


def check_divisible(
    cfg: ModelConfig,
    mesh: Mesh,
    batch: int | None = None,
    rules: ShardingRules = DEFAULT_RULES,
) -> ShardingRules:
    """Checks that `cfg` (and a batch of `batch` rows) splits evenly over `mesh`.

    Heads and MLP hidden must divide: splitting them unevenly would put part of a head's group
    on another device. Vocab is different: checkpoints have odd vocab sizes (97, 151936 + pads),
    and only the embedding table and the head use it, so a vocab that does not divide is
    replicated instead (the returned rules say so) rather than refused.

    Returns:
      The rules to use for this model on this mesh.

    Raises:
      ValueError: naming the axis and the mesh sizes that would work.
    """
    sizes, total = dict(mesh.shape), mesh.devices.size
    for axis, count, what in (
        ("kv_heads", cfg.kv_heads, "KV heads"),
        ("q_heads", cfg.q_heads, "query heads"),
        ("ffw", cfg.ffw, "MLP hidden units"),
        *([("expert_ffw", cfg.experts.ffw, "expert hidden units")] if cfg.experts else []),
    ):
        name = rules.mesh_axis(axis)
        if name is not None and count % sizes[name]:
            raise ValueError(
                f"{count} {what} cannot be split over {name}={sizes[name]} devices; "
                f"use {name} in {_divisors(count, total)}"
            )
    vocab = rules.mesh_axis("vocab")
    if vocab is not None and cfg.vocab_size % sizes[vocab]:
        rules = dataclasses.replace(rules, vocab=None)
    data = rules.mesh_axis("batch")
    if batch is not None and data is not None and batch % sizes[data]:
        raise ValueError(
            f"a batch of {batch} rows cannot be split over {data}={sizes[data]} devices; use a "
            f"multiple of {sizes[data]} rows (generate pads with dummy rows itself)"
        )
    return rules


def constrain(x: jax.Array, rules: ShardingRules | None, *axes: str | None) -> jax.Array:
    """Pins x to the sharding of its logical axes under the current mesh (no-op when rules is
    None: the single-device path)."""
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.spec(*axes))


def local(fn: Callable, rules: ShardingRules | None, in_axes: Any, out_axes: Any) -> Callable:
    """`fn` run per device under `jax.shard_map` over the current mesh, or `fn` itself when
    rules is None.

    `in_axes` / `out_axes` mirror fn's arguments / results with a tuple of logical axis names
    for each array (a tuple of strings is one array's axes, any other tuple or list is a
    pytree node). fn must only mix data inside one block of every sharded axis; results
    declared replicated over an axis must be equal on every device of it (they are not
    checked: `check_vma=False`, which the Pallas kernels need as well).
    """
    if rules is None:
        return fn

    def specs(tree):
        return jax.tree.map(
            lambda axes: rules.spec(*axes),
            tree,
            is_leaf=lambda t: isinstance(t, tuple) and all(isinstance(a, str | None) for a in t),
        )

    return jax.shard_map(fn, in_specs=specs(in_axes), out_specs=specs(out_axes), check_vma=False)


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Joins a multi-process run (one process per host, or several on one machine for tests).

    Every process runs the same program; afterwards `jax.devices()` lists every process's
    devices, so `make_mesh` spans them all and `load` / `generate` / `convert` work unchanged.
    On CPU the processes talk through gloo collectives. Must run before anything touches a
    JAX backend. With no arguments (one process) it does nothing.

    Raises:
      ValueError: if only some arguments are given, or they are out of range.
    """
    given = (coordinator, num_processes, process_id)
    if all(x is None for x in given):
        return
    if any(x is None for x in given):
        raise ValueError(
            "a multi-process run needs all of coordinator (host:port of process 0), "
            f"num_processes and process_id; got {coordinator=}, {num_processes=}, {process_id=}"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator must be host:port, got {coordinator!r}")
    # Only the CPU client reads this; accelerators use their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)


def host_array(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array (the same on every process) as a global array split by `sharding`: each
    process fills only its own devices' blocks, so this works on one process or many."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(tree: Any) -> Any:
    """`jax.device_get` that also fetches arrays split over several processes: each process
    gets the whole array (a gather over processes; one process never needs it)."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)  # one call: the host loop fetches every chunk's outputs
    return jax.tree.map(get, tree)
