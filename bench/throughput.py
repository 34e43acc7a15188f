"""The paper's throughput table in miniature: under one KV-memory cap, FullKV at the largest
batch that fits against R-KV (a token budget and a budget of 10% of the sequence) at theirs,
each decoding the same forced generation on the slot runtime.

The R-KV paper's Table 3 (A100 80 GB, R1-Llama-8B, 16K generated tokens): FullKV fits 30
sequences and decodes 347 tok/s, R-KV at budget 1024 fits 402 and decodes 3,189 tok/s (9.2x).
Here: the default model, --gen-tokens new tokens after one MATH-500 prompt, and a cap on the
cache alone (--kv-cap-mib: its keys, values, slot positions and query ring, per
`Engine.state_shapes()`); a batch is the cap over one row's cache bytes. Tokens/s is the
runtime's own count (generated tokens over wall time less compilation), one run per setting.
--kv-dtype runs every setting once per cache storage type (default: the model's dtype); an 8-bit
cache's rows count its scales too, so more of them fit under the cap.
"""

from __future__ import annotations

import argparse

import rkvjax
from bench import common
from rkvjax import api, defaults

PREFER_MEMORY = True
TINY = {
    "gen_tokens": 40,
    "kv_cap_mib": 0.25,
    "budget": 24,
    "buffer": 8,
    "ratio": 0.0,
    "max_batch": 8,
}
# The paper's Table 3, for the table's last lines.
PAPER = [
    {"method": "full", "budget": None, "batch": 30, "tokens_per_s": 347.0},
    {"method": "rkv", "budget": 1024, "batch": 402, "tokens_per_s": 3189.0},
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gen-tokens", type=common.int_at_least(2), default=4096)
    p.add_argument("--kv-cap-mib", type=float, default=256.0, help="cache memory for all rows")
    p.add_argument("--budget", type=common.int_at_least(2), default=256, help="R-KV tokens")
    p.add_argument("--ratio", type=float, default=0.1, help="R-KV budget as a fraction (0: none)")
    p.add_argument("--buffer", type=common.int_at_least(1), default=defaults.BUFFER)
    p.add_argument(
        "--max-batch", type=common.int_at_least(1), default=512, help="batch at most (time)"
    )
    common.add_kv_dtype_argument(p, several=True)


def _prompt(model, tiny: bool) -> list[int]:
    if common.has_chat(model):
        return common.chat_ids(model, common.math_prompts(common.DATA, 1)[0])
    return common.random_ids(model, 24 if tiny else 100)


def _engine(model, prompt, params, cache: dict, slots: int) -> rkvjax.Engine:
    return api.engine_for(model, [prompt], [params], slots=slots, **cache)


def run(args, folder) -> list[dict]:
    model, name = common.load_model(args, args.dtype)
    prompt = _prompt(model, args.tiny)
    params = rkvjax.SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    cap = int(args.kv_cap_mib * 2**20)
    settings = {
        "full": {"method": "full"},
        f"rkv-{args.budget}": {"method": "rkv", "budget": args.budget, "buffer": args.buffer},
    }
    if args.ratio:
        settings[f"rkv-{args.ratio:g}"] = {
            "method": "rkv",
            "budget": args.ratio,
            "buffer": args.buffer,
        }
    rows = []
    cases = [
        (label, {**cache, "kv_dtype": kv_dtype})
        for label, cache in settings.items()
        for kv_dtype in dict.fromkeys(args.kv_dtype)
    ]
    for label, cache in cases:
        one = _engine(model, prompt, params, cache, 1)
        per_row = common.tree_bytes(one.state_shapes().cache)
        batch = min(cap // per_row, args.max_batch)
        row = {
            "bench": "throughput",
            "setting": label,
            "kv_dtype": common.kv_dtype_name(cache["kv_dtype"], model.dtype),
            "method": cache["method"],
            "budget": one.compression.budget if one.compression.compressing else None,
            "cache_slots_per_row": one.capacity,
            "kv_bytes_per_row": per_row,
            "kv_cap_bytes": cap,
            "batch": batch,
            "gen_tokens": args.gen_tokens,
            "prompt_tokens": len(prompt),
            "model": name,
        }
        if batch == 0:
            rows.append({**row, "tokens_per_s": None})
            common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
            continue
        eng = _engine(model, prompt, params, cache, batch)
        eng.submit_many([prompt] * batch, [params] * batch)
        results = eng.run()
        st = eng.stats
        assert all(len(r.token_ids) == args.gen_tokens for r in results)
        row.update(
            tokens_per_s=st.tokens_per_s,
            generated_tokens=st.generated_tokens,
            wall_s=st.wall_s,
            compile_s=st.compile_s,
            compressions=st.compressions,
            stalled_row_steps=st.stalled_row_steps,
        )
        rows.append(row)
        common.emit({**row, **common.run_meta(dtype=args.dtype)}, folder)
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """x FullKV: each row's tokens/s over FullKV's with the same storage type."""
    full = {r.get("kv_dtype"): r["tokens_per_s"] for r in rows if r["setting"] == "full"}
    for r in rows:
        f, t = full.get(r.get("kv_dtype")), r["tokens_per_s"]
        r["vs_full"] = t / f if f and t else None


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    cols = [
        ("setting", "setting", "s"),
        ("kv dtype", "kv_dtype", "s"),
        ("budget", "budget", "d"),
        ("cache slots / row", "cache_slots_per_row", "d"),
        ("KV MiB / row", lambda r: r["kv_bytes_per_row"] / 2**20, ".2f"),
        ("batch under the cap", "batch", "d"),
        ("tok/s", "tokens_per_s", ".1f"),
        ("x FullKV", "vs_full", ".2f"),
    ]
    head = (
        f"{r0['model']}, {r0['gen_tokens']} generated tokens after a {r0['prompt_tokens']}-token "
        f"prompt, KV cap {r0['kv_cap_bytes'] / 2**20:g} MiB\n\n"
    )
    return head + common.markdown_table(rows, cols) + "\n\n" + paper_line()


def paper_line() -> str:
    """The paper's Table 3, as the last line of this suite's and the scale suite's tables."""
    full, rkv = PAPER
    return (
        f"Paper (A100 80 GB, R1-Llama-8B, 16K tokens): FullKV batch {full['batch']} at "
        f"{full['tokens_per_s']:g} tok/s; R-KV budget {rkv['budget']} batch {rkv['batch']} at "
        f"{rkv['tokens_per_s']:g} tok/s ({rkv['tokens_per_s'] / full['tokens_per_s']:.1f}x)."
    )


def batch_figure(plt, rows: list[dict], label=lambda r: r["setting"]):
    """Batch and tokens/s per setting, side by side (None when nothing ran)."""
    done = [r for r in rows if r.get("tokens_per_s")]
    if not done:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [label(r) for r in done]
    common.bars(a, labels, [r["batch"] for r in done], ylabel="rows", title="batch")
    common.bars(b, labels, [r["tokens_per_s"] for r in done], ylabel="tok/s", title="throughput")
    return fig


def plot(plt, rows: list[dict]):
    if len({r.get("kv_dtype") for r in rows}) > 1:
        short = common.KV_DTYPE_SHORT
        return batch_figure(plt, rows, lambda r: f"{r['setting']}\n{short[r['kv_dtype']]}")
    return batch_figure(plt, rows)
