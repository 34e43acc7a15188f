"""Command line: `rkvjax generate "prompt" ...`, `rkvjax batch IN.jsonl OUT.jsonl ...`,
`rkvjax eval DATA OUT_DIR ...`, `rkvjax merge OUT SHARDS...`, `rkvjax convert SRC DST`,
`rkvjax calibrate DATA.jsonl OUT` and `rkvjax serve`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from rkvjax import (
    api,
    checks,
    defaults,
    evaluation,
    home,
    jobs,
    loading,
    policies,
    quantization,
    requests,
    sharding,
    xla_flags,
)
from rkvjax import serve as serve_defaults
from rkvjax.config import check_context, compression_config, method_names
from rkvjax.sampling import SamplingParams


def _add_generation_args(
    p: argparse.ArgumentParser,
    n_flags: tuple[str, ...] = ("--n",),
    n_help: str = "samples per prompt",
    *,
    sampling: dict | None = None,
    max_tokens_help: str = "(default: %(default)s)",
    offline: bool = True,
) -> None:
    """The model, cache and sampling flags; `sampling` overrides the defaults of temperature,
    top_p and max_new_tokens (their help shows the parser's own); `offline`: with --no-chat
    and --progress (a server has neither)."""
    shown = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": api.DEFAULT_MAX_NEW_TOKENS}
    shown.update(sampling or {})
    p.add_argument(
        "--model",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder or .gguf file (default: %(default)s, prepared on first use)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=shown["max_new_tokens"],
        help=f"tokens to generate at most per sample {max_tokens_help}",
    )
    p.add_argument(
        "--method",
        choices=_method_choices(),
        default=None,
        help="cache policy (default: rkv with --budget, FullKV without); $RKVJAX_POLICIES names "
        "modules that register more",
    )
    p.add_argument(
        "--method-arg",
        dest="method_args",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a hyperparameter of the method (repeatable), e.g. lam=0.2 for rkv",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="PATH",
        help="statistics of the model's queries for a method that reads them (triattention), "
        "written by `rkvjax calibrate`",
    )
    p.add_argument(
        "--budget",
        type=_budget_arg,
        default=None,
        help="KV tokens kept per layer/head/row: an integer, or a fraction in (0, 1] of the "
        "longest prompt + max tokens written with a point (0.1, 1.0); omit for FullKV",
    )
    p.add_argument(
        "--buffer",
        type=int,
        default=defaults.BUFFER,
        help="new tokens between compressions (%(default)s)",
    )
    p.add_argument(
        "--share",
        choices=checks.SHARES,
        default=defaults.SHARE,
        help="one kept set per (layer, KV head) (none, the default), per layer (heads: scores "
        "averaged over KV heads), per KV head (layers: scores summed over layers), or per row "
        "(all)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=quantization.KV_DTYPES,
        default=None,
        help="what the cache stores, for every method: int8 and float8_e4m3fn keep a float32 "
        "scale per (token, head), about half of bfloat16's bytes (default: the model's dtype)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute each row's numbers the same way whatever runs beside it, so a sample's "
        "tokens, logprobs and kept sets equal its run alone to the bit (default: on for an "
        "8-bit --kv-dtype, off otherwise)",
    )
    p.add_argument("--think-only", action="store_true", help="stop compressing after </think>")
    s = p.add_argument_group("sampling (vLLM's SamplingParams; a job's lines may override them)")
    s.add_argument(*n_flags, dest="n", type=int, default=1, help=n_help)
    s.add_argument(
        "--temperature",
        type=float,
        default=shown["temperature"],
        help="0 = greedy (default: %(default)s)",
    )
    s.add_argument("--top-p", type=float, default=shown["top_p"], help="(default: %(default)s)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument(
        "--logprobs", type=int, default=None, metavar="N", help="record the top N logprobs"
    )
    if not offline:
        return
    p.add_argument(
        "--no-chat", action="store_true", help="send the raw text, without the chat template"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        return jobs.parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mesh_arg(text: str) -> dict[str, int]:
    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mesh(args: argparse.Namespace):
    return None if args.mesh is None else sharding.make_mesh(**args.mesh)


def _load(args: argparse.Namespace) -> api.Model:
    """The model, once the cache flags are checked against its config (no weights read yet)."""
    cfg = loading.read_config(args.model)
    budget = getattr(args, "budget", None)
    if isinstance(budget, int):  # a fraction resolves within the lengths, checked later
        try:
            check_context(compression_config(**_policy(_cache(args))), cfg.max_positions)
        except ValueError as e:
            raise ValueError(f"cache flags: {e}") from None
    return api.load(args.model, dtype=args.dtype, mesh=_mesh(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rkvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt text (several make a batch)")
    _add_generation_args(g)
    g.add_argument("--json", action="store_true", help="print results as JSON lines")
    b = sub.add_parser(
        "batch", help="offline job: JSONL requests in, JSONL results out (continuous, resumable)"
    )
    b.add_argument(
        "input",
        help="JSONL: per line `prompt`, `messages` or `prompt_token_ids`, an optional `id` and "
        "sampling fields; or OpenAI batch lines (`custom_id`, `body`)",
    )
    b.add_argument("output", help="JSONL results, appended; samples already there are skipped")
    b.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"rows decoded at once (default: what memory allows, at most "
        f"{jobs.DEFAULT_JOB_SLOTS})",
    )
    b.add_argument(
        "--shard",
        type=_shard_arg,
        default=None,
        metavar="I/N",
        help="run shard I of N of the input (by id), e.g. one per host; `rkvjax merge` joins them",
    )
    b.add_argument(
        "--order",
        choices=jobs.ORDERS,
        default="longest",
        help="which requests take free slots first: the largest max_tokens (default; the job "
        "ends sooner) or input order; the tokens are the same",
    )
    b.add_argument("--token-ids", action="store_true", help="also write generated token ids")
    _add_generation_args(b)
    e = sub.add_parser(
        "eval",
        help="reasoning evaluation: the R1 recipe over a problem file, graded (resumable)",
    )
    e.add_argument(
        "data",
        help="JSONL of problems (`problem` or `question`, `answer`, optional `id`), or a "
        "Hugging Face dataset: owner/name (e.g. HuggingFaceH4/MATH-500), fetched once into "
        "$RKVJAX_HOME/datasets",
    )
    e.add_argument(
        "out_dir", help=f"folder for {evaluation.SAMPLES_FILE} and {evaluation.SUMMARY_FILE}"
    )
    e.add_argument("--limit", type=int, default=None, help="the first N problems only")
    e.add_argument("--slots", type=int, default=None, help="rows decoded at once")
    e.add_argument("--token-ids", action="store_true", help="also write generated token ids")
    e.add_argument(
        "--instruction",
        default=evaluation.R1_INSTRUCTION,
        help="appended to each problem (default: %(default)r)",
    )
    _add_generation_args(
        e,
        ("--samples", "--n"),
        "samples per problem, the k of pass@k",
        sampling={**evaluation.R1_SAMPLING, "max_new_tokens": None},
        max_tokens_help=f"(default: what the model's context leaves after the file's longest "
        f"prompt, at most {evaluation.MAX_TOKENS})",
    )
    m = sub.add_parser("merge", help="join the outputs of a job's shards into one output")
    m.add_argument("output", help="the merged JSONL to write (must not exist)")
    m.add_argument("shards", nargs="+", help="the shard outputs (`rkvjax batch --shard I/N`)")
    c = sub.add_parser(
        "convert",
        help="write a checkpoint as Orbax weights + config + tokenizer (restores into any mesh)",
    )
    c.add_argument(
        "source",
        nargs="?",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder, .gguf file, or converted folder (default: %(default)s)",
    )
    c.add_argument("output", help="folder to write (`rkvjax.load` and --model accept it)")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    c.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    k = sub.add_parser(
        "calibrate",
        help="statistics of a model's queries over a prompt file, for --method triattention",
    )
    k.add_argument(
        "data",
        help="JSONL of problems as `rkvjax eval` reads them (`problem` or `question`, `answer`), "
        "or of prompts as `rkvjax batch` reads them (`prompt`, `messages` or `prompt_token_ids`)",
    )
    k.add_argument("output", help="the .npz file to write (pass it as --calibration)")
    k.add_argument(
        "--model",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder or .gguf file (default: %(default)s, prepared on first use)",
    )
    k.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    k.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    k.add_argument(
        "--instruction",
        default=evaluation.R1_INSTRUCTION,
        help="appended to each problem of a problem file (default: %(default)r)",
    )
    k.add_argument(
        "--no-chat", action="store_true", help="send the raw text, without the chat template"
    )
    k.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    k.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    v = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and text completions, streaming, metrics)",
    )
    _add_generation_args(
        v,
        n_help="samples per request when it gives no n",
        sampling={"temperature": 1.0, "max_new_tokens": None},
        max_tokens_help="when a request gives none (default: the rest of the context)",
        offline=False,
    )
    v.set_defaults(seed=None)
    v.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"rows decoded at once (default: what memory allows, at most "
        f"{serve_defaults.DEFAULT_SERVE_SLOTS})",
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    v.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    v.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $RKVJAX_API_KEY, "
        "else none)",
    )
    v.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` clients name (default: the model folder's or file's name)",
    )
    v.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + max_tokens at most per request (default: the model's positions)",
    )
    v.add_argument(
        "--max-logprobs",
        type=int,
        default=serve_defaults.DEFAULT_MAX_LOGPROBS,
        help="the most top_logprobs a request may ask for (%(default)s)",
    )
    v.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="abort a request that runs longer (default: no limit)",
    )
    v.add_argument(
        "--max-body-bytes",
        type=int,
        default=serve_defaults.DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (%(default)s)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=int,
        default=serve_defaults.SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish before they are aborted "
        "(%(default)s)",
    )
    v.add_argument(
        "--no-warmup",
        action="store_true",
        help="start at once; programs compile when the first requests need them",
    )
    v.add_argument(
        "--no-narrow-tail",
        action="store_true",
        help="always decode every slot: skips compiling the narrower batches at start (faster "
        "start-up, slower decoding while few requests run)",
    )
    for p in (g, b, e, c, k, v):
        _add_mesh_args(p)
    return parser


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        type=_mesh_arg,
        default=None,
        metavar="data=D,model=M",
        help="split over D x M devices: batch rows on data, heads / MLP / vocab on model "
        "(D * M must equal the device count, every process's together; default: one device)",
    )
    d = p.add_argument_group("multi-process (one process per host; see README)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)


def _budget_arg(text: str) -> int | float:
    """--budget: an integer is tokens, a number with a point (or an exponent) a fraction, as
    `generate`'s int and float budgets: "1.0" is the whole length, "1" one token."""
    try:
        if not any(c in text for c in ".eE"):
            return int(text)
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes tokens (an integer) or a fraction in (0, 1], got {text!r}"
        ) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"a fraction must lie in (0, 1], got {text}; give tokens as an integer"
        )
    return value


