"""The tail of a run: decoding only the rows still running against decoding every slot.

Requests whose lengths differ (one long, the rest short: max_tokens drawn from 16..128 and one
at 512, greedy with ignore_eos) run through an `rkvjax.Engine` in two scenarios:

  batch    every request submitted at once, one per slot: the short ones end and the long
           one decodes on alone.
  online   the long request and one short one first; each time a short one ends the next is
           submitted: one short request at a time beside the long one, then alone once it
           has ended (a server with a trickle of requests).

and in two modes:

  narrow   the default (`narrow_tail=True`): once nothing waits and at most half the slots
           are busy, the busy rows move into a batch half as wide or narrower, so each step
           costs what the rows that need it cost; a new request takes a free row of it.
  wide     `narrow_tail=False`: every step decodes every slot to the end of the run, the
           finished rows included (what the runtime did before).

Both modes give the same tokens (`same_tokens`, in the table too). A warm-up run of each compiles
every width; the modes take turns run by run, and the speedup is the median per-round ratio
of wall time less compilation. `decoded_row_steps` counts the rows the device decoded, step by
step; `widenings` the moves back to a wider batch.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

import rkvjax
from bench import common
from rkvjax.runtime import programs

MODES = ("narrow", "wide")
TINY = dict(slots=4, short_tokens=[8, 16], long_tokens=200, budget=32, buffer=16, repeats=1)
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
    p.add_argument(
        "--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS), help="see above"
    )


def _batch(eng: rkvjax.Engine, prompts, params) -> list:
    eng.submit_many(prompts, params, ids=list(range(len(prompts))))
    return eng.run()


def _online(eng: rkvjax.Engine, prompts, params) -> list:
    """Request 0 (the long one) and 1 first; each short one that ends submits the next."""
    nxt = 2
    eng.submit_many(prompts[:2], params[:2], ids=[0, 1])
    out = []
    for res in eng.results():
        out.append(res)
        if res.request_id != 0 and nxt < len(prompts):
            eng.submit(prompts[nxt], params[nxt], request_id=nxt)
            nxt += 1
    return out


SCENARIOS = {"batch": _batch, "online": _online}


def run_once(model, cc, prompts, params, scenario: str, narrow: bool):
    """-> (wall seconds, of which compiling, tokens per request, runtime counters)."""
    eng = rkvjax.Engine(model, slots=len(prompts), cache=cc, narrow_tail=narrow)
    c0 = programs.compile_seconds()
    wall, out = common.timed(SCENARIOS[scenario], eng, prompts, params)
    tokens = [r.token_ids for r in sorted(out, key=lambda r: r.request_id)]
    return wall, programs.compile_seconds() - c0, tokens, eng.stats.to_dict()


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
    rows = []
    for scenario in args.scenarios:
        for mode in MODES:  # warm-up: every width compiles here
            run_once(model, cc, prompts, params, scenario, mode == "narrow")
        times = {m: [] for m in MODES}
        compiles = {m: [] for m in MODES}
        tokens, stats = {}, {}
        for order in common.rotations(MODES, args.repeats):
            for mode in order:
                wall, comp, tokens[mode], stats[mode] = run_once(
                    model, cc, prompts, params, scenario, mode == "narrow"
                )
                times[mode].append(wall - comp)
                compiles[mode].append(comp)
        total = sum(lengths)
        row = {
            "bench": "tail",
            "scenario": scenario,
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
            "narrow_decode_steps": stats["narrow"]["decode_steps"],
            "narrowings": stats["narrow"]["narrowings"],
            "widenings": stats["narrow"]["widenings"],
            "speedup": common.paired_speedup(times["wide"], times["narrow"]),
            "loadavg": os.getloadavg(),
            **common.run_meta(model=name, dtype=args.dtype),
        }
        common.emit(row, folder)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r = rows[0]
    head = (
        f"{r['model']} {r['dtype']}: {r['slots']} requests, {r['slots']} slots, max_tokens "
        f"{min(r['max_tokens'])}..{max(r['max_tokens'])} (one at {r['max_tokens'][0]}), "
        f"R-KV budget {r['budget']} + buffer {r['buffer']}, greedy with ignore_eos."
    )
    cols = [
        ("scenario", "scenario", "s"),
        ("mode", "mode", "s"),
        ("tok/s (wall less compilation)", "tps", ".1f"),
        ("rows decoded x steps", "row_steps", ",d"),
        ("compilation in the timed runs", "compile", ".1f"),
    ]
    lines = [
        {
            "scenario": x.get("scenario", "batch"),
            "mode": m,
            "tps": x[f"{m}_tokens_per_s"],
            "row_steps": x[f"{m}_decoded_row_steps"],
            "compile": sum(x[f"{m}_compile_s"]),
        }
        for x in rows
        for m in MODES
    ]
    notes = [
        f"{x.get('scenario', 'batch')}: narrow over wide (median per-round ratio) "
        f"{x['speedup']:.2f}x over {x['decode_steps']:,} decode steps, {x['narrowings']} "
        f"narrowings, {x.get('widenings', 0)} widenings; same tokens: {x['same_tokens']}."
        for x in rows
    ]
    return f"{head}\n\n{common.markdown_table(lines, cols)}\n\n" + "\n".join(notes)


def plot(plt, rows: list[dict]):
    """Tokens/s of each scenario and mode."""
    r = rows[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    common.bars(
        ax,
        [f"{x.get('scenario', 'batch')}\n{m}" for x in rows for m in MODES],
        [x[f"{m}_tokens_per_s"] for x in rows for m in MODES],
        ylabel="tokens/s (wall less compilation)",
        title=f"{r['model']}: a {r['slots']}-slot run's tail",
    )
    return fig
