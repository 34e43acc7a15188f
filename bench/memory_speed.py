"""KV-cache bytes and decode tokens/s as the context grows; the largest batch in a memory cap."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import random_checkpoint  # bench/, beside this script

import rkvjax
from rkvjax import engine, policy, requests, xla_flags
from rkvjax.config import compression_config
from rkvjax.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(os.environ.get("RKVJAX_DATA", "/work/shared/data")) / "math500.jsonl"
METHODS = ("full", "rkv", "snapkv", "streaming")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--methods", nargs="+", choices=METHODS, help="default: all four")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--batch", type=int, default=1, help="rows of the speed runs (a)")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192],
        help="context length at the end of the timed decode: prompt = context - new tokens",
    )
    p.add_argument("--new-tokens", type=int, default=256, help="decoded per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed decodes after one warm-up")
    p.add_argument("--mem-cap-gb", type=float, default=4.0, help="memory cap of part (b), GiB")
    p.add_argument("--gen-tokens", type=int, default=16384, help="generation length of (b)")
    p.add_argument("--gen-prompt", type=int, default=128, help="prompt tokens of (b)")
    p.add_argument(
        "--fit-batches", type=int, nargs=2, default=[4, 8], help="batches of the (b) fit"
    )
    p.add_argument("--skip-speed", action="store_true", help="only part (b)")
    p.add_argument("--skip-capacity", action="store_true", help="only part (a)")
    p.add_argument("--data", type=Path, default=DATA, help="text for the prompts (math500.jsonl)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CI smoke run)")
    p.add_argument("--out", type=Path, help="JSON lines appended here (default results/)")
    p.add_argument("--plot", type=Path, help="PNG (default results/memory_speed.png)")
    args = p.parse_args(argv)
    if args.tiny:
        # Every method still compresses twice per timed decode; outputs go to a scratch folder.
        scratch = Path(tempfile.mkdtemp(prefix="rkvjax-memory-speed-"))
        # Compilation dominates a tiny run: one context, and FullKV against R-KV only.
        args.methods = args.methods or ["full", "rkv"]
        args.contexts = [c for c in args.contexts if c <= 256] or [256]
        args.new_tokens, args.budget, args.buffer = 32, 32, 16
        args.repeats = min(args.repeats, 2)
        args.gen_tokens, args.gen_prompt = 2048, 16
        args.mem_cap_gb = min(args.mem_cap_gb, 0.05)
        args.out = args.out or scratch / "memory_speed.jsonl"
        args.plot = args.plot or scratch / "memory_speed.png"
    args.methods = args.methods or list(METHODS)
    args.out = args.out or RESULTS / "memory_speed.jsonl"
    args.plot = args.plot or RESULTS / "memory_speed.png"
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    return args


def text_ids(model, path: Path, n: int) -> list[int]:
    """At least n token ids of real text (MATH-500 problems back to back), cycled if short;
    random ids for a model without a tokenizer."""
    tok = model.tokenizer
    if tok is None:
        return np.random.default_rng(0).integers(3, model.config.vocab_size, n).tolist()
    ids: list[int] = []
    with path.open() as fh:
        for line in fh:
            ids += tok.encode(json.loads(line)["problem"] + "\n\n", add_special_tokens=False)
            if len(ids) >= n:
                break
    return (ids * (n // len(ids) + 1))[:n]


def weight_bytes(model) -> int:
    """Bytes of every weight; a tied embedding is one array, so it counts once."""
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.decoder, nnx.Param)))


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def kv_bytes(cfg, batch: int, capacity: int, itemsize: int) -> int:
    """K and V of every layer plus slot_pos (int32): 2 L B K C H itemsize + L B K C 4."""
    slots = cfg.num_layers * batch * cfg.kv_heads * capacity
    return 2 * slots * cfg.head_dim * itemsize + slots * 4


def _compression(method: str, args, prompt_len: int, max_new: int):
    return compression_config(
        method,
        None if method == "full" else args.budget,
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        buffer=args.buffer,
        window=args.window,
    )


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _engine(model, method, args, ids, n_new) -> rkvjax.Engine:
    """A runtime with one slot per prompt, every prompt submitted (greedy, n_new tokens)."""
    cc = _compression(method, args, max(map(len, ids)), n_new)
    max_len = requests.bucket(max(map(len, ids)), model.config.max_positions) + n_new - 1
    eng = rkvjax.Engine(model, slots=len(ids), cache=cc, max_len=max_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    eng.submit_many(ids, [greedy] * len(ids))
    return eng


def _decode_all(eng: rkvjax.Engine, state) -> tuple[engine.SlotState, engine.Tokens]:
    """The decode loop of the runtime, chunk after chunk until every row is done (no stop
    strings, no admissions); returns the state and the last chunk's output."""
    while True:
        state, out = engine.decode(eng.model.decoder, state, steps=eng.chunk, plan=eng.plan)
        if not bool(jax.device_get(out.active).any()):
            return state, out


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compression_ms(eng: rkvjax.Engine, state, repeats: int = 5) -> float | None:
    """One row's compression (all layers), as a decode step runs it in one of its lanes under
    `lax.cond` when the row is full. Its cost does not depend on how full the cache is (scoring
    covers every slot under a mask)."""
    cc = eng.compression
    if not cc.compressing:
        return None
    fn = jax.jit(lambda c, f: policy.compress_lanes(c, f, cc, lanes=1, start=jnp.int32(0)))
    full = jnp.ones(state.cache.length.shape, bool)
    jax.block_until_ready(fn(state.cache, full))  # compile

    def run():
        jax.block_until_ready(fn(state.cache, full))

    return _median_s(run, repeats) * 1e3


