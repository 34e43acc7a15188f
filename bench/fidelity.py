"""Fidelity of each cache policy to FullKV on long greedy traces: top-1 agreement and KL."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import random_checkpoint  # bench/, beside this script

import rkvjax

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(os.environ.get("RKVJAX_DATA", "/work/shared/data")) / "math500.jsonl"
# The prompt the R-KV paper uses for MATH-500 (DeepSeek-R1 style).
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--new-tokens", type=int, default=1024, help="length of the FullKV traces")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--methods", nargs="+", default=["rkv", "snapkv", "streaming"])
    p.add_argument("--prompts", type=int, default=3, help="traces, scored as one batch")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="skip longer problems")
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--lam", type=float, default=0.1)
    p.add_argument("--data", type=Path, default=DATA, help="math500.jsonl (problem field)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CI smoke run)")
    p.add_argument("--out", type=Path, help="JSON lines appended here (default results/)")
    p.add_argument("--traces", type=Path, help="FullKV trace cache (default results/)")
    p.add_argument("--plot", type=Path, help="PNG (default results/fidelity.png)")
    p.add_argument("--regenerate", action="store_true", help="ignore cached traces")
    args = p.parse_args(argv)
    if args.tiny:
        # Small enough for well under a minute on two CPU cores, yet every method compresses
        # several times; the outputs go to a scratch folder so smoke runs leave results/ alone.
        scratch = Path(tempfile.mkdtemp(prefix="rkvjax-fidelity-"))
        args.new_tokens = min(args.new_tokens, 64)
        args.budgets = [b for b in args.budgets if b <= 32] or [24]
        args.buffer, args.prompts = min(args.buffer, 16), min(args.prompts, 2)
        args.out = args.out or scratch / "fidelity.jsonl"
        args.traces = args.traces or scratch / "fidelity_traces.json"
        args.plot = args.plot or scratch / "fidelity.png"
    args.out = args.out or RESULTS / "fidelity.jsonl"
    args.traces = args.traces or RESULTS / "fidelity_traces.json"
    args.plot = args.plot or RESULTS / "fidelity.png"
    bad = [m for m in args.methods if m not in ("rkv", "snapkv", "streaming")]
    if bad:
        p.error(f"--methods: unknown {bad}; choose from rkv, snapkv, streaming")
    return args


def prompt_ids(model, args) -> list[list[int]]:
    """Chat prompts of the first MATH-500 problems that fit --max-prompt-tokens (random ids for
    a model without a tokenizer)."""
    tok = model.tokenizer
    if tok is None or not tok.has_chat_template:
        rng = np.random.default_rng(0)
        return [rng.integers(3, model.config.vocab_size, 24 + 5 * i).tolist() for i in range(2)][
            : args.prompts
        ]
    out = []
    with args.data.open() as fh:
        for line in fh:
            text = json.loads(line)["problem"] + "\n\n" + INSTRUCTION
            ids = tok.chat_ids([{"role": "user", "content": text}])
            if len(ids) <= args.max_prompt_tokens:
                out.append(ids)
            if len(out) == args.prompts:
                return out
    raise ValueError(f"{args.data}: fewer than {args.prompts} problems of <= max-prompt-tokens")


def _trace_key(name: str, ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([name, ids]).encode()).hexdigest()[:16]


def full_traces(model, name: str, prompts: list[list[int]], args) -> tuple[list, dict]:
    """FullKV greedy continuations of every prompt (ignore_eos), from the cache file when it holds
    them at least --new-tokens long. Returns (continuations, generation info)."""
    n = args.new_tokens
    cache = {}
    if args.traces.is_file() and not args.regenerate:
        cache = json.loads(args.traces.read_text())
    keys = [_trace_key(name, ids) for ids in prompts]
    if all(k in cache and len(cache[k]["token_ids"]) >= n for k in keys):
        # A greedy trace's prefix is the greedy trace of the shorter length.
        return [cache[k]["token_ids"][:n] for k in keys], {"trace_cached": True}
    t0 = time.perf_counter()
    out = rkvjax.generate(
        model, prompts, method="full", max_new_tokens=n, ignore_eos=True, temperature=0.0
    )
    wall = time.perf_counter() - t0
    for k, ids, r in zip(keys, prompts, out, strict=True):
        cache[k] = {"model": name, "prompt_ids": ids, "token_ids": r.token_ids, "text": r.text}
    args.traces.parent.mkdir(parents=True, exist_ok=True)
    args.traces.write_text(json.dumps(cache))
    s = out[0].stats
    info = {
        "trace_cached": False,
        "trace_wall_s": wall,
        "trace_tokens_per_s": s.tokens_per_s,
        "trace_compile_s": s.compile_s,
    }
    return [r.token_ids for r in out], info


def kl_rows(ref: np.ndarray, other: np.ndarray, chunk: int = 256) -> np.ndarray:
    """KL(ref || other) per position of [T, V] log-prob rows, in chunks to bound temporaries."""
    out = np.empty(ref.shape[0], np.float64)
    for i in range(0, ref.shape[0], chunk):
        f, g = ref[i : i + chunk], other[i : i + chunk]
        out[i : i + chunk] = np.sum(np.exp(f) * (f - g), axis=-1, dtype=np.float64)
    return out


def run_score(model, seqs, lens, **kw):
    t0 = time.perf_counter()
    res = rkvjax.score(model, seqs, prompt_len=lens, return_dists=True, **kw)
    return res, time.perf_counter() - t0


def compare(ref, res) -> dict:
    """Per-row and pooled agreement, KL and NLL change of `res` against the FullKV `ref`."""
    agree, kl, dnll = [], [], []
    for a, b in zip(ref, res, strict=True):
        agree.append(float(np.mean(a.top1 == b.top1)))
        kl.append(kl_rows(a.dists, b.dists))
        dnll.append(float(np.mean(a.logprobs) - np.mean(b.logprobs)))
    pooled = np.concatenate(kl)
    n = [len(r.top1) for r in ref]
    return {
        "top1_agreement": float(np.average(agree, weights=n)),
        "kl_mean": float(pooled.mean()),
        "kl_median": float(np.median(pooled)),
        "kl_p90": float(np.quantile(pooled, 0.9)),
        "nll_delta": float(np.average(dnll, weights=n)),  # trace NLL increase per token, nats
        "top1_agreement_rows": agree,
        "kl_mean_rows": [float(x.mean()) for x in kl],
        "compressions_rows": [r.compressions for r in res],
        "peak_cache_slots_rows": [r.peak_cache_slots for r in res],
    }


def _meta(args, name: str) -> dict:
    return {
        "model": name,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "buffer": args.buffer,
        "window": args.window,
        "lam": args.lam,
    }


def emit(row: dict, out: Path) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with out.open("a") as fh:
        fh.write(line + "\n")


def table(rows: list[dict]) -> str:
    head = f"{'method':>9} {'budget':>6} {'top1 agree':>10} {'KL mean':>9} {'KL p90':>8} "
    head += f"{'dNLL':>7} {'comps':>5} {'wall s':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:>9} {r['budget'] or '-':>6} {r['top1_agreement']:>10.4f} "
            f"{r['kl_mean']:>9.4f} {r['kl_p90']:>8.4f} {r['nll_delta']:>7.4f} "
            f"{max(r['compressions_rows']):>5} {r['score_wall_s']:>6.0f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    from plot import lines, pyplot, save

    plt = pyplot()
    if plt is None:
        return
    methods = sorted({r["method"] for r in rows if r["method"] != "full"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    pick = {m: [r for r in rows if r["method"] == m] for m in methods}

    def series(field):
        return {m: ([r["budget"] for r in rs], [r[field] for r in rs]) for m, rs in pick.items()}

    lines(
        ax1,
        series("top1_agreement"),
        xlabel="budget (tokens kept per layer and KV head)",
        ylabel="top-1 agreement with FullKV",
        title=title,
    )
    lines(
        ax2,
        series("kl_mean"),
        xlabel="budget (tokens kept per layer and KV head)",
        ylabel="mean KL(FullKV || method), nats",
        title=title,
    )
    ax2.set_yscale("log")
    save(fig, path)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            path, name = (
                random_checkpoint.save("tiny", Path(tmp) / "tiny-llama"),
                "tiny-random-llama",
            )
        else:
            path = args.model
            name = Path(path).name if path else "SmolLM2-135M-Instruct"
        model = rkvjax.load(path)
        prompts = prompt_ids(model, args)
        conts, info = full_traces(model, name, prompts, args)
    seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
    lens = [len(p) for p in prompts]
    meta = {**_meta(args, name), **info, "prompt_tokens": lens, "new_tokens": args.new_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    comp = {"buffer": args.buffer, "window": args.window, "lam": args.lam}

    ref, wall = run_score(model, seqs, lens, method="full")
    # The FullKV rescoring should predict its own greedy trace; less than 1 means argmax ties
    # or numerics differ between the generation and the teacher-forced pass.
    same = [r.top1 == c for r, c in zip(ref, conts, strict=True)]
    self_agree = float(np.mean(np.concatenate(same)))
    rows = []
    full_row = {
        "bench": "fidelity",
        "method": "full",
        "budget": None,
        **compare(ref, ref),
        "full_vs_trace_agreement": self_agree,
        "score_wall_s": wall,
        "loadavg": os.getloadavg(),
        **meta,
    }
    emit(full_row, args.out)
    rows.append(full_row)
    for budget in sorted(args.budgets):
        for method in args.methods:
            res, wall = run_score(model, seqs, lens, method=method, budget=budget, **comp)
            row = {
                "bench": "fidelity",
                "method": method,
                "budget": budget,
                **compare(ref, res),
                "score_wall_s": wall,
                "score_tokens_per_s": sum(map(len, conts)) / wall,
                "loadavg": os.getloadavg(),
                **meta,
            }
            del res  # [B, T, V] float32 log-probs: one method's worth at a time
            emit(row, args.out)
            rows.append(row)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"\n{name}: {len(seqs)} FullKV greedy traces of {args.new_tokens} tokens (prompts {lens}),"
        f" teacher-forced; buffer {args.buffer}, window {args.window}, lam {args.lam}; "
        f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"host peak RSS {rss / 2**30:.1f} GiB; {time.perf_counter() - t_start:.0f} s",
        file=sys.stderr,
    )
    print(table(rows), file=sys.stderr)
    plot(rows, args.plot, f"{name}, {args.new_tokens}-token traces")


if __name__ == "__main__":
    main()
