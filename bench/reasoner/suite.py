"""Accuracy at a budget on the reasoner (the R-KV paper's Figure 1, on a model trained here):
greedy answers to fresh problems under FullKV and every cache method, budget, cache storage
type and kept-set sharing, graded line by line.

The reasoner (`bench/reasoner/model`, trained by `python -m bench.reasoner.train`) runs a small
loop of mod-10 assignments for up to 40 rounds and writes every step; its answer needs values,
a round count and a name written only in the prompt, hundreds of tokens back, while old lines of
the same op are near copies of new ones. A setting is one `rkvjax.generate` over every problem
(one slot each, `chat=False`, greedy); each answer is graded by `bench.reasoner.task.grade`
(right, or the first thing that went wrong: no answer line, a value read wrong, the round count
lost, a malformed line, a wrong final answer). Rows also split accuracy by the trace's length
(quartiles of the problem set's trace tokens). TriAttention reads statistics calibrated once on
training-distribution problems (prompt and trace), kept in the suite's folder. Finished settings
are appended to results.jsonl as they end and are not run again for the same model and problems
(delete the file to rerun).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import rkvjax
from bench import common
from bench.reasoner import task
from rkvjax import defaults
from rkvjax.kv import policies

PREFER_MEMORY = True
MODEL = Path(__file__).resolve().parent / "model"
BUDGETS = (32, 64, 128, 256, 512)
# A cache holds up to budget + buffer tokens. The engine's buffer (128) suits the paper's
# 4K-16K-token chains; a reasoner's whole problem is 100-280 tokens, so a buffer of 128 would
# leave most of them uncompressed at every budget here. At 16 the cache stays within 16 tokens
# of the budget.
BUFFER = 16
FAILURES = ("no answer", "value", "rounds", "format", "answer")
TINY = {
    "problems": 4,
    "budgets": [32],
    "methods": ["full", "rkv", "streaming"],
    "kv_dtypes": ["model"],
    "shares": ["none"],
    "ops": [2, 2],
    "rounds": [2, 3],
    "buffer": 8,
}
# Problems for TriAttention's statistics: the training distribution, from a seed no evaluation
# set uses.
CALIBRATION_SEED, CALIBRATION_PROBLEMS = 99_991, 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"the reasoner's folder (default: {MODEL.relative_to(MODEL.parents[2])}; --tiny: "
        "a two-step model trained here)",
    )
    p.add_argument("--problems", type=common.int_at_least(1), default=100)
    p.add_argument("--seed", type=int, default=2026, help="the problem set's seed")
    p.add_argument("--ops", type=int, nargs=2, default=[3, 5], metavar=("MIN", "MAX"))
    p.add_argument("--rounds", type=int, nargs=2, default=[8, 20], metavar=("MIN", "MAX"))
    common.add_methods_argument(
        p,
        ["full", *policies.BUILTINS],
        full=True,
        calibrated_on=f"{CALIBRATION_PROBLEMS} training-distribution problems (prompt and trace)",
    )
    p.add_argument("--budgets", type=common.int_at_least(2), nargs="+", default=list(BUDGETS))
    p.add_argument("--buffer", type=common.int_at_least(1), default=BUFFER,
                   help="decoded tokens between compressions (the engine's default is "
                   f"{defaults.BUFFER})")  # fmt: skip
    common.add_kv_dtypes_argument(p)
    p.add_argument(
        "--shares",
        nargs="+",
        default=["none"],
        choices=["none", "heads", "layers", "all"],
        help="kept sets: none = one per (layer, KV head); heads / layers / all = shared",
    )


TINY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip


def model_folder(args, out: Path) -> Path:
    """The reasoner to measure: --model, the committed one, or (--tiny) a two-step model
    trained into the suite's folder."""
    if args.tiny:
        from bench.reasoner import train

        folder = out / "tiny-model"
        cfg = train.TrainConfig(steps=2, rows=2, length=256, warmup=1, start=(2, 4), end=(2, 4),
                                read_layer=1, shape=tuple(TINY_SHAPE.items()))  # fmt: skip
        train.train(cfg, folder, progress=False)
        return folder
    folder = Path(args.model) if args.model else MODEL
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"{folder}: no reasoner here; train one with `python -m bench.reasoner.train {folder}`"
        )
    return folder


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()[:16]


