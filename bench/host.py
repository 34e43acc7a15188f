"""The host's share of a run: main-thread CPU time per decoded token, at 64, 256 and 1024 slots.

Between decode chunks the host admits requests, parses each chunk's tokens, checks stop strings,
builds results and frees rows. On an accelerator the device decodes a 16-step chunk of a small
model at a large batch in tens of milliseconds, so the host must do its part for those tokens in
less than that, or the host sets the speed. This suite measures that part directly: the main
thread's CPU time (`time.thread_time`, which leaves out XLA's own threads, where a CPU device
computes) over a whole run, after a warm-up run that compiled every program, divided by the
tokens decoded. Each setting runs `requests` = 2 x slots (deep: 16 x) requests of `max_tokens`
tokens (sampled at temperature 0.7 / top-p 0.95 with ignore_eos, R-KV budget + buffer) through
one `rkvjax.Engine` per setting, which serves its warm-up and its timed runs as a server's
engine serves every request (its state's memory is made once), in variants:

  plain          nothing but the tokens
  stop           a stop string on every request (never found: the host checks every token)
  logprobs       the 5 most likely tokens' logprobs with every token
  arrivals       requests as a server admits them: one `submit` each, prompts of 8 to 40
                 tokens (the ones above submit all at once with `submit_many`, prompts of
                 `--prompt` tokens)
  arrivals-stop  arrivals, each with a stop string
  stream         arrivals-stop, streamed: the deltas (new tokens and text) taken after every
                 round, as the server's engine thread does
  deep           arrivals with 16 x slots requests queued instead of 2 x slots

`host_us_per_token` is the headline; `host_ms_per_chunk` puts it against the device's time for a
16-step chunk at that batch: `chunk_budget_ms` is an estimate for an H200 decoding
R1-Distill-Qwen-1.5B's shape (about 7 ms a step at 1,024 rows, proportionally less at fewer
rows, at least 2 ms a step), an order of magnitude, not a measurement.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import rkvjax
from bench import common
from rkvjax import runtime

VARIANTS = ("plain", "stop", "logprobs", "arrivals", "arrivals-stop", "stream", "deep")
ONE_BY_ONE = ("arrivals", "arrivals-stop", "stream", "deep")  # one `submit` per request
WITH_STOP = ("stop", "arrivals-stop", "stream")
ARRIVAL_PROMPTS = (8, 40)  # prompt tokens of the arrivals variant, drawn per request
TINY = dict(slots=[8, 16], max_tokens=8, repeats=1, default_model_slots=[])
PREFER_MEMORY = True
STOP = "\u2603 never \u2603"  # a stop string no sampled text holds: checked, never found
H200_STEP_MS_AT_1024 = 7.0  # estimated for R1-Distill-Qwen-1.5B's shape, bf16, not measured


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--slots", type=int, nargs="+", default=[64, 256, 1024], help="tiny model")
    p.add_argument(
        "--default-model-slots",
        type=int,
        nargs="*",
        default=[64],
        help="slots for --model (default: the default model; none: skip it)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--model's")
    p.add_argument("--max-tokens", type=common.int_at_least(2), default=32)
    p.add_argument("--prompt", type=common.int_at_least(8), default=16, help="prompt tokens")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--buffer", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per setting (median)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))


def _params(variant: str, max_tokens: int, seed: int) -> rkvjax.SamplingParams:
    extra = {"stop": [STOP]} if variant in WITH_STOP else {}
    if variant == "logprobs":
        extra["logprobs"] = 5
    return rkvjax.SamplingParams(
        temperature=0.7, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=seed, **extra
    )


def requests_of(slots: int, variant: str) -> int:
    return (16 if variant == "deep" else 2) * slots


def make_engine(model, slots: int, variant: str, args) -> rkvjax.Engine:
    """The setting's engine: one for its warm-up and timed runs, as a server keeps one engine
    for all its requests (the state's memory is made once, not per run)."""
    cc = rkvjax.compression_config("rkv", args.budget, buffer=args.buffer)
    return rkvjax.Engine(
        model, slots=slots, cache=cc, logprobs=5 if variant == "logprobs" else None
    )


def run_once(eng: rkvjax.Engine, slots: int, variant: str, args) -> dict:
    """One run of the variant's requests on an idle `eng`; the main thread's CPU time and the
    run's counters."""
    model = eng.model
    n = requests_of(slots, variant)
    lo, hi = ARRIVAL_PROMPTS
    one_by_one = variant in ONE_BY_ONE
    lengths = [lo + i * 7919 % (hi - lo + 1) if one_by_one else args.prompt
               for i in range(n)]  # fmt: skip
    prompts = [common.random_ids(model, k, seed=i) for i, k in enumerate(lengths)]
    params = [_params(variant, args.max_tokens, i) for i in range(n)]
    eng.reset_stats()
    gc.collect()  # each run starts from the same heap: the last run's garbage is not its cost
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    if one_by_one:
        for p, sp in zip(prompts, params, strict=True):
            eng.submit(p, sp, stream=variant == "stream")
    else:
        eng.submit_many(prompts, params)
    if variant == "stream":
        results = []
        while eng.has_work:
            results += eng.step()
            eng.take_deltas()
    else:
        results = eng.run()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    st = eng.stats
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "host_cpu_s": cpu,
        "wall_s": wall,
        "compile_s": st.compile_s,
        "tokens": tokens,
        "decode_steps": st.decode_steps,
        "prefills": st.prefills,
    }