def _cache(args: argparse.Namespace) -> dict:
    """The cache-policy keywords of `generate` / `engine_for` from the flags (the method's
    options only as given, so that job headers written before options existed still match)."""
    method = args.method
    if method is None:  # what the headers of earlier jobs recorded for no --method
        method = "rkv"
    elif method != "full" and args.budget is None:
        raise ValueError(
            f"cache flags: --method {method} compresses the cache to a --budget: give one "
            "(e.g. --budget 256), or drop --method for FullKV"
        )
    if args.method_args and method == "full":
        raise ValueError("cache flags: --method full has no options; drop --method-arg")
    try:
        options = policies.parse_options(method, args.method_args) if args.method_args else {}
    except ValueError as e:
        raise ValueError(f"cache flags: --method-arg: {e}") from None
    calibration = getattr(args, "calibration", None)
    if calibration is not None:
        if method == "full" or "calibration" not in policies.option_names(method):
            raise ValueError(
                f"cache flags: --calibration: method {method!r} reads no calibration "
                "statistics; drop --calibration"
            )
        if "calibration" in options:
            raise ValueError(
                "cache flags: --calibration and --method-arg calibration=... both given; give one"
            )
        options["calibration"] = calibration
    return {
        "method": method,
        "budget": args.budget,
        "buffer": args.buffer,
        "think_only": args.think_only,
        # Only when given: the headers of jobs written before these flags still match.
        **({"share": args.share} if args.share != defaults.SHARE else {}),
        **({"kv_dtype": args.kv_dtype} if args.kv_dtype is not None else {}),
        **({"batch_invariant": args.batch_invariant} if args.batch_invariant is not None else {}),
        **options,
    }


