"""The tail of a run: decoding only the rows still running against decoding every slot.

One batch of requests whose lengths differ (one long, the rest short: max_tokens drawn from
16..128 and one at 512, greedy with ignore_eos) runs through an `rkvjax.Engine` twice:

  narrow   the default (`narrow_tail=True`): once nothing waits and at most half the slots
           are busy, the busy rows move into a batch half as wide or narrower, so each step
           costs what the rows that need it cost.
  wide     `narrow_tail=False`: every step decodes every slot to the end of the run, the
           finished rows included (what the runtime did before).

Both give the same tokens (`same_tokens`, in the table too). A warm-up run of each compiles
every width; the modes take turns run by run, and the speedup is the median per-round ratio
of wall time less compilation. `decoded_row_steps` counts the rows the device decoded, step by step.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

import rkvjax
from bench import common
from rkvjax import engine

MODES = ("narrow", "wide")
TINY = dict(slots=4, short_tokens=[8, 16], long_tokens=96, budget=32, buffer=16, repeats=1)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (the modes alternate)")
    p.add_argument("--slots", type=common.int_at_least(2), default=16, help="requests too")
    p.add_argument("--short-tokens", type=int, nargs=2, default=[16, 128])
    p.add_argument("--long-tokens", type=common.int_at_least(2), default=512)
    p.add_argument("--prompt", type=common.int_at_least(1), default=64, help="prompt tokens")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=64)


def run_once(model, cc, prompts, params, narrow: bool) -> tuple[float, float, list, dict]:
    """-> (wall seconds, of which compiling, tokens per request, runtime counters)."""
    eng = rkvjax.Engine(model, slots=len(prompts), cache=cc, narrow_tail=narrow)
    eng.submit_many(prompts, params)
    c0 = engine.compile_seconds()
    wall, out = common.timed(eng.run)
    tokens = [r.token_ids for r in sorted(out, key=lambda r: r.request_id)]
    return wall, engine.compile_seconds() - c0, tokens, eng.stats.to_dict()


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    lo, hi = args.short_tokens
    lengths = np.random.default_rng(0).integers(lo, hi + 1, args.slots).tolist()
    lengths[0] = args.long_tokens
    prompts = [common.random_ids(model, args.prompt, seed=i) for i in range(args.slots)]
    params = [
        rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths
    ]
    cc = rkvjax.compression_config("rkv", args.budget, buffer=args.buffer)
    for mode in MODES:  # warm-up: every width compiles here
        run_once(model, cc, prompts, params, mode == "narrow")
    times = {m: [] for m in MODES}
    compiles = {m: [] for m in MODES}
    tokens, stats = {}, {}
    for order in common.rotations(MODES, args.repeats):
        for mode in order:
            wall, comp, tokens[mode], stats[mode] = run_once(
                model, cc, prompts, params, mode == "narrow"
            )
            times[mode].append(wall - comp)
            compiles[mode].append(comp)
    total = sum(lengths)
    row = {
        "bench": "tail",
        "slots": args.slots,
        "max_tokens": lengths,
        "prompt_tokens": args.prompt,
        "budget": args.budget,
        "buffer": args.buffer,
        "generated_tokens": total,
        "same_tokens": tokens["narrow"] == tokens["wide"],
        **{f"{m}_s": times[m] for m in MODES},  # wall time less compilation
        **{f"{m}_compile_s": compiles[m] for m in MODES},
        **{f"{m}_tokens_per_s": total / statistics.median(times[m]) for m in MODES},
        **{f"{m}_decoded_row_steps": stats[m]["decoded_row_steps"] for m in MODES},
        "decode_steps": stats["wide"]["decode_steps"],
        "narrowings": stats["narrow"]["narrowings"],
        "speedup": common.paired_speedup(times["wide"], times["narrow"]),
        "loadavg": os.getloadavg(),
        **common.run_meta(model=name, dtype=args.dtype),
    }
    common.emit(row, folder)
    return [row]


def table(rows: list[dict]) -> str:
    r = rows[0]
    head = (
        f"{r['model']} {r['dtype']}: {r['slots']} requests in {r['slots']} slots, max_tokens "
        f"{min(r['max_tokens'])}..{max(r['max_tokens'])} (one at {r['max_tokens'][0]}), "
        f"R-KV budget {r['budget']} + buffer {r['buffer']}, greedy with ignore_eos."
    )
    cols = [
        ("", lambda x: x["mode"], "s"),
        ("tok/s (wall less compilation)", lambda x: x["tps"], ".1f"),
        ("rows decoded x steps", lambda x: x["row_steps"], ",d"),
        ("compilation in the timed runs", lambda x: x["compile"], ".1f"),
    ]
    lines = [
        {
            "mode": m,
            "tps": r[f"{m}_tokens_per_s"],
            "row_steps": r[f"{m}_decoded_row_steps"],
            "compile": sum(r[f"{m}_compile_s"]),
        }
        for m in MODES
    ]
    tail = (
        f"Narrow over wide (median per-round ratio): {r['speedup']:.2f}x over "
        f"{r['decode_steps']:,} decode steps, {r['narrowings']} narrowings; same tokens: "
        f"{r['same_tokens']}."
    )
    return f"{head}\n\n{common.markdown_table(lines, cols)}\n\n{tail}"


def plot(plt, rows: list[dict]):
    """Tokens/s of each mode."""
    r = rows[0]
    fig, ax = plt.subplots(figsize=(5, 4))
    common.bars(
        ax,
        list(MODES),
        [r[f"{m}_tokens_per_s"] for m in MODES],
        ylabel="tokens/s (wall less compilation)",
        title=f"{r['model']}: the tail of a {r['slots']}-slot run",
    )
    return fig
