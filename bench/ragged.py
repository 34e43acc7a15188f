"""Compression lanes: each method (R-KV by default) against StreamingLLM decode tokens/s with
ragged fill levels, at equal shape (`--methods rkv keydiff ...`: any registered policy).

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
from rkvjax import defaults
from rkvjax.kv.config import compression_config
from rkvjax.sampling.params import SamplingParams

BASELINE = "streaming"  # no scores to compute: the cost of a compression's gather alone
# Two rows: one equal-length prefill, and two ragged ones (16 and 121 tokens).
TINY = dict(batches=[2], budget=32, buffer=16, new_tokens=48, repeats=1)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (alternating)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="rows per run")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=defaults.BUFFER)
    p.add_argument("--new-tokens", type=int, default=320, help="decoded per row")
    common.add_methods_argument(p, ["rkv"])


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
            methods = dict.fromkeys([*args.methods, BASELINE])
            settings = {
                m: common.prefilled(
                    model,
                    ids,
                    [greedy] * b,
                    compression_config(
                        m,
                        args.budget,
                        buffer=args.buffer,
                        **common.method_options(m, args, model, name, folder),
                    ),
                )
                for m in methods
            }
            t = common.time_decodes(settings, args.repeats)
            tps = t["tokens_per_s"]
            row = {
                "bench": "runtime_speed",
                "part": "ragged",
                "batch": b,
                "prompts": shape,
                "budget": args.budget,
                "buffer": args.buffer,
                "new_tokens": args.new_tokens,
                "methods": list(methods),
                **{f"{m}_tokens_per_s": tps[m] for m in methods},
                **{
                    f"{m}_vs_streaming": common.paired_speedup(t["times"][BASELINE], t["times"][m])
                    for m in args.methods
                    if m != BASELINE
                },
                "lanes": settings[args.methods[0]][0].plan.lanes,
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
        "method / StreamingLLM is the median per-round ratio of decode times."
    )
    methods = [m for m in r0["methods"] if m != BASELINE]
    columns = [("rows", "batch", "d"), ("prompts", "prompts", "s")]
    columns += [(f"{m} tok/s", f"{m}_tokens_per_s", ".1f") for m in [*methods, BASELINE]]
    columns += [(f"{m} / streaming", f"{m}_vs_streaming", ".3f") for m in methods]
    columns += [("lanes", "lanes", "d")]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def plot(plt, rows: list[dict]):
    """Each method / StreamingLLM per batch and prompt shape."""
    methods = [m for m in rows[0]["methods"] if m != BASELINE]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[f"{m}_vs_streaming"] for r in rows], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['batch']} {r['prompts']}" for r in rows])
    ax.set_ylabel("decode speed / StreamingLLM")
    ax.set_title(f"{rows[0]['model']}, budget {rows[0]['budget']}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend()
    return fig
