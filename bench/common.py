"""What every suite shares: run metadata, result rows, timing, byte counts, prompts, the model
under test, driving a prefilled engine, Markdown tables and plots."""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rkvjax
from bench import checkpoints
from rkvjax import allocator
from rkvjax.kv import config, policies, quantization
from rkvjax.runtime import programs, requests

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
# ../shared/data beside the checkout, as the tests find it.
DATA = Path(os.environ.get("RKVJAX_DATA", BENCH.parents[1] / "shared" / "data")) / "math500.jsonl"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TINY_MODEL_NAME = "tiny-random-llama"


# -- run metadata and result rows ---------------------------------------------------------


@functools.cache
def git_commit() -> dict:
    """HEAD of the checkout and whether tracked files differ from it (None outside git)."""

    def git(*cmd: str) -> str | None:
        # No optional locks: reading the status must not write the index another process uses.
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
        try:
            out = subprocess.run(
                ["git", *cmd], cwd=BENCH, env=env, capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def run_meta(**extra) -> dict:
    """Fields every row carries: versions, machine, date and command line, then `extra`."""
    return {
        **git_commit(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "argv": sys.argv[1:],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "preload": allocator.current(),  # the allocator (rkvjax.allocator), or ""
        **extra,
    }


def emit(row: dict, folder: Path) -> None:
    """Prints `row` as a JSON line and appends it to folder/results.jsonl at once, so a run that
    fails later keeps what it measured."""
    line = json.dumps(row)
    print(line, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "results.jsonl").open("a") as f:
        f.write(line + "\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= low."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


# -- timing -------------------------------------------------------------------------------


def timed(fn: Callable, *args) -> tuple[float, object]:
    """(wall seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def timings(
    fn: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
    budget_s: float = math.inf,
    min_repeats: int = 1,
) -> list[float]:
    """Wall seconds of up to `repeats` calls of `fn` after `warmup` untimed ones (the first
    compiles); stops early once `budget_s` has passed and `min_repeats` calls are timed."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (
        len(times) < min_repeats or time.perf_counter() - start < budget_s
    ):
        times.append(timed(fn)[0])
    return times


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls after one warm-up call."""
    return statistics.median(timings(fn, repeats))


def rotations(names: Sequence[str], repeats: int):
    """`names` once per repeat, each round starting one further along: settings take turns, so
    load from other processes on a shared machine hits them alike."""
    names = list(names)
    for i in range(repeats):
        k = i % len(names)
        yield names[k:] + names[:k]


# -- byte counts --------------------------------------------------------------------------


def tree_bytes(tree) -> int:
    """Bytes of every array (or shape) leaf of `tree`."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def weight_bytes(model) -> int:
    """Bytes of every weight as stored; a tied embedding is one array, so it counts once."""
    from flax import nnx

    return tree_bytes(nnx.state(model.decoder, nnx.Param))


def kv_bytes(cfg, batch: int, capacity: int, dtype, *, positions: bool = False) -> int:
    """K and V of every layer over `capacity` slots as a cache of `dtype` (a storage type, or
    a float type's itemsize) keeps them, 2 L B K C H itemsize, plus for an 8-bit type its float32
    scale per (token, KV head), 2 L B K C 4; with `positions` each slot's int32 position,
    L B K C 4 (the cache's whole per-slot state). `cache_bytes` counts a built engine's."""
    slots = cfg.num_layers * batch * cfg.kv_heads * capacity
    if isinstance(dtype, int):
        itemsize, scale = dtype, 0
    else:
        itemsize = jnp.dtype(dtype).itemsize
        scale = 4 if quantization.is_quantized(dtype) else 0
    return 2 * slots * (cfg.head_dim * itemsize + scale) + (4 * slots if positions else 0)


def cache_bytes(cache, *, positions: bool = True, queries: bool = False) -> int:
    """Bytes of a cache (a `KVCache`, or its shapes from `Engine.state_shapes()`): keys and
    values with their scales (an 8-bit cache's), with `positions` the slot positions, with
    `queries` the observation ring and its scales. Not the per-row counters or a policy's
    per-key state."""
    parts = [cache.k, cache.v, cache.k_scale, cache.v_scale]
    parts += [cache.slot_pos] if positions else []
    parts += [cache.q_win, cache.q_scale] if queries else []
    return tree_bytes(parts)


def add_kv_dtype_argument(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--kv-dtype: the cache's storage type (`rkvjax.kv.quantization.KV_DTYPES`; default the
    model's dtype); with `several`, one or more, each a setting of its own."""
    kw = dict(nargs="+", default=[None]) if several else dict(default=None)
    what = "cache storage types, side by side" if several else "cache storage type"
    p.add_argument(
        "--kv-dtype",
        choices=quantization.KV_DTYPES,
        help=f"{what} (default: the model's dtype; 8-bit: codes and a float32 scale per vector)",
        **kw,
    )


def add_kv_dtypes_argument(p: argparse.ArgumentParser) -> None:
    """--kv-dtypes: cache storage types to run every setting with ("model": the model's own;
    `kv_dtype_arg` reads one back as `generate`'s kv_dtype)."""
    p.add_argument(
        "--kv-dtypes",
        nargs="+",
        choices=["model", *quantization.KV_DTYPES],
        default=["model"],
        help="cache storage types to run every setting with (model: the model's dtype)",
    )


def kv_dtype_arg(name: str) -> str | None:
    """A --kv-dtypes entry as `kv_dtype=`: None for "model"."""
    return None if name == "model" else name


def kv_dtype_name(kv_dtype: str | None, model_dtype) -> str:
    """What a cache of `kv_dtype` stores, by name: the model's dtype when None."""
    return quantization.cache_dtype(kv_dtype, model_dtype).name


# Short names of the storage types, for table headers.
KV_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "int8": "int8", "float8_e4m3fn": "fp8"}


def max_rss_bytes() -> int:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- prompts ------------------------------------------------------------------------------


@functools.cache
def math500_problems(path: Path = DATA) -> tuple[str, ...]:
    """The `problem` field of every line of the MATH-500 JSONL, in file order."""
    with path.open() as f:
        return tuple(json.loads(line)["problem"] for line in f)


def math_prompts(path: Path, n: int) -> list[str]:
    """The first n MATH-500 problems, cycled when n exceeds the file."""
    problems = list(math500_problems(path))
    return (problems * (n // len(problems) + 1))[:n]


def random_ids(model, length: int, seed: int = 0) -> list[int]:
    """`length` random token ids (none of the first 3, which are special in the tiny models):
    the prompts of a model without a tokenizer."""
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, length).tolist()


def random_prompts(model, n: int) -> list[list[int]]:
    """n prompts of random ids, 24 to 31 tokens: one prefill length bucket, so a tiny run
    compiles one prefill for them."""
    return [random_ids(model, 24 + i % 8, seed=i) for i in range(n)]


def has_chat(model) -> bool:
    """Whether the model's prompts can be chats (a tokenizer with a chat template)."""
    return model.tokenizer is not None and model.tokenizer.has_chat_template


def chat_ids(model, text: str) -> list[int]:
    """`text` as the only user message of a chat, in the model's template."""
    return model.tokenizer.chat_ids([{"role": "user", "content": text}])


# -- the model under test -----------------------------------------------------------------


@functools.cache
def tiny_checkpoint() -> Path:
    """A tiny random Llama checkpoint, built once per process (every suite of a run shares it)
    and removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="rkvjax-bench-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return checkpoints.save("tiny", folder / "tiny-llama")


# A byte-level tokenizer and a ChatML template for the tiny checkpoint: enough to run chat
# prompts (an evaluation) through a model with no trained tokenizer.
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def tiny_chat_checkpoint() -> Path:
    """The tiny checkpoint with a byte-level tokenizer (256 bytes and ChatML's special tokens,
    within its 512-token vocabulary) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tiny_checkpoint().with_name("tiny-llama-chat")
    shutil.copytree(tiny_checkpoint(), folder, dirs_exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update((s, len(vocab) + i) for i, s in enumerate(_TINY_SPECIALS))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_TINY_SPECIALS))
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": _TINY_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def load_model(args, dtype: str | None = None):
    """(model, name): the tiny checkpoint with --tiny, else --model (default: SmolLM2-135M)."""
    if args.tiny:
        path, name = tiny_checkpoint(), TINY_MODEL_NAME
    else:
        path = args.model
        name = Path(path).name if path else DEFAULT_MODEL_NAME
    return rkvjax.load(path, dtype=dtype), name


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M; --tiny: none)"
    )


