"""The paper's throughput table at full shape, on an accelerator: FullKV at the largest batch
that fits against R-KV (a token budget, and 10% of the sequence) at theirs, plus R-KV at
FullKV's batch, for an R1-Llama-8B-shaped model with random weights (nothing to download).

Batches: the device memory share --memory-fraction (of `memory_stats()["bytes_limit"]`, or
--mem-gib) less the weights, over one row's state bytes (`Engine.state_shapes()`); a setting
that runs out of memory is retried at 90% of its batch. The capacity suite's compiled
estimate agrees within 3% at this shape (bench/results/capacity).

Time: a 16K-token forced generation of ~800 rows takes longer than a GPU run may, so this
measures the decode step at the filled cache and derives the whole: each row's cache is marked
full (`filled`: every slot occupied, in position order; the keys stay what the prefill left,
and no step's cost depends on their values), `--warmup-steps` decode steps run (compilation,
and for R-KV the first round of compressions), and the next `--timed-steps` are timed. The
decode attends over the whole static cache on every step, so FullKV's step costs the same at
any fill: its total is exact. R-KV's steps include its compressions (one per row every
`buffer` steps, rows waiting for a lane when all fill at once, as in a forced generation);
its first ~budget steps, which never compress, are counted at the steady rate, so its total
is an upper bound. Derived: total = prefill + gen_tokens x step time; tokens/s = batch x
gen_tokens / total.

--kv-dtype runs each setting once per cache storage type (default: the model's dtype), the
types innermost, each at its own largest batch: an 8-bit cache's row holds codes and float32
scales, about half a bfloat16 row, so about twice the rows fit. --methods keeps FullKV or R-KV
alone (R-KV at FullKV's batch needs both).

The paper (Table 3: A100 80 GB, R1-Llama-8B, 16K tokens): FullKV batch 30 at 347 tok/s, R-KV
budget 1024 batch 402 at 3,189 tok/s (9.2x).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rkvjax.models import loading

import rkvjax
from bench import common, throughput
from rkvjax import defaults
from rkvjax.runtime import programs

PREFER_MEMORY = True
REAL_CONFIGS = common.DATA.parent / "real_configs"
DEFAULT_CONFIG = REAL_CONFIGS / "DeepSeek-R1-Distill-Llama-8B.json"
TINY = {
    "config": None,  # the tiny random checkpoint's
    "dtype": "float32",
    "gen_tokens": [96],
    "prompt": 16,
    "budget": 24,
    "buffer": 8,
    "ratio": 0.0,  # the share path is the budget path with a float budget
    "mem_gib": 0.004,
    "max_batch": 6,
    "warmup_steps": 8,
    "timed_steps": 16,
}
OOM_RETRIES = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a config.json")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--gen-tokens", type=int, nargs="+", default=[16384, 8192])
    p.add_argument("--methods", nargs="+", choices=["full", "rkv"], default=["full", "rkv"])
    common.add_kv_dtype_argument(p, several=True)
    p.add_argument("--prompt", type=common.int_at_least(1), default=128, help="prompt tokens")
    p.add_argument("--budget", type=common.int_at_least(2), default=1024, help="R-KV tokens")
    p.add_argument("--ratio", type=float, default=0.1, help="R-KV budget as a share (0: none)")
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    p.add_argument(
        "--memory-fraction", type=float, default=0.9, help="of the device's memory, for all"
    )
    p.add_argument("--mem-gib", type=float, default=None, help="memory for all, instead")
    p.add_argument("--max-batch", type=common.int_at_least(1), default=4096)
    p.add_argument("--warmup-steps", type=common.int_at_least(1), default=192)
    p.add_argument("--timed-steps", type=common.int_at_least(1), default=256)
    p.add_argument(
        "--batch-invariant",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's batch invariance (auto: on for an 8-bit cache on one data shard)",
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="start no further setting after this many seconds (rows are written as they end)",
    )


def memory_cap(args) -> int:
    """Bytes for weights and state together."""
    if args.mem_gib is not None:
        return int(args.mem_gib * 2**30)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"{jax.default_backend()} reports no memory limit: give --mem-gib")
    return int(args.memory_fraction * stats["bytes_limit"])


def settings(
    args, gen: int, kv_dtype: str | None = None
) -> list[tuple[str, rkvjax.CompressionConfig]]:
    """(label, compression) in the order they run: the table's headline pair first."""
    seq = {"prompt_len": args.prompt, "max_new_tokens": gen, "buffer": args.buffer}
    seq["kv_dtype"] = kv_dtype
    out = []
    if "full" in args.methods:
        out.append(("full", rkvjax.compression_config("full", kv_dtype=kv_dtype)))
    if "rkv" in args.methods:
        out.append((f"rkv-{args.budget}", rkvjax.compression_config("rkv", args.budget, **seq)))
    if "rkv" in args.methods and args.ratio:
        out.append((f"rkv-{args.ratio:g}", rkvjax.compression_config("rkv", args.ratio, **seq)))
    return out