def speed_rows(model, name: str, args, meta: dict) -> list[dict]:
    """Part (a): for each context, prefill a prompt of context - new_tokens tokens once per
    method, then time decoding new_tokens from copies of that state.

    `generate` would redo the prefill on every call, which at 8K tokens costs more than the
    decode being measured; this drives the same compiled prefill and decode (same plan, same
    64-step chunks) and times the decode alone. The methods take turns repeat by repeat, so
    load from other processes on a shared machine hits them alike.
    """
    b, n_new = args.batch, args.new_tokens
    cfg, itemsize = model.config, jnp.dtype(model.dtype).itemsize
    rows = []
    text = text_ids(model, args.data, max(args.contexts) + 97 * b)
    for ctx in args.contexts:
        p_len = ctx - n_new
        # Different text per row, so rows do not compress identically.
        ids = [text[97 * r : 97 * r + p_len] for r in range(b)]
        runs = {}
        for method in args.methods:
            eng = _engine(model, method, args, ids, n_new)
            c0, t0 = engine.compile_seconds(), time.perf_counter()
            try:
                state = eng.prefilled()
                prefill_comps = int(jax.device_get(state.compressions).max())
            except Exception as e:  # an out-of-memory prefill is a result, not a crash
                print(f"context {ctx} {method}: prefill failed: {e!r}"[:500], file=sys.stderr)
                err = {"context": ctx, "method": method, "error": repr(e)[:500]}
                rows.append({"bench": "memory_speed", "part": "speed", **err, **meta})
                continue
            c1, t1 = engine.compile_seconds(), time.perf_counter()
            _decode_all(eng, _copy(state))  # warm-up: compiles the decode chunk
            c2, t2 = engine.compile_seconds(), time.perf_counter()
            runs[method] = {
                "engine": eng,
                "state": state,
                "prefill_s": (t1 - t0) - (c1 - c0),
                "compile_s": (c1 - c0) + (c2 - c1),
                "warmup_decode_s": (t2 - t1) - (c2 - c1),
                "times": [],
                "comp_ms": _compression_ms(eng, state),
                "prefill_comps": prefill_comps,
            }
        for i in range(args.repeats):
            order = list(runs)
            for m in order[i % len(order) :] + order[: i % len(order)]:  # rotate who goes first
                r = runs[m]
                s = _copy(r["state"])
                t0 = time.perf_counter()
                s, out = _decode_all(r["engine"], s)
                r["times"].append(time.perf_counter() - t0)
                r["compressions"] = int(jax.device_get(out.compressions).max())
                r["peak"] = int(jax.device_get(out.peak).max())
                del s
        for method, r in runs.items():
            eng, dec = r["engine"], statistics.median(r["times"])
            # Methods run in the same rounds, so per-round time ratios cancel slow drifts in the
            # load of a shared machine better than ratios of medians.
            paired = {
                f"speedup_vs_{ref}": statistics.median(
                    a / b for a, b in zip(runs[ref]["times"], r["times"], strict=True)
                )
                for ref in ("full", "streaming")
                if ref in runs
            }
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
                "budget": eng.compression.budget if eng.compression.compressing else None,
                "buffer": args.buffer,
                "cache_capacity": eng.capacity,
                "peak_cache_slots": r["peak"],
                "cache_kv_bytes": kv_bytes(cfg, b, eng.capacity, itemsize),
                "cache_state_bytes": tree_bytes(r["state"].cache),  # + q window, counters
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
                "host_max_rss_bytes": _rss(),
                **meta,
            }
            emit(row, args.out)
            rows.append(row)
        runs.clear()
    return rows


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compiled_memory(model, cc, capacity: int, batch: int, prompt: int, parts=("decode",)):
    """Compile-only memory of a runtime of `batch` slots: its decode chunk (and optionally the
    prefill of its prompts, or one compression step). Nothing runs: the state is abstract."""
    eng = rkvjax.Engine(model, slots=batch, cache=cc, max_len=capacity)
    out = eng.memory_analysis(prompt_len=prompt, parts=parts)
    out["peak_bytes"] = max(out[n]["peak_bytes"] for n in parts if n != "compress")
    # Every program compiled for another batch stays cached, and each holds hundreds of memory
    # mappings for its code: the search would reach the kernel's limit (65530) and fail.
    jax.clear_caches()
    return out


