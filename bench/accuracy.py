"""Accuracy against budget (the R-KV paper's Figure 4 / table of MATH-500 and AIME24 pass@1):
`rkvjax eval` over a grid of methods and budgets, plus FullKV, on one problem file.

Each setting is one evaluation folder (samples.jsonl and summary.json, resumable) under
<out>/accuracy/runs/; the table puts pass@1, pass@k, generated length, compressions, the
outputs' 4-gram repetition and the share of looping samples side by side, with the paper's
R1-Llama-8B MATH-500 pass@1 where it has the budget. The default model is far too small to
solve MATH problems; the table is the harness, the numbers that matter come from a reasoning
model on an accelerator. With --kv-dtypes every setting also runs with each cache storage type
("model": the model's dtype), with the same seeds, so what an 8-bit cache does to the outputs'
length and repetition reads off rows that differ only in it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import rkvjax
from bench import common
from rkvjax import defaults
from rkvjax.entrypoints import evaluation

PREFER_MEMORY = True
TINY = {
    "limit": 2,
    "samples": 2,
    "max_tokens": 8,
    "budgets": [16],
    "methods": ["rkv"],
    "buffer": 8,
}
# The paper's MATH-500 pass@1 (R1-Llama-8B, 64 samples), by method and budget.
PAPER_MATH500 = {
    ("rkv", 128): 51.1,
    ("rkv", 256): 67.4,
    ("rkv", 512): 76.9,
    ("rkv", 1024): 81.3,
    ("rkv", 1536): 82.3,
    ("rkv", 2048): 82.7,
    ("snapkv", 128): 32.5,
    ("snapkv", 256): 50.1,
    ("snapkv", 512): 64.0,
    ("snapkv", 1024): 74.4,
    ("snapkv", 1536): 78.4,
    ("snapkv", 2048): 80.5,
    ("full", None): 82.4,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--data", type=Path, default=common.DATA, help="JSONL of problems")
    p.add_argument("--limit", type=common.int_at_least(1), default=20)
    p.add_argument("--samples", type=common.int_at_least(1), default=2)
    p.add_argument("--max-tokens", type=common.int_at_least(1), default=1024)
    common.add_methods_argument(p, ["full", "rkv", "snapkv"], full=True)  # FullKV once
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    p.add_argument("--slots", type=int, default=None)
    common.add_kv_dtypes_argument(p)


def _settings(args, model, name, folder) -> dict:
    base = {"full": {"method": "full"}} if "full" in args.methods else {}
    for m in (m for m in args.methods if m != "full"):
        own = common.method_options(m, args, model, name, folder)
        for b in args.budgets:
            base[f"{m}-{b}"] = {"method": m, "budget": b, "buffer": args.buffer, **own}
    out = {}
    for label, cache in base.items():
        for kv in args.kv_dtypes:
            if kv == "model":  # the label and settings runs before --kv-dtypes had
                out[label] = cache
            else:
                out[f"{label} {kv}"] = {**cache, "kv_dtype": kv}
    return out


def run(args, folder) -> list[dict]:
    if args.tiny:
        model, name = rkvjax.load(common.tiny_chat_checkpoint()), common.TINY_MODEL_NAME
    else:
        model, name = common.load_model(args, args.dtype)
    rows = []
    for label, cache in _settings(args, model, name, folder).items():
        s = evaluation.run_eval(
            model,
            args.data,
            folder / "runs" / label,
            limit=args.limit,
            samples=args.samples,
            cache=cache,
            sampling={"max_tokens": args.max_tokens},
            settings={"model": name, "dtype": args.dtype},
            slots=args.slots,
            progress=False,
        )
        keys = (
            "pass@1",
            "pass@k",
            "k",
            "problems",
            "samples",
            "mean_generated_tokens",
            "mean_compressions",
            "repetition",
            "looping",
            "method",
            "budget",
            "kv_dtype",
        )
        row = {
            "bench": "accuracy",
            "setting": label,
            "data": Path(args.data).name,
            "model": name,
            **{k: s.get(k) for k in keys},
            "tokens_per_s": s["runtime"].get("tokens_per_s"),
            "paper_math500_pass@1": PAPER_MATH500.get((s["method"], s["budget"])),
        }
        rows.append(row)
        common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
    return rows


def table(rows: list[dict]) -> str:
    k = rows[0]["k"]
    cols = [
        ("setting", "setting", "s"),
        ("pass@1 %", lambda r: None if r["pass@1"] is None else 100 * r["pass@1"], ".1f"),
        (f"pass@{k} %", lambda r: None if r["pass@k"] is None else 100 * r["pass@k"], ".1f"),
        ("tokens / sample", "mean_generated_tokens", ".0f"),
        ("compressions / sample", "mean_compressions", ".1f"),
        ("4-gram repetition", "repetition", ".3f"),
        ("looping %", lambda r: None if r.get("looping") is None else 100 * r["looping"], ".1f"),
        ("tok/s", "tokens_per_s", ".1f"),
        ("paper MATH-500 pass@1 %", "paper_math500_pass@1", ".1f"),
    ]
    r0 = rows[0]
    head = f"{r0['model']} on {r0['data']}: {r0['problems']} problems x {k} samples\n\n"
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in rows if r["budget"] is not None}):
        sel = sorted((r for r in rows if r["method"] == method), key=lambda r: r["budget"])
        ax.plot(
            [r["budget"] for r in sel],
            [100 * (r["pass@1"] or 0) for r in sel],
            marker="o",
            label=method,
        )
    full = [r for r in rows if r["budget"] is None]
    if full:
        ax.axhline(100 * (full[0]["pass@1"] or 0), color="grey", ls="--", label="FullKV")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("pass@1 %")
    ax.set_title("accuracy against budget")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
