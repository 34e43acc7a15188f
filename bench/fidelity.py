"""Fidelity of each cache policy to FullKV on long traces: top-1 agreement and KL.

Generates greedy (or, with --temperature, sampled) FullKV traces of MATH-500 chat prompts
(cached in the suite's traces.json), then teacher-forces them with `rkvjax.score` under each
method and budget, and compares each position's next-token distribution with FullKV's.

With --kv-dtypes, every setting (FullKV and each method and budget) is scored again with each
listed cache storage type (`kv_dtype`, e.g. int8 and float8_e4m3fn): besides the comparison with
FullKV, those rows give the NLL increase per token, top-1 agreement and KL against the same
setting with the model-dtype cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import rkvjax
from bench import common
from rkvjax import checks, defaults
from rkvjax.kv import quantization

# The prompt the R-KV paper uses for MATH-500 (DeepSeek-R1 style).
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
METHODS = ("rkv", "snapkv", "streaming")
# Small enough for seconds on two CPU cores, yet R-KV compresses several times.
TINY = dict(new_tokens=64, budgets=[24], methods=["rkv"], buffer=16, prompts=2)
PREFER_MEMORY = False


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--new-tokens", type=int, default=1024, help="length of the FullKV traces")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    common.add_methods_argument(p, METHODS)
    p.add_argument("--prompts", type=int, default=3, help="traces, scored as one batch")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="FullKV traces greedy (0) or sampled at this temperature, top-p 0.95",
    )
    p.add_argument("--seed", type=int, default=0, help="of the sampled traces")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="skip longer problems")
    p.add_argument("--buffer", type=int, default=defaults.BUFFER)
    p.add_argument("--window", type=int, default=defaults.WINDOW)
    p.add_argument("--lam", type=float, default=defaults.LAM, help="R-KV's")
    p.add_argument("--share", choices=checks.SHARES, default=defaults.SHARE, help="kept sets")
    p.add_argument("--data", type=Path, default=common.DATA, help="math500.jsonl (problem field)")
    p.add_argument("--traces", type=Path, help="FullKV trace cache (default: traces.json here)")
    p.add_argument("--regenerate", action="store_true", help="ignore cached traces")
    p.add_argument(
        "--kv-dtypes",
        nargs="*",
        choices=quantization.KV_DTYPES,
        default=[],
        help="also score every setting with these cache storage types and compare each with the "
        "same setting's model-dtype cache (default: the model's dtype only)",
    )


def problem_ids(model, args) -> list[list[int]]:
    """Chat prompts of the first MATH-500 problems that fit --max-prompt-tokens (random ids for
    a model without a tokenizer)."""
    if not common.has_chat(model):
        return common.random_prompts(model, args.prompts)
    out = []
    for problem in common.math500_problems(args.data):
        ids = common.chat_ids(model, problem + "\n\n" + INSTRUCTION)
        if len(ids) <= args.max_prompt_tokens:
            out.append(ids)
        if len(out) == args.prompts:
            return out
    raise ValueError(f"{args.data}: fewer than {args.prompts} problems of <= max-prompt-tokens")


def _trace_key(name: str, ids: list[int], temperature: float = 0.0, seed: int = 0) -> str:
    """A trace's key in the cache file: the model and prompt (greedy traces, as they always
    were), plus the temperature and seed of a sampled one."""
    what = [name, ids] if temperature == 0.0 else [name, ids, temperature, seed]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def full_traces(model, name: str, prompts: list[list[int]], args) -> tuple[list, dict]:
    """FullKV continuations of every prompt (ignore_eos; greedy, or sampled at --temperature
    with top-p 0.95 from --seed), from the cache file when it holds them at least
    --new-tokens long. Returns (continuations, generation info)."""
    n, temperature = args.new_tokens, args.temperature
    cache = {}
    if args.traces.is_file() and not args.regenerate:
        cache = json.loads(args.traces.read_text())
    keys = [_trace_key(name, ids, temperature, args.seed) for ids in prompts]
    if all(k in cache and len(cache[k]["token_ids"]) >= n for k in keys):
        # A trace's prefix is the trace of the shorter length (a sample's too: token i's key
        # depends on the seed and i only).
        return [cache[k]["token_ids"][:n] for k in keys], {"trace_cached": True}
    sampled = dict(temperature=temperature, top_p=0.95, seed=args.seed) if temperature else {}
    wall, out = common.timed(
        lambda: rkvjax.generate(
            model,
            prompts,
            method="full",
            max_new_tokens=n,
            ignore_eos=True,
            **(sampled or {"temperature": 0.0}),
        )
    )
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


def _kind(temperature: float) -> str:
    return f"sampled (T={temperature:g}, top-p 0.95)" if temperature else "greedy"


def kl_rows(ref: np.ndarray, other: np.ndarray, chunk: int = 256) -> np.ndarray:
    """KL(ref || other) per position of [T, V] log-prob rows, in chunks to bound temporaries."""
    out = np.empty(ref.shape[0], np.float64)
    for i in range(0, ref.shape[0], chunk):
        f, g = ref[i : i + chunk], other[i : i + chunk]
        out[i : i + chunk] = np.sum(np.exp(f) * (f - g), axis=-1, dtype=np.float64)
    return out


def run_score(model, seqs, lens, **kw):
    """(results, wall seconds) of teacher-forcing `seqs` under one cache setting."""
    wall, res = common.timed(
        lambda: rkvjax.score(model, seqs, prompt_len=lens, return_dists=True, **kw)
    )
    return res, wall


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
        "nll_per_token": nll_per_token(res),
        "top1_agreement_rows": agree,
        "kl_mean_rows": [float(x.mean()) for x in kl],
        "nll_delta_rows": dnll,
        "compressions_rows": [r.compressions for r in res],
        "peak_cache_slots_rows": [r.peak_cache_slots for r in res],
    }


def nll_per_token(res) -> float:
    """The traces' mean NLL per scored token (nats), pooled over rows."""
    return float(-np.mean(np.concatenate([r.logprobs for r in res])))


