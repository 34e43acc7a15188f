"""The paper's memory table at full shape: how many sequences fit on an 80 GB A100 and a 141 GB
H200 for R1-Llama-8B with FullKV and with R-KV (budget 1024, and 10% of the sequence), at 8K
and 16K generated tokens; from compile-only memory analysis of the decode program (runs on CPU:
the model is abstract, no weight is allocated).

For each setting the decode chunk of a runtime with --fit-batches slots is compiled and its
peak (weights, the slots' state, XLA's temporaries, as `Compiled.memory_analysis()` reports
them) fitted as an affine function of the batch; from the fit's prediction under each cap,
batches are compiled until the largest that fits is found and the next one up is shown not to.
R-KV's peak grows a little faster than the fit at hundreds of rows (the runtime's compression
lanes, `compress.lane_count`, grow with the batch: 7 at 437 rows), so its prediction is 2-4%
high. Those compiles are most of the time (a decode of hundreds of rows takes minutes to
compile on CPU); --no-check reports the prediction instead. The paper (Table 3, 16K): FullKV
30, R-KV 402 on 80 GB.

--kv-dtype names the cache's storage types to set side by side (default: the model's dtype):
an 8-bit cache (int8, float8_e4m3fn) keeps one-byte codes and a float32 scale per (token, head),
so its rows are a little over half a bfloat16 cache's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from rkvjax.models import loading

import rkvjax
from bench import common
from rkvjax import defaults
from rkvjax.kv import compress

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
PAPER_MODEL = "DeepSeek-R1-Distill-Llama-8B"  # the only model the paper's table sizes


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
    p.add_argument(
        "--no-check",
        action="store_true",
        help="report the affine fit's largest batch without compiling it (rows say so)",
    )
    common.add_kv_dtype_argument(p, several=True)


def _settings(args, gen: int, kv_dtype: str | None = None) -> dict:
    """label -> CompressionConfig for one generation length and cache storage type."""
    seq = {"prompt_len": args.prompt, "max_new_tokens": gen, "buffer": args.buffer}
    seq["kv_dtype"] = kv_dtype
    out = {}
    if "full" in args.methods:
        out["full"] = rkvjax.compression_config("full", kv_dtype=kv_dtype)
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
    kv = common.cache_bytes(eng.state_shapes().cache, queries=True)
    return {"peak": out["decode"]["peak_bytes"], "state": out["state_bytes"], "kv": kv}


def _memo(checked: dict, model, cc, max_len: int, args):
    """batch -> compiled decode peak, each batch compiled once."""

    def peak_of(b: int) -> int:
        if b not in checked:
            checked[b] = _peak(model, cc, max_len, b, args.prompt)["peak"]
        return checked[b]

    return peak_of


@dataclasses.dataclass
class Fit:
    """A setting's compiled decode peak as an affine function of the batch."""

    per_row: float
    fixed: float
    state_row: float  # the slots' state per row (weights aside)
    kv_row: float  # keys, values, their scales, slot positions and query ring per row
    checked: dict  # batch -> compiled peak

    def largest(self, cap: int) -> int:
        """The largest batch whose predicted peak fits `cap`."""
        return max(0, int((cap - self.fixed) // self.per_row))


def _fit(model, cc, max_len: int, args) -> Fit:
    """The decode peak compiled at both --fit-batches."""
    b1, b2 = sorted(args.fit_batches)
    m1 = _peak(model, cc, max_len, b1, args.prompt)
    m2 = _peak(model, cc, max_len, b2, args.prompt)
    per_row = (m2["peak"] - m1["peak"]) / (b2 - b1)
    fixed = m1["peak"] - per_row * b1
    return Fit(per_row, fixed, m2["state"] / b2, m2["kv"] / b2, {})


def _largest_under(cap: int, guess: int, peak_of, per_row: float) -> int:
    """The largest batch whose compiled peak fits `cap`, from the fit's `guess`: steps of as
    many rows as the excess (or the room left) is worth at the fit's bytes per row, within the
    bracket of batches known to fit and not to, until the batch above the answer is compiled
    and does not fit. Usually the guess, one step down and the batch above it: the true peak
    grows a little faster than the fit (R-KV's compression lanes, `compress.lane_count`, add up
    with the batch), so a step down lands at or just below the answer."""
    lo, hi = 0, None  # lo fits (0 trivially); hi does not (None: none seen yet)
    b = max(1, guess)
    while hi is None or hi - lo > 1:
        p = peak_of(b)
        if p <= cap:
            lo, b = b, b + max(1, int((cap - p) // per_row))
        else:
            hi, b = b, b - max(1, math.ceil((p - cap) / per_row))
        if hi is not None and not lo < b < hi:
            b = (lo + hi) // 2 if hi - lo > 2 else lo + 1
    return lo


def _rows(model, args, cc, label: str, gen: int, fitted: dict, weights: int):
    """One row per cap for one setting, storage type and generation length, each as soon as
    it is found; `fitted` keeps each cache's affine fit and compiled peaks across calls."""
    kv_name = common.kv_dtype_name(cc.kv_dtype, model.dtype)
    max_len = args.prompt + gen - 1
    key = (cc, None if cc.compressing else max_len)
    if key not in fitted:  # R-KV at a token budget holds the same cache at any length
        fitted[key] = _fit(model, cc, max_len, args)
    fit = fitted[key]
    checked = fit.checked
    method = cc.method if cc.compressing else "full"
    for cap_gib in args.caps_gib:
        cap = int(cap_gib * 2**30)
        guess = fit.largest(cap)
        if args.no_check:
            batch = guess
        else:
            peak_of = _memo(checked, model, cc, max_len, args)
            batch = _largest_under(cap, guess, peak_of, fit.per_row)
        yield {
            "bench": "capacity",
            "config": Path(args.config).stem if args.config else common.TINY_MODEL_NAME,
            "setting": label,
            "kv_dtype": kv_name,
            "method": method,
            "budget": cc.budget if cc.compressing else None,
            "gen_tokens": gen,
            "prompt_tokens": args.prompt,
            "cache_slots_per_row": cc.capacity if cc.compressing else max_len,
            "cap_bytes": cap,
            "weight_bytes": weights,
            # Keys, values, their scales (8-bit), slot positions, the query ring.
            "kv_bytes_per_row": fit.kv_row,
            "state_bytes_per_row": fit.state_row,
            "peak_bytes_per_row": fit.per_row,
            "peak_bytes_fixed": fit.fixed,
            "lanes_at_max_batch": compress.lane_count(batch, cc) if cc.compressing else None,
            "max_batch_predicted": guess,
            "max_batch": batch,
            # Whether that batch was compiled and fits (else the fit's prediction).
            "max_batch_checked": batch == 0 or batch in checked,
            "peak_bytes_at_max_batch": checked.get(batch),
            "peak_bytes_at_max_batch_plus_1": checked.get(batch + 1),
            "max_batch_state_only": max(0, int((cap - weights) // fit.state_row)),
            "paper_max_batch": (
                PAPER.get((method, gen))
                if label in ("full", "rkv-1024")
                and args.config is not None
                and Path(args.config).stem == PAPER_MODEL
                and round(cap_gib) == 80
                and kv_name == jnp.dtype(model.dtype).name
                else None
            ),
            "analysis": "compile-only Compiled.memory_analysis() of one decode chunk",
        }


def run(args, folder) -> list[dict]:
    config = args.config or common.tiny_checkpoint() / "config.json"
    model = loading.abstract(config, dtype=args.dtype)
    weights = common.tree_bytes(model.decoder)
    rows, fitted = [], {}
    # Settings first, storage types innermost: a run cut short still has side-by-side rows.
    for gen in args.gen_tokens:
        for label in _settings(args, gen):
            for kv_dtype in dict.fromkeys(args.kv_dtype):
                cc = _settings(args, gen, kv_dtype)[label]
                for row in _rows(model, args, cc, label, gen, fitted, weights):
                    rows.append(row)
                    common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
    return rows


def _kv_name(row: dict) -> str:
    return row.get("kv_dtype", "bfloat16")  # rows from before kv_dtype: the model's bfloat16


def table(rows: list[dict]) -> str:
    """One line per (generation, setting, cap); with several storage types, their MiB per row
    and largest batches side by side, and each one's batch over the first one's."""
    kvs = list(dict.fromkeys(map(_kv_name, rows)))
    lines: dict[tuple, dict] = {}
    for r in rows:
        line = lines.setdefault((r["gen_tokens"], r["setting"], r["cap_bytes"]), dict(r))
        line[f"row_{_kv_name(r)}"] = r
        if r.get("paper_max_batch") is not None:
            line["paper_max_batch"] = r["paper_max_batch"]

    def of(kv: str, key: str, scale: float | None = None):
        def f(line):
            r = line.get(f"row_{kv}")
            return None if r is None else r[key] if scale is None else r[key] * scale

        return f

    def batch(r: dict | None) -> str | None:
        if r is None:
            return None
        return f"{r['max_batch']}" + ("" if r.get("max_batch_checked", True) else "*")

    def ratio(kv: str):
        def f(line):
            a, b = line.get(f"row_{kv}"), line.get(f"row_{kvs[0]}")
            return a["max_batch"] / b["max_batch"] if a and b and b["max_batch"] else None

        return f

    cols = [
        ("gen tokens", "gen_tokens", "d"),
        ("setting", "setting", "s"),
        ("budget", "budget", "d"),
        ("cap GiB", lambda r: r["cap_bytes"] / 2**30, ".3g"),
    ]
    short = common.KV_DTYPE_SHORT
    if len(kvs) == 1:
        cols += [
            ("kv dtype", _kv_name, "s"),
            ("MiB / row", lambda r: r["peak_bytes_per_row"] / 2**20, ".1f"),
            ("max batch", batch, "s"),
            ("state only", "max_batch_state_only", "d"),
        ]
    else:
        cols += [
            (f"MiB / row {short[kv]}", of(kv, "peak_bytes_per_row", 2**-20), ".1f") for kv in kvs
        ]
        cols += [
            (f"max batch {short[kv]}", lambda line, kv=kv: batch(line.get(f"row_{kv}")), "s")
            for kv in kvs
        ]
        cols += [(f"batch {short[kv]} / {short[kvs[0]]}", ratio(kv), ".2f") for kv in kvs[1:]]
    cols.append(("paper", "paper_max_batch", "d"))
    r0 = rows[0]
    notes = [
        f"{r0['config']} ({r0['weight_bytes'] / 2**30:.1f} GiB of weights), prompt "
        f"{r0['prompt_tokens']} tokens, cache {', '.join(kvs)}",
        "MiB / row: the compiled decode peak per row (cache and XLA's temporaries)",
    ]
    if len(kvs) == 1:
        notes.append("'state only' counts weights and the slots' state without XLA's temporaries")
    if not all(r.get("max_batch_checked", True) for r in rows):
        notes.append("*: the affine fit's prediction, not compiled (--no-check)")
    head = "; ".join(notes) + "\n\n"
    return head + common.markdown_table(list(lines.values()), cols)


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(8, 4))
    caps = sorted({r["cap_bytes"] for r in rows})
    kvs = list(dict.fromkeys(map(_kv_name, rows)))
    for cap in caps:
        for kv in kvs:
            sel = [r for r in rows if r["cap_bytes"] == cap and _kv_name(r) == kv]
            labels = [f"{r['setting']}\n{r['gen_tokens'] // 1024}K" for r in sel]
            name = f"{cap / 2**30:.0f} GiB" + (f", {kv}" if len(kvs) > 1 else "")
            ax.plot(labels, [r["max_batch"] for r in sel], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_ylabel("largest batch")
    ax.set_title("sequences that fit")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