# `_cache` keywords that are the engine's, not the cache policy's (`compression_config`'s).
_ENGINE_KEYWORDS = ("think_only", "batch_invariant")


def _policy(cache: dict) -> dict:
    """`_cache`'s keywords as `compression_config` takes them."""
    return {k: v for k, v in cache.items() if k not in _ENGINE_KEYWORDS}


def _sampling(args: argparse.Namespace) -> dict:
    """The sampling flags as `SamplingParams` fields."""
    return {
        "n": args.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "max_tokens": args.max_new_tokens,
        "min_tokens": args.min_tokens,
        "stop": args.stop or [],
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
    }


def _checked_sampling(args: argparse.Namespace, fields: dict | None = None) -> dict:
    """The sampling flags (or `fields` made of them), checked before anything slow starts;
    the cache flags too."""
    fields = _sampling(args) if fields is None else fields
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"sampling flags: {e}") from None
    cache = _cache(args)
    if cache["method"] == "full" and cache["budget"] is not None:
        # `generate(method="full", budget=...)` is FullKV by contract; a flag typed for nothing
        # is refused instead.
        raise ValueError(
            f"cache flags: --method full keeps every token and takes no --budget (got "
            f"{cache['budget']}); drop --budget, or pick a compressing method"
        )
    try:  # the lengths only resolve a fractional budget, which is checked again with the model
        compression_config(prompt_len=1, max_new_tokens=1, **_policy(cache))
    except ValueError as e:
        raise ValueError(f"cache flags: {e}") from None
    return fields