def compare_same_setting(base, res) -> dict:
    """Agreement, KL and NLL increase per token of `res` (a quantized cache) against `base`,
    the same method and budget with the model-dtype cache."""
    c = compare(base, res)
    return {
        "nll_increase_vs_model_dtype": c["nll_delta"],
        "top1_agreement_vs_model_dtype": c["top1_agreement"],
        "kl_mean_vs_model_dtype": c["kl_mean"],
        "kl_p90_vs_model_dtype": c["kl_p90"],
        "nll_increase_vs_model_dtype_rows": c["nll_delta_rows"],
        "top1_agreement_vs_model_dtype_rows": c["top1_agreement_rows"],
    }


def run(args, folder) -> list[dict]:
    args.traces = args.traces or folder / "traces.json"
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    model, name = common.load_model(args)
    prompts = problem_ids(model, args)
    conts, info = full_traces(model, name, prompts, args)
    seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
    lens = [len(p) for p in prompts]
    model_dtype = np.dtype(model.dtype).name
    meta = {
        **common.run_meta(
            model=name,
            model_dtype=model_dtype,
            buffer=args.buffer,
            window=args.window,
            lam=args.lam,
            share=args.share,
            temperature=args.temperature,
            trace_seed=args.seed if args.temperature else None,
        ),
        **info,
        "prompt_tokens": lens,
        "new_tokens": args.new_tokens,
    }
    comp = {"buffer": args.buffer, "window": args.window, "share": args.share}
    n_tokens = sum(map(len, conts))
    rows = []

    def emit(row: dict) -> None:
        common.emit(row, folder)
        rows.append(row)

    def quantized(method: str, budget: int | None, ref, base, kw: dict) -> None:
        """Scores the setting again with each --kv-dtypes cache: rows against FullKV (`ref`,
        model dtype) and against the same setting's model-dtype run (`base`)."""
        for kv_dtype in args.kv_dtypes:
            res, wall = run_score(
                model, seqs, lens, method=method, budget=budget, **kw, kv_dtype=kv_dtype
            )
            emit(
                {
                    "bench": "fidelity",
                    "method": method,
                    "budget": budget,
                    "kv_dtype": kv_dtype,
                    **compare(ref, res),
                    **compare_same_setting(base, res),
                    "score_wall_s": wall,
                    "score_tokens_per_s": n_tokens / wall,
                    "loadavg": os.getloadavg(),
                    **meta,
                }
            )
            del res

    ref, wall = run_score(model, seqs, lens, method="full")
    # The FullKV rescoring should predict its own greedy trace; less than 1 means argmax ties
    # or numerics differ between the generation and the teacher-forced pass (a sampled trace
    # agrees less: it did not always take the argmax).
    same = [r.top1 == c for r, c in zip(ref, conts, strict=True)]
    self_agree = float(np.mean(np.concatenate(same)))
    emit(
        {
            "bench": "fidelity",
            "method": "full",
            "budget": None,
            "kv_dtype": None,  # the model's dtype (model_dtype)
            **compare(ref, ref),
            "full_vs_trace_agreement": self_agree,
            "score_wall_s": wall,
            "loadavg": os.getloadavg(),
            **meta,
        }
    )
    quantized("full", None, ref, ref, {})
    for budget in sorted(args.budgets):
        for method in args.methods:
            own = common.method_options(method, args, model, name, folder)
            if method == "rkv":  # --lam is R-KV's (G-KV has a lam of its own)
                own["lam"] = args.lam
            kw = {**comp, **own}
            res, wall = run_score(model, seqs, lens, method=method, budget=budget, **kw)
            emit(
                {
                    "bench": "fidelity",
                    "method": method,
                    "budget": budget,
                    "kv_dtype": None,
                    **compare(ref, res),
                    "score_wall_s": wall,
                    "score_tokens_per_s": n_tokens / wall,
                    "loadavg": os.getloadavg(),
                    **meta,
                }
            )
            quantized(method, budget, ref, res, kw)
            del res  # [B, T, V] float32 log-probs: one setting's worth at a time
    print(
        f"\n{name}: {len(seqs)} FullKV {_kind(args.temperature)} traces of {args.new_tokens} "
        f"tokens (prompts {lens}),"
        f" teacher-forced; buffer {args.buffer}, window {args.window}, lam {args.lam}; "
        f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"host peak RSS {common.max_rss_bytes() / 2**30:.1f} GiB; "
        f"{time.perf_counter() - t_start:.0f} s",
        file=sys.stderr,
    )
    return rows


