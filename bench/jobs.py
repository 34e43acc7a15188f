"""An offline job on the slot runtime against the batch-by-batch job it replaced.

One JSONL file of MATH-500 prompts with per-line `max_tokens` drawn from 32..1024 (64 requests),
run twice through `rkvjax.entrypoints.jobs.run_job` with the same output handling:

  continuous     `EngineRunner`, what `rkvjax batch --slots 16` runs: one engine over the whole
                 file, a freed slot takes the next request at once, largest max_tokens first.
  continuous in input order
                 the same in file order (`--order input`): what the runtime alone gives.
  batch-by-batch what `rkvjax batch --batch-size 16` ran before, static batching: 16 requests
                 at a time, prefilled as one group padded to the batch's longest prompt,
                 each batch until its longest request ends, then the next
                 (`--batch-prefill by-length`: the same batches, prefilled per length bucket
                 as the runtime admits them).

Both write the same (greedy) tokens; the bench checks that. The two take turns run by run, so
load from other processes hits them alike; the speedup is the median of the per-round ratios
of wall time less compilation (a shape the warm-up missed compiles once per process, which is
not throughput; both are reported).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench import common
from rkvjax import api, defaults
from rkvjax.entrypoints import jobs
from rkvjax.runtime import programs, requests

MODES = ("continuous", "continuous_input_order", "batch_by_batch")
TINY = dict(requests=8, slots=2, max_tokens=[8, 40], budget=32, buffer=16)
PREFER_MEMORY = True


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1, help="timed rounds (the modes alternate)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, nargs=2, default=[32, 1024])
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=defaults.BUFFER)
    p.add_argument("--data", type=Path, default=common.DATA, help="MATH-500 JSONL: the prompts")
    p.add_argument(
        "--batch-prefill",
        choices=["padded", "by-length"],
        default="padded",
        help="the batch-by-batch job's prefill: one group padded to the batch's longest prompt "
        "(static batching, default) or one per prompt-length bucket (the runtime's admission)",
    )


class BatchByBatch(jobs.Runner):
    """The job before the slot runtime, as a static-batch engine runs it: `size` requests at a
    time, decoded until the batch's longest request ends, then the next batch. With
    `padded_prefill` each batch is prefilled as one group padded to its longest prompt (what
    static batching does); without it, one prefill per prompt-length bucket (the runtime's
    admission)."""

    def __init__(self, model, name: str, cache: dict, size: int, padded_prefill: bool = True):
        self.model, self.cache, self.size = model, cache, size
        self.padded_prefill = padded_prefill
        self.model_name = name

    def run(self, reqs):
        for i in range(0, len(reqs), self.size):
            batch = reqs[i : i + self.size]
            ids = [requests.encode(self.model.tokenizer, r.prompt, None, str(r.id)) for r in batch]
            params = [r.sampling for r in batch]
            eng = api.engine_for(
                self.model,
                ids,
                params,
                slots=self.size,
                prefill_by_length=not self.padded_prefill,
                narrow_tail=False,  # a static batch decodes at its width to its end
                **self.cache,
            )
            eng.submit_many(ids, params, ids=[r.id for r in batch])
            by_id = {r.id: r for r in batch}
            for res in eng.results():
                yield by_id[res.request_id], jobs.sample_record(res)


def prompt_fields(model, texts: list[str]) -> list[dict]:
    """Each request's prompt field: the text (the job applies the chat template), or random
    token ids for a model without a tokenizer."""
    if model.tokenizer is None:
        return [{"prompt_token_ids": ids} for ids in common.random_prompts(model, len(texts))]
    return [{"prompt": t} for t in texts]


def write_requests(path: Path, prompts: list[dict], **fields) -> Path:
    """One JSONL line per prompt, with its id and `fields` (a value, or one per prompt)."""
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            extra = {k: v[i] if isinstance(v, list) else v for k, v in fields.items()}
            f.write(json.dumps({"id": i, **p, **extra}) + "\n")
    return path


def run_once(runner, src: Path, folder: Path, name: str) -> tuple[float, float, list, dict]:
    """-> (wall seconds, of which compiling, (id, tokens) of every result, summary)."""
    dst = folder / f"{name}.jsonl"
    dst.unlink(missing_ok=True)
    jobs.summary_path(dst).unlink(missing_ok=True)
    c0 = programs.compile_seconds()
    wall, summary = common.timed(
        lambda: jobs.run_job(runner, src, dst, token_ids=True, progress=False)
    )
    compile_s = programs.compile_seconds() - c0
    tokens = sorted((r["id"], r["token_ids"]) for r in jobs.read_output(dst).lines)
    return wall, compile_s, tokens, summary


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    lo, hi = args.max_tokens
    lengths = np.random.default_rng(0).integers(lo, hi + 1, args.requests).tolist()
    prompts = prompt_fields(model, common.math_prompts(args.data, args.requests))
    cache = {"method": "rkv", "budget": args.budget, "buffer": args.buffer}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = write_requests(work / "requests.jsonl", prompts, max_tokens=lengths, ignore_eos=True)
        modes = {
            "continuous": lambda: jobs.EngineRunner(model, cache=cache, slots=args.slots),
            "continuous_input_order": lambda: jobs.EngineRunner(
                model, cache=cache, slots=args.slots, order="input"
            ),
            "batch_by_batch": lambda: BatchByBatch(
                model, name, cache, args.slots, padded_prefill=args.batch_prefill == "padded"
            ),
        }
        # Warm-up: every prompt with max_tokens 2 compiles the prefill and insert shapes the
        # timed runs meet (the decode chunk does not depend on lengths).
        warm = write_requests(work / "warm.jsonl", prompts, max_tokens=2)
        for mode, make in modes.items():
            run_once(make(), warm, work, f"warm_{mode}")
        times = {mode: [] for mode in modes}
        compiles = {mode: [] for mode in modes}
        tokens, summaries = {}, {}
        for order in common.rotations(modes, args.repeats):
            for mode in order:
                wall, comp, tokens[mode], summaries[mode] = run_once(modes[mode](), src, work, mode)
                # Compiling a shape the warm-up missed is a one-off, not throughput.
                times[mode].append(wall - comp)
                compiles[mode].append(comp)
    total = sum(lengths)
    ratio = common.paired_speedup(times["batch_by_batch"], times["continuous"])
    ratio_input = common.paired_speedup(times["batch_by_batch"], times["continuous_input_order"])
    s = args.slots
    steps = sum(max(lengths[j : j + s]) - 1 for j in range(0, args.requests, s))
    rt = summaries["continuous"]["runtime"]
    rt_input = summaries["continuous_input_order"]["runtime"]
    row = {
        "bench": "job_speed",
        "requests": args.requests,
        "slots": s,
        "max_tokens_range": [lo, hi],
        "budget": args.budget,
        "buffer": args.buffer,
        "generated_tokens": total,
        "batch_by_batch_prefill": args.batch_prefill,
        "same_tokens": all(tokens[m] == tokens["batch_by_batch"] for m in MODES),
        **{f"{m}_s": times[m] for m in MODES},  # wall time less compilation
        **{f"{m}_compile_s": compiles[m] for m in MODES},
        **{f"{m}_tokens_per_s": total / statistics.median(times[m]) for m in MODES},
        "speedup": ratio,
        "speedup_input_order": ratio_input,
        "continuous_occupancy": rt["slot_occupancy"],
        "continuous_input_order_occupancy": rt_input["slot_occupancy"],
        # Useful row-steps over slots x steps, each batch as long as its longest request.
        "batch_by_batch_occupancy": (total - args.requests) / (s * steps),
        "continuous_decode_steps": rt["decode_steps"],
        "continuous_input_order_decode_steps": rt_input["decode_steps"],
        "batch_by_batch_decode_steps": steps,
        "compressions": rt["compressions"],
        "stalled_row_steps": rt["stalled_row_steps"],
        "lanes": rt["lanes"],
        "loadavg": os.getloadavg(),
        **common.run_meta(model=name, dtype=args.dtype),
    }
    common.emit(row, folder)
    return [row]


def table(rows: list[dict]) -> str:
    r = rows[0]
    head = (
        f"{r['model']} {r['dtype']}: {r['requests']} requests, max_tokens "
        f"{r['max_tokens_range'][0]}..{r['max_tokens_range'][1]}, {r['slots']} slots, R-KV "
        f"budget {r['budget']} + buffer {r['buffer']}, greedy with ignore_eos."
    )
    metrics = [
        ("tokens/s (wall less compilation)", "tokens_per_s", ".1f"),
        ("decode steps", "decode_steps", ",d"),
        ("slot occupancy", "occupancy", ".2f"),
    ]
    lines = [
        {"metric": label, **{m: format(r[f"{m}_{key}"], fmt) for m in MODES}}
        for label, key, fmt in metrics
    ]
    lines.append(
        {"metric": "compilation in the timed runs"}
        | {m: f"{sum(r[f'{m}_compile_s']):.1f} s" for m in MODES}
    )
    columns = [("", "metric", "s")] + [(m.replace("_", " "), m, "s") for m in MODES]
    tail = (
        f"Speedup over batch by batch (median per-round ratio): {r['speedup']:.2f}x, "
        f"{r['speedup_input_order']:.2f}x in input order; same tokens: {r['same_tokens']}."
    )
    return f"{head}\n\n{common.markdown_table(lines, columns)}\n\n{tail}"


def plot(plt, rows: list[dict]):
    """Tokens/s and slot occupancy of the two modes."""
    r = rows[0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    labels = [m.replace("_", " ") for m in MODES]
    common.bars(
        ax1,
        labels,
        [r[f"{m}_tokens_per_s"] for m in MODES],
        ylabel="tokens/s (wall less compilation)",
        title=f"{r['requests']} requests, {r['slots']} slots: {r['speedup']:.2f}x",
    )
    common.bars(
        ax2, labels, [r[f"{m}_occupancy"] for m in MODES], ylabel="slot occupancy", title=""
    )
    return fig
