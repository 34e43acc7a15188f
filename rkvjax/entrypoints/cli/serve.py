"""`rkvjax serve`: the OpenAI-compatible HTTP server on one model."""

from __future__ import annotations

import argparse
import os
import sys

import jax

from rkvjax.entrypoints import serve as serve_defaults
from rkvjax.entrypoints.cli import flags


def add(sub) -> argparse.ArgumentParser:
    v = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and text completions, streaming, metrics)",
    )
    flags.add_generation_args(
        v,
        n_help="samples per request when it gives no n",
        sampling={"temperature": 1.0, "max_new_tokens": None},
        max_tokens_help="when a request gives none (default: the rest of the context)",
        offline=False,
    )
    v.set_defaults(seed=None)
    v.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"rows decoded at once (default: what memory allows, at most "
        f"{serve_defaults.DEFAULT_SERVE_SLOTS})",
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    v.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    v.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $RKVJAX_API_KEY, "
        "else none)",
    )
    v.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` clients name (default: the model folder's or file's name)",
    )
    v.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + max_tokens at most per request (default: the model's positions)",
    )
    v.add_argument(
        "--max-logprobs",
        type=int,
        default=serve_defaults.DEFAULT_MAX_LOGPROBS,
        help="the most top_logprobs a request may ask for (%(default)s)",
    )
    v.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="abort a request that runs longer (default: no limit)",
    )
    v.add_argument(
        "--max-body-bytes",
        type=int,
        default=serve_defaults.DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (%(default)s)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=int,
        default=serve_defaults.SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish before they are aborted "
        "(%(default)s)",
    )
    v.add_argument(
        "--no-warmup",
        action="store_true",
        help="start at once; programs compile when the first requests need them",
    )
    v.add_argument(
        "--no-narrow-tail",
        action="store_true",
        help="always decode every slot: skips compiling the narrower batches at start (faster "
        "start-up, slower decoding while few requests run)",
    )
    return v


def run(args: argparse.Namespace) -> int:
    from rkvjax.entrypoints import serve
    from rkvjax.entrypoints.serve import app as serve_app

    if jax.process_count() > 1:
        raise ValueError("rkvjax serve runs in one process (a --mesh over its own devices)")
    fields = flags.sampling(args)
    if fields["max_tokens"] is None:  # the rest of each request's context
        del fields["max_tokens"]
    flags.checked_sampling(args, fields)
    for name in ("port", "max_body_bytes", "shutdown_timeout"):
        value = getattr(args, name)
        low = 1 if name != "shutdown_timeout" else 0
        if value < low or (name == "port" and value > 65535):
            raise ValueError(f"--{name.replace('_', '-')} out of range: {value}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    api_key = api_key_of(args.api_key, os.environ.get("RKVJAX_API_KEY"))
    serve_app.check_api_key(api_key)
    if fields.get("logprobs") is not None and fields["logprobs"] > args.max_logprobs:
        raise ValueError(f"--logprobs {fields['logprobs']} is more than --max-logprobs")
    sock = serve.bind(args.host, args.port)
    model = flags.load(args)
    engine, length = serve.serving_engine(
        model,
        cache=flags.cache(args),
        slots=args.slots,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        narrow_tail=not args.no_narrow_tail,
    )
    if fields.get("n", 1) > engine.slots:
        raise ValueError(f"--n {fields['n']} is more than the {engine.slots} slots")
    cc = engine.compression
    policy = "FullKV" if not cc.compressing else f"{cc.method} budget {cc.budget}"
    name = args.served_model_name or model.path.name
    print(f"[rkvjax] {serve.memory_line(engine)}", file=sys.stderr)
    if not args.no_warmup:
        print(
            "[rkvjax] compiling the programs of the full batch width (kept in the compile "
            "cache for the next start; the narrower widths compile behind the first requests) "
            "...",
            file=sys.stderr,
        )
        seconds = serve.warm_up(engine)
        print(f"[rkvjax] warm-up done in {seconds:.1f} s", file=sys.stderr)
    config = serve.ServeConfig(
        model_name=name,
        max_model_len=length,
        defaults=fields,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )
    access = "API key required" if api_key is not None else "open: no API key"
    print(
        f"[rkvjax] serving {name} ({model.config.describe()}, {model.dtype.__name__}, {policy}, "
        f"{engine.slots} slots, context {length}) on http://{args.host}:{args.port}/v1 "
        f"({access})",
        file=sys.stderr,
    )
    serve.serve(
        engine,
        config,
        host=args.host,
        port=args.port,
        sock=sock,
        shutdown_timeout=args.shutdown_timeout,
    )
    return 0


def api_key_of(flag: str | None, env: str | None) -> str | None:
    """The server's API key: --api-key, else $RKVJAX_API_KEY, else None (an open server). An
    empty one is refused: `--api-key "$KEY"` with KEY unset would otherwise start an open
    server while its user believes it is protected."""
    for given, name in ((flag, "--api-key"), (env, "$RKVJAX_API_KEY")):
        if given is None:
            continue
        if not given:
            raise ValueError(
                f"{name} is empty (an unset shell variable?): give the key, or leave "
                f"{name} out to serve without one"
            )
        return given
    return None
