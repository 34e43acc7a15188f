"""The benchmark suite's one entry point.

    python -m bench --list                        # the suites
    python -m bench SUITE... [--tiny] [--out DIR] [suite options]
    python -m bench all --tiny --out /tmp/bench   # every suite's tiny variant (CI)
    python -m bench jobs --repeats 3              # one suite, with its own options
    python -m bench decode --help                 # a suite's options

Each suite appends JSON lines to DIR/<suite>/results.jsonl and writes DIR/<suite>/table.md and
plot.png (DIR: bench/results; with --tiny, a scratch folder). Options after the suite name are
that suite's own; with several suites only the common flags apply.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import common
from rkvjax import allocator, xla_flags

# In the order `all` runs them.
SUITES = (
    "decode",
    "memory",
    "capacity",
    "throughput",
    "scale",
    "fidelity",
    "kept",
    "accuracy",
    "ragged",
    "tail",
    "host",
    "sampling",
    "jobs",
    "kernels",
    "load",
    "serve",
    "start",
    "invariance",
    "experts",
    "reasoner",
)
# A suite that lives in a package of its own.
_MODULES = {"reasoner": "bench.reasoner.suite"}
TINY_OUT = Path(tempfile.gettempdir()) / "rkvjax-bench-tiny"
OPT_LEVEL_FLAG = "--xla_backend_optimization_level"


def suite_module(name: str):
    """A suite: its docstring says what it measures; add_arguments(parser), TINY (the option
    defaults of its tiny variant), PREFER_MEMORY (XLA:CPU's memory-saving scheduler, see
    rkvjax/xla_flags.py), run(args, folder) -> rows, table(rows) -> Markdown, plot(plt, rows)."""
    return importlib.import_module(_MODULES.get(name, f"bench.{name}"))


def _parser(module=None, tiny: bool = False) -> argparse.ArgumentParser:
    """The common flags, plus `module`'s options with its tiny defaults under --tiny."""
    p = argparse.ArgumentParser(
        prog="python -m bench" + (f" {module.__name__.split('.')[-1]}" if module else ""),
        description=(module or sys.modules[__name__]).__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=None if module else f"suites: {', '.join(SUITES)}, or all",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random checkpoint and few steps: a smoke run, written to "
        f"{TINY_OUT} unless --out",
    )
    p.add_argument("--out", type=Path, help="results under OUT/<suite>/ (default bench/results)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    if module is not None:
        module.add_arguments(p)
        if tiny:
            p.set_defaults(**module.TINY)
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, argparse.Namespace]]:
    """(common flags, {suite: its options}) from `SUITE... [flags]`."""
    names = list(itertools.takewhile(lambda a: a in SUITES or a == "all", argv))
    rest = argv[len(names) :]
    suites = list(SUITES) if "all" in names else list(dict.fromkeys(names))
    tiny = "--tiny" in rest
    if len(suites) == 1:
        args = _parser(suite_module(suites[0]), tiny).parse_args(rest)
        return args, {suites[0]: args}
    p = _parser()
    args, extra = p.parse_known_args(rest)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)} (suite options need one suite)")
    if not suites and not args.list:
        p.error("name one or more suites, or all (--list shows them)")
    return args, {s: _parser(suite_module(s), tiny).parse_args(rest) for s in suites}


def configure_xla(modules, tiny: bool) -> None:
    """Process-wide XLA settings, before anything compiles (XLA reads XLA_FLAGS once)."""
    if any(m.PREFER_MEMORY for m in modules):
        xla_flags.prefer_memory_on_cpu()
    flags = os.environ.get("XLA_FLAGS", "")
    if tiny and OPT_LEVEL_FLAG not in flags:
        # Compiling is most of a tiny run, and without LLVM's optimisation passes XLA:CPU
        # compiles faster (as in the tests); a tiny run's timings are not results anyway.
        os.environ["XLA_FLAGS"] = f"{flags} {OPT_LEVEL_FLAG}=0".strip()


def run_suite(name: str, args: argparse.Namespace, folder: Path) -> int:
    """Runs one suite into `folder`; returns its row count."""
    module = suite_module(name)
    rows = module.run(args, folder)
    if rows:
        common.write_table(folder, module.table(rows))
        common.write_plot(folder, module.plot, rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    args, suites = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for name in SUITES:
            summary = " ".join(suite_module(name).__doc__.split("\n\n")[0].split())
            print(f"{name:9} {summary}")
        return 0
    configure_xla([suite_module(s) for s in suites], args.tiny)
    out = args.out or (TINY_OUT if args.tiny else common.RESULTS)
    failed = []
    for name, suite_args in suites.items():
        t0 = time.perf_counter()
        try:
            n = run_suite(name, suite_args, out / name)
        except Exception:  # one failing suite should not hide the others' results
            traceback.print_exc()
            failed.append(name)
            n = 0
        print(f"== {name}: {n} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    # The allocator the `rkvjax` command runs with, so that host timings are the command's.
    allocator.exec_tuned()
    sys.exit(main())
