"""Mixture-of-experts (Qwen3-MoE): the grouped expert products equal every expert run on every
token, their compiled work follows the active parameters, and the runtime, the cache policies and
a mesh run a MoE model as they run a dense one.

Logits and greedy decoding equal transformers' in tests/test_models.py (the "qwen3_moe" kind)."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rkvjax.models import experts, loading, sharding
from rkvjax.models.config import Experts, ModelConfig
from rkvjax.models.decoder import Decoder

import rkvjax
from bench.experts import compiled_flops, token_flops
from bench.flops import dot_flops
from rkvjax.kv import policies
from tests.hf_tiny import VOCAB
from tests.tolerances import SELF_ATOL


def _inputs(n: int, k: int, e: int, d: int = 16, f: int = 8, seed: int = 0, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(n, d), dtype)
    router = jnp.asarray(rng.randn(e, d), dtype)
    gate, up = (jnp.asarray(rng.randn(e, f, d) * 0.3, dtype) for _ in range(2))
    down = jnp.asarray(rng.randn(e, d, f) * 0.3, dtype)
    weights, chosen = experts.route(x, router, k, norm=True)
    return x, weights, chosen, gate, up, down


@pytest.mark.parametrize(
    "n,k,e", [(1, 2, 8), (8, 2, 8), (5, 3, 4), (64, 8, 16), (3, 1, 1), (40, 2, 64)], ids=str
)
def test_grouped_products_equal_every_expert_on_every_token(n, k, e):
    x, weights, chosen, gate, up, down = _inputs(n, k, e)
    assert chosen.shape == (n, k) and len(set(np.asarray(chosen).ravel())) > min(1, e - 1)
    got = experts.grouped_swiglu(x, weights, chosen, gate, up, down)
    want = experts.dense_reference(x, weights, chosen, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_every_token_on_one_expert():
    """The longest run a tile layout must hold: all assignments on one expert (and one on
    another), in bfloat16."""
    x, weights, _, gate, up, down = _inputs(33, 2, 8, dtype=jnp.bfloat16)
    chosen = jnp.stack([jnp.full(33, 5), jnp.full(33, 2).at[7].set(0)], axis=1).astype(jnp.int32)
    got = experts.grouped_swiglu(x, weights, chosen, gate, up, down)
    want = experts.dense_reference(x, weights, chosen, gate, up, down)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.05, rtol=0.02
    )


def test_route_follows_the_softmax_top_k():
    x, weights, chosen, *_ = _inputs(6, 3, 8)
    rng = np.random.RandomState(0)  # _inputs' draws again: x, then the router
    xs, router = rng.randn(6, 16), rng.randn(8, 16)
    p = np.exp(xs @ router.T)
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(chosen), top)
    want = np.take_along_axis(p, top, -1)
    np.testing.assert_allclose(np.asarray(weights), want / want.sum(-1, keepdims=True), atol=1e-6)
    unnormed, _ = experts.route(x, jnp.asarray(router, jnp.float32), 3, norm=False)
    np.testing.assert_allclose(np.asarray(unnormed), want, atol=1e-6)


@pytest.mark.parametrize("a,e", [(1, 8), (16, 8), (512, 128), (65536, 128), (24, 4), (7, 64)])
def test_tiles_hold_each_experts_rows_within_the_padding(a, e):
    m = experts.tile_rows(a, e)
    n_tiles = experts.tiles(a, e, m)
    assert n_tiles * m <= experts.MAX_PADDING * a
    rng = np.random.RandomState(a)
    for skew in (0.0, 3.0):  # uniform, then most assignments on a few experts
        p = np.exp(-skew * np.arange(e))
        chosen = rng.choice(e, size=a, p=p / p.sum()).astype(np.int32)
        row, expert = experts.layout(jnp.asarray(chosen), e, m, n_tiles)
        row, expert = np.asarray(row), np.asarray(expert)
        assert len(set(row)) == a and row.min() >= 0 and row.max() < n_tiles * m
        np.testing.assert_array_equal(expert[row // m], chosen)  # each row in its expert's tile


# A MoE whose dense layer is as wide as its two chosen experts together, and a dense model of
# its active parameters: the same but for layer 1's experts, a dense MLP of that width.
MOE = ModelConfig(
    arch="qwen3_moe",
    vocab_size=VOCAB,
    embed=64,
    ffw=96,
    num_layers=2,
    q_heads=8,
    kv_heads=4,
    head_dim=16,
    rms_eps=1e-6,
    rope_theta=1e4,
    max_positions=512,
    qk_norm=True,
    experts=Experts(count=8, top_k=2, ffw=48, norm_top_k=True, layers=(1,)),
)
SAME_ACTIVE = dataclasses.replace(MOE, arch="qwen3", experts=None)


def _layer_flops(cfg: ModelConfig, rows: int) -> float:
    """Compiled FLOPs of layer 1's MLP (the experts, or a dense MLP) for one token per row."""
    mlp = Decoder(cfg, rngs=nnx.Rngs(0)).layers[1].mlp
    x = jnp.ones((cfg.embed, rows, 1), jnp.float32)  # [D, B, T]
    return compiled_flops(nnx.jit(lambda m, x: m(x)).lower(mlp, x).compile())


