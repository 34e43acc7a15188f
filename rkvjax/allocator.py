"""The host's allocator: jemalloc under the commands where it is installed.

Every program call makes and frees small host blocks for each buffer it takes and returns
(PjRt's buffer records, events, futures), beside XLA's compute threads doing the same. Under
glibc's malloc a decode call of the default model at 64 rows spent about half of its
main-thread time in `malloc` and `free` (their arena locks and bin consolidation); with
jemalloc the host's CPU per token dropped by about a quarter and peak memory did not grow
(`bench/README.md`, host). glibc's own knob for it, a larger per-thread cache
(`glibc.malloc.tcache_count`), gave less and doubled the process's peak memory, so it is not
used.

An allocator is chosen when the process starts, so only the program that owns the process
may choose: the `rkvjax` command starts itself once more with `LD_PRELOAD` naming jemalloc
(`exec_tuned`) before it imports JAX, and `python -m bench` does the same after its imports.
`RKVJAX_MALLOC` says which: `auto` (the default: jemalloc where the dynamic linker's cache has
it, e.g. Debian's and Ubuntu's `libjemalloc2`; glibc's otherwise), `system` (glibc's), or the
path of a malloc library. A process whose `LD_PRELOAD` is already set is left as it is. Code
that imports `rkvjax` into its own process sets `LD_PRELOAD` in the environment that starts
Python.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping

AUTO, OFF = "auto", "system"  # RKVJAX_MALLOC's values besides a path


def find_jemalloc() -> str | None:
    """jemalloc's shared library as the dynamic linker's cache names it (`ldconfig -p`), or
    None."""
    return ctypes.util.find_library("jemalloc")


def library(environ: Mapping[str, str]) -> str | None:
    """The malloc library `environ` asks the commands to run with (None: glibc's)."""
    choice = environ.get("RKVJAX_MALLOC", AUTO) or AUTO
    if choice == OFF:
        return None
    if choice == AUTO:
        return find_jemalloc() if sys.platform.startswith("linux") else None
    if not os.path.isfile(choice):
        raise FileNotFoundError(f"RKVJAX_MALLOC={choice}: no such malloc library")
    return choice


def tuned_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to start this program again in, with `library(environ)` preloaded, or
    None where there is nothing to do: `LD_PRELOAD` already set (the user's, or this program's
    after its restart, which so skips looking for jemalloc), or no library."""
    if environ.get("LD_PRELOAD"):
        return None
    lib = library(environ)
    return None if lib is None else {**environ, "LD_PRELOAD": lib}


def exec_tuned() -> None:
    """Replaces this process with itself (the same interpreter, options and arguments) started
    under `tuned_environ`; returns at once where there is nothing to do. Call it first thing in
    a program's entry point, before threads start or files open."""
    if not sys.platform.startswith("linux") or not getattr(sys, "orig_argv", None):
        return
    try:
        env = tuned_environ(os.environ)
    except FileNotFoundError as e:
        sys.exit(f"rkvjax: error: {e}")
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def current() -> str:
    """What this process preloads (for benchmark rows and logs): `LD_PRELOAD`, or ""."""
    return os.environ.get("LD_PRELOAD", "")
