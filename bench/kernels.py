"""Redundancy scoring: the Pallas kernel against the jnp path, time and compiled memory vs n.

One row per (n, implementation); nothing is asserted. Memory is XLA's compiled estimate
(`memory_analysis()`: arguments + outputs + temporaries) and needs no run, so it is reported for
both paths at every n, on any backend. Timing runs the jnp path everywhere (up to --max-time-n
on CPU, where the n x n temporaries get large) and the kernel only where Pallas compiles
(GPU / TPU) or with --time-kernel: on CPU the kernel runs in interpret mode, which is correct
but orders of magnitude slower, so its CPU time says nothing about the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from rkvjax import defaults
from rkvjax.kv import scores
from rkvjax.kv.kernels import redundancy_pallas, tuning

TINY = dict(
    sizes=[64, 128],
    batch=1,
    kv_heads=2,
    head_dim=64,
    repeats=1,
    time_kernel=True,
    tiles=["16x32", "32x16"],
)
PREFER_MEMORY = False


def add_arguments(p) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1, help="B rows")
    p.add_argument("--kv-heads", type=int, default=8, help="K KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="H")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--window", type=int, default=defaults.WINDOW)
    p.add_argument("--retain", type=int, default=1)
    p.add_argument("--block-r", type=int, default=None, help="kernel row tile (default: table)")
    p.add_argument("--block-c", type=int, default=None, help="kernel column tile")
    p.add_argument(
        "--tiles",
        nargs="+",
        default=None,
        metavar="RxC",
        help="a sweep of kernel tiles (block_r x block_c), one kernel row each, e.g. 32x64",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up")
    p.add_argument("--time-kernel", action="store_true", help="time the kernel on CPU too")
    p.add_argument("--max-time-n", type=int, default=2048, help="largest n timed on CPU")


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


def kernel_tiles(args) -> dict[str, tuple[int | None, int | None]]:
    """label -> (block_r, block_c) of each kernel variant: the --tiles sweep ("pallas-RxC"),
    or one "pallas" at --block-r / --block-c (None: the backend's default tiles)."""
    if not args.tiles:
        return {"pallas": (args.block_r, args.block_c)}
    out = {}
    for t in args.tiles:
        r, sep, c = t.partition("x")
        if not (sep and r.isdigit() and c.isdigit()):
            raise ValueError(f"--tiles: {t!r} is not RxC (e.g. 64x32)")
        out[f"pallas-{t}"] = (int(r), int(c))
    return out


def seconds(fn, *xs, repeats: int) -> float:
    """Median wall time of one call after a warm-up (compile) call."""
    fn = jax.jit(fn)
    return common.median_seconds(lambda: jax.block_until_ready(fn(*xs)), repeats)


def run(args, folder) -> list[dict]:
    backend = tuning.backend()
    interpret = backend == "cpu"
    kw = dict(window=args.window, threshold=defaults.THRESHOLD, retain=args.retain)
    paths = {"jnp": functools.partial(scores.redundancy, **kw)}
    for name, (block_r, block_c) in kernel_tiles(args).items():
        paths[name] = functools.partial(
            redundancy_pallas, **kw, block_r=block_r, block_c=block_c, interpret=interpret
        )
    meta = common.run_meta(backend=backend)
    rows = []
    for n in args.sizes:
        keys, valid = inputs(n, args)
        results = {}
        for name, fn in paths.items():
            kernel = name != "jnp"
            is_timed = (not kernel and (not interpret or n <= args.max_time_n)) or (
                kernel and (not interpret or args.time_kernel)
            )
            row = {
                "bench": "kernel_redundancy",
                "impl": "pallas" if kernel else "jnp",
                "label": name,
                "tiles": kernel_tiles(args).get(name),
                "n": n,
                "batch": args.batch,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "dtype": args.dtype,
                "interpret": interpret and kernel,
                # An n x n float32 matrix per (row, KV head): what the kernel never writes.
                "dense_matrix_bytes": 4 * n * n * args.batch * args.kv_heads,
                **memory(fn, keys, valid),
                "seconds": seconds(fn, keys, valid, repeats=args.repeats) if is_timed else None,
                **meta,
            }
            if is_timed:
                results[name] = jax.jit(fn)(keys, valid)
            if kernel and name in results and "jnp" in results:
                diff = jnp.max(jnp.abs(results["jnp"] - results[name]))
                row["max_abs_diff_vs_jnp"] = float(diff)
            common.emit(row, folder)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"B={r0['batch']}, K={r0['kv_heads']}, H={r0['head_dim']}, {r0['dtype']}, "
        f"{r0['backend']}{' (kernel in interpret mode)' if r0['backend'] == 'cpu' else ''}; "
        "memory: XLA's compiled estimate."
    )
    mib = 2**-20
    columns = [
        ("n", "n", "d"),
        ("impl", lambda r: r.get("label", r["impl"]), "s"),
        ("ms", lambda r: r["seconds"] and r["seconds"] * 1e3, ".2f"),
        ("temp MiB", lambda r: r["temp_bytes"] and r["temp_bytes"] * mib, ".1f"),
        ("peak MiB", lambda r: r["peak_bytes"] and r["peak_bytes"] * mib, ".1f"),
        ("n x n MiB", lambda r: r["dense_matrix_bytes"] * mib, ".1f"),
        ("max diff vs jnp", "max_abs_diff_vs_jnp", ".1e"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def _labelled(rows: list[dict]) -> list[dict]:
    """Rows with a "label" (rows written before the tile sweep have only "impl")."""
    return [{"label": r["impl"], **r} for r in rows]


def plot(plt, rows: list[dict]):
    """Time and compiled temporaries against n, per implementation."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    title = f"redundancy, {rows[0]['backend']}"
    common.lines(
        ax1,
        common.series(_labelled(rows), "label", "n", "seconds", 1e3),
        xlabel="n (keys)",
        ylabel="ms",
        title=title,
    )
    common.lines(
        ax2,
        common.series(_labelled(rows), "label", "n", "temp_bytes", 2**-20),
        xlabel="n (keys)",
        ylabel="temporaries MiB",
        title=title,
    )
    for ax in (ax1, ax2):
        ax.set_yscale("log")
    return fig
