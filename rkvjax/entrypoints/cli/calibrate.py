"""`rkvjax calibrate DATA OUT`: the statistics of a model's queries that TriAttention reads."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

from rkvjax import api
from rkvjax.entrypoints import evaluation, jobs
from rkvjax.entrypoints.cli import flags


def add(sub) -> argparse.ArgumentParser:
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
    return k


def run(args: argparse.Namespace) -> int:
    from rkvjax.entrypoints import calibration
    from rkvjax.kv.policies import triattention_stats

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
    model = flags.load(args)
    ids = calibration.encode_prompts(model, prompts)
    primary = jax.process_index() == 0
    stats = calibration.calibrate(
        model, ids, progress=flags.progress(args) and primary, source=str(Path(args.data).resolve())
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
