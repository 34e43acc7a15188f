"""KV-cache bytes and decode tokens/s as the context grows; the largest batch in a memory cap.

(a) speed: for each context, prefill a prompt of context - new_tokens tokens once per method
and time decoding new_tokens from copies of that state, with the cache bytes of each method.
(b) capacity: the largest batch whose prefill and decode fit --mem-cap-gb for a long
generation, from compile-only memory analysis (nothing runs).

--kv-dtype sets cache storage types side by side (default: the model's dtype): each method
runs once per type, and rows compare against the same method in the first type.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import rkvjax
from bench import common
from rkvjax import defaults
from rkvjax.kv import compress
from rkvjax.kv.config import compression_config
from rkvjax.runtime import programs, requests
from rkvjax.sampling.params import SamplingParams

METHODS = ("full", "rkv", "snapkv", "streaming")
# Compilation is most of a tiny run (every batch of part (b) compiles a prefill and a decode):
# one context, R-KV alone (FullKV's paths run in the decode suite), and a cap just above the
# weights, where the search for the largest batch ends after a step or two.
TINY = dict(
    methods=["rkv"],
    contexts=[256],
    new_tokens=32,
    budget=32,
    buffer=16,
    repeats=2,
    gen_tokens=512,
    gen_prompt=16,
    fit_batches=[1, 2],
    mem_cap_gb=0.0015,
)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    common.add_methods_argument(p, METHODS, full=True)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--buffer", type=int, default=defaults.BUFFER)
    p.add_argument("--window", type=int, default=defaults.WINDOW)
    common.add_kv_dtype_argument(p, several=True)
    p.add_argument("--batch", type=int, default=1, help="rows of the speed runs (a)")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192],
        help="context length at the end of the timed decode: prompt = context - new tokens",
    )
    p.add_argument(
        "--new-tokens", type=common.int_at_least(2), default=256, help="decoded per timed run"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed decodes after one warm-up")
    p.add_argument("--mem-cap-gb", type=float, default=4.0, help="memory cap of part (b), GiB")
    p.add_argument("--gen-tokens", type=int, default=16384, help="generation length of (b)")
    p.add_argument("--gen-prompt", type=int, default=128, help="prompt tokens of (b)")
    p.add_argument(
        "--fit-batches", type=int, nargs=2, default=[4, 8], help="batches of the (b) fit"
    )
    p.add_argument("--skip-speed", action="store_true", help="only part (b)")
    p.add_argument("--skip-capacity", action="store_true", help="only part (a)")
    p.add_argument(
        "--data", type=Path, default=common.DATA, help="text for the prompts (math500.jsonl)"
    )


def text_ids(model, path, n: int) -> list[int]:
    """At least n token ids of real text (MATH-500 problems back to back), cycled if short;
    random ids for a model without a tokenizer."""
    tok = model.tokenizer
    if tok is None:
        return common.random_ids(model, n)
    ids: list[int] = []
    for problem in common.math500_problems(path):
        ids += tok.encode(problem + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            break
    return (ids * (n // len(ids) + 1))[:n]


def _compression(method: str, args, prompt_len: int, max_new: int, kv_dtype=None):
    return compression_config(
        method,
        None if method == "full" else args.budget,
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        buffer=args.buffer,
        window=args.window,
        kv_dtype=kv_dtype,
    )


def _cases(model, args) -> list[tuple[str, str | None, str]]:
    """(method, --kv-dtype value, the storage type's name) of every setting, the storage types
    innermost."""
    kvs = dict.fromkeys(args.kv_dtype)
    return [(m, kv, common.kv_dtype_name(kv, model.dtype)) for m in args.methods for kv in kvs]


def _engine(model, method, args, ids, n_new, kv_dtype=None) -> rkvjax.Engine:
    """A runtime with one slot per prompt, every prompt submitted (greedy, n_new tokens)."""
    cc = _compression(method, args, max(map(len, ids)), n_new, kv_dtype)
    max_len = requests.bucket(max(map(len, ids)), model.config.max_positions) + n_new - 1
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    return common.submitted(model, ids, [greedy] * len(ids), cc, max_len)


def _compression_ms(eng: rkvjax.Engine, state, repeats: int = 5) -> float | None:
    """One row's compression (all layers), as a decode step runs it in one of its lanes under
    `lax.cond` when the row is full. Its cost does not depend on how full the cache is (scoring
    covers every slot under a mask)."""
    cc = eng.compression
    if not cc.compressing:
        return None
    fn = jax.jit(lambda c, f: compress.compress_lanes(c, f, cc, lanes=1, start=jnp.int32(0)))
    full = jnp.ones(state.cache.length.shape, bool)
    return (
        common.median_seconds(lambda: jax.block_until_ready(fn(state.cache, full)), repeats) * 1e3
    )


def speed_rows(model, args, meta: dict, folder) -> list[dict]:
    """Part (a): for each context, prefill a prompt of context - new_tokens tokens once per
    method, then time decoding new_tokens from copies of that state.

    `generate` would redo the prefill on every call, which at 8K tokens costs more than the
    decode being measured; this drives the same compiled prefill and decode (same plan, same
    64-step chunks) and times the decode alone. The methods take turns repeat by repeat, so
    load from other processes on a shared machine hits them alike.
    """
    b, n_new = args.batch, args.new_tokens
    cases = _cases(model, args)
    kv0 = cases[0][2]
    rows = []
    text = text_ids(model, args.data, max(args.contexts) + 97 * b)
    for ctx in args.contexts:
        p_len = ctx - n_new
        # Different text per row, so rows do not compress identically.
        ids = [text[97 * r : 97 * r + p_len] for r in range(b)]
        runs = {}
        for method, kv_dtype, kv in cases:
            eng = _engine(model, method, args, ids, n_new, kv_dtype)
            c0, t0 = programs.compile_seconds(), time.perf_counter()
            try:
                state = eng.prefilled()
                prefill_comps = int(jax.device_get(state.compressions).max())
            except Exception as e:  # an out-of-memory prefill is a result, not a crash
                print(f"context {ctx} {method} {kv}: prefill failed: {e!r}"[:500], file=sys.stderr)
                err = {"context": ctx, "method": method, "kv_dtype": kv, "error": repr(e)[:500]}
                rows.append({"bench": "memory_speed", "part": "speed", **err, **meta})
                continue
            c1, t1 = programs.compile_seconds(), time.perf_counter()
            common.decode_all(eng, common.copy_state(state))  # warm-up: compiles the chunk
            c2, t2 = programs.compile_seconds(), time.perf_counter()
            runs[method, kv] = {
                "engine": eng,
                "state": state,
                "prefill_s": (t1 - t0) - (c1 - c0),
                "compile_s": (c1 - c0) + (c2 - c1),
                "warmup_decode_s": (t2 - t1) - (c2 - c1),
                "times": [],
                "comp_ms": _compression_ms(eng, state),
                "prefill_comps": prefill_comps,
            }
        for order in common.rotations(runs, args.repeats):
            for m in order:
                r = runs[m]
                s = common.copy_state(r["state"])
                t0 = time.perf_counter()
                s, out, _ = common.decode_all(r["engine"], s)
                r["times"].append(time.perf_counter() - t0)
                r["compressions"] = int(jax.device_get(out.compressions).max())
                r["peak"] = int(jax.device_get(out.peak).max())
                del s
        for (method, kv), r in runs.items():
            eng, dec = r["engine"], statistics.median(r["times"])
            paired = {
                f"speedup_vs_{ref}": common.paired_speedup(runs[ref, kv]["times"], r["times"])
                for ref in ("full", "streaming")
                if (ref, kv) in runs
            }
            if len({c[2] for c in cases}) > 1 and (method, kv0) in runs:
                paired["kv_dtype_ref"] = kv0  # the same method in the first storage type
                ref = runs[method, kv0]["times"]
                paired["speedup_vs_kv_dtype_ref"] = common.paired_speedup(ref, r["times"])
            tps = b * (n_new - 1) / dec  # token 0 comes from the prefill
            comps = r["compressions"] - r["prefill_comps"]
            row = {
                "bench": "memory_speed",
                "part": "speed",
                "context": ctx,
                "prompt_tokens": p_len,
                "new_tokens": n_new,
                "batch": b,
                "method": method,
                "kv_dtype": kv,
                "budget": eng.compression.budget if eng.compression.compressing else None,
                "buffer": args.buffer,
                "cache_capacity": eng.capacity,
                "peak_cache_slots": r["peak"],
                # Keys, values, their scales (8-bit) and slot positions.
                "cache_kv_bytes": common.cache_bytes(r["state"].cache),
                "cache_state_bytes": common.tree_bytes(r["state"].cache),  # + q window, counters
                "decode_s": dec,
                "decode_s_runs": r["times"],
                "tokens_per_s": tps,
                "tokens_per_s_best": b * (n_new - 1) / min(r["times"]),
                **paired,
                "prefill_s": r["prefill_s"],
                "compile_s": r["compile_s"],
                "decode_compressions": comps,
                "compression_ms": r["comp_ms"],
                # Share of the decode spent in compression steps, from the standalone timing.
                "compression_overhead": (
                    comps * r["comp_ms"] / 1e3 / dec if r["comp_ms"] is not None else 0.0
                ),
                "loadavg": os.getloadavg(),
                "host_max_rss_bytes": common.max_rss_bytes(),
                **meta,
            }
            common.emit(row, folder)
            rows.append(row)
        runs.clear()
    return rows


def compiled_memory(model, cc, capacity: int, batch: int, prompt: int, parts=("decode",)):
    """Compile-only memory of a runtime of `batch` slots: its decode chunk (and optionally the
    prefill of its prompts, or one compression step). Nothing runs: the state is abstract."""
    eng = rkvjax.Engine(model, slots=batch, cache=cc, max_len=capacity)
    out = eng.memory_analysis(prompt_len=prompt, parts=parts)
    out["peak_bytes"] = max(out[n]["peak_bytes"] for n in parts if n != "compress")
    # Every program compiled for another batch stays cached, and each holds hundreds of memory
    # mappings for its code: the search would reach the kernel's limit (65530) and fail. Below
    # a safe margin they stay, so a batch compiled twice (a fit batch the search meets again)
    # compiles once.
    if _memory_mappings() > 30_000:
        jax.clear_caches()
    return out


def _memory_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _largest_fitting(peak_of, cap: int, guess: int, limit: int):
    """The largest batch in [0, limit] whose compiled peak fits `cap`, by bisection around the
    affine `guess` (peaks grow with the batch, but not exactly affinely: the prefill's
    temporaries take over at large batches).

    Returns:
      (batch, {batch: compiled_memory(...)} of every batch compiled).
    """
    peaks = {}

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_of(b)
        return peaks[b]["peak_bytes"] <= cap

    b = min(max(guess, 1), max(limit, 1))
    lo, hi = (b, limit + 1) if fits(b) else (0, b)  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo + 1 <= limit:
        fits(lo + 1)  # recorded, to show the next batch up does not fit
    return lo, peaks


def capacity_rows(model, args, meta: dict, folder) -> list[dict]:
    """Part (b): the largest batch whose decode (and prefill) fit --mem-cap-gb for a generation
    of --gen-tokens after a --gen-prompt prompt, from compile-only memory analysis.

    Decode peak memory is close to affine in the batch (weights once; cache, state and
    temporaries per row), so it is compiled at the two --fit-batches and extrapolated to the
    cap. The fit skips batch 1: XLA's buffer assignment there is an outlier (it keeps an extra
    copy of the cache). From that guess, the largest batch whose prefill and decode both fit is
    found by bisection (bounded by the state-only count), and the next batch up is compiled to
    show it does not.
    """
    cap = int(args.mem_cap_gb * 2**30)
    w_bytes = common.weight_bytes(model)
    prompt = requests.bucket(args.gen_prompt, args.gen_prompt)
    b1, b2 = sorted(args.fit_batches)
    rows = []
    for method, kv_dtype, kv in _cases(model, args):
        cc = _compression(method, args, prompt, args.gen_tokens, kv_dtype)
        # An Engine directly, not generate(): a 16K generation exceeds SmolLM2's 8192 positions,
        # which submitting a request checks, but shapes and memory do not depend on that limit.
        capacity = cc.capacity if cc.compressing else prompt + args.gen_tokens - 1
        one = rkvjax.Engine(model, slots=1, cache=cc, max_len=capacity)  # its shapes only
        t0 = time.perf_counter()
        parts = ("decode", "compress") if cc.compressing else ("decode",)
        m1 = compiled_memory(model, cc, capacity, b1, prompt)
        m2 = compiled_memory(model, cc, capacity, b2, prompt, parts)
        per_row = (m2["peak_bytes"] - m1["peak_bytes"]) / (b2 - b1)
        fixed = m1["peak_bytes"] - per_row * b1
        guess = max(0, int((cap - fixed) // per_row)) if per_row > 0 else 0
        state_only = int((cap - w_bytes) // (m2["state_bytes"] / b2))
        best, peaks = _largest_fitting(
            lambda b, cc=cc, c=capacity: compiled_memory(
                model, cc, c, b, prompt, ("prefill", "decode")
            ),
            cap,
            guess,
            state_only,
        )
        checked, above = peaks.get(best), peaks.get(best + 1)
        row = {
            "bench": "memory_speed",
            "part": "capacity",
            "method": method,
            "kv_dtype": kv,
            "budget": cc.budget if cc.compressing else None,
            "buffer": args.buffer,
            "gen_tokens": args.gen_tokens,
            "prompt_tokens": prompt,
            "mem_cap_bytes": cap,
            "cache_capacity": capacity,
            "weight_bytes": w_bytes,
            "kv_bytes_per_row": common.cache_bytes(one.state_shapes().cache),
            "state_bytes_per_row": (m2["state_bytes"] - m1["state_bytes"]) / (b2 - b1),
            "peak_bytes_per_row": per_row,
            "peak_bytes_fixed": fixed,
            "fit_batches": [b1, b2],
            "decode_temp_bytes_fit": [m1["decode"]["temp_bytes"], m2["decode"]["temp_bytes"]],
            # XLA temporaries of one compression step (all layers) at the second fit batch.
            "compress_temp_bytes_fit": m2["compress"]["temp_bytes"] if cc.compressing else None,
            "max_batch": best,
            # The paper-style count: weights plus the decode state alone, no XLA temporaries.
            "max_batch_state_only": state_only,
            "max_batch_predicted": guess,
            "peak_bytes_at_max_batch": checked and checked["peak_bytes"],
            "prefill_peak_bytes_at_max_batch": checked and checked["prefill"]["peak_bytes"],
            "decode_temp_bytes_at_max_batch": checked and checked["decode"]["temp_bytes"],
            "peak_bytes_at_max_batch_plus_1": above and above["peak_bytes"],
            "max_batch_exact": None if above is None else above["peak_bytes"] > cap,
            "analysis_s": time.perf_counter() - t0,
            "analysis": "compile-only Compiled.memory_analysis() on this backend, nothing run",
            **meta,
        }
        common.emit(row, folder)
        rows.append(row)
    return rows


def run(args, folder) -> list[dict]:
    load0 = os.getloadavg()
    model, name = common.load_model(args, args.dtype)
    meta = common.run_meta(model=name, dtype=jnp.dtype(model.dtype).name)
    speed = [] if args.skip_speed else speed_rows(model, args, meta, folder)
    cap = [] if args.skip_capacity else capacity_rows(model, args, meta, folder)
    print(
        f"\n{name} {meta['dtype']}: load average {load0[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end (1-minute); host peak RSS "
        f"{common.max_rss_bytes() / 2**30:.1f} GiB",
        file=sys.stderr,
    )
    return speed + cap


def _speed_table(rows: list[dict]) -> str:
    r0 = next((r for r in rows if "error" not in r), rows[0])
    head = (
        f"(a) {r0['model']} {r0['dtype']}, batch {r0.get('batch')}, buffer {r0.get('buffer')}: "
        f"decode {r0.get('new_tokens')} tokens ending at each context; tok/s: "
        "median of the repeats, best: fastest; x full, x strm: median per-round speed ratio; "
        "ovh %: share of the decode spent compressing."
    )
    ref = next((r["kv_dtype_ref"] for r in rows if "kv_dtype_ref" in r), None)
    if ref:
        head += f" x {_short(ref)}: the same, against the method's {ref} cache."
    columns = [
        ("context", "context", "d"),
        ("method", "method", "s"),
        ("kv dtype", "kv_dtype", "s"),
        ("budget", "budget", "d"),
        ("capacity", "cache_capacity", "d"),
        ("KV MiB", lambda r: r.get("cache_kv_bytes") and r["cache_kv_bytes"] / 2**20, ".1f"),
        ("tok/s", "tokens_per_s", ".2f"),
        ("best", "tokens_per_s_best", ".2f"),
        ("x full", "speedup_vs_full", ".2f"),
        ("x strm", "speedup_vs_streaming", ".2f"),
        *([(f"x {_short(ref)}", "speedup_vs_kv_dtype_ref", ".2f")] if ref else []),
        ("comps", "decode_compressions", "d"),
        ("comp ms", "compression_ms", ".1f"),
        ("ovh %", lambda r: r.get("compression_overhead", 0.0) * 100, ".1f"),
        ("prefill s", "prefill_s", ".1f"),
        ("error", lambda r: r.get("error", "")[:60], "s"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def _capacity_table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"(b) {r0['gen_tokens']}-token generation, {r0['mem_cap_bytes'] / 2**30:g} GiB cap, "
        f"weights {r0['weight_bytes'] / 2**20:.0f} MiB (compile-only memory analysis)."
    )
    full = {r.get("kv_dtype"): r["max_batch"] for r in rows if r["method"] == "full"}

    def temp_per_row(r):
        (b1, b2), (t1, t2) = r["fit_batches"], r["decode_temp_bytes_fit"]
        return (t2 - t1) / (b2 - b1) / 2**20

    def cmp_per_row(r):
        c = r["compress_temp_bytes_fit"]
        return None if c is None else c / r["fit_batches"][1] / 2**20

    columns = [
        ("method", "method", "s"),
        ("kv dtype", "kv_dtype", "s"),
        ("budget", "budget", "d"),
        ("capacity", "cache_capacity", "d"),
        ("KV MiB/row", lambda r: r["kv_bytes_per_row"] / 2**20, ".2f"),
        ("peak MiB/row", lambda r: r["peak_bytes_per_row"] / 2**20, ".2f"),
        ("temp MiB/row", temp_per_row, ".2f"),
        ("cmp MiB/row", cmp_per_row, ".2f"),
        ("fixed MiB", lambda r: r["peak_bytes_fixed"] / 2**20, ".0f"),
        ("max batch", "max_batch", "d"),
        (
            "x full",
            lambda r: r["max_batch"] / f if (f := full.get(r.get("kv_dtype"))) else None,
            ".1f",
        ),
        ("state-only", "max_batch_state_only", "d"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def _short(kv: str) -> str:
    return common.KV_DTYPE_SHORT.get(kv, kv)


def _label(r: dict, several: bool) -> str:
    """A row's method, and its storage type when a run has several."""
    return f"{r['method']} {_short(r['kv_dtype'])}" if several else r["method"]