def _progress(args) -> bool:
    return sys.stderr.isatty() if args.progress is None else args.progress


def _generate(args: argparse.Namespace) -> int:
    fields = _checked_sampling(args)
    for i, prompt in enumerate(args.prompts):  # before the model loads
        requests.check_text(prompt, f"prompt {i}")
    t0 = time.perf_counter()
    model = _load(args)
    load_s = time.perf_counter() - t0
    primary = jax.process_index() == 0  # on several processes, process 0 reports
    params = api.per_prompt_sampling(len(args.prompts), **fields)
    outs = api.generate(
        model,
        list(args.prompts),
        sampling=params,
        chat=False if args.no_chat else None,
        progress=_progress(args) and primary,
        **_cache(args),
    )
    if not primary:
        return 0
    samples = [(p, r) for p, out in zip(args.prompts, outs, strict=True) for r in _listed(out)]
    for prompt, r in samples:
        if args.json:
            print(json.dumps({"prompt": prompt, **r.to_dict()}))
            continue
        if len(samples) > 1:
            print(f"### {prompt}" + (f" (sample {r.sample_index})" if args.n > 1 else ""))
        print(r.text)
    results = [r for _, r in samples]
    s = results[0].stats
    policy = "FullKV" if s.budget is None else f"{s.method} budget {s.budget}"
    policy += f", {s.kv_dtype} cache" if s.kv_dtype != model.dtype.__name__ else ""
    print(
        f"[rkvjax] {model.path.name} ({model.config.arch}, {model.dtype.__name__}, {policy}) | "
        f"batch {s.batch_size} | prompt tokens {sum(r.stats.prompt_tokens for r in results)} | "
        f"generated {sum(r.stats.generated_tokens for r in results)} | "
        f"{s.tokens_per_s:.1f} tok/s decode | time to first token {s.time_to_first_token_s:.2f} s"
        f" | compile {s.compile_s:.1f} s | load {load_s:.1f} s | "
        f"compressions {sum(r.stats.compressions for r in results)} | "
        f"finish {','.join(r.finish_reason for r in results)}",
        file=sys.stderr,
    )
    return 0


def _listed(out) -> list:
    return out if isinstance(out, list) else [out]


