"""How many rows fit: the one place that sizes a slot's device bytes and the default slot count,
for `generate`, offline jobs and the server alike.

A slot holds its K/V cache (as the cache's `kv_dtype`, an 8-bit cache with a float32 scale per
vector), its slot positions, the policy's per-key state and its query ring. The default count
is a power of two, so the same call always compiles the same programs.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rkvjax.kv import quantization
from rkvjax.kv.config import CompressionConfig

# How much of a device's memory, less the weights, the default slot count may take.
MEMORY_SHARE = 0.5


def slot_bytes(model, cc: CompressionConfig, capacity: int, penalties: bool) -> int:
    """Device bytes one slot of `model` holds with cache `cc` at `capacity` cache slots per
    (layer, KV head): K/V in `cc.kv_dtype` (None: the model's dtype), positions, the policy's
    per-key state, the query ring of a compressing cache, and penalty counts (`penalties`)."""
    cfg = model.config
    dtype = quantization.cache_dtype(cc.kv_dtype, model.dtype)
    # Bytes of one stored vector of head_dim numbers, its scale included.
    vector = cfg.head_dim * dtype.itemsize + (4 if quantization.is_quantized(dtype) else 0)
    state = cc.state is not None
    window = cc.window if cc.compressing else 0
    per_layer = cfg.kv_heads * capacity * (2 * vector + 4 + (4 if state else 0))
    per_layer += cfg.q_heads * window * vector
    return cfg.num_layers * per_layer + (5 * cfg.vocab_size if penalties else 0)


def device_memory(model) -> int | None:
    """Bytes one device has for slots: its memory (the limit a GPU or TPU reports; on CPU the
    host's total) less the model's weights on it. Fixed for a model on a machine: the slot
    count that follows from it, and so every compiled shape, does not move from run to run
    with what else happens to be allocated. None when nothing says."""
    leaves = [x for x in jax.tree.leaves(nnx.state(model.decoder)) if isinstance(x, jax.Array)]
    dev = model.device
    total = (dev.memory_stats() or {}).get("bytes_limit")
    if total is None:
        try:
            with open("/proc/meminfo") as f:
                total = next(
                    int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")
                )
        except (OSError, StopIteration):
            return None
    weights = sum(
        shard.data.nbytes for x in leaves for shard in x.addressable_shards if shard.device == dev
    )
    return max(0, total - weights)


def default_slots(
    model,
    cc: CompressionConfig,
    *,
    samples: int,
    capacity: int,
    penalties: bool,
    peak_rows: float = 1.0,
) -> int:
    """Every sample at once when their slots (`slot_bytes`) fit in MEMORY_SHARE of each
    device's memory less the weights, else the largest power of two of rows that does (at
    least one per data shard). `peak_rows`: the rows' worth of cache the engine holds at its
    peak per slot (a server: its state and half as many rows again,
    `serve.server.PEAK_ROWS`), so that the peak fits. Every process of a multi-process run
    gets process 0's count, so they build the same engine."""
    memory = device_memory(model)
    fit = samples
    if memory is not None:
        per_slot = slot_bytes(model, cc, capacity, penalties) * peak_rows
        fit = int(memory * MEMORY_SHARE * model.data_shards // per_slot)
        fit = 1 << (fit.bit_length() - 1) if fit else 0
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        fit = int(multihost_utils.broadcast_one_to_all(np.int64(fit)))
    return max(model.data_shards, min(samples, fit))