def test_the_flops_count_runs_each_loop_body_as_often_as_it_runs():
    """`dot_flops` counts a looped product as the batched one (cost_analysis counts a loop's
    body once), nested loops multiply, a conditional counts its dearest branch, and a loop of
    unknown length is refused."""
    x, w = jnp.ones((6, 8, 16)), jnp.ones((6, 12, 16))  # 6 tiles: [8, 16] x [12, 16]^T
    want = 2 * 6 * 8 * 12 * 16
    tile = lambda xw: jnp.einsum("md,fd->mf", *xw)
    programs = {
        "batched": lambda x, w: jnp.einsum("tmd,tfd->tmf", x, w),
        "map": lambda x, w: jax.lax.map(tile, (x, w)),
        "nested": lambda x, w: jax.lax.map(
            lambda xw: jax.lax.map(tile, (xw[0].reshape(2, 4, 16), jnp.stack([xw[1]] * 2))),
            (x, w),
        ),
        "cond": lambda x, w: jax.lax.cond(
            x[0, 0, 0] > 0, lambda: jax.lax.map(tile, (x, w)), lambda: jnp.zeros((6, 8, 12))
        ),
    }
    compiled = {name: jax.jit(f).lower(x, w).compile() for name, f in programs.items()}
    for name, c in compiled.items():
        assert dot_flops(c) == want, name
    assert compiled["map"].cost_analysis()["flops"] < want / 5  # why the count exists

    def until_small(x, w):
        return jax.lax.while_loop(lambda x: x.sum() > 1, lambda x: tile((x, w)) @ w, x)

    unknown = jax.jit(until_small).lower(x[0], w[0]).compile()
    with pytest.raises(ValueError, match="no trip count"):
        dot_flops(unknown)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_decode_flops_follow_the_active_parameters(rows, monkeypatch):
    assert MOE.parameters(active=True) == SAME_ACTIVE.parameters() + 8 * 64  # + the router
    moe = token_flops(Decoder(MOE, rngs=nnx.Rngs(0)), rows)
    same_active = token_flops(Decoder(SAME_ACTIVE, rngs=nnx.Rngs(0)), rows)
    assert moe <= 1.5 * same_active, (moe, same_active)
    # The layer alone, where the work differs, and against every expert on every token (what
    # jax.lax.ragged_dot compiles to on CPU), which the bound must catch.
    layer, dense = _layer_flops(MOE, rows), _layer_flops(SAME_ACTIVE, rows)
    router = 2 * 8 * 64 * rows  # its product; twice that again for the softmax and the sort
    assert layer <= experts.MAX_PADDING * dense + 3 * router, (layer, dense)
    monkeypatch.setattr(experts, "grouped_swiglu", experts.dense_reference)
    assert _layer_flops(MOE, rows) > 3 * dense


@pytest.fixture(scope="module")
def moe_folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")[0]


@pytest.fixture(scope="module")
def moe(moe_folder):
    return rkvjax.load(moe_folder, dtype="float32")


