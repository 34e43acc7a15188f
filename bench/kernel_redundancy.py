"""Redundancy scoring: the Pallas kernel against the jnp path, time and compiled memory vs n.

One JSON line per (n, implementation) on stdout; nothing is asserted. Memory is XLA's compiled
estimate (`memory_analysis()`: arguments + outputs + temporaries) and needs no run, so it is
reported for both paths at every n, on any backend. Timing runs the jnp path everywhere (up to
--max-time-n on CPU, where the n x n temporaries get large) and the kernel only where Pallas
compiles (GPU / TPU) or with --time-kernel: on CPU the kernel runs in interpret mode, which is
correct but orders of magnitude slower, so its CPU time says nothing about the kernel.

    python bench/kernel_redundancy.py                 # n = 256 .. 8192
    python bench/kernel_redundancy.py --tiny          # a few seconds: CI smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax import compression
from rkvjax.kernels import tuning
from rkvjax.kernels.redundancy import redundancy as redundancy_pallas


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1, help="B rows")
    p.add_argument("--kv-heads", type=int, default=8, help="K KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="H")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--retain", type=int, default=1)
    p.add_argument("--block-r", type=int, default=None, help="kernel row tile (default: table)")
    p.add_argument("--block-c", type=int, default=None, help="kernel column tile")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up")
    p.add_argument("--time-kernel", action="store_true", help="time the kernel on CPU too")
    p.add_argument("--max-time-n", type=int, default=2048, help="largest n timed on CPU")
    p.add_argument("--tiny", action="store_true", help="two small sizes, one repeat")
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes = [64, 128]
        args.batch, args.kv_heads, args.head_dim, args.repeats = 1, 2, 64, 1
        args.time_kernel = True
    return args


def inputs(n: int, args) -> tuple[jax.Array, jax.Array]:
    """keys [B, K, n, H] with a near-duplicate of every 8th key, valid [B, K, n] all True."""
    rng = np.random.default_rng(n)
    k = rng.normal(size=(args.batch, args.kv_heads, n, args.head_dim)).astype(np.float32)
    # Planted copies make the threshold / newest-match logic do real work.
    k[:, :, 4::8] = 1.5 * k[:, :, 0:-4:8] + 0.05 * rng.normal(size=k[:, :, 4::8].shape)
    return jnp.asarray(k, args.dtype), jnp.ones(k.shape[:3], dtype=bool)


def memory(fn, *xs) -> dict:
    """XLA's compiled memory estimate in bytes (None where the backend does not report it)."""
    ma = jax.jit(fn).lower(*xs).compile().memory_analysis()
    if ma is None:
        return {"temp_bytes": None, "peak_bytes": None}
    parts = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    return {"temp_bytes": ma.temp_size_in_bytes, "peak_bytes": sum(getattr(ma, a) for a in parts)}


def seconds(fn, *xs, repeats: int) -> float:
    """Median wall time of one call after a warm-up (compile) call."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*xs))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = tuning.backend()
    interpret = backend == "cpu"
    kw = dict(window=args.window, threshold=0.5, retain=args.retain)
    paths = {
        "jnp": functools.partial(compression.redundancy, **kw),
        "pallas": functools.partial(
            redundancy_pallas,
            **kw,
            block_r=args.block_r,
            block_c=args.block_c,
            interpret=interpret,
        ),
    }
    for n in args.sizes:
        keys, valid = inputs(n, args)
        results = {}
        for name, fn in paths.items():
            timed = (name == "jnp" and (not interpret or n <= args.max_time_n)) or (
                name == "pallas" and (not interpret or args.time_kernel)
            )
            row = {
                "bench": "kernel_redundancy",
                "impl": name,
                "n": n,
                "batch": args.batch,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "dtype": args.dtype,
                "backend": backend,
                "interpret": interpret and name == "pallas",
                # An n x n float32 matrix per (row, KV head): what the kernel never writes.
                "dense_matrix_bytes": 4 * n * n * args.batch * args.kv_heads,
                **memory(fn, keys, valid),
                "seconds": seconds(fn, keys, valid, repeats=args.repeats) if timed else None,
            }
            if timed:
                results[name] = jax.jit(fn)(keys, valid)
            if len(results) == 2:
                diff = jnp.max(jnp.abs(results["jnp"] - results["pallas"]))
                row["max_abs_diff_vs_jnp"] = float(diff)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
