"""Compression lanes: R-KV against StreamingLLM decode tokens/s with ragged fill levels.

Every row sits at its own fill level ("ragged": prompt lengths spread over 16..121) or all are
equal (64 tokens). Before lanes, R-KV ran every row's selection whenever one row was full:
0.79x StreamingLLM ragged, 0.997x equal.

Decode-only timings prefill once and time `programs.decode` from copies of the prefilled state;
the methods take turns run by run, so load from other processes on a shared machine hits them
alike; medians are reported, and per-round ratios.
"""

from __future__ import annotations

import os

import numpy as np

from bench import common
from rkvjax.config import compression_config
from rkvjax.sampling import SamplingParams

METHODS = ("rkv", "streaming")
# Two rows: one equal-length prefill, and two ragged ones (16 and 121 tokens).
TINY = dict(batches=[2], budget=32, buffer=16, new_tokens=48, repeats=1)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (alternating)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="rows per run")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=320, help="decoded per row")


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    meta = common.run_meta(model=name, dtype=args.dtype)
    rows = []
    for b in args.batches:
        lengths = {
            "equal": [64] * b,
            "ragged": np.linspace(16, 121, b).round().astype(int).tolist(),
        }
        for shape, lens in lengths.items():
            ids = [common.random_ids(model, n, seed=r) for r, n in enumerate(lens)]
            greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
            settings = {
                m: common.prefilled(
                    model, ids, [greedy] * b, compression_config(m, args.budget, buffer=args.buffer)
                )
                for m in METHODS
            }
            t = common.time_decodes(settings, args.repeats)
            tps = t["tokens_per_s"]
            ratio = common.paired_speedup(t["times"]["streaming"], t["times"]["rkv"])
            row = {
                "bench": "runtime_speed",
                "part": "ragged",
                "batch": b,
                "prompts": shape,
                "budget": args.budget,
                "buffer": args.buffer,
                "new_tokens": args.new_tokens,
                "rkv_tokens_per_s": tps["rkv"],
                "streaming_tokens_per_s": tps["streaming"],
                "rkv_vs_streaming": ratio,
                "lanes": settings["rkv"][0].plan.lanes,
                "times": t["times"],
                "loadavg": os.getloadavg(),
                **meta,
            }
            common.emit(row, folder)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"{r0['model']} {r0['dtype']}: budget {r0['budget']}, buffer {r0['buffer']}, "
        f"{r0['new_tokens']} new tokens; ragged = prompt lengths over 16..121, equal = 64; "
        "R-KV / StreamingLLM is the median per-round ratio."
    )
    columns = [
        ("rows", "batch", "d"),
        ("prompts", "prompts", "s"),
        ("R-KV tok/s", "rkv_tokens_per_s", ".1f"),
        ("StreamingLLM tok/s", "streaming_tokens_per_s", ".1f"),
        ("R-KV / StreamingLLM", "rkv_vs_streaming", ".3f"),
        ("lanes", "lanes", "d"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def plot(plt, rows: list[dict]):
    """R-KV / StreamingLLM per batch and prompt shape."""
    fig, ax = plt.subplots(figsize=(6, 4))
    common.bars(
        ax,
        [f"{r['batch']} {r['prompts']}" for r in rows],
        [r["rkv_vs_streaming"] for r in rows],
        ylabel="R-KV / StreamingLLM decode speed",
        title=f"{rows[0]['model']}, budget {rows[0]['budget']}",
    )
    ax.axhline(1.0, color="gray", linewidth=0.8)
    return fig
