"""Sampling cost per decode step: the former batch-level sampler against per-row `sample_rows`.

Random float32 logits [B, V] (V = 49,152, the default model's vocabulary), jit-compiled, median
wall time of many calls after a warm-up, for greedy, temperature only, top-k 50 and temperature
0.6 + top-p 0.95. Two kinds of logits: "flat" (standard normal x 3: a nucleus of thousands of
tokens, the worst case, which takes the bisection) and "peaked" (standard normal x 2 with three
tokens lifted by ~15, like a language model's next token: the nucleus lies within the 64
largest logits). Prints one JSON line per case, then a table of ms per call and the ratio to
greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax import sampling as S

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_k_50": dict(temperature=1.0, top_k=50),
    "top_p_0.95": dict(temperature=0.6, top_p=0.95),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--kinds", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    p.add_argument("--repeats", type=int, default=50, help="timed calls per case, after warm-up")
    p.add_argument("--budget-s", type=float, default=5.0, help="time spent per case at most")
    p.add_argument("--tiny", action="store_true", help="batch 8, vocab 4096, 10 repeats (smoke)")
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.repeats = [8], 4096, 10
    return args


def make_logits(kind: str, batch: int, vocab: int, seed: int = 0) -> jax.Array:
    rs = np.random.RandomState(seed)
    x = rs.randn(batch, vocab).astype(np.float32) * (3.0 if kind == "flat" else 2.0)  # [B, V]
    if kind == "peaked":
        for row in x:
            row[rs.choice(vocab, 3, replace=False)] += 15.0 * rs.uniform(0.8, 1.2, 3)
    return jnp.asarray(x)


def legacy_sample(logits: jax.Array, key: jax.Array, temperature=0.0, top_k=0, top_p=1.0):
    """The batch-level sampler rkvjax had before per-row sampling (one setting for the whole
    batch; top-p sorted the vocabulary every step), kept here as the baseline."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)  # [B, V], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        rows = jnp.arange(logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def legacy_fn(case: dict):
    @jax.jit
    def run(logits, key):
        return legacy_sample(logits, key, **case)

    key = jax.random.key(0)
    return lambda logits, sp, extra: run(logits, key)


@jax.jit
def _rows(logits, sp, token_index):
    keys = S.token_keys(sp.seed, sp.sample_index, token_index)  # [B]
    return S.sample_rows(logits, sp, keys)


def rows_fn(case: dict):
    return lambda logits, sp, token_index: _rows(logits, sp, token_index)


def time_ms(fn, logits, sp, extra, repeats: int, budget_s: float) -> tuple[float, int]:
    """Median ms per call after a compile and 3 warm-up calls, over `repeats` calls or fewer (5
    at least) when they would take longer than `budget_s`; and the number of calls timed."""
    jax.block_until_ready(fn(logits, sp, extra))  # compile
    for _ in range(3):
        jax.block_until_ready(fn(logits, sp, extra))
    times = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(logits, sp, extra))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), len(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    info = dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        cpus=os.cpu_count(),
        machine=platform.machine(),
        loadavg_start=[round(x, 2) for x in load],
    )
    print(f"# {json.dumps(info)}", flush=True)
    results = []
    for kind in args.kinds:
        for batch in args.batch:
            logits = make_logits(kind, batch, args.vocab)
            for name, case in CASES.items():
                sp = S.SlotSampling.from_params(
                    [S.SamplingParams(**case)] * batch, rng=np.random.default_rng(0)
                )
                token_index = jnp.zeros((batch,), jnp.int32)  # [B]
                timing = dict(repeats=args.repeats, budget_s=args.budget_s)
                legacy, legacy_n = time_ms(legacy_fn(case), logits, sp, None, **timing)
                rows, rows_n = time_ms(rows_fn(case), logits, sp, token_index, **timing)
                rec = dict(
                    bench="sampling_speed",
                    kind=kind,
                    batch=batch,
                    vocab=args.vocab,
                    case=name,
                    legacy_ms=round(legacy, 4),
                    rows_ms=round(rows, 4),
                    legacy_calls=legacy_n,
                    rows_calls=rows_n,
                )
                results.append(rec)
                print(json.dumps(rec), flush=True)
    by_key = {(r["kind"], r["batch"], r["case"]): r for r in results}
    print(f"# loadavg at the end: {[round(x, 2) for x in os.getloadavg()]}")
    header = f"{'kind':7} {'B':>3} {'case':12} {'legacy ms':>10} {'x greedy':>8} "
    header += f"{'rows ms':>9} {'x greedy':>8} {'legacy/rows':>11}"
    print(header)
    for r in results:
        g = by_key[(r["kind"], r["batch"], "greedy")]
        print(
            f"{r['kind']:7} {r['batch']:>3} {r['case']:12} {r['legacy_ms']:>10.3f} "
            f"{r['legacy_ms'] / g['legacy_ms']:>8.2f} {r['rows_ms']:>9.3f} "
            f"{r['rows_ms'] / g['rows_ms']:>8.2f} {r['legacy_ms'] / r['rows_ms']:>11.2f}"
        )
    if args.out is not None:
        with args.out.open("a") as f:
            for r in results:
                f.write(json.dumps({**r, **info}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
