"""Decode throughput of rkvjax against Hugging Face transformers, and the bandwidth roofline.

Times `rkvjax.generate` (FullKV, greedy, a fixed number of new tokens) against transformers'
`generate` on the same weights and prompt ids, and against a weights-only loop of the same
decoder (no attention, no cache); steps/s = (N - 1) / (t(N) - t(1)). The roofline is the
machine's measured read bandwidth over the bytes one decode step reads.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import rkvjax
from bench import common

SYSTEM = "You are a helpful assistant. Answer clearly and concisely."
QUESTION = (
    "Why is the sky blue during the day but red and orange at sunset? Explain the physics of "
    "light scattering in simple words, then give a short example that a child could understand, "
    "and finish with one sentence about why clouds look white."
)
# Reported once per XLA compilation (trace events nest, so they would double count).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# One batch and few tokens: compilation dominates a tiny run. transformers stays in: on the
# tiny model it takes milliseconds.
TINY = dict(batch=[1], new_tokens=16, repeats=2, bandwidth_mib=64, hf_threads=[1])
PREFER_MEMORY = False


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument(
        "--new-tokens",
        type=common.int_at_least(2),
        default=128,
        help="at least 2: decode speed is measured from t(N) - t(1)",
    )
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (at most)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per length, after warm-up")
    p.add_argument(
        "--hf-bf16-repeats", type=int, default=1, help="repeats of the slow bf16 HF baseline"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--hf-threads",
        type=int,
        nargs="+",
        default=None,
        help="torch thread counts to time (default: all cores, and 1); the fastest is the baseline",
    )
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array for the bandwidth probe")


def default_hf_threads() -> list[int]:
    # One thread as well: on a shared machine a descheduled OpenMP thread stalls torch at every
    # barrier, and the baseline should be the best transformers can do here.
    cores = os.cpu_count() or 1
    return [cores, 1] if cores > 1 else [1]


class CompileTimer:
    """Sums XLA backend compile durations reported while `active`."""

    def __init__(self):
        self.seconds = 0.0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_) -> None:
        if self.active and event == _COMPILE_EVENT:
            self.seconds += duration

    @contextlib.contextmanager
    def measure(self):
        self.active, start = True, self.seconds
        try:
            yield
        finally:
            self.active = False
            self.last = self.seconds - start


def _read_gbs(nbytes: int, fn, repeats: int) -> float:
    return nbytes / common.median_seconds(fn, repeats) / 1e9


def measure_bandwidth(mib: int, repeats: int = 7) -> dict:
    """Read bandwidth in GB/s: median time of a sum over a `mib` MiB float32 array, with NumPy
    (one thread, and one thread per core over slices: one core may not saturate memory) and with
    a jitted jnp.sum; the highest is the roofline's."""
    host = np.random.default_rng(0).random(mib * 2**20 // 4, dtype=np.float32)
    cores = os.cpu_count() or 1
    parts = np.array_split(host, cores)
    out = {"numpy_gbs": _read_gbs(host.nbytes, lambda: np.sum(host), repeats)}
    with ThreadPoolExecutor(cores) as pool:  # np.sum releases the GIL
        out["numpy_threads_gbs"] = _read_gbs(
            host.nbytes, lambda: sum(pool.map(np.sum, parts)), repeats
        )
    dev, total = jnp.asarray(host), jax.jit(jnp.sum)
    out["jax_gbs"] = _read_gbs(dev.nbytes, lambda: total(dev).block_until_ready(), repeats)
    dev.delete()
    return {**out, "gbs": max(out.values())}


def question_ids(model, target_len: int) -> list[int]:
    """A real chat prompt of at most `target_len` tokens (random ids for a model without a
    tokenizer): the question is cut at a word so the template stays intact."""
    if not common.has_chat(model):
        return common.random_ids(model, target_len)
    words, best = QUESTION.split(), None
    for n in range(1, len(words) + 1):
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": " ".join(words[:n])},
        ]
        ids = model.tokenizer.chat_ids(msgs)
        if len(ids) > target_len:
            break
        best = ids
    if best is None:
        raise ValueError(f"--prompt-len {target_len} is shorter than the chat template itself")
    return best


def rkvjax_runner(model, batch_ids):
    """n -> (generated token ids per row, result stats of the batch)."""

    def run(n):
        out = rkvjax.generate(model, batch_ids, max_new_tokens=n, ignore_eos=True)
        return [r.token_ids for r in out], out[0].stats

    return run