def plan(args, gen: int) -> list[tuple[str, rkvjax.CompressionConfig, str | None]]:
    """(label, compression, "full" for FullKV's batch or None for its own) of every setting of
    one generation length, storage types innermost; R-KV at FullKV's batch after the headline
    pair when both methods run."""
    kvs = list(dict.fromkeys(args.kv_dtype))
    base = [settings(args, gen, kv) for kv in kvs]
    out = [(label, cc, None) for i in range(len(base[0])) for label, cc in (b[i] for b in base)]
    if set(args.methods) >= {"full", "rkv"}:
        at = 2 * len(kvs)
        out[at:at] = [(f"{b[1][0]}@full-batch", b[1][1], "full") for b in base]
    return out


INVARIANT = {"auto": None, "on": True, "off": False}


def _engine(model, cc, slots: int, max_len: int, invariant: str = "auto") -> rkvjax.Engine:
    return rkvjax.Engine(
        model,
        slots=slots,
        cache=cc,
        max_len=None if cc.compressing else max_len,
        batch_invariant=INVARIANT[invariant],
    )


def row_bytes(model, cc, max_len: int) -> int:
    """Device state of one slot (cache, query window, counters)."""
    return common.tree_bytes(_engine(model, cc, 1, max_len).state_shapes())


def filled(state: programs.SlotState, length: int) -> programs.SlotState:
    """`state` with every row's cache holding `length` tokens, in position order (the cache's
    invariant: slots [0, length) occupied, the rest empty)."""
    c = state.cache
    slot = jnp.arange(c.capacity, dtype=jnp.int32)
    pos = jnp.where(slot < length, slot, -1)  # [C]
    # Distinct buffers per leaf: decode donates each of them.
    slot_pos = tuple(jnp.broadcast_to(pos, x.shape).copy() for x in c.slot_pos)  # L x [B, K, C]
    n = functools.partial(jnp.full_like, c.length, length)
    cache = dataclasses.replace(c, slot_pos=slot_pos, length=n(), pos=n())
    # Placed as the leaves they replace: jit keys its programs on placement, and a state
    # mixing placements would compile the decode step again at the first timed step.
    new = dataclasses.replace(state, cache=cache)
    return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), new, state)


def _decode(eng: rkvjax.Engine, state, steps: int):
    """`steps` decode steps (whole chunks) -> (state, steps run, compressions, stalled row
    steps): rows never finish here (max_tokens is the generation length)."""
    run = comps = stalls = 0
    while run < steps:
        state, out = programs.decode(eng.executor.decoder, state, steps=eng.chunk, plan=eng.plan)
        c, s = jax.device_get((out.compressions, out.stalls))
        comps, stalls = int(np.sum(c)), int(np.sum(s))
        run += eng.chunk
    return state, run, comps, stalls


