"""`rkvjax generate PROMPT...`: completions of one or more prompts, printed (or as JSON lines)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from rkvjax import api
from rkvjax.entrypoints.cli import flags
from rkvjax.runtime import requests


def add(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt text (several make a batch)")
    flags.add_generation_args(g)
    g.add_argument("--json", action="store_true", help="print results as JSON lines")
    return g


def run(args: argparse.Namespace) -> int:
    fields = flags.checked_sampling(args)
    for i, prompt in enumerate(args.prompts):  # before the model loads
        requests.check_text(prompt, f"prompt {i}")
    t0 = time.perf_counter()
    model = flags.load(args)
    load_s = time.perf_counter() - t0
    primary = jax.process_index() == 0  # on several processes, process 0 reports
    params = api.per_prompt_sampling(len(args.prompts), **fields)
    outs = api.generate(
        model,
        list(args.prompts),
        sampling=params,
        chat=False if args.no_chat else None,
        progress=flags.progress(args) and primary,
        **flags.cache(args),
    )
    if not primary:
        return 0
    samples = [(p, r) for p, out in zip(args.prompts, outs, strict=True) for r in _listed(out)]
    for prompt, r in samples:
        if args.json:
            print(json.dumps({"prompt": prompt, **r.to_dict()}))
            continue
        if len(samples) > 1:
            print(f"### {prompt}" + (f" (sample {r.sample_index})" if args.n > 1 else ""))
        print(r.text)
    results = [r for _, r in samples]
    s = results[0].stats
    policy = "FullKV" if s.budget is None else f"{s.method} budget {s.budget}"
    policy += f", {s.kv_dtype} cache" if s.kv_dtype != model.dtype.__name__ else ""
    print(
        f"[rkvjax] {model.path.name} ({model.config.describe()}, {model.dtype.__name__}, "
        f"{policy}) | "
        f"batch {s.batch_size} | prompt tokens {sum(r.stats.prompt_tokens for r in results)} | "
        f"generated {sum(r.stats.generated_tokens for r in results)} | "
        f"{s.tokens_per_s:.1f} tok/s decode | time to first token {s.time_to_first_token_s:.2f} s"
        f" | compile {s.compile_s:.1f} s | load {load_s:.1f} s | "
        f"compressions {sum(r.stats.compressions for r in results)} | "
        f"finish {','.join(r.finish_reason for r in results)}",
        file=sys.stderr,
    )
    return 0


def _listed(out) -> list:
    return out if isinstance(out, list) else [out]
