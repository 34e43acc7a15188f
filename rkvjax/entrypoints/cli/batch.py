"""`rkvjax batch IN OUT`: an offline job, JSONL requests in and results out (continuous and
resumable), and `rkvjax merge OUT SHARDS...`, which joins a sharded job's outputs."""

from __future__ import annotations

import argparse
import sys

from rkvjax import api
from rkvjax.entrypoints import jobs
from rkvjax.entrypoints.cli import flags


def add(sub) -> argparse.ArgumentParser:
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
        type=flags.shard_arg,
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
    flags.add_generation_args(b)
    return b


def add_merge(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("merge", help="join the outputs of a job's shards into one output")
    m.add_argument("output", help="the merged JSONL to write (must not exist)")
    m.add_argument("shards", nargs="+", help="the shard outputs (`rkvjax batch --shard I/N`)")
    return m


def settings(args: argparse.Namespace, model: api.Model) -> dict:
    """The flags that shape a job's results (besides the sampling defaults), kept in its
    output's header."""
    return {
        "model": str(model.path.resolve()),
        "dtype": model.dtype.__name__,
        **flags.cache(args),
        "no_chat": args.no_chat,
    }


def run(args: argparse.Namespace) -> int:
    defaults = flags.checked_sampling(args)
    # Bad lines and files fail now, not after the model loads.
    jobs.preflight(args.input, args.output, defaults=defaults)
    model = flags.load(args)
    runner = jobs.EngineRunner(
        model,
        cache=flags.cache(args),
        slots=args.slots,
        chat=False if args.no_chat else None,
        order=args.order,
    )
    summary = jobs.run_job(
        runner,
        args.input,
        args.output,
        defaults=defaults,
        settings=settings(args, model),
        shard=args.shard,
        token_ids=args.token_ids,
        progress=flags.progress(args),
    )
    flags.report(line(summary, args.output))
    return 0


def line(summary: dict, output) -> str:
    """The one-line report of a finished job."""
    rt = summary["runtime"]
    text = (
        f"[rkvjax] {summary['samples_written']} samples written, "
        f"{summary['samples_already_done']} already done -> {output}"
    )
    if rt:
        text += (
            f" | {summary['requests_run']} requests, {rt['generated_tokens']} tokens, "
            f"{rt['tokens_per_s']:.1f} tok/s, {rt['compressions']} compressions, "
            f"{rt['slots']} slots ({rt['slot_occupancy']:.0%} busy) | "
            f"wall {summary['wall_s']:.1f} s (compile {rt['compile_s']:.1f} s)"
        )
    return text + f" | summary {jobs.summary_path(output)}"


def run_merge(args: argparse.Namespace) -> int:
    merged, lines = jobs.merge(args.output, args.shards)
    print(f"[rkvjax] merged {merged} shards, {lines} lines -> {args.output}", file=sys.stderr)
    return 0
