"""Sampling cost: in the engine, and of the sampler alone.

engine   temperature 0.6 + top-p 0.95 against greedy decode tokens/s at batch 8 on the model
         (before per-row sampling, nucleus sampling sorted the vocabulary every step: 0.35x).
         Decode-only: prefill once, time `programs.decode` from copies of the prefilled state,
         the two settings taking turns run by run; medians, and the per-round ratio.
sampler  the former batch-level sampler against per-row `sample_rows`: random float32 logits
         [B, V] (V = 49,152, the default model's vocabulary), jit-compiled, median wall time
         of many calls after a warm-up, for greedy, temperature only, top-k 50 and
         temperature 0.6 + top-p 0.95. Two kinds of logits: "flat" (standard normal x 3: a
         nucleus of thousands of tokens, the worst case, which takes the bisection) and
         "peaked" (standard normal x 2 with three tokens lifted by ~15, like a language
         model's next token: the nucleus lies within the 64 largest logits).
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from rkvjax.kv.config import compression_config
from rkvjax.sampling import sampler as S

PARTS = ("engine", "sampler")
ENGINE_BATCH = 8
CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_k_50": dict(temperature=1.0, top_k=50),
    "top_p_0.95": dict(temperature=0.6, top_p=0.95),
}
TINY = dict(new_tokens=32, batch=[8], vocab=4096, kinds=["flat"], calls=10, budget_s=1.0)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    g = p.add_argument_group("engine")
    common.add_model_argument(g)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--repeats", type=int, default=3, help="timed runs per setting (alternating)")
    g.add_argument("--new-tokens", type=int, default=256, help="decoded per row")
    g.add_argument("--data", type=Path, default=common.DATA, help="MATH-500 JSONL: the prompts")
    g = p.add_argument_group("sampler")
    g.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    g.add_argument("--vocab", type=int, default=49152)
    g.add_argument("--kinds", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    g.add_argument("--calls", type=int, default=50, help="timed calls per case, after warm-up")
    g.add_argument("--budget-s", type=float, default=5.0, help="time spent per case at most")


# -- the engine ----------------------------------------------------------------------------


def engine_rows(args, folder) -> list[dict]:
    """Nucleus sampling against greedy decode speed at batch 8."""
    model, name = common.load_model(args, args.dtype)
    prompts = common.math_prompts(args.data, ENGINE_BATCH)
    if common.has_chat(model):
        ids = [common.chat_ids(model, p) for p in prompts]
    else:
        ids = common.random_prompts(model, ENGINE_BATCH)
    n = args.new_tokens
    greedy = [S.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)] * ENGINE_BATCH
    nucleus = [
        S.SamplingParams(temperature=0.6, top_p=0.95, seed=i, max_tokens=n, ignore_eos=True)
        for i in range(ENGINE_BATCH)
    ]
    cc = compression_config("full")
    settings = {
        "greedy": common.prefilled(model, ids, greedy, cc),
        "top_p": common.prefilled(model, ids, nucleus, cc),
    }
    t = common.time_decodes(settings, args.repeats)
    tps = t["tokens_per_s"]
    ratio = common.paired_speedup(t["times"]["greedy"], t["times"]["top_p"])
    row = {
        "bench": "runtime_speed",
        "part": "sampling",
        "batch": ENGINE_BATCH,
        "new_tokens": n,
        "greedy_tokens_per_s": tps["greedy"],
        "top_p_tokens_per_s": tps["top_p"],
        "top_p_vs_greedy": ratio,
        "times": t["times"],
        "loadavg": os.getloadavg(),
        **common.run_meta(model=name, dtype=args.dtype),
    }
    common.emit(row, folder)
    return [row]


# -- the sampler alone ---------------------------------------------------------------------


def make_logits(kind: str, batch: int, vocab: int, seed: int = 0) -> jax.Array:
    rs = np.random.RandomState(seed)
    x = rs.randn(batch, vocab).astype(np.float32) * (3.0 if kind == "flat" else 2.0)  # [B, V]
    if kind == "peaked":
        for row in x:
            row[rs.choice(vocab, 3, replace=False)] += 15.0 * rs.uniform(0.8, 1.2, 3)
    return jnp.asarray(x)


def legacy_sample(logits: jax.Array, key: jax.Array, temperature=0.0, top_k=0, top_p=1.0):
    """The batch-level sampler rkvjax had before per-row sampling (one setting for the whole
    batch; top-p sorted the vocabulary every step), kept here as the baseline."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)  # [B, V], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        rows = jnp.arange(logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def legacy_fn(case: dict):
    @jax.jit
    def run(logits, key):
        return legacy_sample(logits, key, **case)

    key = jax.random.key(0)
    return lambda logits, sp, extra: run(logits, key)


@jax.jit
def rows_sample(logits, sp, token_index):
    """Today's sampler: every row's own settings live in `sp`, so one program serves them all."""
    keys = S.token_keys(sp.seed, sp.sample_index, token_index)  # [B]
    return S.sample_rows(logits, sp, keys)


