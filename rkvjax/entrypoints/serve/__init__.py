"""`rkvjax serve`: an OpenAI-compatible HTTP server on the slot runtime.

One model and one cache policy, chosen at start, behind `/v1/chat/completions`,
`/v1/completions`, `/v1/models`, `/health` and `/metrics` (`app`). One thread owns the
`Engine` (`worker`); the HTTP handlers (Starlette under uvicorn) check requests, hand them to
it and stream its deltas back (`protocol`). `serving_engine` builds the engine a server runs,
`build_app` the ASGI app around it, and `serve` runs both until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rkvjax.lazy import attribute_loader

if TYPE_CHECKING:
    from rkvjax.entrypoints.serve.app import ServeConfig, build_app
    from rkvjax.entrypoints.serve.server import bind, memory_line, serve, serving_engine, warm_up

# The command line reads these without loading the HTTP stack.
DEFAULT_SERVE_SLOTS = 32  # at most, when memory allows (`runtime.sizing.default_slots`)
DEFAULT_MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
DEFAULT_MAX_BODY_BYTES = 16 << 20
SHUTDOWN_TIMEOUT_S = 30  # SIGTERM: seconds running requests get to finish

_HOMES = {
    "ServeConfig": "rkvjax.entrypoints.serve.app",
    "build_app": "rkvjax.entrypoints.serve.app",
    "bind": "rkvjax.entrypoints.serve.server",
    "memory_line": "rkvjax.entrypoints.serve.server",
    "serve": "rkvjax.entrypoints.serve.server",
    "serving_engine": "rkvjax.entrypoints.serve.server",
    "warm_up": "rkvjax.entrypoints.serve.server",
}

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_SERVE_SLOTS",
    "SHUTDOWN_TIMEOUT_S",
    "ServeConfig",
    "bind",
    "build_app",
    "memory_line",
    "serve",
    "serving_engine",
    "warm_up",
]


__getattr__ = attribute_loader(__name__, _HOMES)