def _largest_fitting(peak_of, cap: int, guess: int, limit: int, *, search: bool):
    """The largest batch in [0, limit] whose compiled peak fits `cap`, by bisection around the
    affine `guess` (peaks grow with the batch, but not exactly affinely: the prefill's
    temporaries take over at large batches). Without `search`, steps down from the guess only.

    Returns:
      (batch, {batch: compiled_memory(...)} of every batch compiled).
    """
    peaks = {}

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_of(b)
        return peaks[b]["peak_bytes"] <= cap

    b = min(max(guess, 1), max(limit, 1))
    if not search:
        while b > 0 and not fits(b):
            b -= 1
        return b, peaks
    lo, hi = (b, limit + 1) if fits(b) else (0, b)  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo + 1 <= limit:
        fits(lo + 1)  # recorded, to show the next batch up does not fit
    return lo, peaks


def capacity_rows(model, name: str, args, meta: dict) -> list[dict]:
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
    cfg, itemsize = model.config, jnp.dtype(model.dtype).itemsize
    w_bytes = weight_bytes(model)
    prompt = requests.bucket(args.gen_prompt, args.gen_prompt)
    b1, b2 = sorted(args.fit_batches)
    rows = []
    for method in args.methods:
        cc = _compression(method, args, prompt, args.gen_tokens)
        # An Engine directly, not generate(): a 16K generation exceeds SmolLM2's 8192 positions,
        # which submitting a request checks, but shapes and memory do not depend on that limit.
        capacity = cc.capacity if cc.compressing else prompt + args.gen_tokens - 1
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
            search=True,
        )
        checked, above = peaks.get(best), peaks.get(best + 1)
        row = {
            "bench": "memory_speed",
            "part": "capacity",
            "method": method,
            "budget": cc.budget if cc.compressing else None,
            "buffer": args.buffer,
            "gen_tokens": args.gen_tokens,
            "prompt_tokens": prompt,
            "mem_cap_bytes": cap,
            "cache_capacity": capacity,
            "weight_bytes": w_bytes,
            "kv_bytes_per_row": kv_bytes(cfg, 1, capacity, itemsize),
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
        emit(row, args.out)
        rows.append(row)
    return rows


def emit(row: dict, out: Path) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write(line + "\n")


def speed_table(rows: list[dict]) -> str:
    head = (
        f"{'context':>7} {'method':>9} {'capacity':>8} {'KV MiB':>7} {'tok/s':>6} {'best':>6} "
        f"{'x full':>6} {'x strm':>6} {'comps':>5} {'comp ms':>7} {'ovh %':>5} {'prefill s':>9}"
    )
    lines = [head, "-" * len(head)]

    def f(x, fmt, width):
        return f"{'-':>{width}}" if x is None else format(x, fmt)

    for r in rows:
        if "error" in r:
            lines.append(f"{r['context']:>7} {r['method']:>9}  failed: {r['error'][:60]}")
            continue
        lines.append(
            f"{r['context']:>7} {r['method']:>9} {r['cache_capacity']:>8} "
            f"{r['cache_kv_bytes'] / 2**20:>7.1f} {r['tokens_per_s']:>6.2f} "
            f"{r['tokens_per_s_best']:>6.2f} {f(r.get('speedup_vs_full'), '6.2f', 6)} "
            f"{f(r.get('speedup_vs_streaming'), '6.2f', 6)} {r['decode_compressions']:>5} "
            f"{f(r['compression_ms'], '7.1f', 7)} {r['compression_overhead'] * 100:>5.1f} "
            f"{r['prefill_s']:>9.1f}"
        )
    return "\n".join(lines)


def capacity_table(rows: list[dict]) -> str:
    head = (
        f"{'method':>9} {'budget':>6} {'capacity':>8} {'KV MiB/row':>10} {'peak MiB/row':>12} "
        f"{'temp MiB/row':>12} {'cmp MiB/row':>11} {'fixed MiB':>9} {'max batch':>9} "
        f"{'x full':>6} {'state-only':>10}"
    )
    lines = [head, "-" * len(head)]
    full = next((r["max_batch"] for r in rows if r["method"] == "full"), None)
    for r in rows:
        rel = f"{r['max_batch'] / full:6.1f}" if full else f"{'-':>6}"
        (b1, b2), (t1, t2) = r["fit_batches"], r["decode_temp_bytes_fit"]
        temp = (t2 - t1) / (b2 - b1)
        c = r["compress_temp_bytes_fit"]
        cmp = f"{c / b2 / 2**20:11.2f}" if c is not None else f"{'-':>11}"
        lines.append(
            f"{r['method']:>9} {r['budget'] or '-':>6} {r['cache_capacity']:>8} "
            f"{r['kv_bytes_per_row'] / 2**20:>10.2f} {r['peak_bytes_per_row'] / 2**20:>12.2f} "
            f"{temp / 2**20:>12.2f} {cmp:>11} {r['peak_bytes_fixed'] / 2**20:>9.0f} "
            f"{r['max_batch']:>9} {rel} {r['max_batch_state_only']:>10}"
        )
    return "\n".join(lines)


def plot(speed: list[dict], cap: list[dict], path: Path, title: str) -> None:
    from plot import lines, pyplot, save

    plt = pyplot()
    if plt is None:
        return
    speed = [r for r in speed if "error" not in r]
    panels = (1 if speed else 0) * 2 + (1 if cap else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    if speed:
        methods = sorted({r["method"] for r in speed})

        def series(field, scale=1.0):
            return {
                m: (
                    [r["context"] for r in speed if r["method"] == m],
                    [r[field] * scale for r in speed if r["method"] == m],
                )
                for m in methods
            }

        ax = axes.pop(0)
        lines(
            ax,
            series("cache_kv_bytes", 2**-20),
            xlabel="context (tokens)",
            ylabel="KV cache MiB",
            title=title,
        )
        ax.set_yscale("log")
        ax = axes.pop(0)
        sub = f"batch {speed[0]['batch']}, {speed[0]['new_tokens']} new tokens"
        lines(
            ax,
            series("tokens_per_s"),
            xlabel="context (tokens)",
            ylabel="decode tokens/s",
            title=sub,
        )
    if cap:
        ax = axes.pop(0)
        bars = ax.bar([r["method"] for r in cap], [r["max_batch"] for r in cap])
        ax.bar_label(bars)
        ax.set_ylabel(f"max batch in {cap[0]['mem_cap_bytes'] / 2**30:g} GiB")
        ax.set_title(f"{cap[0]['gen_tokens']}-token generation (compile-only analysis)")
        ax.set_yscale("log")
    save(fig, path)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    xla_flags.prefer_memory_on_cpu()  # before anything compiles: see rkvjax/xla_flags.py
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
        model = rkvjax.load(path, dtype=args.dtype)
    meta = {
        "model": name,
        "dtype": jnp.dtype(model.dtype).name,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "argv": sys.argv[1:],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    speed = [] if args.skip_speed else speed_rows(model, name, args, meta)
    cap = [] if args.skip_capacity else capacity_rows(model, name, args, meta)
    print(
        f"\n{name} {meta['dtype']}: load average {load0[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end (1-minute); host peak RSS {_rss() / 2**30:.1f} GiB",
        file=sys.stderr,
    )
    if speed:
        print(
            f"(a) batch {args.batch}, budget {args.budget}, buffer {args.buffer}: decode "
            f"{args.new_tokens} tokens ending at each context; tok/s: median of {args.repeats}, "
            "best: fastest; x full, x strm: median per-round speed ratio",
            file=sys.stderr,
        )
        print(speed_table(speed), file=sys.stderr)
    if cap:
        print(
            f"(b) {args.gen_tokens}-token generation, {args.mem_cap_gb:g} GiB cap, weights "
            f"{cap[0]['weight_bytes'] / 2**20:.0f} MiB",
            file=sys.stderr,
        )
        print(capacity_table(cap), file=sys.stderr)
    plot(speed, cap, args.plot, f"{name}, budget {args.budget}")


if __name__ == "__main__":
    main()
