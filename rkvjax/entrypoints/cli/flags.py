"""The flags the commands share, and what they mean: the model, cache and sampling flags,
the mesh, and the checks that run before a model loads."""

from __future__ import annotations

import argparse
import sys

import jax

from rkvjax import api, checks, defaults
from rkvjax.entrypoints import jobs
from rkvjax.kv import policies, quantization
from rkvjax.kv.config import check_context, compression_config, method_names
from rkvjax.models import loading, sharding
from rkvjax.sampling.params import SamplingParams


def add_generation_args(
    p: argparse.ArgumentParser,
    n_flags: tuple[str, ...] = ("--n",),
    n_help: str = "samples per prompt",
    *,
    sampling: dict | None = None,
    max_tokens_help: str = "(default: %(default)s)",
    offline: bool = True,
) -> None:
    """The model, cache and sampling flags; `sampling` overrides the defaults of temperature,
    top_p and max_new_tokens (their help shows the parser's own); `offline`: with --no-chat
    and --progress (a server has neither)."""
    shown = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": api.DEFAULT_MAX_NEW_TOKENS}
    shown.update(sampling or {})
    p.add_argument(
        "--model",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder or .gguf file (default: %(default)s, prepared on first use)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=shown["max_new_tokens"],
        help=f"tokens to generate at most per sample {max_tokens_help}",
    )
    p.add_argument(
        "--method",
        choices=method_choices(),
        default=None,
        help="cache policy (default: rkv with --budget, FullKV without); $RKVJAX_POLICIES names "
        "modules that register more",
    )
    p.add_argument(
        "--method-arg",
        dest="method_args",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a hyperparameter of the method (repeatable), e.g. lam=0.2 for rkv",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="PATH",
        help="statistics of the model's queries for a method that reads them (triattention), "
        "written by `rkvjax calibrate`",
    )
    p.add_argument(
        "--budget",
        type=budget_arg,
        default=None,
        help="KV tokens kept per layer/head/row: an integer, or a fraction in (0, 1] of the "
        "longest prompt + max tokens written with a point (0.1, 1.0); omit for FullKV",
    )
    p.add_argument(
        "--buffer",
        type=int,
        default=defaults.BUFFER,
        help="new tokens between compressions (%(default)s)",
    )
    p.add_argument(
        "--share",
        choices=checks.SHARES,
        default=defaults.SHARE,
        help="one kept set per (layer, KV head) (none, the default), per layer (heads: scores "
        "averaged over KV heads), per KV head (layers: scores summed over layers), or per row "
        "(all)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=quantization.KV_DTYPES,
        default=None,
        help="what the cache stores, for every method: int8 and float8_e4m3fn keep a float32 "
        "scale per (token, head), about half of bfloat16's bytes (default: the model's dtype)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute each row's numbers the same way whatever runs beside it, so a sample's "
        "tokens, logprobs and kept sets equal its run alone to the bit (default: on for an "
        "8-bit --kv-dtype, off otherwise)",
    )
    p.add_argument("--think-only", action="store_true", help="stop compressing after </think>")
    s = p.add_argument_group("sampling (vLLM's SamplingParams; a job's lines may override them)")
    s.add_argument(*n_flags, dest="n", type=int, default=1, help=n_help)
    s.add_argument(
        "--temperature",
        type=float,
        default=shown["temperature"],
        help="0 = greedy (default: %(default)s)",
    )
    s.add_argument("--top-p", type=float, default=shown["top_p"], help="(default: %(default)s)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument(
        "--logprobs", type=int, default=None, metavar="N", help="record the top N logprobs"
    )
    if not offline:
        return
    p.add_argument(
        "--no-chat", action="store_true", help="send the raw text, without the chat template"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        type=mesh_arg,
        default=None,
        metavar="data=D,model=M",
        help="split over D x M devices: batch rows on data, heads / MLP / vocab on model "
        "(D * M must equal the device count, every process's together; default: one device)",
    )
    d = p.add_argument_group("multi-process (one process per host; see README)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)


def shard_arg(text: str) -> tuple[int, int]:
    try:
        return jobs.parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mesh_arg(text: str) -> dict[str, int]:
    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def budget_arg(text: str) -> int | float:
    """--budget: an integer is tokens, a number with a point (or an exponent) a fraction, as
    `generate`'s int and float budgets: "1.0" is the whole length, "1" one token."""
    try:
        if not any(c in text for c in ".eE"):
            return int(text)
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes tokens (an integer) or a fraction in (0, 1], got {text!r}"
        ) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"a fraction must lie in (0, 1], got {text}; give tokens as an integer"
        )
    return value


