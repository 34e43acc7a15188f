"""What batch invariance costs: decode tokens/s with `batch_invariant` off and on, side by side.

Batch-invariant decoding computes every weight product on a fixed number of columns
(`rkvjax.models.layers.fixed_columns`): a batch narrower than that pads, a wider one reads the
weights once per tile. For each batch size and cache type, the same prompts are prefilled into an
engine of each mode and their decode loop (R-KV, greedy, --gen-tokens new tokens per row) is timed
in alternating rounds after a warm-up; the ratio is the median of the per-round ratios (on / off,
below 1 is slower). Prefill is not timed: it runs each prompt alone in the mode, a cost paid once
per request.
"""

from __future__ import annotations

import argparse

import rkvjax
from bench import common
from rkvjax import defaults
from rkvjax.runtime import requests

PREFER_MEMORY = True
TINY = {"gen_tokens": 24, "batches": [1, 4], "kv_dtypes": ["int8"], "repeats": 1, "budget": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gen-tokens", type=common.int_at_least(2), default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--kv-dtypes", nargs="+", default=["model", "int8"])
    p.add_argument("--budget", type=common.int_at_least(2), default=64)
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    p.add_argument("--repeats", type=common.int_at_least(1), default=3)


def _prefilled(model, ids, params, cc, invariant: bool):
    """(engine, its state before decoding) with one slot per prompt, every prompt admitted."""
    longest = max(map(len, ids))
    max_len = requests.bucket(longest, longest) + max(p.max_tokens for p in params) - 1
    eng = rkvjax.Engine(
        model,
        slots=len(ids),
        cache=cc,
        max_len=None if cc.compressing else max_len,
        batch_invariant=invariant,
    )
    eng.submit_many(ids, params)
    return eng, eng.prefilled()


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    params = rkvjax.SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    rows = []
    for kv in args.kv_dtypes:
        kv_dtype = common.kv_dtype_arg(kv)
        cc = rkvjax.compression_config("rkv", args.budget, buffer=args.buffer, kv_dtype=kv_dtype)
        for batch in args.batches:
            ids = common.random_prompts(model, batch)
            settings = {
                mode: _prefilled(model, ids, [params] * batch, cc, mode == "on")
                for mode in ("off", "on")
            }
            got = common.time_decodes(settings, args.repeats)
            t = got["times"]
            row = {
                "bench": "invariance",
                "batch": batch,
                "kv_dtype": common.kv_dtype_name(kv_dtype, model.dtype),
                "columns": settings["on"][0].plan.invariant_columns,
                "tokens_per_s_off": got["tokens_per_s"]["off"],
                "tokens_per_s_on": got["tokens_per_s"]["on"],
                "on_over_off": common.paired_speedup(t["off"], t["on"]),  # tok/s on / off
                "gen_tokens": args.gen_tokens,
                "budget": args.budget,
                "repeats": args.repeats,
                "model": name,
            }
            rows.append(row)
            common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
    return rows


def table(rows: list[dict]) -> str:
    cols = [
        ("cache", "kv_dtype", "s"),
        ("batch", "batch", "d"),
        ("tok/s off", "tokens_per_s_off", ".1f"),
        ("tok/s on", "tokens_per_s_on", ".1f"),
        ("on / off", "on_over_off", ".2f"),
    ]
    r0 = rows[0]
    head = (
        f"{r0['model']}, R-KV budget {r0['budget']}, {r0['gen_tokens']} greedy tokens per row, "
        f"{r0['columns']} columns per product when on; median of {r0['repeats']} alternating "
        "rounds after a warm-up\n\n"
    )
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for kv in dict.fromkeys(r["kv_dtype"] for r in rows):
        mine = [r for r in rows if r["kv_dtype"] == kv]
        ax.plot([r["batch"] for r in mine], [r["on_over_off"] for r in mine], "o-", label=kv)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tok/s, invariant / not")
    ax.set_title("the cost of batch invariance")
    ax.legend()
    return fig