def _model_dtype_rows(rows: list[dict]) -> list[dict]:
    """The rows of the model-dtype cache (rows from before --kv-dtypes have no kv_dtype)."""
    return [r for r in rows if r.get("kv_dtype") is None]


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"{r0['model']}: {len(r0['prompt_tokens'])} FullKV {_kind(r0.get('temperature', 0.0))} "
        f"traces of {r0['new_tokens']} "
        f"tokens, teacher-forced; buffer {r0['buffer']}, window {r0['window']}, lam {r0['lam']}, "
        f"shared kept sets: {r0.get('share', 'none')}; "
        "KL(FullKV || method) per position, dNLL: trace NLL increase per token (nats)."
    )
    columns = [
        ("method", "method", "s"),
        ("budget", "budget", "d"),
        ("top1 agree", "top1_agreement", ".4f"),
        ("KL mean", "kl_mean", ".4f"),
        ("KL p90", "kl_p90", ".4f"),
        ("dNLL", "nll_delta", ".4f"),
        ("comps", lambda r: max(r["compressions_rows"]), "d"),
        ("wall s", "score_wall_s", ".0f"),
    ]
    text = f"{head}\n\n{common.markdown_table(_model_dtype_rows(rows), columns)}"
    quant = quantized_table(rows)
    return f"{text}\n\n{quant}" if quant else text


def quantized_table(rows: list[dict]) -> str | None:
    """Each setting's NLL per token with the model-dtype cache, and per --kv-dtypes type the
    NLL increase per token, top-1 agreement and mean KL against it (None without such rows)."""
    kv_dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rows if r.get("kv_dtype")))
    if not kv_dtypes:
        return None
    by = {(r["method"], r["budget"], r.get("kv_dtype")): r for r in rows}
    settings = []
    for r in _model_dtype_rows(rows):
        cells = {"method": r["method"], "budget": r["budget"], "nll": r.get("nll_per_token")}
        for d in kv_dtypes:
            q = by.get((r["method"], r["budget"], d), {})
            cells[f"inc {d}"] = q.get("nll_increase_vs_model_dtype")
            cells[f"top1 {d}"] = q.get("top1_agreement_vs_model_dtype")
            cells[f"kl {d}"] = q.get("kl_mean_vs_model_dtype")
        settings.append(cells)
    short = {"float8_e4m3fn": "fp8"}
    columns = [
        ("method", "method", "s"),
        ("budget", "budget", "d"),
        (f"NLL/token ({rows[0].get('model_dtype', 'model dtype')})", "nll", ".4f"),
    ]
    for what, fmt in (("inc", "+.4f"), ("top1", ".4f"), ("kl", ".5f")):
        label = {"inc": "+NLL", "top1": "top1", "kl": "KL"}[what]
        columns += [(f"{label} {short.get(d, d)}", f"{what} {d}", fmt) for d in kv_dtypes]
    head = (
        "Each cache storage type against the model-dtype cache of the same method and budget: "
        "NLL/token of the trace with the model-dtype cache; +NLL: its increase per token with "
        "the other type (nats); top1: agreement of the next-token argmax; KL: mean "
        "KL(model dtype || other type) per position."
    )
    return f"{head}\n\n{common.markdown_table(settings, columns)}"


def plot(plt, rows: list[dict]):
    """Top-1 agreement and mean KL against the budget, one line per method."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    compressed = [r for r in _model_dtype_rows(rows) if r["method"] != "full"]
    title = f"{rows[0]['model']}, {rows[0]['new_tokens']}-token traces"
    xlabel = "budget (tokens kept per layer and KV head)"
    common.lines(
        ax1,
        common.series(compressed, "method", "budget", "top1_agreement"),
        xlabel=xlabel,
        ylabel="top-1 agreement with FullKV",
        title=title,
    )
    common.lines(
        ax2,
        common.series(compressed, "method", "budget", "kl_mean"),
        xlabel=xlabel,
        ylabel="mean KL(FullKV || method), nats",
        title=title,
    )
    ax2.set_yscale("log")
    return fig