def time_ms(fn, logits, sp, extra, calls: int, budget_s: float) -> tuple[float, int]:
    """Median ms per call after a compile and 3 warm-up calls, over `calls` calls or fewer (5
    at least) when they would take longer than `budget_s`; and the number of calls timed."""
    times = common.timings(
        lambda: jax.block_until_ready(fn(logits, sp, extra)),
        calls,
        warmup=4,
        budget_s=budget_s,
        min_repeats=5,
    )
    return 1e3 * statistics.median(times), len(times)


def sampler_rows(args, folder) -> list[dict]:
    meta = common.run_meta(
        machine=platform.machine(), loadavg_start=[round(x, 2) for x in os.getloadavg()]
    )
    rows = []
    for kind in args.kinds:
        for batch in args.batch:
            logits = make_logits(kind, batch, args.vocab)
            for name, case in CASES.items():
                sp = S.SlotSampling.from_params(
                    [S.SamplingParams(**case)] * batch, rng=np.random.default_rng(0)
                )
                token_index = jnp.zeros((batch,), jnp.int32)  # [B]
                timing = dict(calls=args.calls, budget_s=args.budget_s)
                legacy, legacy_n = time_ms(legacy_fn(case), logits, sp, None, **timing)
                now, now_n = time_ms(rows_sample, logits, sp, token_index, **timing)
                row = dict(
                    bench="sampling_speed",
                    kind=kind,
                    batch=batch,
                    vocab=args.vocab,
                    case=name,
                    legacy_ms=round(legacy, 4),
                    rows_ms=round(now, 4),
                    legacy_calls=legacy_n,
                    rows_calls=now_n,
                    **meta,
                )
                common.emit(row, folder)
                rows.append(row)
    return rows


def run(args, folder) -> list[dict]:
    parts = {"engine": engine_rows, "sampler": sampler_rows}
    return [row for part in args.parts for row in parts[part](args, folder)]


def table(rows: list[dict]) -> str:
    out = []
    engine = [r for r in rows if r["bench"] == "runtime_speed"]
    if engine:
        head = (
            f"engine: {engine[0]['model']} {engine[0]['dtype']}, batch {ENGINE_BATCH}, "
            f"{engine[0]['new_tokens']} new tokens, FullKV; top-p / greedy is the median "
            "per-round ratio of decode speed."
        )
        columns = [
            ("greedy tok/s", "greedy_tokens_per_s", ".1f"),
            ("temp 0.6 + top-p 0.95 tok/s", "top_p_tokens_per_s", ".1f"),
            ("top-p / greedy", "top_p_vs_greedy", ".3f"),
        ]
        out.append(f"{head}\n\n{common.markdown_table(engine, columns)}")
    sampler = [r for r in rows if r["bench"] == "sampling_speed"]
    if sampler:
        greedy = {(r["kind"], r["batch"]): r for r in sampler if r["case"] == "greedy"}

        def ratio(field):
            return lambda r: r[field] / greedy[r["kind"], r["batch"]][field]

        head = (
            f"sampler: ms per call, vocabulary {sampler[0]['vocab']}; legacy = the batch-level "
            "sampler before per-row sampling, rows = `sample_rows`; x greedy: over the same "
            "sampler's greedy."
        )
        columns = [
            ("kind", "kind", "s"),
            ("B", "batch", "d"),
            ("case", "case", "s"),
            ("legacy ms", "legacy_ms", ".3f"),
            ("x greedy", ratio("legacy_ms"), ".2f"),
            ("rows ms", "rows_ms", ".3f"),
            ("x greedy", ratio("rows_ms"), ".2f"),
            ("legacy / rows", lambda r: r["legacy_ms"] / r["rows_ms"], ".2f"),
        ]
        out.append(f"{head}\n\n{common.markdown_table(sampler, columns)}")
    return "\n\n".join(out)


def plot(plt, rows: list[dict]):
    """The engine's tokens/s per setting, and the sampler's ms per call per case."""
    engine = [r for r in rows if r["bench"] == "runtime_speed"]
    sampler = [r for r in rows if r["bench"] == "sampling_speed"]
    fig, axes = plt.subplots(1, bool(engine) + bool(sampler), figsize=(11, 4), squeeze=False)
    axes = list(axes[0])
    if engine:
        r = engine[0]
        common.bars(
            axes.pop(0),
            ["greedy", "temp 0.6 + top-p 0.95"],
            [r["greedy_tokens_per_s"], r["top_p_tokens_per_s"]],
            ylabel="decode tokens/s",
            title=f"{r['model']}, batch {r['batch']}",
        )
    if sampler:
        ax = axes.pop(0)
        big = max(r["batch"] for r in sampler)
        picked = [r for r in sampler if r["batch"] == big]
        labels = [f"{r['kind']} {r['case']}" for r in picked]
        x = np.arange(len(picked))
        ax.bar(x - 0.2, [r["legacy_ms"] for r in picked], 0.4, label="legacy")
        ax.bar(x + 0.2, [r["rows_ms"] for r in picked], 0.4, label="sample_rows")
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("ms per call")
        ax.set_title(f"sampler alone, batch {big}, vocabulary {picked[0]['vocab']}")
        ax.legend()
    return fig
