"""`rkvjax eval DATA OUT_DIR`: the R1 reasoning evaluation over a problem file, graded and
resumable."""

from __future__ import annotations

import argparse
from pathlib import Path

from rkvjax.entrypoints import evaluation
from rkvjax.entrypoints.cli import flags


def add(sub) -> argparse.ArgumentParser:
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
    flags.add_generation_args(
        e,
        ("--samples", "--n"),
        "samples per problem, the k of pass@k",
        sampling={**evaluation.R1_SAMPLING, "max_new_tokens": None},
        max_tokens_help=f"(default: what the model's context leaves after the file's longest "
        f"prompt, at most {evaluation.MAX_TOKENS})",
    )
    return e


def run(args: argparse.Namespace) -> int:
    fields = flags.sampling(args)
    if fields["max_tokens"] is None:  # the recipe's length, fitted to the model once loaded
        del fields["max_tokens"]
    flags.checked_sampling(args, fields)
    data = evaluation.problem_file(args.data)  # a Hub dataset: fetched once, then cached
    evaluation.read_problems(data, args.limit)  # bad lines fail before the model loads
    model = flags.load(args)
    summary = evaluation.run_eval(
        model,
        data,
        args.out_dir,
        limit=args.limit,
        samples=fields.pop("n"),
        cache=flags.cache(args),
        sampling=fields,
        settings={"model": str(model.path.resolve()), "dtype": model.dtype.__name__},
        slots=args.slots,
        instruction=args.instruction,
        token_ids=args.token_ids,
        progress=flags.progress(args),
    )
    flags.report(line(summary, args.out_dir))
    return 0


def line(summary: dict, out_dir) -> str:
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