def measure(model, cc, *, batch: int, gen: int, args) -> dict:
    """Prefill `batch` rows, mark their caches full, and time decode steps (module doc)."""
    prompt_len = args.prompt
    max_len = prompt_len + gen - 1
    eng = _engine(model, cc, batch, max_len, args.batch_invariant)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, model.config.vocab_size, size=(batch, prompt_len)).tolist()
    sp = rkvjax.SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    eng.submit_many(prompts, [sp] * batch)
    c0, t0 = programs.compile_seconds(), time.perf_counter()
    state = eng.prefilled()
    prefill_s = time.perf_counter() - t0 - (programs.compile_seconds() - c0)
    room = args.warmup_steps + args.timed_steps + 2 * eng.chunk
    if not cc.compressing and eng.capacity <= room:
        raise ValueError(f"gen_tokens {gen} leaves no room for {room} timed steps")
    # FullKV: full but for the steps to come; R-KV: full, so the first step compresses.
    state = filled(state, eng.capacity - room if not cc.compressing else eng.capacity - 1)
    state, warm, comps0, stalls0 = _decode(eng, state, args.warmup_steps)
    jax.block_until_ready(state)
    c1, t1 = programs.compile_seconds(), time.perf_counter()
    state, timed, comps1, stalls1 = _decode(eng, state, args.timed_steps)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t1
    assert programs.compile_seconds() == c1, "a timed step compiled"
    compile_s = c1 - c0
    step_s = dt / timed
    total_s = prefill_s + gen * step_s
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {
        "batch": batch,
        "batch_invariant": eng.batch_invariant,
        "cache_slots_per_row": eng.capacity,
        "state_bytes": common.tree_bytes(state),
        "prefill_s": prefill_s,
        "compile_s": compile_s,
        "warmup_steps": warm,
        "timed_steps": timed,
        "step_ms": step_s * 1e3,
        "steady_tokens_per_s": batch / step_s,
        "derived_total_s": total_s,
        "tokens_per_s": batch * gen / total_s,
        "timed_compressions": comps1 - comps0,
        "timed_stalled_row_steps": stalls1 - stalls0,
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
        "device_bytes_limit": stats.get("bytes_limit"),
    }
    del state, eng
    gc.collect()
    return out


