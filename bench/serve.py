"""`rkvjax serve` against the engine it runs: the same closed-loop workload through HTTP and
in-process.

One workload, a fixed list of chat prompts (MATH-500 problems, or a fixed list when the data
file is absent), greedy with `ignore_eos`, each request's `max_tokens` drawn once from a range,
driven two ways at each level of C concurrent clients:

  engine  `rkvjax.entrypoints.serve.serving_engine` (what `rkvjax serve` builds, with its warm-up)
          driven in this process: C requests in flight, the next submitted as soon as one
          finishes (`Engine.step`, streamed deltas, as the server's engine thread drives it).
  server  a real `rkvjax serve` process on 127.0.0.1 with the same flags, driven by C clients
          (asyncio tasks with `openai.AsyncOpenAI`, one thread), each streaming its chat
          completion and sending the next request when its stream ends.

The server runs as a subprocess, not in a thread of this process: it is then the command users
run (flags, warm-up, XLA settings, uvicorn), its CPU time can be read per thread from /proc
apart from the clients', and the clients' parsing does not take the server's GIL, which a
server's clients never share. Clients are asyncio tasks rather than threads so that 32 of them
cost one thread's CPU on the same cores.

Before timing, each level runs once untimed in each mode: its prompts, all but the last `--slots`
requests cut to the low end of the max_tokens range (every prompt's prefill and admission
compile), the last ones whole (a tail that narrows the batch as the timed run's does). A program
the warm-up missed still compiles in the timed part: it is measured (the engine's compile log;
the server's JAX_LOG_COMPILES lines) and left out of tokens/s and requests/s, as in `jobs`. Both
processes use `rkvjax serve`'s persistent compilation cache, so a second run warms up faster.
Each level runs `--repeats` timed rounds of both modes, which take turns going first from round
to round and level to level (ABBA), so a change in the machine's load hits both alike. A level
is bounded in count (`--requests`, at most `--per-client` per client) and in time
(`--level-timeout`, an error past it).

Per row (one mode at one level): the medians over rounds of requests/s and generated tokens/s,
and on the server's row the median per-round ratio of its tokens/s to the engine's; median and
p90 time to first token over every round's requests (engine: from submit to the first delta
with text; server: at the client, from sending the request to the first chunk with content);
CPU seconds of the serving process by thread (and the clients'), which a busy machine does not
change as it changes wall time; the engine's decode steps and compressions (the server's from
/metrics). `same_outputs`: every request's text from the server equals the engine's, in every
round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import rkvjax
from bench import common
from rkvjax import home
from rkvjax.entrypoints import serve
from rkvjax.kv import config

MODES = ("engine", "server")
TINY = dict(
    repeats=1,
    requests=6,
    per_client=3,
    clients=[1, 4],
    slots=2,
    max_tokens=[8, 24],
    budget=32,
    buffer=16,
    prompt_chars=48,
)
# `rkvjax serve` turns XLA:CPU's concurrency-optimized scheduler off (rkvjax/xla_flags.py);
# the in-process engine must compile the same programs.
PREFER_MEMORY = True
SERVED_NAME = "bench-served"
HOST = "127.0.0.1"
# Used when the MATH-500 file is absent: short chat questions of mixed length.
FALLBACK_PROMPTS = (
    "What is 17 times 23?",
    "Find the sum of the first 50 positive odd integers.",
    "Solve for x: 3x + 7 = 22.",
    "How many ways can 5 books be arranged on a shelf?",
    "What is the remainder when 2^100 is divided by 7?",
    "A rectangle has perimeter 40 and area 96. What are its side lengths?",
    "Simplify (x^2 - 9) / (x - 3) and state where it is defined.",
    "What is the greatest common divisor of 462 and 1071? Show the Euclidean algorithm.",
)
# JAX_LOG_COMPILES lines: tracing, lowering and XLA compilation of each program, as the engine's
# own compile seconds count them (`programs.CompileLog`).
_COMPILE_STEP = re.compile(
    r"Finished (?:tracing|jaxpr to MLIR module conversion|XLA compilation) .* in ([0-9.eE+-]+) sec"
)
_PROGRAM = re.compile(r"Finished XLA compilation of (\S+) in")


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="(default: the server's, float32 on CPU)",
    )
    p.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="concurrent clients, one level each (default: %(default)s)",
    )
    p.add_argument(
        "--requests",
        type=common.int_at_least(1),
        default=64,
        help="requests per level at most (default: %(default)s)",
    )
    p.add_argument(
        "--per-client",
        type=common.int_at_least(1),
        default=4,
        help="requests per client at most, so that one client alone does not run the whole "
        "count (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=common.int_at_least(1),
        default=2,
        help="timed rounds per level, the modes alternating (default: %(default)s)",
    )
    p.add_argument(
        "--slots",
        type=common.int_at_least(1),
        default=8,
        help="the engine's rows: 32 clients oversubscribe 8 (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        nargs=2,
        default=[32, 192],
        help="each request's max_tokens, drawn from LO..HI (default: %(default)s)",
    )
    p.add_argument("--method", choices=config.method_names(), default="rkv")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--buffer", type=int, default=32)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the served context (default: the model's positions)",
    )
    p.add_argument("--data", type=Path, default=common.DATA, help="MATH-500 JSONL: the prompts")
    p.add_argument(
        "--prompt-chars",
        type=int,
        default=None,
        help="cut each prompt to this many characters (default: whole)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds the server may take to load and compile (default: %(default)s)",
    )
    p.add_argument(
        "--level-timeout",
        type=float,
        default=1800.0,
        help="seconds one level may take, an error past it (default: %(default)s)",
    )


# -- the workload -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """Request i asks `prompts[i]` as a chat with `max_tokens[i]`, greedy with ignore_eos."""

    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    def first(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.max_tokens[:n])

    def warm_up(self, short: int, tail: int) -> Workload:
        """The same prompts, all but the last `tail` cut to `short` tokens: every prompt's
        prefill and admission compile, and the last requests, kept whole, run a tail like the
        timed one's, which narrows the batch (only rows with chunks left to run narrow)."""
        head = len(self) - tail
        return Workload(self.prompts, (short,) * head + self.max_tokens[head:])


