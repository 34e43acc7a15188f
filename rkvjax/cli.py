"""Command line: `rkvjax generate "prompt" [--model PATH] [--max-new-tokens N] ...`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rkvjax import api


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rkvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt text (several make a batch)")
    g.add_argument(
        "--model",
        default=api.DEFAULT_MODEL,
        help="Hugging Face folder or .gguf file (default: %(default)s, prepared on first use)",
    )
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--max-new-tokens", type=int, default=api.DEFAULT_MAX_NEW_TOKENS)
    g.add_argument("--method", choices=api.METHODS, default="rkv")
    g.add_argument("--budget", type=float, default=None, help="KV budget (tokens); omit for FullKV")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--no-chat", action="store_true", help="send the raw text, without the chat template"
    )
    g.add_argument("--json", action="store_true", help="print results as JSON lines")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return parser


def _budget(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if value >= 1 and value == int(value) else value


def _generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model = api.load(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    results = api.generate(
        model,
        list(args.prompts),
        budget=_budget(args.budget),
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        chat=False if args.no_chat else None,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    for prompt, r in zip(args.prompts, results, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, **r.to_dict()}))
            continue
        if len(results) > 1:
            print(f"### {prompt}")
        print(r.text)
    s = results[0].stats
    generated = sum(r.stats.generated_tokens for r in results)
    print(
        f"[rkvjax] {model.path.name} ({model.config.arch}, {args.dtype or 'default dtype'}) | "
        f"batch {s.batch_size} | prompt tokens {sum(r.stats.prompt_tokens for r in results)} | "
        f"generated {generated} | {s.tokens_per_s:.1f} tok/s decode | "
        f"time to first token {s.time_to_first_token_s:.2f} s | compile {s.compile_s:.1f} s | "
        f"load {load_s:.1f} s | finish {','.join(r.finish_reason for r in results)}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"rkvjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