def _out_of_memory(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _measured(model, cc, batch: int, gen: int, args) -> dict:
    """`measure`, at 90% of the batch after each out-of-memory failure."""
    for attempt in range(OOM_RETRIES + 1):
        try:
            return {**measure(model, cc, batch=batch, gen=gen, args=args), "oom_retries": attempt}
        except Exception as e:
            if not _out_of_memory(e) or attempt == OOM_RETRIES:
                raise
            print(f"batch {batch}: out of memory, retrying at 90%", file=sys.stderr)
            batch = max(1, int(batch * 0.9))
            gc.collect()
    raise AssertionError("unreachable")


def run(args, folder) -> list[dict]:
    config = args.config or common.tiny_checkpoint() / "config.json"
    model = loading.random_init(config, dtype=args.dtype)
    weights = common.tree_bytes(model.decoder)
    cap = memory_cap(args)
    meta = common.run_meta(dtype=args.dtype)
    name = Path(config).stem if args.config else common.TINY_MODEL_NAME
    start, rows = time.perf_counter(), []

    def emit(row: dict) -> None:
        rows.append(row)
        common.emit({**row, **meta}, folder)

    for gen in args.gen_tokens:
        full_batch = {}  # storage type -> FullKV's measured batch
        for label, cc, batch_of in plan(args, gen):
            kv = common.kv_dtype_name(cc.kv_dtype, model.dtype)
            base = {
                "bench": "scale",
                "config": name,
                "setting": label,
                "kv_dtype": kv,
                "method": cc.method if cc.compressing else "full",
                "budget": cc.budget if cc.compressing else None,
                "buffer": cc.buffer if cc.compressing else None,
                "gen_tokens": gen,
                "prompt_tokens": args.prompt,
                "weight_bytes": weights,
                "memory_cap_bytes": cap,
            }
            if args.time_limit_s is not None and time.perf_counter() - start > args.time_limit_s:
                emit({**base, "skipped": "time limit"})
                continue
            per_row = row_bytes(model, cc, args.prompt + gen - 1)
            batch = min(args.max_batch, max(0, (cap - weights) // per_row))
            if batch_of == "full":
                if not full_batch.get(kv):  # FullKV's row says why
                    emit({**base, "skipped": "no FullKV batch to match"})
                    continue
                batch = full_batch[kv]
            base["row_bytes"] = per_row
            if batch == 0:
                emit({**base, "batch": 0, "tokens_per_s": None})
                continue
            try:
                got = _measured(model, cc, batch, gen, args)
            except Exception as e:  # one failed setting is a row; the others still run
                if args.tiny:  # a smoke run's failure is a bug
                    raise
                print(f"{label} at {gen}: {e!r}"[:800], file=sys.stderr)
                emit({**base, "batch": batch, "error": repr(e)[:500]})
                continue
            if label == "full":
                full_batch[kv] = got["batch"]
            emit({**base, **got})
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """x FullKV: each setting's tokens/s over FullKV's at the same generation length and
    storage type."""
    full = {
        (r["gen_tokens"], r.get("kv_dtype")): r.get("tokens_per_s")
        for r in rows
        if r["setting"] == "full"
    }
    for r in rows:
        f, t = full.get((r["gen_tokens"], r.get("kv_dtype"))), r.get("tokens_per_s")
        r["vs_full"] = t / f if f and t else None


def _note(row: dict) -> str | None:
    """Why a row has no measurement."""
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("error"):
        return row["error"].split("(", 1)[0]  # the exception's type; the row keeps the text
    if row.get("batch") == 0:
        return "one row does not fit"
    return None


def table(rows: list[dict]) -> str:
    _ratios(rows)
    r0 = rows[0]
    cols = [
        ("gen tokens", "gen_tokens", "d"),
        ("setting", "setting", "s"),
        ("kv dtype", "kv_dtype", "s"),
        ("budget", "budget", "d"),
        ("MiB / row", lambda r: r["row_bytes"] / 2**20 if r.get("row_bytes") else None, ".1f"),
        ("batch", "batch", "d"),
        ("step ms", "step_ms", ".1f"),
        ("compressions timed", "timed_compressions", "d"),
        ("derived total s", "derived_total_s", ".0f"),
        ("tok/s", "tokens_per_s", ".0f"),
        ("x FullKV", "vs_full", ".2f"),
        ("note", _note, "s"),
    ]
    head = (
        f"{r0['config']} (random weights, {r0['weight_bytes'] / 2**30:.1f} GiB), prompt "
        f"{r0['prompt_tokens']} tokens, memory for weights and state "
        f"{r0['memory_cap_bytes'] / 2**30:.1f} GiB; steps timed at the filled cache, totals "
        "derived (bench/scale.py)\n\n"
    )
    ports = (
        " The authors' vLLM port on an H100: 3,747 vs FullKV's 8,054 tok/s with ample memory, "
        "+32% when tight; their FlashInfer engine within 2.6% of FullKV at equal batch."
    )
    return head + common.markdown_table(rows, cols) + "\n\n" + throughput.paper_line() + ports


def plot(plt, rows: list[dict]):
    short = common.KV_DTYPE_SHORT
    several = len({r.get("kv_dtype") for r in rows}) > 1

    def label(r):
        kv = f" {short[r['kv_dtype']]}" if several else ""
        return f"{r['setting']}{kv}\n{r['gen_tokens']}"

    return throughput.batch_figure(plt, rows, label)
