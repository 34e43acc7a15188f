"""`rkvjax convert SRC DST`: a checkpoint written as Orbax weights, config and tokenizer."""

from __future__ import annotations

import argparse
import time

from rkvjax import api
from rkvjax.entrypoints.cli import flags
from rkvjax.models import loading


def add(sub) -> argparse.ArgumentParser:
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
    return c


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = loading.convert(
        args.source, args.output, dtype=args.dtype, mesh=flags.mesh(args), overwrite=args.overwrite
    )
    flags.report(f"[rkvjax] wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