def add_methods_argument(
    p: argparse.ArgumentParser, default: Sequence[str], full=False, calibrated_on: str | None = None
) -> None:
    """--methods: any registered cache policy (and "full" where `full`), plug-ins included
    ($RKVJAX_POLICIES); --calibration for the methods that read statistics of the model
    (`calibrated_on` says what a suite calibrates on when it is not given)."""
    choices = config.method_names() if full else policies.names()
    p.add_argument(
        "--methods",
        nargs="+",
        choices=choices,
        default=list(default),
        help="cache policies (default: %(default)s)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="`rkvjax calibrate`'s statistics for triattention (default: calibrated here once, "
        f"on {calibrated_on or f'the last {CALIBRATION_PROMPTS} MATH-500 problems'}, and kept in "
        "the suite's folder)",
    )


CALIBRATION_PROMPTS = 32  # problems a bench calibrates TriAttention on (the file's last ones)


def method_options(method: str, args, model, name: str, folder: Path) -> dict:
    """The options a suite gives `method` beyond its defaults: the statistics of the model for a
    method that reads them (`--calibration`, or calibrated once on the last MATH-500 problems,
    which no suite scores, and kept as `folder/calibration-<model>.npz`)."""
    if method == "full" or "calibration" not in policies.option_names(method):
        return {}
    if args.calibration is not None:
        return {"calibration": str(args.calibration)}
    from rkvjax.entrypoints import calibration
    from rkvjax.kv.policies import triattention_stats

    data = Path(getattr(args, "data", DATA))
    path = Path(folder) / f"calibration-{name}-{np.dtype(model.dtype).name}-{data.stem}.npz"
    if not path.is_file():
        if has_chat(model):
            problems = math500_problems(data)
            ids = [chat_ids(model, p) for p in problems[-CALIBRATION_PROMPTS:]]
        else:
            ids = random_prompts(model, 4)
        stats = calibration.calibrate(model, ids, source=f"bench: {len(ids)} prompts")
        path.parent.mkdir(parents=True, exist_ok=True)
        triattention_stats.save(stats, path, overwrite=True)
    return {"calibration": str(path)}


