"""Pallas kernels for the R-KV hot spots and their pure-jnp references: leaves of the engine.

Each kernel file holds `_validate`, the `_kernel` bodies, a jitted wrapper (tiles and
`interpret` static) and `<name>_reference`, the pure-jnp specification. Nothing here imports
the engine: `rkvjax.kv.scores` decides when a kernel runs (`scores.use_pallas`).
"""

from __future__ import annotations

from rkvjax.kv.kernels import tuning
from rkvjax.kv.kernels.redundancy import redundancy as redundancy_pallas
from rkvjax.kv.kernels.redundancy import redundancy_reference
from rkvjax.kv.kernels.topk import topk_positions as topk_pallas
from rkvjax.kv.kernels.topk import topk_reference

__all__ = [
    "redundancy_pallas",
    "redundancy_reference",
    "topk_pallas",
    "topk_reference",
    "tuning",
]