def settings(args) -> list[dict]:
    """Every (method, budget, kv_dtype, share) to run: FullKV once per storage type."""
    out = []
    for kv in args.kv_dtypes:
        if "full" in args.methods:
            out.append({"method": "full", "budget": None, "kv_dtype_arg": kv, "share": "none"})
        for m in (m for m in args.methods if m != "full"):
            for share in args.shares:
                for b in args.budgets:
                    out.append({"method": m, "budget": b, "kv_dtype_arg": kv, "share": share})
    return out


def _calibration(model, folder: Path, weights: str) -> str:
    """TriAttention's statistics of these weights (by digest: a retrained model gets its own)."""
    from rkvjax.entrypoints import calibration
    from rkvjax.kv.policies import triattention_stats

    path = folder / f"calibration-{weights}.npz"
    if not path.is_file():
        problems = task.problems(CALIBRATION_SEED, CALIBRATION_PROBLEMS)
        ids = [model.tokenizer.encode(p.prompt() + p.trace()) for p in problems]
        stats = calibration.calibrate(
            model, ids, source=f"bench reasoner: {len(ids)} training-distribution problems"
        )
        folder.mkdir(parents=True, exist_ok=True)
        triattention_stats.save(stats, path, overwrite=True)
    return str(path)


def quartile_edges(lengths: list[int]) -> list[float]:
    """Three cut points splitting trace lengths into four buckets of about equal size."""
    return [float(x) for x in np.percentile(lengths, [25, 50, 75])]


def grade_all(problems, texts, lengths, edges) -> dict:
    """Accuracy, failure counts and accuracy by length bucket of one setting's answers."""
    grades = [task.grade(p, t) for p, t in zip(problems, texts, strict=True)]
    right = [g.correct for g in grades]
    bucket = np.digitize(lengths, edges)  # 0..3
    by_length = []
    for q in range(4):
        mine = [r for r, b in zip(right, bucket, strict=True) if b == q]
        by_length.append(round(100 * sum(mine) / len(mine), 1) if mine else None)
    return {
        "accuracy": round(100 * sum(right) / len(right), 1),
        "right": sum(right),
        "failures": {f: sum(g.failure == f for g in grades) for f in FAILURES},
        "accuracy_by_length": by_length,
        "rounds_written_median": statistics.median(g.rounds_written for g in grades),
    }


def _earlier_rows(folder: Path) -> list[dict]:
    path = folder / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _done(earlier: list[dict], key: dict) -> dict | None:
    return next((r for r in earlier if all(r.get(k) == v for k, v in key.items())), None)


def run(args, folder) -> list[dict]:
    path = model_folder(args, folder)
    model = rkvjax.load(path, dtype="float32")
    name = "tiny-reasoner" if args.tiny else path.name
    problems = task.problems(args.seed, args.problems, ops=tuple(args.ops),
                             rounds=tuple(args.rounds))  # fmt: skip
    prompts = [p.prompt() for p in problems]
    lengths = [len(model.tokenizer.encode(p.trace())) + 1 for p in problems]  # with the end
    edges = quartile_edges(lengths)
    params = rkvjax.SamplingParams(temperature=0.0, max_tokens=max(lengths) + 32)
    base = {
        "bench": "reasoner",
        "model": name,
        "weights": _digest(path),
        "problems": args.problems,
        "seed": args.seed,
        "ops": list(args.ops),
        "rounds": list(args.rounds),
        "buffer": args.buffer,
    }
    if args.calibration is not None:  # rows under other statistics are not these
        base["calibration"] = str(args.calibration)
    rows, earlier = [], _earlier_rows(folder)
    for s in settings(args):
        key = {**base, **s}
        old = _done(earlier, key)
        if old is not None:
            rows.append(old)
            continue
        cache = {"method": s["method"], "budget": s["budget"], "buffer": args.buffer}
        if s["method"] != "full":
            cache["share"] = s["share"]
            if "calibration" in policies.option_names(s["method"]):
                cache["calibration"] = str(
                    args.calibration or _calibration(model, folder, base["weights"])
                )
        kv_dtype = common.kv_dtype_arg(s["kv_dtype_arg"])
        t0 = time.perf_counter()
        outs = rkvjax.generate(
            model,
            prompts,
            sampling=params,
            slots=len(prompts),
            kv_dtype=kv_dtype,
            chat=False,
            **cache,
        )
        seconds = time.perf_counter() - t0
        # Every setting compiles programs of its own, and each keeps its code mapped: a grid
        # of hundreds passed the kernel's limit of 65,530 mappings (LLVM: cannot allocate
        # memory). No later setting reuses them.
        jax.clear_caches()
        row = {
            **key,
            "kv_dtype": common.kv_dtype_name(kv_dtype, model.dtype),
            **grade_all(problems, [o.text for o in outs], lengths, edges),
            "length_edges": edges,
            "trace_tokens_median": statistics.median(lengths),
            "compressions_mean": float(np.mean([o.stats.compressions for o in outs])),
            "seconds": round(seconds, 1),
        }
        rows.append(row)
        common.emit({**row, **common.run_meta()}, folder)
    return rows