# -- driving a prefilled engine -----------------------------------------------------------


def submitted(model, ids, params, cc, max_len: int) -> rkvjax.Engine:
    """An engine with one slot per prompt and every prompt submitted, not yet admitted."""
    eng = rkvjax.Engine(model, slots=len(ids), cache=cc, max_len=max_len)
    eng.submit_many(ids, params)
    return eng


def copy_state(state):
    """A fresh copy of a device state: `programs.decode` donates the state it is given."""
    return jax.tree.map(jnp.copy, state)


def decode_all(eng: rkvjax.Engine, state):
    """The runtime's decode loop, chunk after chunk until every row is done (no stop strings,
    no admissions). Returns (state, the last chunk's output, tokens made)."""
    made = 0
    while True:
        state, out = programs.decode(eng.executor.decoder, state, steps=eng.chunk, plan=eng.plan)
        counts, active = jax.device_get((out.count, out.active))
        made += int(counts.sum())
        if not active.any():
            return state, out, made


def prefilled(model, ids, params, cc):
    """(engine, state before decoding) with one slot per prompt, every prompt admitted. FullKV
    holds the longest prompt plus every new token."""
    longest = max(map(len, ids))
    max_len = requests.bucket(longest, longest) + max(p.max_tokens for p in params) - 1
    eng = submitted(model, ids, params, cc, max_len)
    return eng, eng.prefilled()


def paired_speedup(slow: Sequence[float], fast: Sequence[float]) -> float:
    """The median of per-round time ratios slow / fast: settings timed in the same rounds cancel
    slow drifts in the load of a shared machine better than a ratio of medians does."""
    return statistics.median(a / b for a, b in zip(slow, fast, strict=True))


def time_decodes(settings: dict, repeats: int) -> dict:
    """name -> (engine, state): decode times of each, in alternating order after a warm-up, the
    tokens each made, and its tokens/s over the median time."""
    times = {name: [] for name in settings}
    made = {}
    for eng, state in settings.values():  # warm-up compiles the decode chunk
        decode_all(eng, copy_state(state))
    for order in rotations(settings, repeats):
        for name in order:
            eng, state = settings[name]
            dt, (_, _, n) = timed(decode_all, eng, copy_state(state))
            times[name].append(dt)
            made[name] = n
    tokens_per_s = {name: made[name] / statistics.median(ts) for name, ts in times.items()}
    return {"times": times, "made": made, "tokens_per_s": tokens_per_s}


# -- tables and plots ---------------------------------------------------------------------


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple]) -> str:
    """A Markdown table: one line per row, one cell per (header, value, format) column, where
    value is a row key or a function of the row and None (or a missing key) prints as '-'."""

    def cell(row, value, fmt):
        x = value(row) if callable(value) else row.get(value)
        return "-" if x is None else format(x, fmt)

    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, v, f) for _, v, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_table(folder: Path, text: str) -> None:
    """folder/table.md, also printed to stderr."""
    print(f"\n{text}", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "table.md").write_text(text + "\n")


@functools.cache
def pyplot():
    """matplotlib.pyplot with a file-only backend, or None (said once) when not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plots", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # no display on CI machines or servers
    import matplotlib.pyplot as plt

    return plt


def series(rows, by: str, x: str, y: str, scale: float = 1.0) -> dict[str, tuple[list, list]]:
    """{row[by]: (xs, ys * scale)} of the rows where y is not None, for `lines`."""
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        if r.get(y) is not None:
            xs, ys = out.setdefault(r[by], ([], []))
            xs.append(r[x])
            ys.append(r[y] * scale)
    return out


def lines(ax, named: dict[str, tuple[list, list]], *, xlabel: str, ylabel: str, title: str):
    """One marked line per name: named {name: (xs, ys)}; a log2 x axis ticked at the xs."""
    for name, (xs, ys) in named.items():
        ax.plot(xs, ys, marker="o", label=name)
    ticks = sorted({x for xs, _ in named.values() for x in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def bars(ax, labels: list[str], values: list[float], *, ylabel: str, title: str):
    """One bar per value, labelled with it."""
    ax.bar_label(ax.bar(labels, values), fmt=lambda v: f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20)


def write_plot(folder: Path, draw: Callable, rows: list[dict]) -> None:
    """folder/plot.png of `draw(plt, rows)` (a figure, or None for nothing to plot), unless
    matplotlib is missing."""
    plt = pyplot()
    fig = plt and draw(plt, rows)
    if fig is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plot.png"
    if fig.get_layout_engine() is None:  # a figure that chose its own layout keeps it
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
