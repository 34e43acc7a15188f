"""Which tokens each method keeps over one trace (the R-KV paper's Figures 3 and 7): the
positions every compression kept, per (layer, KV head), from `record_kept`.

One MATH-500 prompt is decoded greedily for --gen-tokens tokens with each method at one budget;
every compression's kept positions are saved (kept_<method>.npz: [compressions, layers, KV
heads, budget], -1 = empty) and plotted: for each compression (x: the newest position then) the
positions kept (y), shaded by the share of (layer, head) pairs that kept them. The table gives,
at the last compression, the share of kept slots holding prompt tokens, their mean age
(newest position - kept position), and their overlap with R-KV's kept sets.
"""

from __future__ import annotations

import argparse

import numpy as np

import rkvjax
from bench import common
from rkvjax import defaults

PREFER_MEMORY = True
TINY = {"gen_tokens": 64, "budget": 16, "buffer": 8, "methods": ["rkv", "streaming"]}
METHODS = ("rkv", "snapkv", "streaming")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gen-tokens", type=common.int_at_least(2), default=1024)
    p.add_argument("--budget", type=common.int_at_least(2), default=128)
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    common.add_methods_argument(p, METHODS)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean Jaccard overlap of two [L, K, budget] kept sets, per (layer, head)."""
    scores = []
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), strict=True):
        sx, sy = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        scores.append(len(sx & sy) / max(len(sx | sy), 1))
    return float(np.mean(scores))


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    if common.has_chat(model):
        prompt = common.chat_ids(model, common.math_prompts(common.DATA, 1)[0])
    else:
        prompt = common.random_ids(model, 24)
    params = rkvjax.SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    kept = {}
    if "rkv" not in args.methods:
        raise ValueError("kept: --methods must include rkv (the others are compared with it)")
    for method in args.methods:
        out = rkvjax.generate(
            model,
            prompt,
            sampling=params,
            method=method,
            budget=args.budget,
            buffer=args.buffer,
            record_kept=True,
        )
        kept[method] = out.kept_positions  # [E, L, K, budget]
        folder.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(folder / f"kept_{method}.npz", kept=kept[method])
    rows = []
    for method, k in kept.items():
        last = k[-1] if len(k) else None
        valid = last[last >= 0] if last is not None else np.zeros(0, int)
        newest = int(valid.max()) if valid.size else None
        row = {
            "bench": "kept",
            "method": method,
            "budget": args.budget,
            "buffer": args.buffer,
            "gen_tokens": args.gen_tokens,
            "prompt_tokens": len(prompt),
            "compressions": len(k),
            "kept_prompt_share": float(np.mean(valid < len(prompt))) if valid.size else None,
            "kept_mean_age": float(np.mean(newest - valid)) if valid.size else None,
            "overlap_with_rkv": (
                _overlap(last, kept["rkv"][-1]) if last is not None and len(kept["rkv"]) else None
            ),
            "model": name,
            # The kept positions themselves, for the plot (not written to results.jsonl).
            "_kept": k,
        }
        rows.append(row)
        common.emit(
            {**{a: b for a, b in row.items() if a != "_kept"}, **common.run_meta(dtype=args.dtype)},
            folder,
        )
    return rows


def table(rows: list[dict]) -> str:
    cols = [
        ("method", "method", "s"),
        ("compressions", "compressions", "d"),
        ("kept: prompt share", "kept_prompt_share", ".2f"),
        ("kept: mean age", "kept_mean_age", ".0f"),
        ("overlap with R-KV", "overlap_with_rkv", ".2f"),
    ]
    r0 = rows[0]
    head = (
        f"{r0['model']}, {r0['prompt_tokens']}-token prompt, {r0['gen_tokens']} generated "
        f"tokens, budget {r0['budget']}, buffer {r0['buffer']}; at the last compression\n\n"
    )
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    shown = [r for r in rows if "_kept" in r and len(r["_kept"])]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 4), sharey=True)
    for ax, r in zip(np.atleast_1d(axes), shown, strict=True):
        k = r["_kept"]
        pairs = k.shape[1] * k.shape[2]
        for step in k:
            valid = step[step >= 0]
            pos, count = np.unique(valid, return_counts=True)
            ax.scatter(
                np.full(pos.shape, valid.max()),
                pos,
                c=count / pairs,
                s=2,
                cmap="viridis",
                vmin=0,
                vmax=1,
            )
        ax.axhline(r["prompt_tokens"], color="grey", lw=0.5, ls="--")
        ax.set_title(f"{r['method']} (budget {r['budget']})")
        ax.set_xlabel("newest position at the compression")
    np.atleast_1d(axes)[0].set_ylabel("kept position (shade: share of layer-heads)")
    return fig
