"""The paper's memory table at full shape: how many sequences fit on an 80 GB A100 and a 141 GB
H200 for R1-Llama-8B with FullKV and with R-KV (budget 1024, and 10% of the sequence), at 8K
and 16K generated tokens; from compile-only memory analysis of the decode program (runs on CPU:
the model is abstract, no weight is allocated).

For each setting the decode chunk of a runtime with --fit-batches slots is compiled and its
peak (weights, the slots' state, XLA's temporaries, as `Compiled.memory_analysis()` reports
them) fitted as an affine function of the batch; the largest batch under each cap is then
compiled to check it fits. The paper (Table 3, 16K): FullKV 30, R-KV 402 on 80 GB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

import rkvjax
from bench import common
from rkvjax import defaults, loading

PREFER_MEMORY = True
REAL_CONFIGS = common.DATA.parent / "real_configs"
TINY = {
    "config": None,  # the tiny random checkpoint's
    "gen_tokens": [128],
    "caps_gib": [0.004],
    "budget": 64,
    "buffer": 16,
    "fit_batches": [2, 4],
    "ratio": 0.0,
    "methods": ["full"],  # compiles in seconds; R-KV's decode chunk takes several
    "dtype": "float32",
}
PAPER = {("full", 8192): 62, ("full", 16384): 30, ("rkv", 8192): 402, ("rkv", 16384): 402}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=REAL_CONFIGS / "DeepSeek-R1-Distill-Llama-8B.json",
        help="a config.json (the model's shape)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--gen-tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--prompt", type=common.int_at_least(1), default=128, help="prompt tokens")
    p.add_argument(
        "--caps-gib",
        type=float,
        nargs="+",
        default=[80.0, 141e9 / 2**30],
        help="device memory caps (default: an 80 GB A100, a 141 GB H200)",
    )
    p.add_argument("--methods", nargs="+", choices=["full", "rkv"], default=["full", "rkv"])
    p.add_argument("--budget", type=common.int_at_least(2), default=1024)
    p.add_argument("--ratio", type=float, default=0.1, help="R-KV budget as a fraction (0: none)")
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    p.add_argument("--fit-batches", type=int, nargs=2, default=[8, 16])


def _settings(args, gen: int) -> dict:
    """label -> CompressionConfig for one generation length."""
    seq = {"prompt_len": args.prompt, "max_new_tokens": gen, "buffer": args.buffer}
    out = {}
    if "full" in args.methods:
        out["full"] = rkvjax.compression_config("full")
    if "rkv" in args.methods:
        out[f"rkv-{args.budget}"] = rkvjax.compression_config("rkv", args.budget, **seq)
    if "rkv" in args.methods and args.ratio:
        out[f"rkv-{args.ratio:g}"] = rkvjax.compression_config("rkv", args.ratio, **seq)
    return out


def _peak(model, cc, max_len: int, slots: int, prompt: int) -> dict:
    eng = rkvjax.Engine(model, slots=slots, cache=cc, max_len=max_len)
    out = eng.memory_analysis(prompt_len=prompt, parts=("decode",))
    # Each compiled program keeps its code mapped; a search over many batches would pile up.
    jax.clear_caches()
    return {"peak": out["decode"]["peak_bytes"], "state": out["state_bytes"]}


def _memo(checked: dict, model, cc, max_len: int, args):
    """batch -> compiled decode peak, each batch compiled once."""

    def peak_of(b: int) -> int:
        if b not in checked:
            checked[b] = _peak(model, cc, max_len, b, args.prompt)["peak"]
        return checked[b]

    return peak_of


def _largest_under(cap: int, guess: int, peak_of) -> int:
    """The largest batch whose compiled peak fits `cap`, from the affine fit's `guess`: the
    guess when it fits (almost always: the fit is close to exact), else by bisection below it.
    """
    if guess == 0 or peak_of(guess) <= cap:
        return guess
    lo, hi = 0, guess  # peak_of(hi) > cap; lo fits (0 trivially)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_of(mid) <= cap else (lo, mid)
    return lo


def run(args, folder) -> list[dict]:
    config = args.config or common.tiny_checkpoint() / "config.json"
    model = loading.abstract(config, dtype=args.dtype)
    weights = common.tree_bytes(model.decoder)
    b1, b2 = sorted(args.fit_batches)
    rows, fitted = [], {}
    for gen in args.gen_tokens:
        for label, cc in _settings(args, gen).items():
            max_len = args.prompt + gen - 1
            key = (cc, None if cc.compressing else max_len)
            if key not in fitted:  # R-KV at a token budget holds the same cache at any length
                m1 = _peak(model, cc, max_len, b1, args.prompt)
                m2 = _peak(model, cc, max_len, b2, args.prompt)
                per_row = (m2["peak"] - m1["peak"]) / (b2 - b1)
                fitted[key] = (per_row, m1["peak"] - per_row * b1, m2["state"] / b2, {})
            per_row, fixed, state_row, checked = fitted[key]
            for cap_gib in args.caps_gib:
                cap = int(cap_gib * 2**30)
                batch = _largest_under(
                    cap,
                    max(0, int((cap - fixed) // per_row)),
                    _memo(checked, model, cc, max_len, args),
                )
                method = cc.method if cc.compressing else "full"
                row = {
                    "bench": "capacity",
                    "config": Path(config).stem if args.config else common.TINY_MODEL_NAME,
                    "setting": label,
                    "method": method,
                    "budget": cc.budget if cc.compressing else None,
                    "gen_tokens": gen,
                    "prompt_tokens": args.prompt,
                    "cache_slots_per_row": cc.capacity if cc.compressing else max_len,
                    "cap_bytes": cap,
                    "weight_bytes": weights,
                    "state_bytes_per_row": state_row,
                    "peak_bytes_per_row": per_row,
                    "peak_bytes_fixed": fixed,
                    "max_batch": batch,
                    "peak_bytes_at_max_batch": checked.get(batch),
                    "max_batch_state_only": max(0, int((cap - weights) // state_row)),
                    "paper_max_batch": (
                        PAPER.get((method, gen))
                        if label in ("full", "rkv-1024") and round(cap_gib) == 80
                        else None
                    ),
                    "analysis": "compile-only Compiled.memory_analysis() of one decode chunk",
                }
                rows.append(row)
                common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
    return rows


def table(rows: list[dict]) -> str:
    cols = [
        ("gen tokens", "gen_tokens", "d"),
        ("setting", "setting", "s"),
        ("budget", "budget", "d"),
        ("cap GiB", lambda r: r["cap_bytes"] / 2**30, ".3g"),
        ("MiB / row", lambda r: r["peak_bytes_per_row"] / 2**20, ".1f"),
        ("max batch", "max_batch", "d"),
        ("state only", "max_batch_state_only", "d"),
        ("paper", "paper_max_batch", "d"),
    ]
    r0 = rows[0]
    head = (
        f"{r0['config']} ({r0['weight_bytes'] / 2**30:.1f} GiB of weights), prompt "
        f"{r0['prompt_tokens']} tokens; 'state only' counts weights and the slots' state "
        "without XLA's temporaries\n\n"
    )
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(8, 4))
    caps = sorted({r["cap_bytes"] for r in rows})
    for cap in caps:
        sel = [r for r in rows if r["cap_bytes"] == cap]
        labels = [f"{r['setting']}\n{r['gen_tokens'] // 1024}K" for r in sel]
        ax.plot(labels, [r["max_batch"] for r in sel], marker="o", label=f"{cap / 2**30:.0f} GiB")
    ax.set_yscale("log")
    ax.set_ylabel("largest batch")
    ax.set_title("sequences that fit")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
