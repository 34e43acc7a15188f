"""How soon a server answers: `rkvjax serve` launched as users launch it (its default slots, the
default model), timed from the launch to the first `/health` answer and to the end of a first
completion (8 greedy tokens), with the compile cache warm (a start before it filled the cache)
and cold (`RKVJAX_COMPILE_CACHE=0`: everything compiles).

The server compiles the full batch width's programs ahead of time without running them, starts
allocating its state on another thread and answers; the narrower widths compile behind the
first requests (README, "Serving"). The first completion therefore includes the state's memory
being filled (on a CPU, page by page) and anything a first request still compiles.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import common, serve

TINY = dict(repeats=1)
PREFER_MEMORY = True
START_TIMEOUT_S = 1800  # a hang guard: a cold start on a busy 2-core machine takes minutes


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--repeats", type=int, default=2, help="starts per cache state (median)")
    p.add_argument("--slots", type=int, default=None, help="default: the server's own sizing")


def _command(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "rkvjax", "serve"]
    if args.tiny:
        cmd += ["--model", str(common.tiny_chat_checkpoint())]
    elif args.model:
        cmd += ["--model", str(args.model)]
    if args.slots is not None:
        cmd += ["--slots", str(args.slots)]
    return [*cmd, "--host", serve.HOST, "--port", str(port)]


def _first_completion(server: serve.Server) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        server.base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=START_TIMEOUT_S) as r:
        json.loads(r.read())


def start_once(args, *, cache: bool) -> dict:
    """One launch: seconds to /health and to the first completion's end."""
    port = serve.free_port()
    env = None if cache else {**os.environ, "RKVJAX_COMPILE_CACHE": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        t0 = time.perf_counter()
        with serve.running_server(_command(args, port), port, log, env=env) as server:
            serve.wait_ready(server, START_TIMEOUT_S)
            health = time.perf_counter() - t0
            _first_completion(server)
            first = time.perf_counter() - t0
    return {"health_s": health, "first_completion_s": first}


def run(args, folder) -> list[dict]:
    name = common.TINY_MODEL_NAME if args.tiny else common.DEFAULT_MODEL_NAME
    if args.model and not args.tiny:
        name = os.path.basename(os.path.normpath(args.model))
    start_once(args, cache=True)  # fills the compile cache for the warm starts
    rows = []
    for cache in (True, False):
        runs = [start_once(args, cache=cache) for _ in range(args.repeats)]
        row = {
            "bench": "start",
            "compile_cache": "warm" if cache else "off",
            "health_s": statistics.median(r["health_s"] for r in runs),
            "first_completion_s": statistics.median(r["first_completion_s"] for r in runs),
            "runs": runs,
            "loadavg": os.getloadavg(),
            **common.run_meta(model=name),
        }
        common.emit(row, folder)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "Seconds from launching `rkvjax serve` (default slots) to its first `/health` answer "
        "and to the end of a first completion (8 tokens), median of the starts."
    )
    cols = [
        ("model", "model", "s"),
        ("compile cache", "compile_cache", "s"),
        ("/health s", "health_s", ".1f"),
        ("first completion s", "first_completion_s", ".1f"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, cols)}"


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = [f"{r['model']}\ncache {r['compile_cache']}" for r in rows]
    ax.bar(labels, [r["first_completion_s"] for r in rows], label="first completion")
    ax.bar(labels, [r["health_s"] for r in rows], label="/health")
    ax.set_ylabel("seconds after launch")
    ax.set_title("a server's start")
    ax.legend()
    fig.tight_layout()
    return fig