@jax.jit
def _weights_only_loop(decoder, tok: jax.Array, n: jax.Array) -> jax.Array:
    """tok [B, 1] -> [B, 1]: n greedy steps of `decoder` with attention replaced by its queries."""

    def attend(i, q, k, v, state):
        return q, state  # [B, 1, N, H]: no cache, no scores

    def step(i, tok):
        x, _ = decoder.hidden(tok, jnp.full_like(tok, i), attend, ())
        return jnp.argmax(decoder.head(x), axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, n, step, tok)


def weights_only_runner(model, batch_ids):
    """n -> (token ids per row, None): the same decoder's weight products, norms, RoPE and LM head
    with no attention and no cache, as one compiled loop of n steps. Its speed is what XLA makes
    of the weights alone, so the gap to it is what attention and the cache cost, and its ratio
    to transformers bounds what any cache design could reach."""
    tok = jnp.asarray([ids[-1:] for ids in batch_ids], jnp.int32)  # [B, 1]

    def run(n):
        out = _weights_only_loop(model.decoder, tok, jnp.int32(n))
        return out.tolist(), None  # .tolist() waits for the device

    return run


def torch_device() -> str:
    """transformers runs where rkvjax runs: on the GPU when JAX has one, else on the CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def load_hf(path, dtype: str):
    import torch
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return hf.to(torch_device()).eval()


def hf_runner(hf, batch_ids, threads: int):
    """n -> (generated token ids per row, None): `generate`, greedy, its default DynamicCache,
    on `threads` torch threads."""
    import torch

    ids = torch.tensor(batch_ids, dtype=torch.long, device=hf.device)  # equal lengths: no pad
    mask = torch.ones_like(ids)

    def run(n):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,  # ignore EOS, like rkvjax's ignore_eos
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist(), None  # .tolist() waits for the GPU

    return run


def time_engines(runners: dict, repeats: dict, n_new: int, timer: CompileTimer) -> dict:
    """Times t(1) and t(N) of every engine: one warm-up call per length (rkvjax compiles there),
    then the engines take turns repeat by repeat, so load from other processes on a shared
    machine hits them alike.

    Returns:
      {name: {"t1", "tn" (medians, s), "compile_s", "xla_compile_s", "recompile_s_while_timing",
      "internal_tokens_per_s", "tokens" and "stats" of the warm-up call of N tokens}}.
    """
    res = {}
    for name, run in runners.items():
        with timer.measure():
            t1_first, _ = common.timed(run, 1)
            tn_first, (tokens, stats) = common.timed(run, n_new)
        res[name] = {
            "first": (t1_first, tn_first),
            "xla_compile_s": timer.last,
            "tokens": tokens,
            "stats": stats,
            "t1s": [],
            "tns": [],
            "internal": [],
        }
    with timer.measure():
        for i in range(max(repeats.values())):
            for name, run in runners.items():
                if i >= repeats[name]:
                    continue
                r = res[name]
                r["t1s"].append(common.timed(run, 1)[0])
                t, (_, stats) = common.timed(run, n_new)
                r["tns"].append(t)
                if stats is not None:  # rkvjax's own count: decode tokens / its decode time
                    r["internal"].append(stats.tokens_per_s)
    for r in res.values():
        r["t1"], r["tn"] = statistics.median(r["t1s"]), statistics.median(r["tns"])
        # First calls minus steady ones: tracing, lowering, compilation and first-run overheads
        # (noisy on a loaded machine; xla_compile_s, XLA's own count, is not).
        r["compile_s"] = (r["first"][0] - r["t1"]) + (r["first"][1] - r["tn"])
        r["recompile_s_while_timing"] = timer.last
        r["internal_tokens_per_s"] = statistics.median(r["internal"]) if r["internal"] else None
    return res


def _steps_per_s(t: dict, n_new: int) -> float:
    """Decode steps/s with prefill and the first token cancelled out: (N-1) / (t(N) - t(1))."""
    return (n_new - 1) / (t["tn"] - t["t1"])


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of greedy tokens equal in both runs, up to each row's first divergence."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same, total = same + k, total + max(len(x), len(y))
    return same / total if total else 1.0


def bench_config(model, hf, name: str, dtype: str, batch: int, args, bw: dict, timer) -> dict:
    ids = question_ids(model, args.prompt_len)
    batch_ids = [list(ids) for _ in range(batch)]
    n = args.new_tokens
    runners = {
        "rkvjax": rkvjax_runner(model, batch_ids),
        "weights_only": weights_only_runner(model, batch_ids),
    }
    repeats = {"rkvjax": args.repeats, "weights_only": args.repeats}
    if hf is not None:
        # transformers in bfloat16 on CPU can be very slow: time it fewer times.
        hf_reps = args.repeats if dtype == "float32" else min(args.repeats, args.hf_bf16_repeats)
        for threads in args.hf_threads:
            runners[f"hf{threads}"] = hf_runner(hf, batch_ids, threads)
            repeats[f"hf{threads}"] = hf_reps
    load_start = os.getloadavg()[0]
    t = time_engines(runners, repeats, n, timer)
    rk = t["rkvjax"]
    capacity = rk["stats"].cache_capacity  # static C: prompt bucket + N - 1 slots
    itemsize = jnp.dtype(model.dtype).itemsize
    w_bytes = common.weight_bytes(model)
    # K and V read by one decode step: every layer attends over all C slots of the cache.
    kv_bytes = common.kv_bytes(model.config, batch, capacity, itemsize)
    step_bytes = w_bytes + kv_bytes
    roofline = bw["gbs"] * 1e9 / step_bytes
    rk_steps = _steps_per_s(rk, n)
    wo_steps = _steps_per_s(t["weights_only"], n)
    row = {
        "bench": "decode_throughput",
        "model": name,
        "dtype": dtype,
        "batch": batch,
        "new_tokens": n,
        "prompt_len": len(ids),
        "cache_capacity": capacity,
        "method": "full",
        "compressions": 0,  # FullKV: no compression step, so no compression overhead
        "repeats": args.repeats,
        "rkvjax_steps_per_s": rk_steps,
        "rkvjax_tokens_per_s": rk_steps * batch,
        "rkvjax_internal_tokens_per_s": rk["internal_tokens_per_s"],
        "rkvjax_ttft_s": rk["t1"],
        "rkvjax_t_new_tokens_s": rk["tn"],
        "rkvjax_compile_s": rk["compile_s"],
        "rkvjax_xla_compile_s": rk["xla_compile_s"],
        "recompile_s_while_timing": rk["recompile_s_while_timing"],
        "weights_only_steps_per_s": wo_steps,
        "weights_only_fraction": rk_steps / wo_steps,
        "weights_only_vs_hf": None,
        "hf_steps_per_s": None,
        "hf_tokens_per_s": None,
        "hf_ttft_s": None,
        "hf_t_new_tokens_s": None,
        "hf_repeats": None,
        "hf_threads": None,
        "hf_by_threads": None,
        "speedup_vs_hf": None,
        "speedup_vs_hf_all_cores": None,
        "greedy_agreement_vs_hf": None,
        "bandwidth_gbs": bw["gbs"],
        "bandwidth_numpy_gbs": bw["numpy_gbs"],
        "bandwidth_numpy_threads_gbs": bw["numpy_threads_gbs"],
        "bandwidth_jax_gbs": bw["jax_gbs"],
        "weight_bytes": w_bytes,
        "kv_bytes_per_step": kv_bytes,
        "bytes_per_step": step_bytes,
        "roofline_steps_per_s": roofline,
        "roofline_fraction": rk_steps / roofline,
        # Other processes on the machine skew both engines, multi-threaded torch the most (a
        # descheduled OpenMP thread stalls every barrier): read the numbers with these.
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": os.getloadavg()[0],
    }
    if hf is not None:
        by_threads = {
            th: {
                "steps_per_s": _steps_per_s(t[f"hf{th}"], n),
                "ttft_s": t[f"hf{th}"]["t1"],
                "t_new_tokens_s": t[f"hf{th}"]["tn"],
            }
            for th in args.hf_threads
        }
        best = max(by_threads, key=lambda th: by_threads[th]["steps_per_s"])
        h, hf_steps = by_threads[best], by_threads[best]["steps_per_s"]
        all_cores = by_threads.get(os.cpu_count() or 1)
        row.update(
            hf_steps_per_s=hf_steps,
            hf_tokens_per_s=hf_steps * batch,
            hf_ttft_s=h["ttft_s"],
            hf_t_new_tokens_s=h["t_new_tokens_s"],
            hf_repeats=hf_reps,
            hf_threads=best,
            hf_by_threads={str(th): v for th, v in by_threads.items()},
            speedup_vs_hf=rk_steps / hf_steps,
            weights_only_vs_hf=wo_steps / hf_steps,
            speedup_vs_hf_all_cores=all_cores and rk_steps / all_cores["steps_per_s"],
            greedy_agreement_vs_hf=_agreement(rk["tokens"], t[f"hf{best}"]["tokens"]),
        )
    stats = jax.devices()[0].memory_stats() or {}
    row["device_peak_bytes"] = stats.get("peak_bytes_in_use")
    row["host_max_rss_bytes"] = common.max_rss_bytes()
    return row


def _library_versions() -> dict:
    v = {}
    with contextlib.suppress(ImportError):
        import torch

        v["torch"] = torch.__version__
    with contextlib.suppress(ImportError):
        import transformers

        v["transformers"] = transformers.__version__
    return v


def run(args, folder) -> list[dict]:
    args.hf_threads = args.hf_threads or default_hf_threads()
    threads = os.cpu_count() or 1
    timer = CompileTimer()
    if os.getloadavg()[0] > threads / 2:
        print(
            f"warning: load average {os.getloadavg()[0]:.1f} on {threads} cores: other processes "
            "will slow both engines (multi-threaded torch the most)",
            file=sys.stderr,
        )
    bw = measure_bandwidth(args.bandwidth_mib)
    meta = common.run_meta(**_library_versions())
    rows = []
    for dtype in args.dtype:
        model, name = common.load_model(args, dtype)
        hf = None if args.no_hf else load_hf(model.path, dtype)
        for batch in args.batch:
            row = {**bench_config(model, hf, name, dtype, batch, args, bw, timer), **meta}
            common.emit(row, folder)
            rows.append(row)
        del model, hf
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    legend = (
        f"{r0['model']}: bandwidth {r0['bandwidth_gbs']:.1f} GB/s (numpy "
        f"{r0['bandwidth_numpy_gbs']:.1f}, numpy x{r0['cpus']} threads "
        f"{r0['bandwidth_numpy_threads_gbs']:.1f}, jax {r0['bandwidth_jax_gbs']:.1f}); new tokens "
        f"{r0['new_tokens']}; steps/s = (N-1)/(t(N)-t(1)); ratio = rkvjax / fastest "
        "transformers steps/s; hf thr = its torch threads; w-only = steps/s of the same decoder "
        "without attention or cache (its weights alone), w/hf = that over transformers."
    )
    columns = [
        ("batch", "batch", "d"),
        ("dtype", "dtype", "s"),
        ("rkv tok/s", "rkvjax_tokens_per_s", ".1f"),
        ("steps/s", "rkvjax_steps_per_s", ".1f"),
        ("hf tok/s", "hf_tokens_per_s", ".1f"),
        ("hf thr", "hf_threads", "d"),
        ("ratio", "speedup_vs_hf", ".2f"),
        ("w-only", "weights_only_steps_per_s", ".1f"),
        ("w/hf", "weights_only_vs_hf", ".2f"),
        ("ttft rkv ms", lambda r: r["rkvjax_ttft_s"] * 1e3, ".0f"),
        ("ttft hf ms", lambda r: r["hf_ttft_s"] and r["hf_ttft_s"] * 1e3, ".0f"),
        ("MB/step", lambda r: r["bytes_per_step"] / 1e6, ".0f"),
        ("roof st/s", "roofline_steps_per_s", ".1f"),
        ("roof %", lambda r: r["roofline_fraction"] * 100, ".0f"),
        ("xla cmp s", "rkvjax_xla_compile_s", ".1f"),
        ("load", "load_avg_1m_start", ".1f"),
    ]
    return f"{legend}\n\n{common.markdown_table(rows, columns)}"


def plot(plt, rows: list[dict]):
    """Tokens/s against batch: rkvjax, its weights-only loop and transformers, per dtype."""
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        rs = [r for r in rows if r["dtype"] == dtype]
        batches = [r["batch"] for r in rs]
        series[f"rkvjax {dtype}"] = (batches, [r["rkvjax_tokens_per_s"] for r in rs])
        series[f"weights only {dtype}"] = (
            batches,
            [r["weights_only_steps_per_s"] * r["batch"] for r in rs],
        )
        if all(r["hf_tokens_per_s"] is not None for r in rs):
            series[f"transformers {dtype}"] = (batches, [r["hf_tokens_per_s"] for r in rs])
    common.lines(
        ax,
        series,
        xlabel="batch",
        ylabel="decode tokens/s",
        title=f"{rows[0]['model']}, {rows[0]['new_tokens']} new tokens",
    )
    return fig