def test_the_loaded_model_reports_its_active_parameters(moe):
    cfg = moe.config
    leaves = jax.tree.leaves(nnx.state(moe.decoder, nnx.Param))
    assert cfg.parameters() == sum(math.prod(x.shape) for x in leaves)
    per_expert = 3 * cfg.embed * cfg.experts.ffw
    unused = (cfg.experts.count - cfg.experts.top_k) * per_expert
    assert cfg.parameters() - cfg.parameters(active=True) == unused


LENGTHS = (9, 30, 12, 41, 8, 17, 25)
MAX_TOKENS = (21, 5, 34, 12, 30, 9, 17)


def _run(model, slots: int, method: str, kv_dtype=None, options=None):
    budget = 16 if method != "full" else None
    cc = rkvjax.compression_config(method, budget, buffer=8, kv_dtype=kv_dtype, **(options or {}))
    eng = rkvjax.Engine(model, slots=slots, cache=cc, max_len=128)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, VOCAB, n).tolist() for n in LENGTHS]
    # Seeded: random eviction draws from the request's seed.
    params = [rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, seed=m)
              for m in MAX_TOKENS]  # fmt: skip
    eng.submit_many(prompts, params)
    return sorted(eng.run(), key=lambda r: r.request_id)


# Every built-in policy, the cache storage types spread over them (the policy and the storage
# are independent of the MLP: what is tested is that rows routed to different experts do not
# leak into each other's scores).
_KV_DTYPES = (None, "int8", "float8_e4m3fn")
POLICY_CASES = [(m, _KV_DTYPES[i % 3]) for i, m in enumerate(policies.BUILTINS)]


@pytest.mark.parametrize("method,kv_dtype", POLICY_CASES, ids=str)
def test_continuous_batching_of_a_moe_equals_each_request_alone(moe, method, kv_dtype, stats_of):
    """Rows routed to different experts in one step: each request's tokens and compressions
    through 3 slots equal those of the request alone, for every built-in policy."""
    options = {"calibration": stats_of("qwen3_moe")} if method == "triattention" else {}
    got = _run(moe, 3, method, kv_dtype, options)
    alone = _run(moe, 1, method, kv_dtype, options)
    for r, (a, b) in enumerate(zip(got, alone, strict=True)):
        assert a.token_ids == b.token_ids, f"request {r}"
        assert a.stats.compressions == b.stats.compressions, f"request {r}"
    assert sum(r.stats.compressions for r in got) >= len(LENGTHS)


COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
PROMPTS = [np.random.RandomState(0).randint(0, VOCAB, n).tolist() for n in (9, 20, 33)]
GEN = dict(budget=16, buffer=8, max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method,kv_dtype", [("rkv", None), ("h2o", "int8")], ids=str)
def test_a_moe_on_a_mesh_equals_one_device(moe, moe_folder, method, kv_dtype):
    mesh = sharding.make_mesh(2, 4)
    sharded = rkvjax.load(moe_folder, dtype="float32", mesh=mesh)
    gate = sharded.decoder.layers[1].mlp.gate[...]
    assert gate.sharding.shard_shape(gate.shape) == (8, 12, 64)  # hidden units split by 4
    ids = np.array(PROMPTS[2][:32]).reshape(4, 8)
    np.testing.assert_allclose(
        np.asarray(rkvjax.logits(sharded, ids)),
        np.asarray(rkvjax.logits(moe, ids)),
        atol=SELF_ATOL[jnp.float32],
        rtol=1e-5,
    )
    want = rkvjax.generate(moe, PROMPTS, method=method, kv_dtype=kv_dtype, **GEN)
    got = rkvjax.generate(sharded, PROMPTS, method=method, kv_dtype=kv_dtype, **GEN)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.compressions for r in got] == [r.stats.compressions for r in want]
    assert min(r.stats.compressions for r in got) >= 1


def test_experts_config_is_checked():
    with pytest.raises(ValueError, match="top_k"):
        Experts(count=4, top_k=5, ffw=8, norm_top_k=False, layers=(0,))
    assert re.search("qwen3_moe", MOE.to_json())
    assert ModelConfig.from_dict(__import__("json").loads(MOE.to_json())) == MOE