def _label(r: dict) -> str:
    share = "" if r["share"] == "none" else f" share={r['share']}"
    return f"{r['method']}{share}"


def whole_trace(r: dict) -> float:
    """The share of problems written without an error, answer included (%). The loop's values
    fall into short cycles, so a wrong run can still end on the right answer."""
    return 100 * (r["problems"] - sum(r["failures"].values())) / r["problems"]


def _by_length(r: dict) -> str:
    return " / ".join("-" if a is None else f"{a:g}" for a in r["accuracy_by_length"])


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    e = r0["length_edges"]
    head = (
        f"{r0['model']} ({r0['weights']}), {r0['problems']} fresh problems (seed {r0['seed']}, "
        f"{r0['ops'][0]}-{r0['ops'][1]} ops, {r0['rounds'][0]}-{r0['rounds'][1]} rounds; trace "
        f"tokens median {r0['trace_tokens_median']:g}, quartile edges "
        f"{', '.join(f'{x:g}' for x in e)}), greedy, buffer {r0['buffer']}; accuracy (the "
        "answer right) and whole trace (every line right) in %\n\n"
    )
    cols = [
        ("method", _label, "s"),
        ("budget", lambda r: "full" if r["budget"] is None else str(r["budget"]), "s"),
        ("cache", "kv_dtype", "s"),
        ("accuracy", "accuracy", ".1f"),
        ("whole trace", whole_trace, ".1f"),
        ("by length quartile", _by_length, "s"),
        *((f"fail: {f}", lambda r, f=f: r["failures"][f], "d") for f in FAILURES),
        ("compressions", "compressions_mean", ".1f"),
    ]
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    """Accuracy (solid) and whole traces (dotted) against budget, one color per method, one
    panel per kept-set sharing; the model's own cache type."""
    mine = [r for r in rows if r["kv_dtype_arg"] == "model"]
    full = next((r for r in mine if r["method"] == "full"), None)
    shares = list(dict.fromkeys(r["share"] for r in mine if r["method"] != "full")) or ["none"]
    methods = list(dict.fromkeys(r["method"] for r in mine if r["method"] != "full"))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(shares), figsize=(5 * len(shares), 4.4), squeeze=False,
                             sharey=True, layout="constrained")  # fmt: skip
    for ax, share in zip(axes[0], shares, strict=True):
        if full is not None:
            ax.axhline(full["accuracy"], color="black", ls="--", lw=1, label="FullKV")
        for m in methods:
            pts = sorted(
                (r["budget"], r["accuracy"], whole_trace(r))
                for r in mine
                if r["method"] == m and r["share"] == share
            )
            if not pts:
                continue
            b = [p[0] for p in pts]
            ax.plot(b, [p[1] for p in pts], "o-", ms=3, color=colors[m], label=m)
            ax.plot(b, [p[2] for p in pts], ":", lw=1, color=colors[m])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens per KV head)")
        ax.set_ylim(-2, 102)
        ax.set_title(
            "one kept set per KV head" if share == "none" else f"kept sets shared: {share}"
        )
    axes[0][0].set_ylabel("% right (solid: the answer; dotted: the whole trace)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # Constrained layout places an "outside" legend below the axes' labels, not over them.
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5 * len(shares)),
               fontsize=8)  # fmt: skip
    fig.suptitle("the reasoner: accuracy at a budget")
    return fig