def table(rows: list[dict]) -> str:
    speed = [r for r in rows if r["part"] == "speed"]
    cap = [r for r in rows if r["part"] == "capacity"]
    parts = [_speed_table(speed)] if speed else []
    return "\n\n".join(parts + ([_capacity_table(cap)] if cap else []))


def plot(plt, rows: list[dict]):
    """KV cache bytes and decode tokens/s against the context, and the largest batch."""
    speed = [r for r in rows if r["part"] == "speed" and "error" not in r]
    cap = [r for r in rows if r["part"] == "capacity"]
    panels = 2 * bool(speed) + bool(cap)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    several = len({r.get("kv_dtype") for r in rows}) > 1
    speed = [{**r, "label": _label(r, several)} for r in speed]
    if speed:
        budgets = sorted({r["budget"] for r in speed} - {None})
        ax = axes.pop(0)
        common.lines(
            ax,
            common.series(speed, "label", "context", "cache_kv_bytes", 2**-20),
            xlabel="context (tokens)",
            ylabel="KV cache MiB",
            title=f"{speed[0]['model']}, budget {', '.join(map(str, budgets)) or '-'}",
        )
        ax.set_yscale("log")
        common.lines(
            axes.pop(0),
            common.series(speed, "label", "context", "tokens_per_s"),
            xlabel="context (tokens)",
            ylabel="decode tokens/s",
            title=f"batch {speed[0]['batch']}, {speed[0]['new_tokens']} new tokens",
        )
    if cap:
        ax = axes.pop(0)
        common.bars(
            ax,
            [_label(r, several) for r in cap],
            [r["max_batch"] for r in cap],
            ylabel=f"max batch in {cap[0]['mem_cap_bytes'] / 2**30:g} GiB",
            title=f"{cap[0]['gen_tokens']}-token generation (compile-only analysis)",
        )
        ax.set_yscale("log")
    return fig
