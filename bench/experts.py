"""A mixture of experts against the dense model of the same active size: decode speed and
compiled work per token, side by side.

Two random-init models differ only in the MLP: the MoE config (default: Qwen3-30B-A3B's
routing, 128 experts and the top 8, at a width a CPU decodes in seconds; --config for another)
and a dense Qwen3 whose MLP has the active experts' hidden units (intermediate_size = top_k x
moe_intermediate_size), so both compute the same active parameters per token. For each batch
both decode the same random prompts (FullKV, greedy, forced length), timed as `bench decode`
times (steps/s = (N - 1) / (t(N) - t(1)), medians of --repeats after a warm-up, the two models
taking turns so that load hits both alike), and the compiled FLOPs of one token through the
weights (`token_flops`; on CPU the matrix products, each loop body counted as often as it runs).
The speed ratio is what routing, sorting and per-tile weight slices cost over a dense MLP of the
same work: the FLOPs stay within 1.5x (the tiles' padding) while the MoE holds experts / top_k
times the expert weights.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from rkvjax.convert.hf_config import MOE_KEYS
from rkvjax.models import experts, layers, loading

from bench import common
from bench.decode import CompileTimer, rkvjax_runner, time_engines
from bench.flops import dot_flops

PREFER_MEMORY = False
# Qwen3-30B-A3B's routing (128 experts, top 8, renormalised) and its ratios (expert hidden units
# = 3/8 of the width, 16 query and 2 KV heads per 4 of them) at width 256.
DEFAULT_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 96,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TINY = {"batch": [2], "new_tokens": 4, "repeats": 1, "layers": 1, "experts": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="a qwen3_moe config.json")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=common.int_at_least(1), nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=common.int_at_least(1), default=32)
    p.add_argument("--new-tokens", type=common.int_at_least(2), default=64)
    p.add_argument("--repeats", type=common.int_at_least(1), default=5)
    p.add_argument("--layers", type=common.int_at_least(1), default=None, help="override")
    p.add_argument("--experts", type=common.int_at_least(1), default=None, help="override")


def configs(args) -> tuple[str, dict, dict]:
    """(name, the MoE config, the dense config of the same active size)."""
    if args.config is not None:
        name, moe = args.config.stem, json.loads(args.config.read_text())
    else:
        name, moe = "qwen3-moe-w256", copy.deepcopy(DEFAULT_CONFIG)
    if args.layers:
        moe["num_hidden_layers"] = args.layers
    if args.experts:
        for key in ("num_experts", "num_local_experts"):
            if key in moe:
                moe[key] = args.experts
    if moe.get("model_type") != "qwen3_moe":
        raise SystemExit(f"{name}: the experts suite needs a qwen3_moe config")
    if moe.get("mlp_only_layers"):
        raise SystemExit(
            f"{name}: dense layers among the sparse ones (mlp_only_layers) are not compared here"
        )
    dense = {k: v for k, v in moe.items() if k not in MOE_KEYS}
    dense.update(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"],
    )
    return name, moe, dense


def compiled_flops(compiled) -> float:
    """FLOPs of one run of a compiled program. On CPU, where a MoE layer loops over its tiles
    (`experts.loops_over_tiles`), the matrix products with each loop body counted as often as
    it runs (`bench.flops.dot_flops`; `cost_analysis` counts a body once). Elsewhere the
    products are batched, not looped, and `cost_analysis` counts them (with the element-wise
    work, a few percent more)."""
    if experts.loops_over_tiles():
        return dot_flops(compiled)
    return compiled.cost_analysis()["flops"]


def token_flops(decoder, rows: int) -> float:
    """Compiled FLOPs (`compiled_flops`) of one decode token per row through `decoder` (an
    rkvjax Decoder) and its head, attention over the token itself: the weights' work, which is
    what a MoE changes."""

    def attend(i, q, k, v, state):
        mask = jnp.ones((q.shape[0], 1, 1), bool)
        return layers.attention(q, k, v, mask, kv_axis=1), state

    def step(m, tokens):
        x, _ = m.hidden(tokens, jnp.zeros_like(tokens), attend, ())
        return m.head(x)

    tokens = jnp.zeros((rows, 1), jnp.int32)
    return compiled_flops(nnx.jit(step).lower(decoder, tokens).compile()) / rows


def run(args, folder) -> list[dict]:
    name, moe_cfg, dense_cfg = configs(args)
    models = {
        "moe": loading.random_init(moe_cfg, dtype=args.dtype),
        "dense": loading.random_init(dense_cfg, dtype=args.dtype),
    }
    timer = CompileTimer()
    meta = common.run_meta()
    rows = []
    for batch in args.batch:
        prompts = [common.random_ids(models["moe"], args.prompt_len, seed=i) for i in range(batch)]
        runners = {k: rkvjax_runner(m, prompts) for k, m in models.items()}
        repeats = dict.fromkeys(runners, args.repeats)
        timed = time_engines(runners, repeats, args.new_tokens, timer)
        per_model = {}
        for kind, model in models.items():
            t = timed[kind]
            steps = (args.new_tokens - 1) / (t["tn"] - t["t1"])
            per_model[kind] = {
                "steps_per_s": steps,
                "tokens_per_s": steps * batch,
                "flops_per_token": token_flops(model.decoder, batch),
                "params": model.config.parameters(),
                "params_active": model.config.parameters(active=True),
            }
        for kind, m in per_model.items():
            row = {
                "bench": "experts",
                "config": name,
                "model": kind,
                "dtype": args.dtype,
                "batch": batch,
                "new_tokens": args.new_tokens,
                **m,
                "speed_vs_dense": m["steps_per_s"] / per_model["dense"]["steps_per_s"],
                "flops_vs_dense": m["flops_per_token"] / per_model["dense"]["flops_per_token"],
                **meta,
            }
            common.emit(row, folder)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    moe = next(r for r in rows if r["model"] == "moe")
    head = (
        f"{r0['config']} ({r0['dtype']}): the MoE has {moe['params'] / 1e6:.1f}M parameters, "
        f"{moe['params_active'] / 1e6:.1f}M active per token; the dense model "
        f"{next(r for r in rows if r['model'] == 'dense')['params'] / 1e6:.1f}M. FullKV, greedy, "
        f"{r0['new_tokens']} forced tokens, medians.\n\n"
    )
    cols = [
        ("batch", "batch", "d"),
        ("model", "model", "s"),
        ("steps/s", "steps_per_s", ".1f"),
        ("tokens/s", "tokens_per_s", ".0f"),
        ("speed vs dense", "speed_vs_dense", ".2f"),
        ("MFLOP/token", lambda r: r["flops_per_token"] / 1e6, ".2f"),
        ("FLOPs vs dense", "flops_vs_dense", ".2f"),
    ]
    return head + common.markdown_table(rows, cols)


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for kind in ("dense", "moe"):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["model"] == kind)
        ax.plot([b for b, _ in pts], [t for _, t in pts], "o-", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("mixture of experts vs dense of the same active size")
    ax.legend()
    fig.tight_layout()
    return fig
