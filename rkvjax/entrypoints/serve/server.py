"""Running a server: the engine it drives (`serving_engine`), its warm-up, and uvicorn
(`serve`)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from rkvjax import api, runtime
from rkvjax.entrypoints.serve import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_SERVE_SLOTS,
    SHUTDOWN_TIMEOUT_S,
    scoring,
)
from rkvjax.entrypoints.serve.app import ServeConfig, build_app
from rkvjax.runtime import sizing

log = logging.getLogger(__name__)

# A server's peak, in rows' worth of cache per slot: its state, and half as many rows again
# while it narrows or widens (both states are live during the move) or while a prefilled group
# of up to half the slots waits for its insert. Warm-up runs each of these once.
PEAK_ROWS = 1.5


def serving_engine(
    model: api.Model,
    *,
    cache: Mapping[str, Any],
    slots: int | None = None,
    max_model_len: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    chunk: int = runtime.DEFAULT_CHUNK,
    narrow_tail: bool = True,
) -> tuple[runtime.Engine, int]:
    """The engine a server runs, and its context length (prompt + max_tokens at most).

    Any request must fit, so the engine allows what a request may ask: penalties, up to
    `max_logprobs` logprobs, and for FullKV a cache of `max_model_len` tokens per slot.

    Args:
      model: from `rkvjax.load`.
      cache: `generate`'s cache keywords (method, budget, buffer, ...); a fractional budget is
        a fraction of the context.
      slots: rows decoded together (default: DEFAULT_SERVE_SLOTS, or fewer: as many as keep
        the server's peak, PEAK_ROWS x the state, within the memory share of
        `sizing.default_slots`).
      max_model_len: the context (default: the model's positions).
      max_logprobs: the most `logprobs` / `top_logprobs` a request may ask for (0: none).
    """
    positions = model.config.max_positions
    length = positions if max_model_len is None else max_model_len
    if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= positions:
        raise ValueError(
            f"max_model_len must be an int in [2, {positions}] (the model's positions), got "
            f"{max_model_len!r}"
        )
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
        raise ValueError(f"max_logprobs must be an int >= 0, got {max_logprobs!r}")
    cache = dict(cache)
    batch_invariant = cache.pop("batch_invariant", None)  # the engine's, not the policy's
    cc = api.cache_config(model, prompt_len=length, max_new=0, **cache)
    capacity = cc.capacity if cc.compressing else length - 1
    if slots is None:
        slots = sizing.default_slots(
            model,
            cc,
            samples=DEFAULT_SERVE_SLOTS,
            capacity=capacity,
            penalties=True,
            peak_rows=PEAK_ROWS,
        )
    engine = runtime.Engine(
        model,
        slots=slots,
        cache=cc,
        max_len=None if cc.compressing else capacity,
        chunk=chunk,
        logprobs=min(max_logprobs, model.config.vocab_size) or None,
        penalties=True,
        narrow_tail=narrow_tail,
        max_prefill_rows=max(1, slots // 2),  # the peak's half-width bound holds for a group too
        batch_invariant=batch_invariant,
    )
    # A client cannot call Engine(...): the refusal of too many logprobs names the flag.
    engine.limits = dataclasses.replace(
        engine.limits, logprobs_setting="the server's --max-logprobs"
    )
    return engine, length


def memory_line(engine: runtime.Engine) -> str:
    """What a server's slots hold, said at start: the state, its peak (PEAK_ROWS of it) and
    the share of memory default slots are sized to."""
    import jax

    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.state_shapes()))
    line = (
        f"{engine.slots} slots: {_gib(state)} of state, at most {_gib(PEAK_ROWS * state)} at its "
        "peak"
    )
    memory = sizing.device_memory(engine.model)
    if memory is not None:
        line += f" (default slots keep the peak within {_gib(sizing.MEMORY_SHARE * memory)})"
    return line


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


UVICORN_MARGIN_S = 10  # uvicorn cuts what still runs this long after our own grace period
WARM_UP_PROMPT = "Say hello to the people of the world, in one short and friendly sentence."


def warm_up(engine: runtime.Engine, *, background: bool = True) -> float:
    """Makes a server ready in seconds: compiles, without running them, the programs requests
    need at the full batch width (the empty state, one prompt's prefill and insert, the decode
    chunk, the release: `Engine.warm_widths`; with a warm compile cache each is a load from
    disk), and starts allocating the state's memory, which then overlaps the rest of the
    start. Nothing is decoded: running the programs on empty rows, as a start once did, cost
    minutes when the rows hold long contexts. The programs of the narrower widths the batch
    tail may shrink to, and the row moves between widths, compile on a background thread,
    behind the first requests (until they are ready, a narrowing that needs one compiles
    it), or before this returns (`background=False`: a benchmark's timed part must not share
    the CPU with them). A prompt of another length bucket, or several prompts arriving at once,
    compile their prefill (and insert) on first use. Returns the seconds it took."""
    t0 = time.perf_counter()
    tok = engine.model.tokenizer
    # At least a compression window's tokens, with or without a chat template.
    prompt = WARM_UP_PROMPT if tok is not None else list(range(1, 17))
    engine.warm_widths(prompt, narrow=False)
    engine.allocate()
    if not background:
        engine.warm_widths(prompt)
    elif engine.scheduler.cfg.narrow_tail:
        threading.Thread(
            # Not a daemon: a process that ends while XLA compiles (JAX's exit handlers
            # tearing the backend down under it) could crash instead of exiting cleanly.
            target=_warm_narrower,
            args=(engine, prompt),
            name="rkvjax-warm-up",
            daemon=False,
        ).start()
    return time.perf_counter() - t0


def _warm_narrower(engine: runtime.Engine, prompt) -> None:
    t0 = time.perf_counter()
    try:
        widths = engine.warm_widths(prompt)
    except Exception:  # a compile that fails here fails again, with its request, where it is used
        log.exception("compiling the narrower batch widths failed")
        return
    print(
        f"[rkvjax] compiled the programs of batch widths {', '.join(map(str, widths))} in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, opened before the model loads: a port in use is an
    error at once, not after minutes of compiling."""
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(
    engine: runtime.Engine,
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    shutdown_timeout: int = SHUTDOWN_TIMEOUT_S,
    log_level: str = "info",
) -> None:
    """Serves `engine` over HTTP until SIGTERM or Ctrl-C, on `sock` (from `bind`) or on
    host:port.

    SIGTERM stops admitting (the listening socket closes), gives running requests up to
    `shutdown_timeout` seconds to finish, aborts the rest and returns; Ctrl-C the same, then
    KeyboardInterrupt.
    """
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="[rkvjax] %(message)s", stream=sys.stderr)
    app = build_app(engine, config, scorer=scoring.scoring_engine(engine, config.max_model_len))
    state = app.state.server

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Our own grace period first, so that uvicorn never has to cancel a response.
            state.shut_down(shutdown_timeout)
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=shutdown_timeout + UVICORN_MARGIN_S,
            lifespan="on",
        )
    )
    # uvicorn raises a signal it handled again once it has shut down; SIGTERM's default
    # action would then end the process with a signal status instead of a clean exit.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