def test_a_converted_moe_restores_into_a_mesh(moe, moe_folder, tmp_path):
    """Orbax conversion keeps the stacked experts; restored split over model=4, it computes the
    same logits."""
    out = loading.convert(moe_folder, tmp_path / "moe-orbax")
    restored = rkvjax.load(out, mesh=sharding.make_mesh(2, 4))
    assert restored.config == moe.config
    ids = np.array(PROMPTS[1][:16]).reshape(2, 8)
    np.testing.assert_allclose(
        np.asarray(rkvjax.logits(restored, ids)),
        np.asarray(rkvjax.logits(moe, ids)),
        atol=SELF_ATOL[jnp.float32],
        rtol=1e-5,
    )


def test_a_moe_decode_step_only_all_reduces(moe_folder, monkeypatch):
    """On a 2 x 4 mesh a MoE decode chunk's collectives are those of a dense model: an
    all-reduce of each layer's attention and MLP outputs (the experts' [B, T, D] partial sums
    over "model") and scalar flags. Routing sorts tokens across the batch, which the automatic
    partitioner did by gathering every data shard's rows."""
    from tests.test_sharding import _compiled_decode_on_mesh

    m = rkvjax.load(moe_folder, dtype="float32", mesh=sharding.make_mesh(2, 4))
    hlo = _compiled_decode_on_mesh(m, monkeypatch, "rkv")
    ops = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo)
    assert set(ops) == {"all-reduce"}, sorted(set(ops))
    shaped = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-reduce(?:-start)?\(", hlo)
    rows = 4 // 2  # 3 prompts padded to 4 rows, over data=2
    activations = {f"{m.config.embed},{rows},1", f"{rows},1,{m.config.embed}"}
    assert {dims for _, dims in shaped} <= activations | {""}
    assert sum(1 for _, dims in shaped if dims) == 2 * m.config.num_layers


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_moe_sample_does_not_depend_on_the_batch(moe, kv_dtype):
    """Batch-invariant mode: rows routed beside others (expert runs and tiles of other sizes)
    give each sampled request the tokens, logprobs and kept sets it gets alone, to the bit."""
    from tests.test_batch_invariance import BUDGET, BUFFER, WINDOW, _assert_same, _batch_and_alone

    cc = rkvjax.compression_config("rkv", BUDGET, buffer=BUFFER, window=WINDOW, kv_dtype=kv_dtype)
    _assert_same(*_batch_and_alone(moe, cc, narrow=False))


@pytest.mark.parametrize(
    "key, value",
    [("decoder_sparse_step", 0), ("num_experts_per_tok", 9), ("mlp_only_layers", [2])],
)
def test_a_bad_moe_setting_is_named(moe_folder, key, value):
    from rkvjax.convert.hf_config import ConfigError, parse_hf_config

    raw = __import__("json").loads((moe_folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=key):
        parse_hf_config({**raw, key: value})


def test_a_bfloat16_moe_decode_holds_no_copy_of_the_experts():
    """Compile-only: a decode chunk's temporaries stay far below the experts' own bytes.
    XLA:CPU gathers bfloat16 through float32 and hoisted that conversion of every expert out of
    the decode loop (temporaries 2-3x the experts' bytes; Qwen3-30B-A3B's decode peak was 178 GB
    for 61 GB of weights). 4 rows x top 2 use 8 of the 64 experts: their gathered tiles are an
    eighth of the experts."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
        "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": 64, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "norm_topk_prob": True, "max_position_embeddings": 512, "rope_theta": 10000.0,
    }  # fmt: skip
    model = loading.abstract(config, dtype="bfloat16")
    expert_bytes = 3 * 64 * 256 * 512 * 2
    eng = rkvjax.Engine(model, slots=4, cache=rkvjax.compression_config("full"), max_len=256)
    temp = eng.memory_analysis(prompt_len=16)["decode"]["temp_bytes"]
    assert temp < expert_bytes / 2, (temp, expert_bytes)
