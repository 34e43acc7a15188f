"""Default tile sizes of the R-KV kernels per backend (a starting point, not measured tunings)."""

from __future__ import annotations

import dataclasses

import jax

# (block_r, block_c) of the redundancy kernel: rows x columns of one similarity tile.
# GPU (Triton): f32 IEEE dots on 64 x 64 tiles with H <= 128 keep the two key tiles and the
# tile of S in registers; tl.dot needs every side >= 16. TPU: 256 fills the MXU and keeps the
# lane dimension dense. CPU interpret mode: larger tiles mean fewer (slow) grid steps.
REDUNDANCY_TILES = {"gpu": (64, 64), "tpu": (256, 256), "cpu": (128, 128)}

# (block_m, block_k) of the top-k kernel: score chunk width and output positions per pass.
# The compaction compares a [block_k, block_m] tile, so their product bounds register use.
TOPK_TILES = {"gpu": (256, 32), "tpu": (512, 128), "cpu": (512, 128)}


def backend() -> str:
    """The default JAX backend folded to "gpu", "tpu" or "cpu" (anything else runs as CPU)."""
    return _fold(jax.default_backend())


def _fold(platform: str) -> str:
    return platform if platform in ("gpu", "tpu") else "cpu"


def fit(block: int, n: int, floor: int) -> int:
    """block shrunk to the next power of two >= n (never below floor): small inputs pad less."""
    need = max(floor, 1 << max(n - 1, 0).bit_length())
    return min(block, need)


def compiler_params(interpret: bool, n_axes: int):
    """Backend compiler parameters of a pallas_call with n_axes independent grid axes.

    GPU: Triton, chosen explicitly because JAX now lowers a bare pallas_call on GPU to Mosaic
    GPU, which deprecates pallas_call (and these kernels are written for the Triton model:
    independent programs, power-of-two tiles). TPU: every grid axis is parallel (no program
    accumulates into another's output), so megacore chips may split them. Interpret: None.
    """
    if interpret:
        return None
    name = backend()
    if name == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_axes)
    if name == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


# Auto (`use_pallas(None)`) moves redundancy to the O(n) kernel when the jnp path's dense
# n x n float32 matrix would exceed this share of device memory (or DENSE_FALLBACK_BYTES when
# the backend does not report its memory). XLA holds about 1.4x that matrix in temporaries.
DENSE_SHARE = 1 / 16
DENSE_FALLBACK_BYTES = 1 << 30


def dense_limit_bytes(device=None) -> int:
    """Largest dense intermediate the auto kernel choice leaves to the jnp path (on `device`,
    default the first local one)."""
    device = device if device is not None else jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return int(limit * DENSE_SHARE) if limit else DENSE_FALLBACK_BYTES


@dataclasses.dataclass(frozen=True)
class Target:
    """What compiled programs run on, decided once from a runtime's devices and carried in its
    static plan, so nothing about the process (its default backend, a device's memory) is
    read while tracing a program whose cache key does not hold it."""

    backend: str  # "gpu", "tpu" or "cpu"
    dense_limit_bytes: int  # see `dense_limit_bytes`

    @classmethod
    def of(cls, device) -> Target:
        return cls(_fold(device.platform), dense_limit_bytes(device))

    @classmethod
    def default(cls) -> Target:
        """The process's default device: what a call outside a runtime runs on."""
        return cls(backend(), dense_limit_bytes())
