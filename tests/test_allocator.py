"""The commands' allocator (`rkvjax.allocator`): which library `RKVJAX_MALLOC` names, the
environment the commands restart in, and that the restart happens once, keeps its arguments
and leaves a user's `LD_PRELOAD` alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rkvjax import allocator

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD: Linux")
# A child that restarts itself as the commands do, then reports what it runs with.
CHILD = """
import json, os, sys
from rkvjax import allocator
os.environ["RESTARTS"] = str(int(os.environ.get("RESTARTS", "-1")) + 1)
allocator.exec_tuned()
print(json.dumps({"preload": os.environ.get("LD_PRELOAD"), "argv": sys.argv[1:],
                  "restarts": int(os.environ["RESTARTS"])}))
"""


def _loaded_libm() -> str | None:
    """The path of the libm this interpreter has loaded: harmless to preload, and a real file
    to stand for a malloc library."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libm.so") and Path(path).is_file():
            return path
    return None


LIBM = _loaded_libm()
with_libm = pytest.mark.skipif(LIBM is None, reason="no loaded libm found in /proc/self/maps")


def child(**env: str) -> subprocess.CompletedProcess:
    """Runs CHILD with `env` over this process's environment (less the allocator's settings)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RKVJAX_MALLOC")}
    return subprocess.run(
        [sys.executable, "-c", CHILD, "a b", "--flag"],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: a restart that repeated itself would never end
    )


def test_rkvjax_malloc_names_the_library(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: "libjemalloc.so.2")
    auto = "libjemalloc.so.2" if sys.platform.startswith("linux") else None
    assert allocator.library({}) == auto
    assert allocator.library({"RKVJAX_MALLOC": "auto"}) == auto
    assert allocator.library({"RKVJAX_MALLOC": "system"}) is None
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert allocator.library({"RKVJAX_MALLOC": str(lib)}) == str(lib)
    with pytest.raises(FileNotFoundError, match=r"RKVJAX_MALLOC=/no/such\.so: no such"):
        allocator.library({"RKVJAX_MALLOC": "/no/such.so"})
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: None)
    assert allocator.library({}) is None  # not installed: glibc's


def test_tuned_environ_preloads_the_library_unless_something_is_preloaded(monkeypatch):
    monkeypatch.setattr(allocator, "library", lambda environ: "libj.so")
    assert allocator.tuned_environ({"HOME": "/h"}) == {"HOME": "/h", "LD_PRELOAD": "libj.so"}
    assert allocator.tuned_environ({"LD_PRELOAD": "mine.so"}) is None
    monkeypatch.setattr(allocator, "library", lambda environ: None)
    assert allocator.tuned_environ({"HOME": "/h"}) is None


@linux
@with_libm
def test_a_program_restarts_once_with_its_arguments_and_the_library():
    out = child(RKVJAX_MALLOC=LIBM)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"preload": LIBM, "argv": ["a b", "--flag"], "restarts": 1}


@linux
@with_libm
def test_no_restart_when_switched_off_or_preloaded_by_the_user():
    off = json.loads(child(RKVJAX_MALLOC="system").stdout)
    assert off == {"preload": None, "argv": ["a b", "--flag"], "restarts": 0}
    mine = json.loads(child(RKVJAX_MALLOC="auto", LD_PRELOAD=LIBM).stdout)
    assert (mine["preload"], mine["restarts"]) == (LIBM, 0)


@linux
def test_a_missing_library_is_one_line_before_anything_runs():
    out = child(RKVJAX_MALLOC="/no/such/libmalloc.so")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (
        "rkvjax: error: RKVJAX_MALLOC=/no/such/libmalloc.so: no such malloc library"
    )


def test_the_command_runs_through_the_restart():
    out = subprocess.run(
        [sys.executable, "-m", "rkvjax", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rkvjax")
