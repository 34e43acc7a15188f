"""Command line: `rkvjax generate "prompt" ...`, `rkvjax batch IN.jsonl OUT.jsonl ...` and
`rkvjax convert SRC DST`."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax

from rkvjax import api, jobs, requests, sharding, xla_flags
from rkvjax.config import METHODS


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder or .gguf file (default: %(default)s, prepared on first use)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--max-new-tokens", type=int, default=api.DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--method", choices=METHODS, default="rkv")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="KV tokens kept per layer/head/row (an int), or a fraction in (0, 1); omit for FullKV",
    )
    p.add_argument("--buffer", type=int, default=128, help="new tokens between compressions")
    p.add_argument("--think-only", action="store_true", help="stop compressing after </think>")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--no-chat", action="store_true", help="send the raw text, without the chat template"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _mesh_arg(text: str) -> dict[str, int]:
    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mesh(args: argparse.Namespace):
    return None if args.mesh is None else sharding.make_mesh(**args.mesh)


def _load(args: argparse.Namespace) -> api.Model:
    return api.load(args.model, dtype=args.dtype, mesh=_mesh(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rkvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt text (several make a batch)")
    _add_generation_args(g)
    g.add_argument("--json", action="store_true", help="print results as JSON lines")
    b = sub.add_parser("batch", help="offline job: JSONL prompts in, JSONL results out (resumable)")
    b.add_argument("input", help="JSONL, one object per line with `prompt` or `prompt_token_ids`")
    b.add_argument("output", help="JSONL results, appended; ids already there are skipped")
    b.add_argument("--batch-size", type=int, default=8)
    _add_generation_args(b)
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
    for p in (g, b, c):
        _add_mesh_args(p)
    return parser


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        type=_mesh_arg,
        default=None,
        metavar="data=D,model=M",
        help="split over D x M devices: batch rows on data, heads / MLP / vocab on model "
        "(D * M must equal the device count, every process's together; default: one device)",
    )
    d = p.add_argument_group("multi-process (one process per host; see README)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)


def _budget(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if value >= 1 and value == int(value) else value


def _generate_fn(args: argparse.Namespace, model: api.Model, progress: bool):
    return functools.partial(
        api.generate,
        model,
        budget=_budget(args.budget),
        method=args.method,
        buffer=args.buffer,
        think_only=args.think_only,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        chat=False if args.no_chat else None,
        progress=progress,
    )


def _progress(args) -> bool:
    return sys.stderr.isatty() if args.progress is None else args.progress


def _generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model = _load(args)
    load_s = time.perf_counter() - t0
    primary = jax.process_index() == 0  # on several processes, process 0 reports
    results = _generate_fn(args, model, _progress(args) and primary)(list(args.prompts))
    if not primary:
        return 0
    for prompt, r in zip(args.prompts, results, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, **r.to_dict()}))
            continue
        if len(results) > 1:
            print(f"### {prompt}")
        print(r.text)
    s = results[0].stats
    policy = "FullKV" if s.budget is None else f"{s.method} budget {s.budget}"
    print(
        f"[rkvjax] {model.path.name} ({model.config.arch}, {model.dtype.__name__}, {policy}) | "
        f"batch {s.batch_size} | prompt tokens {sum(r.stats.prompt_tokens for r in results)} | "
        f"generated {sum(r.stats.generated_tokens for r in results)} | "
        f"{s.tokens_per_s:.1f} tok/s decode | time to first token {s.time_to_first_token_s:.2f} s"
        f" | compile {s.compile_s:.1f} s | load {load_s:.1f} s | "
        f"compressions {sum(r.stats.compressions for r in results)} | "
        f"finish {','.join(r.finish_reason for r in results)}",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from rkvjax.convert import checkpoint

    t0 = time.perf_counter()
    out = checkpoint.convert(
        args.source, args.output, dtype=args.dtype, mesh=_mesh(args), overwrite=args.overwrite
    )
    if jax.process_index() == 0:
        print(f"[rkvjax] wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _job_settings(args: argparse.Namespace, model: api.Model) -> dict:
    """The flags that shape a batch job's results, recorded in its output's header."""
    return {
        "model": str(model.path.resolve()),
        "dtype": model.dtype.__name__,
        "method": args.method,
        "budget": _budget(args.budget),
        "buffer": args.buffer,
        "think_only": args.think_only,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "no_chat": args.no_chat,
    }


def _prompt_check(args: argparse.Namespace, model: api.Model):
    """-> check(prompt), raising ValueError for a prompt the model cannot run with these flags."""
    chat = False if args.no_chat else None

    def check(prompt) -> None:
        ids = requests.encode(model.tokenizer, prompt, chat, "prompt")
        requests.validate_ids(
            ids,
            vocab=model.config.vocab_size,
            max_positions=model.config.max_positions,
            max_tokens=args.max_new_tokens,
            max_tokens_name="max_new_tokens",
        )

    return check


def _batch(args: argparse.Namespace) -> int:
    jobs.preflight(args.input, args.output)  # bad files fail now, not after the model loads
    model = _load(args)
    ran, skipped = jobs.run_job(
        _generate_fn(args, model, progress=False),
        args.input,
        args.output,
        batch_size=args.batch_size,
        progress=_progress(args),
        settings=_job_settings(args, model),
        check=_prompt_check(args, model),
    )
    if jax.process_index() != 0:
        return 0
    print(
        f"[rkvjax] {ran} prompts generated, {skipped} already done -> {args.output}",
        file=sys.stderr,
    )
    return 0


def _enable_compile_cache() -> None:
    """Keeps compiled programs in $RKVJAX_HOME/xla_cache, so a repeated command skips XLA
    compilation (about 4x less compile time for the default model). The command line owns the
    process; the library leaves JAX's global configuration alone."""
    import os

    import jax

    from rkvjax.convert.default_model import rkvjax_home

    if os.environ.get("RKVJAX_COMPILE_CACHE", "1") == "0":
        return
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(rkvjax_home() / "xla_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    xla_flags.prefer_memory_on_cpu()
    try:
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
        _enable_compile_cache()
        run = {"batch": _batch, "convert": _convert, "generate": _generate}[args.command]
        return run(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        print(f"rkvjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(args), file=sys.stderr)
        return 130


def _interrupted(args: argparse.Namespace) -> str:
    if args.command == "batch":
        return (
            f"rkvjax: interrupted; finished results are in {args.output}, rerun the same command "
            "to resume"
        )
    return "rkvjax: interrupted"


if __name__ == "__main__":
    sys.exit(main())
