"""The slot runtime: continuous batching over a fixed number of rows, as four owners that pass
plain data (`vllm/v1/engine/core.py`'s loop):

- `scheduler`: the queue and which sample holds which row; admissions, early chunk ends,
  narrowing and widening, decided as plans. No JAX.
- `executor`: the device state and the compiled programs (`programs`); carries out the
  plans, each insert with one host-to-device transfer, and starts copying a chunk's outputs
  back as soon as it is dispatched. Its compile time is its own.
- `outputs`: chunk outcomes into samples' tokens (stop strings on the new text only), streamed
  samples' deltas (incremental detokenization) and results.
- `engine`: `Engine`, which wires the three: submit, results, run, step, take_deltas, abort,
  stats, progress. A server is a client of it (`rkvjax.entrypoints.serve`).

`Engine` and the executor's helpers load on first use, so the scheduler imports without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rkvjax.lazy import attribute_loader

if TYPE_CHECKING:
    from rkvjax.runtime.engine import DEFAULT_CHUNK, DEFAULT_STOP_WIDTH, Engine
    from rkvjax.runtime.executor import device_rows, on_mesh
    from rkvjax.runtime.scheduler import NARROW_MIN_CHUNKS

_HOMES = {
    "DEFAULT_CHUNK": "rkvjax.runtime.engine",
    "DEFAULT_STOP_WIDTH": "rkvjax.runtime.engine",
    "Engine": "rkvjax.runtime.engine",
    "NARROW_MIN_CHUNKS": "rkvjax.runtime.scheduler",
    "device_rows": "rkvjax.runtime.executor",
    "on_mesh": "rkvjax.runtime.executor",
}

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_STOP_WIDTH",
    "NARROW_MIN_CHUNKS",
    "Engine",
    "device_rows",
    "on_mesh",
]


__getattr__ = attribute_loader(__name__, _HOMES)
