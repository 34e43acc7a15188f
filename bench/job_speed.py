"""An offline job on the slot runtime against the batch-by-batch job it replaced.

One JSONL file of MATH-500 prompts with per-line `max_tokens` drawn from 32..1024 (64 requests),
run twice through `rkvjax.jobs.run_job` with the same output handling:

  continuous     `EngineRunner`, what `rkvjax batch --slots 16` runs: one engine over the whole
                 file, a freed slot takes the next request at once.
  batch-by-batch what `rkvjax batch --batch-size 16` ran before: `generate` on 16 requests at a
                 time, each batch until its longest request ends, then the next.

Both write the same (greedy) tokens; the bench checks that. The two take turns run by run, so
load from other processes hits them alike; the speedup is the median of the per-round ratios
of wall time less compilation (a shape the warm-up missed compiles once per process, which is
not throughput; both are reported).
Prints a JSON line (appended to --out) and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from runtime_speed import DATA, _math_prompts, _meta, emit  # bench/ is the script's folder

import rkvjax
from rkvjax import engine, jobs, xla_flags

RESULTS = Path(__file__).resolve().parent / "results" / "job_speed.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1, help="timed rounds (the modes alternate)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, nargs=2, default=[32, 1024])
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--data", type=Path, default=DATA, help="MATH-500 JSONL for the prompts")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


class BatchByBatch(jobs.Runner):
    """The job before the slot runtime: `generate` on `size` requests at a time."""

    def __init__(self, model, cache: dict, size: int):
        self.model, self.cache, self.size = model, cache, size
        self.model_name = model.path.name

    def run(self, reqs):
        for i in range(0, len(reqs), self.size):
            batch = reqs[i : i + self.size]
            outs = rkvjax.generate(
                self.model,
                [r.prompt for r in batch],
                sampling=[r.sampling for r in batch],
                slots=self.size,
                **self.cache,
            )
            for r, res in zip(batch, outs, strict=True):
                yield r, jobs.sample_record(res)


def _job(runner, src: Path, folder: Path, name: str) -> tuple[float, float, list, dict]:
    """-> (wall seconds, of which compiling, (id, tokens) of every result, summary)."""
    dst = folder / f"{name}.jsonl"
    dst.unlink(missing_ok=True)
    jobs.summary_path(dst).unlink(missing_ok=True)
    t0, c0 = time.perf_counter(), engine.compile_seconds()
    summary = jobs.run_job(runner, src, dst, token_ids=True, progress=False)
    wall, compile_s = time.perf_counter() - t0, engine.compile_seconds() - c0
    with dst.open() as f:
        lines = [json.loads(line) for line in list(f)[1:]]
    tokens = sorted((r["id"], r["token_ids"]) for r in lines)
    return wall, compile_s, tokens, summary


def main(argv=None) -> None:
    args = parse_args(argv)
    xla_flags.prefer_memory_on_cpu()
    model = rkvjax.load(args.model, dtype=args.dtype)
    lo, hi = args.max_tokens
    lengths = np.random.default_rng(0).integers(lo, hi + 1, args.requests).tolist()
    prompts = _math_prompts(args.data, args.requests)
    cache = {"method": "rkv", "budget": args.budget, "buffer": args.buffer}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src = folder / "requests.jsonl"
        with src.open("w") as f:
            for i, (p, m) in enumerate(zip(prompts, lengths, strict=True)):
                row = {"id": i, "prompt": p, "max_tokens": m, "ignore_eos": True}
                f.write(json.dumps(row) + "\n")
        modes = {
            "continuous": lambda: jobs.EngineRunner(model, cache=cache, slots=args.slots),
            "batch_by_batch": lambda: BatchByBatch(model, cache, args.slots),
        }
        # Warm-up: every prompt with max_tokens 2 compiles the prefill and insert shapes the
        # timed runs meet (the decode chunk does not depend on lengths).
        warm = folder / "warm.jsonl"
        with warm.open("w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"id": i, "prompt": p, "max_tokens": 2}) + "\n")
        for name, make in modes.items():
            _job(make(), warm, folder, f"warm_{name}")
        times = {name: [] for name in modes}
        compiles = {name: [] for name in modes}
        tokens, summaries = {}, {}
        names = list(modes)
        for i in range(args.repeats):
            for name in names[i % 2 :] + names[: i % 2]:
                wall, comp, tokens[name], summaries[name] = _job(modes[name](), src, folder, name)
                # Compiling a shape the warm-up missed is a one-off, not throughput.
                times[name].append(wall - comp)
                compiles[name].append(comp)
    total = sum(lengths)
    ratio = statistics.median(
        b / c for b, c in zip(times["batch_by_batch"], times["continuous"], strict=True)
    )
    s = args.slots
    steps = sum(max(lengths[j : j + s]) - 1 for j in range(0, args.requests, s))
    rt = summaries["continuous"]["runtime"]
    row = {
        "bench": "job_speed",
        "requests": args.requests,
        "slots": s,
        "max_tokens_range": [lo, hi],
        "budget": args.budget,
        "buffer": args.buffer,
        "generated_tokens": total,
        "same_tokens": tokens["continuous"] == tokens["batch_by_batch"],
        "continuous_s": times["continuous"],  # wall time less compilation
        "batch_by_batch_s": times["batch_by_batch"],
        "continuous_compile_s": compiles["continuous"],
        "batch_by_batch_compile_s": compiles["batch_by_batch"],
        "continuous_tokens_per_s": total / statistics.median(times["continuous"]),
        "batch_by_batch_tokens_per_s": total / statistics.median(times["batch_by_batch"]),
        "speedup": ratio,
        "continuous_occupancy": rt["slot_occupancy"],
        "batch_by_batch_occupancy": (total - args.requests) / (s * steps),
        "continuous_decode_steps": rt["decode_steps"],
        "batch_by_batch_decode_steps": steps,
        "compressions": rt["compressions"],
        "stalled_row_steps": rt["stalled_row_steps"],
        "lanes": rt["lanes"],
        "loadavg": os.getloadavg(),
        "model": model.path.name,
        **_meta(args),
    }
    emit(row, args.out)
    print(
        f"job: continuous {row['continuous_tokens_per_s']:.1f} tok/s vs batch-by-batch "
        f"{row['batch_by_batch_tokens_per_s']:.1f}: {ratio:.2f}x; occupancy "
        f"{row['continuous_occupancy']:.2f} vs {row['batch_by_batch_occupancy']:.2f}; same "
        f"tokens: {row['same_tokens']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