def workload(args) -> Workload:
    if args.data.is_file():
        texts = common.math_prompts(args.data, args.requests)
    else:
        texts = [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(args.requests)]
    if args.prompt_chars is not None:
        texts = [t[: args.prompt_chars] for t in texts]
    lo, hi = args.max_tokens
    lengths = np.random.default_rng(0).integers(lo, hi + 1, args.requests).tolist()
    return Workload(tuple(texts), tuple(lengths))


def level_size(args, clients: int) -> int:
    return min(args.requests, args.per_client * clients)


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- what a level measured ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    index: int
    ttft_s: float  # from sending it to its first text
    latency_s: float  # from sending it to its end
    text: str
    tokens: int


@dataclasses.dataclass(frozen=True)
class LevelRun:
    """One timed level of one mode."""

    outcomes: tuple[Outcome, ...]  # in request order
    wall_s: float
    compile_s: float
    compiles: int
    compiled: tuple[str, ...] | None  # the programs' names (the server's log has them)
    cpu: dict[str, float]  # CPU seconds of the serving process's threads, by role
    client_cpu_s: float | None  # the clients' process (server mode)
    counters: dict[str, float]  # the engine's decode steps, compressions, engine-side TTFT


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds so far) of every thread of `pid` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_role(pid: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each thread used between two `thread_cpu` readings, summed by role: the
    main thread, the busiest other Python thread (the engine's own thread in a server; Python
    3.11 names no OS threads), the other Python threads, and every other name (XLA's pools)."""
    main_name = after.get(pid, ("", 0.0))[0]
    used = {tid: (name, s - before.get(tid, (name, 0.0))[1]) for tid, (name, s) in after.items()}
    others = sorted(
        (s for tid, (name, s) in used.items() if tid != pid and name == main_name), reverse=True
    )
    out = {
        "main": used.get(pid, ("", 0.0))[1],
        "busiest_other_python": others[0] if others else 0.0,
    }
    out["other_python"] = sum(others[1:])
    for name, s in used.values():
        if name != main_name:
            out[name] = out.get(name, 0.0) + s
    out["total"] = sum(s for _, s in used.values())
    return {k: round(v, 2) for k, v in out.items()}


# -- engine mode --------------------------------------------------------------------------


def sampling(max_tokens: int) -> rkvjax.SamplingParams:
    return rkvjax.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drive_engine(engine, work: Workload, clients: int, timeout_s: float) -> LevelRun:
    """The closed loop on the engine itself: `clients` requests in flight, the next one
    submitted in the round its predecessor finished, until every request is done."""
    engine.reset_stats()
    pid = os.getpid()
    cpu0, programs0 = thread_cpu(pid), engine.executor.compile.programs
    pending = iter(range(len(work)))
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, tuple[float, object]] = {}

    def submit_next() -> None:
        i = next(pending, None)
        if i is not None:
            sent[i] = time.perf_counter()
            stream = dict(request_id=i, stream=True)
            engine.submit(messages(work.prompts[i]), sampling(work.max_tokens[i]), **stream)

    t0 = time.perf_counter()
    for _ in range(clients):
        submit_next()
    while engine.has_work:
        finished = engine.step()
        now = time.perf_counter()
        for d in engine.take_deltas():
            if d.text and d.request_id not in first:
                first[d.request_id] = now
        for r in finished:
            done[r.request_id] = (now, r)
            submit_next()
        if now - t0 > timeout_s:
            raise TimeoutError(f"engine level at {clients} clients ran past {timeout_s} s")
    wall = time.perf_counter() - t0
    st = engine.stats
    outcomes = tuple(
        Outcome(i, first.get(i, end) - sent[i], end - sent[i], r.text, len(r.token_ids))
        for i, (end, r) in sorted(done.items())
    )
    ttfts = [r.stats.time_to_first_token_s for _, r in done.values()]
    counters = {
        "decode_steps": st.decode_steps,
        "compressions": st.compressions,
        "slot_occupancy": st.slot_occupancy,
        "engine_ttft_mean_s": statistics.fmean(ttfts),
    }
    return LevelRun(
        outcomes,
        wall,
        st.compile_s,
        engine.executor.compile.programs - programs0,
        None,
        cpu_by_role(pid, cpu0, thread_cpu(pid)),
        None,
        counters,
    )


# -- the server process -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Server:
    """A running `rkvjax serve` process and its log."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return r.read()

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        out = {}
        for line in self.get("/metrics").decode().splitlines():
            m = re.fullmatch(r"(rkvjax_[a-z_]+) (\S+)", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def log_size(self) -> int:
        return self.log.stat().st_size

    def compiles_since(self, offset: int) -> tuple[tuple[str, ...], float]:
        """(the programs compiled, seconds tracing, lowering and compiling) logged since
        `offset` bytes into the log."""
        with self.log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        names = tuple(_PROGRAM.findall(text))
        return names, sum(float(s) for s in _COMPILE_STEP.findall(text))

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def server_command(args, model, port: int) -> list[str]:
    """`rkvjax serve` with the engine configuration `serving_engine` gets here."""
    cmd = [sys.executable, "-m", "rkvjax", "serve", "--model", str(model.path)]
    cmd += ["--dtype", np.dtype(model.dtype).name, "--slots", str(args.slots)]
    cmd += ["--method", args.method]
    if args.method != "full":
        cmd += ["--budget", str(args.budget), "--buffer", str(args.buffer)]
    if args.max_model_len is not None:
        cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += ["--host", HOST, "--port", str(port), "--served-model-name", SERVED_NAME]
    return [*cmd, "--temperature", "0"]


@contextlib.contextmanager
def running_server(
    cmd: list[str], port: int, log: Path, env: dict | None = None
) -> Iterator[Server]:
    """Starts the server (its compiles logged; `env` default: this process's), yields it, then
    stops it with SIGTERM."""
    env = {**(os.environ if env is None else env), "JAX_LOG_COMPILES": "1"}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        yield Server(proc, port, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def wait_ready(server: Server, timeout_s: float) -> float:
    """Seconds until /health answers (the server loaded and warmed up)."""
    t0 = time.perf_counter()
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {server.proc.returncode}:\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError, urllib.error.URLError):
            if json.loads(server.get("/health")).get("status") == "ok":
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"the server did not start in {timeout_s} s:\n{server.log_tail()}")
        time.sleep(0.5)


# -- server mode --------------------------------------------------------------------------


async def one_request(client, work: Workload, i: int) -> Outcome:
    """Request i as one streamed chat completion; times at the client."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages(work.prompts[i]),
        max_tokens=work.max_tokens[i],
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first, parts, tokens = None, [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Outcome(i, (first or end) - t0, end - t0, "".join(parts), tokens)


async def closed_loop(base: str, work: Workload, clients: int) -> tuple[list[Outcome], float]:
    """`clients` tasks, each sending its next request when its last one's stream ended."""
    import openai

    pending = iter(range(len(work)))
    out: list[Outcome] = []
    async with openai.AsyncOpenAI(
        base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600.0
    ) as client:

        async def one_client():
            for i in pending:  # shared: each task takes the next index
                out.append(await one_request(client, work, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return out, time.perf_counter() - t0


def drive_server(server: Server, work: Workload, clients: int, timeout_s: float) -> LevelRun:
    m0, log0, cpu0 = server.metrics(), server.log_size(), thread_cpu(server.proc.pid)
    me0 = time.process_time()
    outcomes, wall = asyncio.run(
        asyncio.wait_for(closed_loop(server.base, work, clients), timeout_s)
    )
    client_cpu = time.process_time() - me0
    cpu = cpu_by_role(server.proc.pid, cpu0, thread_cpu(server.proc.pid))
    m1 = server.metrics()
    compiled, compile_s = server.compiles_since(log0)

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    ttft_n = delta("rkvjax_time_to_first_token_seconds_count")
    counters = {
        "decode_steps": delta("rkvjax_decode_steps_total"),
        "compressions": delta("rkvjax_compressions_total"),
        "engine_ttft_mean_s": delta("rkvjax_time_to_first_token_seconds_sum") / max(ttft_n, 1),
    }
    return LevelRun(
        tuple(sorted(outcomes, key=lambda o: o.index)),
        wall,
        compile_s,
        len(compiled),
        compiled,
        cpu,
        client_cpu,
        counters,
    )


# -- rows ---------------------------------------------------------------------------------


def row_of(mode: str, clients: int, runs: list[LevelRun], base: dict) -> dict:
    """One mode at one level over its rounds: rates are medians of the rounds', times to first
    token and latencies are pooled over every request of every round."""
    outcomes = [o for r in runs for o in r.outcomes]
    ttft = [o.ttft_s for o in outcomes]
    tokens = sum(o.tokens for o in runs[0].outcomes)  # every round runs the same requests
    # A program the warm-up missed compiles once per process, which is not throughput.
    busy_s = [r.wall_s - r.compile_s for r in runs]
    cpu = {k: round(sum(r.cpu.get(k, 0.0) for r in runs), 2) for k in runs[0].cpu}
    wall = sum(r.wall_s for r in runs)
    return {
        "bench": "serve",
        "mode": mode,
        "clients": clients,
        "rounds": len(runs),
        "requests": len(runs[0].outcomes),
        "generated_tokens": tokens,
        "wall_s": [r.wall_s for r in runs],
        "compile_s": [r.compile_s for r in runs],
        "compiles": [r.compiles for r in runs],
        "compiled": [r.compiled for r in runs],
        "requests_per_s": statistics.median(len(runs[0].outcomes) / t for t in busy_s),
        "tokens_per_s": statistics.median(tokens / t for t in busy_s),
        "tokens_per_s_rounds": [tokens / t for t in busy_s],
        "tokens_per_s_wall": statistics.median(tokens / r.wall_s for r in runs),
        "tokens_per_s_wall_rounds": [tokens / r.wall_s for r in runs],
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "latency_median_s": statistics.median(o.latency_s for o in outcomes),
        # CPU time does not depend on what else the machine runs, as wall time does: a mode
        # that does more work per token shows here even when the load hides it in tokens/s.
        "cpu_ms_per_token": 1e3 * cpu["total"] / (tokens * len(runs)),
        "cores_used": cpu["total"] / wall,
        "cpu_s": cpu,
        "client_cpu_s": None if runs[0].client_cpu_s is None else sum(r.client_cpu_s for r in runs),
        **{k: [r.counters[k] for r in runs] for k in runs[0].counters},
        "loadavg": os.getloadavg(),
        **base,
    }


def compare(engine_runs: list[LevelRun], server_runs: list[LevelRun]) -> dict:
    """Whether every request's text from the server equals the engine's (first round), in
    every round of both."""
    reference = engine_runs[0].outcomes
    wrong, counts = set(), set()
    for run in [*engine_runs[1:], *server_runs]:
        for e, o in zip(reference, run.outcomes, strict=True):
            if e.text != o.text:
                wrong.add(e.index)
            if e.tokens != o.tokens:
                counts.add(e.index)
    return {
        "same_outputs": not wrong,
        "mismatched_requests": sorted(wrong),
        "token_count_mismatches": sorted(counts),
    }


def paired(server: list[float], engine: list[float]) -> float:
    """The median over rounds of server / engine: the two runs of a round are back to back, so
    a slow drift in the machine's load cancels better than in a ratio of medians."""
    return statistics.median(s / e for s, e in zip(server, engine, strict=True))


def load(args):
    """(model, name): the tiny chat checkpoint (the server needs a tokenizer) or --model."""
    path = common.tiny_chat_checkpoint() if args.tiny else args.model
    model = rkvjax.load(path, dtype=args.dtype)
    name = common.TINY_MODEL_NAME if args.tiny else Path(model.path).name
    return model, name


def cache_options(args) -> dict:
    if args.method == "full":
        return {"method": "full"}
    return {"method": args.method, "budget": args.budget, "buffer": args.buffer}


def say(text: str) -> None:
    print(f"[serve] {text}", file=sys.stderr, flush=True)


def warm_up_levels(drive, work: Workload, args) -> None:
    """Each level once, untimed (`Workload.warm_up`)."""
    for c in sorted(set(args.clients)):
        level = work.first(level_size(args, c))
        drive(level.warm_up(args.max_tokens[0], min(args.slots, len(level))), c)


def run(args, folder) -> list[dict]:
    with home.compile_cache():
        return measure(args, folder)


def measure(args, folder) -> list[dict]:
    model, name = load(args)
    work = workload(args)
    engine, _ = serve.serving_engine(
        model, cache=cache_options(args), slots=args.slots, max_model_len=args.max_model_len
    )
    base = {
        "slots": engine.slots,
        "method": args.method,
        "budget": args.budget if args.method != "full" else None,
        "buffer": args.buffer,
        "max_tokens_range": list(args.max_tokens),
        **common.run_meta(model=name, dtype=np.dtype(model.dtype).name),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        # The server loads and compiles while this process warms its own engine up.
        with running_server(server_command(args, model, port), port, Path(tmp) / "log") as srv:
            drivers = {
                "engine": lambda w, c: drive_engine(engine, w, c, args.level_timeout),
                "server": lambda w, c: drive_server(srv, w, c, args.level_timeout),
            }
            t0 = time.perf_counter()
            serve.warm_up(engine, background=False)  # what `rkvjax serve` runs, all of it
            warm_up_levels(drivers["engine"], work, args)
            say(f"engine warmed up in {time.perf_counter() - t0:.0f} s")
            wait_ready(srv, args.start_timeout)
            say(f"server up after {time.perf_counter() - t0:.0f} s")
            warm_up_levels(drivers["server"], work, args)
            say(f"server warmed up after {time.perf_counter() - t0:.0f} s")
            for k, c in enumerate(sorted(set(args.clients))):
                level = work.first(level_size(args, c))
                runs = {m: [] for m in MODES}
                for r in range(args.repeats):
                    # The modes take turns going first (ABBA...), so a change in the machine's
                    # load over the run hits both alike.
                    for m in MODES if (k + r) % 2 == 0 else MODES[::-1]:
                        runs[m].append(drivers[m](level, c))
                    say(f"{c} clients, round {r + 1}: engine {runs['engine'][-1].wall_s:.0f} s, "
                        f"server {runs['server'][-1].wall_s:.0f} s")  # fmt: skip
                same = compare(runs["engine"], runs["server"])
                eng, srv_row = (row_of(m, c, runs[m], base) | same for m in MODES)
                for key in ("", "_wall"):
                    srv_row[f"server_vs_engine{key}"] = paired(
                        srv_row[f"tokens_per_s{key}_rounds"], eng[f"tokens_per_s{key}_rounds"]
                    )
                srv_row["cpu_vs_engine"] = srv_row["cpu_ms_per_token"] / eng["cpu_ms_per_token"]
                for row in (eng, srv_row):
                    common.emit(row, folder)
                    rows.append(row)
    return rows


# -- tables and plots ---------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    r = rows[0]
    budget = "FullKV" if r["method"] == "full" else f"{r['method']} {r['budget']} + {r['buffer']}"
    lo, hi = r["max_tokens_range"]
    head = (
        f"{r['model']} {r['dtype']}, {r['slots']} slots, {budget}, greedy with ignore_eos, "
        f"max_tokens {lo}..{hi}; a closed loop of C streaming clients, {r['rounds']} round(s) "
        "per level, the modes alternating. tok/s and req/s: medians over the rounds, of the "
        "wall time less compilation; server / engine: the median per-round ratio; TTFT: at "
        "the client, over every round's requests; CPU ms per token: the serving process's, "
        "every thread; wall s, compile s and decode steps: per round."
    )

    def each(key: str, fmt: str):
        return lambda x: ", ".join(format(v, fmt) for v in x[key])

    columns = [
        ("mode", "mode", "s"),
        ("clients", "clients", "d"),
        ("requests", "requests", "d"),
        ("tok/s", "tokens_per_s", ".1f"),
        ("req/s", "requests_per_s", ".2f"),
        ("server / engine", "server_vs_engine", ".2f"),
        ("TTFT p50 s", "ttft_median_s", ".2f"),
        ("TTFT p90 s", "ttft_p90_s", ".2f"),
        ("CPU ms/token", "cpu_ms_per_token", ".1f"),
        ("cores used", "cores_used", ".2f"),
        ("wall s", each("wall_s", ".1f"), "s"),
        ("compile s", each("compile_s", ".1f"), "s"),
        ("decode steps", each("decode_steps", ".0f"), "s"),
        ("same outputs", lambda x: str(x["same_outputs"]), "s"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def plot(plt, rows: list[dict]):
    """Tokens/s and time to first token against concurrent clients, both modes."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    common.lines(
        ax1,
        common.series(rows, "mode", "clients", "tokens_per_s"),
        xlabel="concurrent clients",
        ylabel="generated tokens/s",
        title=f"{rows[0]['model']}, {rows[0]['slots']} slots",
    )
    ttft = {}
    for stat, key in (("p50", "ttft_median_s"), ("p90", "ttft_p90_s")):
        for mode, xy in common.series(rows, "mode", "clients", key).items():
            ttft[f"{mode} {stat}"] = xy
    common.lines(
        ax2, ttft, xlabel="concurrent clients", ylabel="seconds", title="time to first token"
    )
    return fig
