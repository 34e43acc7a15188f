"""The `rkvjax` command: its parser, one module per command, and the one-line errors."""

from __future__ import annotations

import argparse
import sys

from rkvjax import home, xla_flags
from rkvjax.entrypoints.cli import batch, calibrate, convert, evaluate, flags, generate, serve
from rkvjax.kv.config import method_names
from rkvjax.models import sharding

DESCRIPTION = (
    'Command line: `rkvjax generate "prompt" ...`, `rkvjax batch IN.jsonl OUT.jsonl ...`, '
    "`rkvjax eval DATA OUT_DIR ...`, `rkvjax merge OUT SHARDS...`, `rkvjax convert SRC DST`, "
    "`rkvjax calibrate DATA.jsonl OUT` and `rkvjax serve`."
)
# Each command's module: `add(sub)` makes its parser, `run(args)` runs it (looked up when it
# runs, so a test may replace it).
COMMANDS = {
    "generate": generate,
    "batch": batch,
    "eval": evaluate,
    "convert": convert,
    "calibrate": calibrate,
    "serve": serve,
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rkvjax", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    with_mesh = []
    for name, command in COMMANDS.items():
        with_mesh.append(command.add(sub))
        if name == "eval":  # the help lists merge after eval
            batch.add_merge(sub)
    for q in with_mesh:
        flags.add_mesh_args(q)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command != "merge":  # the one command that takes no method: files only
        try:
            method_names()
        except ValueError as e:  # a plug-in that fails to load, named in one line
            print(f"rkvjax: error: {e}", file=sys.stderr)
            return 2
    xla_flags.prefer_memory_on_cpu()
    try:
        if args.command == "merge":  # files only: no devices, no model
            return batch.run_merge(args)
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
        home.enable_compile_cache()
        return COMMANDS[args.command].run(args)
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