def method_choices() -> tuple[str, ...]:
    """The methods the flags accept: every registered one, or the built-ins when a plug-in
    fails to load (`main` reports that to the commands that take a method)."""
    try:
        return method_names()
    except ValueError:
        return ("full", *policies.BUILTINS)


def mesh(args: argparse.Namespace):
    return None if args.mesh is None else sharding.make_mesh(**args.mesh)


def load(args: argparse.Namespace) -> api.Model:
    """The model, once the cache flags are checked against its config (no weights read yet)."""
    cfg = loading.read_config(args.model)
    budget = getattr(args, "budget", None)
    if isinstance(budget, int):  # a fraction resolves within the lengths, checked later
        try:
            check_context(compression_config(**policy(cache(args))), cfg.max_positions)
        except ValueError as e:
            raise ValueError(f"cache flags: {e}") from None
    return api.load(args.model, dtype=args.dtype, mesh=mesh(args))


def cache(args: argparse.Namespace) -> dict:
    """The cache-policy keywords of `generate` / `engine_for` from the flags (the method's
    options only as given, so that job headers written before options existed still match)."""
    method = args.method
    if method is None:  # what the headers of earlier jobs recorded for no --method
        method = "rkv"
    elif method != "full" and args.budget is None:
        raise ValueError(
            f"cache flags: --method {method} compresses the cache to a --budget: give one "
            "(e.g. --budget 256), or drop --method for FullKV"
        )
    if args.method_args and method == "full":
        raise ValueError("cache flags: --method full has no options; drop --method-arg")
    try:
        options = policies.parse_options(method, args.method_args) if args.method_args else {}
    except ValueError as e:
        raise ValueError(f"cache flags: --method-arg: {e}") from None
    calibration = getattr(args, "calibration", None)
    if calibration is not None:
        if method == "full" or "calibration" not in policies.option_names(method):
            raise ValueError(
                f"cache flags: --calibration: method {method!r} reads no calibration "
                "statistics; drop --calibration"
            )
        if "calibration" in options:
            raise ValueError(
                "cache flags: --calibration and --method-arg calibration=... both given; give one"
            )
        options["calibration"] = calibration
    return {
        "method": method,
        "budget": args.budget,
        "buffer": args.buffer,
        "think_only": args.think_only,
        # Only when given: the headers of jobs written before these flags still match.
        **({"share": args.share} if args.share != defaults.SHARE else {}),
        **({"kv_dtype": args.kv_dtype} if args.kv_dtype is not None else {}),
        **({"batch_invariant": args.batch_invariant} if args.batch_invariant is not None else {}),
        **options,
    }


# `cache` keywords that are the engine's, not the cache policy's (`compression_config`'s).
ENGINE_KEYWORDS = ("think_only", "batch_invariant")


def policy(cache: dict) -> dict:
    """`cache`'s keywords as `compression_config` takes them."""
    return {k: v for k, v in cache.items() if k not in ENGINE_KEYWORDS}


def sampling(args: argparse.Namespace) -> dict:
    """The sampling flags as `SamplingParams` fields."""
    return {
        "n": args.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "max_tokens": args.max_new_tokens,
        "min_tokens": args.min_tokens,
        "stop": args.stop or [],
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
    }


def checked_sampling(args: argparse.Namespace, fields: dict | None = None) -> dict:
    """The sampling flags (or `fields` made of them), checked before anything slow starts;
    the cache flags too."""
    fields = sampling(args) if fields is None else fields
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"sampling flags: {e}") from None
    settings = cache(args)
    if settings["method"] == "full" and settings["budget"] is not None:
        # `generate(method="full", budget=...)` is FullKV by contract; a flag typed for nothing
        # is refused instead.
        raise ValueError(
            f"cache flags: --method full keeps every token and takes no --budget (got "
            f"{settings['budget']}); drop --budget, or pick a compressing method"
        )
    try:  # the lengths only resolve a fractional budget, which is checked again with the model
        compression_config(prompt_len=1, max_new_tokens=1, **policy(settings))
    except ValueError as e:
        raise ValueError(f"cache flags: {e}") from None
    return fields


def progress(args) -> bool:
    return sys.stderr.isatty() if args.progress is None else args.progress


def report(line: str) -> None:
    """A command's closing line, on stderr, from process 0 only (every process ran it)."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr)