def _chunk_budget_ms(slots: int, chunk: int) -> float:
    return chunk * max(2.0, H200_STEP_MS_AT_1024 * slots / 1024)


def run(args, folder) -> list[dict]:
    # The tiny checkpoint with a byte-level tokenizer: stop strings need one.
    tiny = rkvjax.load(common.tiny_chat_checkpoint(), dtype="float32")
    settings = [(tiny, common.TINY_MODEL_NAME, s) for s in args.slots]
    if args.default_model_slots and not args.tiny:
        model, name = common.load_model(args, args.dtype)
        settings += [(model, name, s) for s in args.default_model_slots]
    rows = []
    for model, name, slots in settings:
        for variant in args.variants:
            eng = make_engine(model, slots, variant, args)
            run_once(eng, slots, variant, args)  # warm-up: compiles every program
            runs = [run_once(eng, slots, variant, args) for _ in range(args.repeats)]
            cpu = statistics.median(r["host_cpu_s"] for r in runs)
            tokens = runs[0]["tokens"]
            per_token = cpu / tokens
            chunk = runtime.DEFAULT_CHUNK
            row = {
                "bench": "host",
                "slots": slots,
                "variant": variant,
                "requests": requests_of(slots, variant),
                "max_tokens": args.max_tokens,
                "tokens": tokens,
                "host_cpu_s": [r["host_cpu_s"] for r in runs],
                "wall_s": [r["wall_s"] for r in runs],
                "compile_s_timed": [r["compile_s"] for r in runs],
                "host_us_per_token": 1e6 * per_token,
                "host_ms_per_chunk": 1e3 * per_token * slots * chunk,
                "chunk_budget_ms": _chunk_budget_ms(slots, chunk),
                "decode_steps": runs[0]["decode_steps"],
                "prefills": runs[0]["prefills"],
                "loadavg": os.getloadavg(),
                **common.run_meta(model=name, dtype=str(model.dtype.__name__)),
            }
            common.emit(row, folder)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r = rows[0]
    head = (
        f"Main-thread CPU time per decoded token: requests of {r['max_tokens']} "
        "tokens each (T=0.7, top-p 0.95, R-KV), median of the timed runs after a warm-up. "
        "The chunk budget is an estimate of an H200's time for a 16-step chunk of "
        "R1-Distill-Qwen-1.5B's shape at that batch."
    )
    cols = [
        ("model", "model", "s"),
        ("slots", "slots", "d"),
        ("variant", "variant", "s"),
        ("requests", "requests", ",d"),
        ("host us / token", "host_us_per_token", ".2f"),
        ("host ms / 16-step chunk", "host_ms_per_chunk", ".1f"),
        ("chunk budget ms (est.)", "chunk_budget_ms", ".0f"),
        ("tokens", "tokens", ",d"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, cols)}"


def plot(plt, rows: list[dict]):
    """Host microseconds per token by slots, one line per model and variant."""
    fig, ax = plt.subplots(figsize=(6, 4))
    named = {}
    for x in rows:
        key = f"{x['model']} {x['variant']}"
        xs, ys = named.setdefault(key, ([], []))
        xs.append(x["slots"])
        ys.append(x["host_us_per_token"])
    common.lines(
        ax, named, xlabel="slots", ylabel="host CPU us / token", title="the host's part of a run"
    )
    ax.set_xscale("log", base=2)
    return fig
