"""The slot runtime's three claims, measured side by side on the default model.

  ragged      compression lanes: R-KV against StreamingLLM decode tokens/s when every row sits
              at its own fill level (16 prompt lengths over 16..121) and when all are equal.
              Before lanes, R-KV ran every row's selection whenever one row was full: 0.79x
              StreamingLLM ragged, 0.997x equal.
  continuous  continuous against static batching: 64 requests with max_tokens drawn from
              32..1024 through 16 slots, as one job (a freed slot takes the next request) and
              as four batches of 16 run one after the other (each until its longest request
              ends). Same tokens; throughput ratio and slot occupancy.
  sampling    temperature 0.6 + top-p 0.95 against greedy decode tokens/s at batch 8 (before
              per-row sampling, nucleus sampling sorted the vocabulary every step: 0.35x).

Decode-only timings prefill once and time `engine.decode` from copies of the prefilled state;
methods and settings take turns run by run, so load from other processes on a shared machine
hits them alike; medians are reported, and per-round ratios. Prints JSON lines (appended to
--out) and a summary table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rkvjax
from rkvjax import engine, requests, xla_flags
from rkvjax.config import compression_config
from rkvjax.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "runtime_speed.jsonl"
DATA = Path(os.environ.get("RKVJAX_DATA", "/work/shared/data")) / "math500.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("parts", nargs="*", default=["ragged", "continuous", "sampling"])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (alternating)")
    p.add_argument("--ragged-batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--requests", type=int, default=64, help="continuous: requests")
    p.add_argument("--slots", type=int, default=16, help="continuous: slots")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[32, 1024], help="continuous")
    p.add_argument("--data", type=Path, default=DATA, help="MATH-500 JSONL for the prompts")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def _meta(args) -> dict:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "argv": sys.argv[1:],
        "dtype": args.dtype,
    }


def emit(row: dict, out: Path) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(line + "\n")


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _prefilled(model, ids, params, cc) -> tuple[rkvjax.Engine, engine.SlotState]:
    """An engine with one slot per prompt, every prompt admitted: the state before decoding.
    FullKV holds the prompt bucket plus every new token, as `generate` sizes it."""
    longest = max(map(len, ids))
    max_len = requests.bucket(longest, longest) + max(p.max_tokens for p in params) - 1
    eng = rkvjax.Engine(model, slots=len(ids), cache=cc, max_len=max_len)
    eng.submit_many(ids, params)
    return eng, eng.prefilled()


def _decode_s(eng: rkvjax.Engine, state) -> tuple[float, int]:
    """Wall time of the decode loop from `state` until every row is done; tokens made."""
    t0 = time.perf_counter()
    made = 0
    while True:
        state, out = engine.decode(eng.model.decoder, state, steps=eng.chunk, plan=eng.plan)
        counts, active = jax.device_get((out.count, out.active))
        made += int(counts.sum())
        if not active.any():
            return time.perf_counter() - t0, made


def _timed(settings: dict, repeats: int) -> dict:
    """name -> (engine, state): decode times of each, in alternating order after a warm-up."""
    times = {name: [] for name in settings}
    made = {}
    for eng, state in settings.values():  # warm-up compiles the decode chunk
        _decode_s(eng, _copy(state))
    names = list(settings)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            eng, state = settings[name]
            dt, n = _decode_s(eng, _copy(state))
            times[name].append(dt)
            made[name] = n
    return {"times": times, "made": made}


def _ids(model, seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, length).tolist()


def ragged(model, args, meta) -> list[dict]:
    """R-KV / StreamingLLM decode speed, equal prompt lengths against one fill level per row."""
    rows = []
    for b in args.ragged_batches:
        lengths = {
            "equal": [64] * b,
            "ragged": np.linspace(16, 121, b).round().astype(int).tolist(),
        }
        for shape, lens in lengths.items():
            ids = [_ids(model, seed=r, length=n) for r, n in enumerate(lens)]
            params = [SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)] * b
            settings = {
                m: _prefilled(model, ids, params, compression_config(m, 128, buffer=128))
                for m in ("rkv", "streaming")
            }
            t = _timed(settings, args.repeats)
            tps = {m: t["made"][m] / statistics.median(ts) for m, ts in t["times"].items()}
            ratio = statistics.median(
                s / r for r, s in zip(t["times"]["rkv"], t["times"]["streaming"], strict=True)
            )
            row = {
                "bench": "runtime_speed",
                "part": "ragged",
                "batch": b,
                "prompts": shape,
                "budget": 128,
                "buffer": 128,
                "new_tokens": 320,
                "rkv_tokens_per_s": tps["rkv"],
                "streaming_tokens_per_s": tps["streaming"],
                "rkv_vs_streaming": ratio,
                "lanes": settings["rkv"][0].plan.lanes,
                "times": t["times"],
                "loadavg": os.getloadavg(),
                **meta,
            }
            emit(row, args.out)
            rows.append(row)
    return rows


def _math_prompts(path: Path, n: int) -> list[str]:
    with path.open() as f:
        problems = [json.loads(line)["problem"] for line in f]
    return (problems * (n // len(problems) + 1))[:n]


def continuous(model, args, meta) -> list[dict]:
    """One continuous job against batch-by-batch static batching, same requests."""
    lo, hi = args.max_tokens
    rs = np.random.default_rng(0)
    lengths = rs.integers(lo, hi + 1, args.requests).tolist()
    prompts = _math_prompts(args.data, args.requests)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    cc = compression_config("rkv", 128, buffer=128)
    s = args.slots

    def job(prompts, params):
        eng = rkvjax.Engine(model, slots=s, cache=cc)
        eng.submit_many(prompts, params)
        return sorted(eng.run(), key=lambda r: r.request_id), eng.stats

    job(prompts[:s], params[:s])  # compile
    runs = {"continuous": [], "static": []}
    outputs, stats = {}, None
    for i in range(args.repeats):
        order = ["continuous", "static"] if i % 2 == 0 else ["static", "continuous"]
        for name in order:
            t0 = time.perf_counter()
            if name == "continuous":
                out, stats = job(prompts, params)
            else:  # batch after batch, each until its longest request ends
                out = []
                for j in range(0, args.requests, s):
                    out += job(prompts[j : j + s], params[j : j + s])[0]
            runs[name].append(time.perf_counter() - t0)
            outputs[name] = [r.token_ids for r in out]
    same = outputs["continuous"] == outputs["static"]
    tokens = sum(lengths)
    # Static occupancy: useful row-steps over slots x steps, each batch as long as its longest.
    steps = sum(max(lengths[j : j + s]) - 1 for j in range(0, args.requests, s))
    ratio = statistics.median(
        a / b for a, b in zip(runs["static"], runs["continuous"], strict=True)
    )
    row = {
        "bench": "runtime_speed",
        "part": "continuous",
        "requests": args.requests,
        "slots": s,
        "max_tokens_range": [lo, hi],
        "generated_tokens": tokens,
        "same_tokens": same,
        "continuous_s": runs["continuous"],
        "static_s": runs["static"],
        "continuous_tokens_per_s": tokens / statistics.median(runs["continuous"]),
        "static_tokens_per_s": tokens / statistics.median(runs["static"]),
        "speedup": ratio,
        "continuous_occupancy": stats.slot_occupancy,
        "static_occupancy": (tokens - args.requests) / (s * steps),
        "continuous_decode_steps": stats.decode_steps,
        "static_decode_steps": steps,
        "prefills": stats.prefills,
        "loadavg": os.getloadavg(),
        **meta,
    }
    emit(row, args.out)
    return [row]


def sampling(model, args, meta) -> list[dict]:
    """Nucleus sampling against greedy decode speed at batch 8."""
    prompts = _math_prompts(args.data, 8)
    ids = [model.tokenizer.chat_ids([{"role": "user", "content": p}]) for p in prompts]
    greedy = [SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)] * 8
    nucleus = [
        SamplingParams(temperature=0.6, top_p=0.95, seed=i, max_tokens=256, ignore_eos=True)
        for i in range(8)
    ]
    cc = compression_config("full")
    settings = {
        "greedy": _prefilled(model, ids, greedy, cc),
        "top_p": _prefilled(model, ids, nucleus, cc),
    }
    t = _timed(settings, args.repeats)
    tps = {m: t["made"][m] / statistics.median(ts) for m, ts in t["times"].items()}
    ratio = statistics.median(
        g / p for g, p in zip(t["times"]["greedy"], t["times"]["top_p"], strict=True)
    )
    row = {
        "bench": "runtime_speed",
        "part": "sampling",
        "batch": 8,
        "new_tokens": 256,
        "greedy_tokens_per_s": tps["greedy"],
        "top_p_tokens_per_s": tps["top_p"],
        "top_p_vs_greedy": ratio,
        "times": t["times"],
        "loadavg": os.getloadavg(),
        **meta,
    }
    emit(row, args.out)
    return [row]


def main(argv=None) -> None:
    args = parse_args(argv)
    xla_flags.prefer_memory_on_cpu()
    model = rkvjax.load(args.model, dtype=args.dtype)
    meta = {"model": model.path.name, **_meta(args)}
    parts = {"ragged": ragged, "continuous": continuous, "sampling": sampling}
    rows = []
    for name in args.parts:
        if name not in parts:
            raise SystemExit(f"unknown part {name!r}; choose from {sorted(parts)}")
        rows += parts[name](model, args, meta)
    for r in rows:
        if r["part"] == "ragged":
            print(
                f"ragged  batch {r['batch']:>3} {r['prompts']:>6}: R-KV {r['rkv_tokens_per_s']:.1f}"
                f" tok/s, StreamingLLM {r['streaming_tokens_per_s']:.1f}: "
                f"{r['rkv_vs_streaming']:.3f}x (lanes {r['lanes']})",
                file=sys.stderr,
            )
        elif r["part"] == "continuous":
            print(
                f"continuous {r['continuous_tokens_per_s']:.1f} tok/s vs static "
                f"{r['static_tokens_per_s']:.1f}: {r['speedup']:.2f}x; occupancy "
                f"{r['continuous_occupancy']:.2f} vs {r['static_occupancy']:.2f}; same tokens: "
                f"{r['same_tokens']}",
                file=sys.stderr,
            )
        else:
            print(
                f"sampling batch 8: greedy {r['greedy_tokens_per_s']:.1f} tok/s, top-p 0.95 "
                f"{r['top_p_tokens_per_s']:.1f}: {r['top_p_vs_greedy']:.3f}x",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