def _convert(args: argparse.Namespace) -> int:
    from rkvjax import loading

    t0 = time.perf_counter()
    out = loading.convert(
        args.source, args.output, dtype=args.dtype, mesh=_mesh(args), overwrite=args.overwrite
    )
    if jax.process_index() == 0:
        print(f"[rkvjax] wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _job_settings(args: argparse.Namespace, model: api.Model) -> dict:
    """The flags that shape a job's results (besides the sampling defaults), kept in its
    output's header."""
    return {
        "model": str(model.path.resolve()),
        "dtype": model.dtype.__name__,
        **_cache(args),
        "no_chat": args.no_chat,
    }


def _batch(args: argparse.Namespace) -> int:
    defaults = _checked_sampling(args)
    # Bad lines and files fail now, not after the model loads.
    jobs.preflight(args.input, args.output, defaults=defaults)
    model = _load(args)
    runner = jobs.EngineRunner(
        model,
        cache=_cache(args),
        slots=args.slots,
        chat=False if args.no_chat else None,
        order=args.order,
    )
    summary = jobs.run_job(
        runner,
        args.input,
        args.output,
        defaults=defaults,
        settings=_job_settings(args, model),
        shard=args.shard,
        token_ids=args.token_ids,
        progress=_progress(args),
    )
    if jax.process_index() == 0:
        print(_job_line(summary, args.output), file=sys.stderr)
    return 0


def _job_line(summary: dict, output) -> str:
    """The one-line report of a finished job."""
    rt = summary["runtime"]
    line = (
        f"[rkvjax] {summary['samples_written']} samples written, "
        f"{summary['samples_already_done']} already done -> {output}"
    )
    if rt:
        line += (
            f" | {summary['requests_run']} requests, {rt['generated_tokens']} tokens, "
            f"{rt['tokens_per_s']:.1f} tok/s, {rt['compressions']} compressions, "
            f"{rt['slots']} slots ({rt['slot_occupancy']:.0%} busy) | "
            f"wall {summary['wall_s']:.1f} s (compile {rt['compile_s']:.1f} s)"
        )
    return line + f" | summary {jobs.summary_path(output)}"


def _eval(args: argparse.Namespace) -> int:
    fields = _sampling(args)
    if fields["max_tokens"] is None:  # the recipe's length, fitted to the model once loaded
        del fields["max_tokens"]
    _checked_sampling(args, fields)
    data = evaluation.problem_file(args.data)  # a Hub dataset: fetched once, then cached
    evaluation.read_problems(data, args.limit)  # bad lines fail before the model loads
    model = _load(args)
    summary = evaluation.run_eval(
        model,
        data,
        args.out_dir,
        limit=args.limit,
        samples=fields.pop("n"),
        cache=_cache(args),
        sampling=fields,
        settings={"model": str(model.path.resolve()), "dtype": model.dtype.__name__},
        slots=args.slots,
        instruction=args.instruction,
        token_ids=args.token_ids,
        progress=_progress(args),
    )
    if jax.process_index() == 0:
        print(_eval_line(summary, args.out_dir), file=sys.stderr)
    return 0


def _eval_line(summary: dict, out_dir) -> str:
    """The one-line report of a finished evaluation."""
    k = summary["k"]
    policy = (
        "FullKV" if summary["budget"] is None else f"{summary['method']} budget {summary['budget']}"
    )
    if summary.get("kv_dtype") != summary["settings"].get("dtype"):
        policy += f", {summary['kv_dtype']} cache"

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    tokens = summary["mean_generated_tokens"]
    return (
        f"[rkvjax] eval {policy}: pass@1 {pct(summary['pass@1'])} (boxed answers only "
        f"{pct(summary['pass@1_boxed'])})"
        + (f", pass@{k} {pct(summary['pass@k'])}" if k > 1 else "")
        + f" over {summary['problems']} problems x {k} samples"
        + (
            f" ({summary['incomplete_problems']} incomplete)"
            if summary["incomplete_problems"]
            else ""
        )
        + (f" | {tokens:.0f} tokens per sample" if tokens is not None else "")
        + (f", repetition {summary['repetition']:.3f}" if summary["repetition"] is not None else "")
        + (f", looping {pct(summary['looping'])}" if summary.get("looping") is not None else "")
        + f" | {summary['samples_written']} samples written, {summary['samples_already_done']} "
        f"already done -> {Path(out_dir) / evaluation.SUMMARY_FILE}"
    )


def _calibrate(args: argparse.Namespace) -> int:
    from rkvjax import calibration
    from rkvjax.policies import triattention_stats

    out = Path(args.output)
    jobs.output.check_folder(out)  # before the model loads, not after the whole calibration
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out}: exists; pass --overwrite to replace it")
    chat = False if args.no_chat else None
    # Bad lines fail now, not after the model loads.
    prompts = calibration.read_prompts(
        args.data, limit=args.limit, instruction=args.instruction, chat=chat
    )
    t0 = time.perf_counter()
    model = _load(args)
    ids = calibration.encode_prompts(model, prompts)
    primary = jax.process_index() == 0
    stats = calibration.calibrate(
        model, ids, progress=_progress(args) and primary, source=str(Path(args.data).resolve())
    )
    if primary:
        triattention_stats.save(stats, out, overwrite=args.overwrite)
        print(
            f"[rkvjax] wrote {out}: query statistics of {model.path.name} ({model.config.arch}, "
            f"{model.dtype.__name__}) over {stats.meta['prompts']} prompts, "
            f"{stats.meta['tokens']} tokens, in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from rkvjax import serve
    from rkvjax.serve import app as serve_app

    if jax.process_count() > 1:
        raise ValueError("rkvjax serve runs in one process (a --mesh over its own devices)")
    fields = _sampling(args)
    if fields["max_tokens"] is None:  # the rest of each request's context
        del fields["max_tokens"]
    _checked_sampling(args, fields)
    for name in ("port", "max_body_bytes", "shutdown_timeout"):
        value = getattr(args, name)
        low = 1 if name != "shutdown_timeout" else 0
        if value < low or (name == "port" and value > 65535):
            raise ValueError(f"--{name.replace('_', '-')} out of range: {value}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    api_key = _api_key(args.api_key, os.environ.get("RKVJAX_API_KEY"))
    serve_app.check_api_key(api_key)
    if fields.get("logprobs") is not None and fields["logprobs"] > args.max_logprobs:
        raise ValueError(f"--logprobs {fields['logprobs']} is more than --max-logprobs")
    sock = serve.bind(args.host, args.port)
    model = _load(args)
    engine, length = serve.serving_engine(
        model,
        cache=_cache(args),
        slots=args.slots,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        narrow_tail=not args.no_narrow_tail,
    )
    if fields.get("n", 1) > engine.slots:
        raise ValueError(f"--n {fields['n']} is more than the {engine.slots} slots")
    cc = engine.compression
    policy = "FullKV" if not cc.compressing else f"{cc.method} budget {cc.budget}"
    name = args.served_model_name or model.path.name
    print(f"[rkvjax] {serve.memory_line(engine)}", file=sys.stderr)
    if not args.no_warmup:
        print(
            "[rkvjax] compiling: the decode chunk at every batch width and a first prefill "
            "(kept in the compile cache for the next start) ...",
            file=sys.stderr,
        )
        seconds = serve.warm_up(engine)
        print(f"[rkvjax] warm-up done in {seconds:.1f} s", file=sys.stderr)
    config = serve.ServeConfig(
        model_name=name,
        max_model_len=length,
        defaults=fields,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )
    access = "API key required" if api_key is not None else "open: no API key"
    print(
        f"[rkvjax] serving {name} ({model.config.arch}, {model.dtype.__name__}, {policy}, "
        f"{engine.slots} slots, context {length}) on http://{args.host}:{args.port}/v1 "
        f"({access})",
        file=sys.stderr,
    )
    serve.serve(
        engine,
        config,
        host=args.host,
        port=args.port,
        sock=sock,
        shutdown_timeout=args.shutdown_timeout,
    )
    return 0


def _api_key(flag: str | None, env: str | None) -> str | None:
    """The server's API key: --api-key, else $RKVJAX_API_KEY, else None (an open server). An
    empty one is refused: `--api-key "$KEY"` with KEY unset would otherwise start an open
    server while its user believes it is protected."""
    for given, name in ((flag, "--api-key"), (env, "$RKVJAX_API_KEY")):
        if given is None:
            continue
        if not given:
            raise ValueError(
                f"{name} is empty (an unset shell variable?): give the key, or leave "
                f"{name} out to serve without one"
            )
        return given
    return None


def _merge(args: argparse.Namespace) -> int:
    merged, lines = jobs.merge(args.output, args.shards)
    print(f"[rkvjax] merged {merged} shards, {lines} lines -> {args.output}", file=sys.stderr)
    return 0


def _method_choices() -> tuple[str, ...]:
    """The methods the flags accept: every registered one, or the built-ins when a plug-in
    fails to load (`main` reports that to the commands that take a method)."""
    try:
        return method_names()
    except ValueError:
        return ("full", *policies.BUILTINS)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "merge":  # the one command that takes no method: files only
        try:
            method_names()
        except ValueError as e:  # a plug-in that fails to load, named in one line
            print(f"rkvjax: error: {e}", file=sys.stderr)
            return 2
    xla_flags.prefer_memory_on_cpu()
    try:
        if args.command == "merge":  # files only: no devices, no model
            return _merge(args)
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
        home.enable_compile_cache()
        commands = {
            "batch": _batch,
            "calibrate": _calibrate,
            "convert": _convert,
            "eval": _eval,
            "generate": _generate,
            "serve": _serve,
        }
        run = commands[args.command]
        return run(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        print(f"rkvjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(args), file=sys.stderr)
        return 130


def _interrupted(args: argparse.Namespace) -> str:
    if args.command in ("batch", "eval"):
        where = args.output if args.command == "batch" else args.out_dir
        return (
            f"rkvjax: interrupted; finished results are in {where}, rerun the same command "
            "to resume"
        )
    return "rkvjax: interrupted"


if __name__ == "__main__":
    sys.exit(main())
