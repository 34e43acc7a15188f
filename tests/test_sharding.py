"""Data + tensor parallel runs over a ("data", "model") mesh of 8 CPU devices equal one device."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import sharding
from rkvjax.models.layers import as_storage

import rkvjax
from rkvjax import runtime
from rkvjax.entrypoints import cli
from rkvjax.entrypoints.cli import flags
from rkvjax.kv import cache as kv
from rkvjax.kv import compress
from rkvjax.kv.config import CompressionConfig
from rkvjax.runtime import programs
from tests.hf_tiny import VOCAB
from tests.tolerances import SELF_ATOL

# "llama" has 4 query heads, 2 KV heads, MLP 128, vocab 97: model in (1, 2); vocab replicated.
MESHES = [(8, 1), (4, 2), (2, 2), (1, 2)]
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
# Three ragged rows (padded to a multiple of data=4 or 8 with dummy rows); the longest prompt is
# over the budget, so the prompt is compressed once and decode compresses every 8 steps.
PROMPTS = [np.random.RandomState(0).randint(0, VOCAB, n).tolist() for n in (9, 20, 33)]
GEN = dict(budget=16, buffer=8, max_new_tokens=24, ignore_eos=True)


def sub_mesh(data: int, model: int):
    """A data x model mesh over the first data * model of the 8 CPU devices."""
    return sharding.make_mesh(data, model, devices=jax.devices()[: data * model])


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def single(folder):
    return rkvjax.load(folder, dtype="float32")


@pytest.fixture(scope="module")
def load_sharded(folder):
    made = {}

    def load(data: int, model: int):
        if (data, model) not in made:
            made[data, model] = rkvjax.load(folder, dtype="float32", mesh=sub_mesh(data, model))
        return made[data, model]

    return load


@pytest.fixture(scope="module")
def reference(single):
    """(method, kv_dtype) -> one-device generation of PROMPTS (computed once for each)."""
    done = {}

    def get(method: str, kv_dtype: str | None = None):
        if (method, kv_dtype) not in done:
            done[method, kv_dtype] = rkvjax.generate(
                single, PROMPTS, method=method, kv_dtype=kv_dtype, **GEN
            )
        return done[method, kv_dtype]

    return get


def test_weights_are_sharded(load_sharded):
    m = load_sharded(4, 2)
    wqkv = m.decoder.layers[0].attn.wqkv[...]  # [K, G + 2, H, D]
    assert wqkv.sharding.spec == m.rules.spec("kv_heads", None, "head_dim", "embed")
    assert tuple(wqkv.sharding.spec) == ("model", None, None, None)
    # One KV head per device, with its 2 query heads, its key and its value.
    assert {s.data.shape for s in wqkv.addressable_shards} == {(1, 4, 16, 64)}
    wo = m.decoder.layers[0].attn.wo[...]  # [D, N, H]
    assert {s.data.shape for s in wo.addressable_shards} == {(64, 2, 16)}  # half the heads
    down = m.decoder.layers[0].mlp.down[...]  # [D, F]
    assert {s.data.shape for s in down.addressable_shards} == {(64, 64)}
    # 97 does not split over 2 devices: the vocab axis is replicated instead of refused.
    assert m.rules.vocab is None
    assert {s.data.shape for s in m.decoder.embed[...].addressable_shards} == {(VOCAB, 64)}


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_logits_match_one_device(single, load_sharded, shape):
    ids = np.array(PROMPTS[2][:32]).reshape(4, 8) if shape[0] <= 4 else [PROMPTS[2]] * 8
    want = np.asarray(rkvjax.logits(single, ids))
    got = rkvjax.logits(load_sharded(*shape), ids)
    np.testing.assert_allclose(np.asarray(got), want, atol=SELF_ATOL[jnp.float32], rtol=1e-5)


@pytest.mark.parametrize(
    "shape,method,kv_dtype",
    [
        ((4, 2), "rkv", None),
        ((2, 2), "snapkv", None),
        ((1, 2), "streaming", None),
        # An 8-bit cache's scales are split and moved like the keys they belong to.
        ((4, 2), "rkv", "int8"),
        ((1, 2), "h2o", "float8_e4m3fn"),
    ],
    ids=str,
)
def test_generate_matches_one_device(reference, load_sharded, shape, method, kv_dtype):
    want = reference(method, kv_dtype)
    got = rkvjax.generate(load_sharded(*shape), PROMPTS, method=method, kv_dtype=kv_dtype, **GEN)
    assert len(got) == len(PROMPTS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.compressions for r in got] == [r.stats.compressions for r in want]
    if method != "full":
        assert min(r.stats.compressions for r in got) >= 1  # prompt and decode
        assert max(r.stats.compressions for r in got) >= 2
    assert got[0].stats.batch_size == len(PROMPTS)  # dummy rows are not reported


def test_tail_narrows_on_a_mesh(load_sharded, single):
    """On a data=2 mesh a run's tail narrows to one row per data shard and decodes,
    compressing, as on one device, where it narrows to two rows. The two long requests go
    to different shards: in the first free rows, both in shard 0, it could never narrow."""

    def run(model):
        cc = rkvjax.compression_config("rkv", 16, buffer=8)
        eng = rkvjax.Engine(model, slots=4, cache=cc)
        for i, (prompt, m) in enumerate(zip(PROMPTS, (100, 90, 8), strict=True)):
            sp = rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            eng.submit(prompt, sp, request_id=i)
        out = sorted(eng.run(), key=lambda r: r.request_id)
        return [(r.token_ids, r.stats.compressions) for r in out], eng.stats

    mesh_model = load_sharded(2, 2)
    got, stats = run(mesh_model)
    want, _ = run(single)
    assert got == want
    assert stats.narrowings == 1 and stats.decoded_row_steps < 4 * stats.decode_steps
    # Each data shard gathers its own rows: narrowing moves nothing between devices (with
    # global indices, every device gathered the whole narrow state).
    eng = rkvjax.Engine(mesh_model, slots=8, cache=rkvjax.compression_config("rkv", 16, buffer=8))
    with jax.set_mesh(mesh_model.mesh):
        rows = runtime.device_rows(mesh_model, np.asarray([1, 3, 0, 2], np.int32))
        state, plan = eng.executor.empty_state(), eng.executor.plan_of(4)
        hlo = programs.take_rows.lower(state, rows, plan=plan).compile()
    assert not [op for op in COLLECTIVES if op in hlo.as_text()]


def _random_cache(rs, *, layers=1, b=4, k=2, n=4, c=24, h=16, w=8):
    def normal(*shape):
        return jnp.asarray(rs.normal(size=shape), jnp.float32)

    sp = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, k, c))
    return kv.KVCache(
        k=tuple(as_storage(normal(b, k, c, h)) for _ in range(layers)),
        v=tuple(as_storage(normal(b, k, c, h)) for _ in range(layers)),
        slot_pos=tuple(sp + 0 for _ in range(layers)),
        q_win=tuple(normal(b, n, w, h) for _ in range(layers)),
        acc=(),
        length=jnp.full((b,), c, jnp.int32),
        pos=jnp.full((b,), c, jnp.int32),
        prompt=jnp.zeros((b,), jnp.int32),
        seed=jnp.zeros((b,), jnp.uint32),
        dtype=jnp.float32,
    )


def test_compression_compiles_without_collectives():
    """The shard_map'd compression is per device; the automatic partitioner would gather."""
    mesh, rules = sub_mesh(4, 2), sharding.DEFAULT_RULES
    cc = CompressionConfig(method="rkv", budget=16, buffer=8, window=8)
    cache = _random_cache(np.random.RandomState(0))
    # data=4: each device holds one row, so one lane per shard compresses every full row.
    rows = jnp.array([True, False, True, True])
    start = jnp.int32(0)
    with jax.set_mesh(mesh):
        sharded = jax.jit(lambda c: kv.constrain(c, rules))(cache)
        assert sharded.k[0].sharding.is_equivalent_to(rules.named(mesh, *kv.KV_AXES), 4)
        local = jax.jit(
            lambda c, r: compress.compress_lanes(c, r, cc, lanes=1, start=start, rules=rules)
        )
        local = local.lower(sharded, rows).compile()
        # Without shard_map: the same rows, 4 lanes over the whole batch.
        auto = jax.jit(lambda c, r: compress.compress_lanes(c, r, cc, lanes=4, start=start))
        auto = auto.lower(sharded, rows).compile()
        got, want = local(sharded, rows), auto(sharded, rows)
    assert not [op for op in COLLECTIVES if op in local.as_text()]
    assert [op for op in COLLECTIVES if op in auto.as_text()]  # the check can see collectives
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(rows))  # every full row fired
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _compiled_decode_on_mesh(model, monkeypatch, method="rkv", **options) -> str:
    """Optimized HLO of the decode chunk `generate` runs for PROMPTS on `model`'s mesh (the
    executor's call, `decode_packed`, which on a mesh is `decode` with nothing packed)."""
    seen = []
    real = programs.decode_packed

    def spy(decoder, state, *, steps, plan, **kw):
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        seen.append((shapes, plan))
        return real(decoder, state, steps=steps, plan=plan, **kw)

    monkeypatch.setattr(programs, "decode_packed", spy)
    rkvjax.generate(model, PROMPTS, method=method, **GEN, **options)
    state, plan = seen[0]
    with jax.set_mesh(model.mesh):
        return real.lower(model.decoder, state, steps=4, plan=plan).compile().as_text()


@pytest.mark.parametrize(
    "method,kv_dtype",
    [
        *[(m, None) for m in ("rkv", "h2o", "gkv", "triattention", "random")],
        ("rkv", "int8"),
    ],
    ids=str,
)
def test_decode_step_gathers_nothing(load_sharded, monkeypatch, stats_of, method, kv_dtype):
    """On a mesh, a compiled decode chunk's only collectives are tensor parallelism's all-reduces
    of the attention and MLP outputs ([D, B, 1] each) and scalar flags, whatever the method:
    H2O's per-step sums of attention stay where their keys are. The cache append once
    all-gathered every layer's new keys, values and scatter indices on every step, and the
    automatic partitioner gathered the rows for the sampler and the output buffers."""
    m = load_sharded(4, 2)
    options = {"calibration": stats_of("llama")} if method == "triattention" else {}
    hlo = _compiled_decode_on_mesh(m, monkeypatch, method, kv_dtype=kv_dtype, **options)
    ops = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo)
    assert set(ops) == {"all-reduce"}, sorted(set(ops))
    shaped = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-reduce(?:-start)?\(", hlo)
    # The step's counters (busy, compressed and waiting rows) sum as one tuple of scalars.
    scalars = re.findall(r"= \((?:\w+\[\], )*\w+\[\]\) all-reduce(?:-start)?\(", hlo)
    assert len(shaped) + len(scalars) == ops.count("all-reduce")  # nothing the checks miss
    rows = 4 // 4  # per data shard: 3 prompts padded to 4 rows
    activation = f"{m.config.embed},{rows},1"
    assert {dims for _, dims in shaped} <= {activation, ""}
    assert sum(1 for _, dims in shaped if dims) == 2 * m.config.num_layers


def test_bfloat16_decode_with_one_row_per_device(folder, monkeypatch):
    """With one row per data shard each device's products are matrix-vector ones, which XLA:CPU
    widens to float32; `layers.project` pads them, so no float32 copy of a weight shard (hoisted
    out of the loop) appears."""
    from tests.test_engine import _top_level_ops

    m = rkvjax.load(folder, dtype="bfloat16", mesh=sub_mesh(4, 2))
    shards = {
        s.data.size for x in jax.tree.leaves(m.decoder) if x.ndim >= 2 for s in x.addressable_shards
    }
    hlo = _compiled_decode_on_mesh(m, monkeypatch)
    widened = [(op, n) for op, n, t in _top_level_ops(hlo) if n in shards and t == "f32"]
    assert not widened


def test_divisibility_errors(single, folder):
    mesh = sub_mesh(4, 2)
    cfg = dataclasses.replace(single.config, q_heads=6, kv_heads=3)
    with pytest.raises(
        ValueError,
        match=r"3 KV heads cannot be split over model=2 devices; "
        r"use model in \(1, 3\)",
    ):
        sharding.check_divisible(cfg, mesh)
    cfg = dataclasses.replace(single.config, ffw=99)
    with pytest.raises(ValueError, match=r"99 MLP hidden units .* model in \(1, 3\)"):
        sharding.check_divisible(cfg, mesh)
    with pytest.raises(ValueError, match="batch of 3 rows cannot be split over data=4"):
        sharding.check_divisible(single.config, mesh, batch=3)
    assert sharding.check_divisible(single.config, mesh, batch=8).vocab is None
    with pytest.raises(ValueError, match=r"2 KV heads cannot be split over model=4"):
        rkvjax.load(folder, mesh=sub_mesh(2, 4))
    with pytest.raises(ValueError, match="needs 9 devices, but there are 8"):
        sharding.make_mesh(3, 3)
    with pytest.raises(ValueError, match="use a mesh axis twice"):
        sharding.DEFAULT_RULES.spec("q_heads", "kv_heads")
    with pytest.raises(ValueError, match="unknown logical axis"):
        sharding.DEFAULT_RULES.spec("heads")


def test_cli_mesh(folder, capsys):
    args = cli.parser().parse_args(
        ["generate", "hi", "--model", str(folder), "--mesh", "data=4,model=2"]
    )
    assert args.mesh == {"data": 4, "model": 2}
    model = flags.load(args)
    assert dict(model.mesh.shape) == {"data": 4, "model": 2}
    assert cli.parser().parse_args(["generate", "hi", "--mesh", "model=8"]).mesh == {
        "data": 1,
        "model": 8,
    }
    for bad in ("data=2;model=4", "data=2,gpu=4", "data=x", "data=2,data=2", "data=0"):
        with pytest.raises(SystemExit):
            cli.parser().parse_args(["generate", "hi", "--mesh", bad])
        assert "--mesh" in capsys.readouterr().err


def test_plain_jax_mesh_is_accepted(folder, reference):
    """`jax.make_mesh` gives Explicit axes in current JAX; `load` uses them as Auto axes, so the
    plain idiom works (it failed inside the embedding gather with a ShardingTypeError)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    model = rkvjax.load(folder, dtype="float32", mesh=mesh)
    got = rkvjax.generate(model, PROMPTS, method="rkv", **GEN)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference("rkv")]
    with pytest.raises(ValueError, match="mesh axes must be"):
        rkvjax.load(folder, mesh=jax.make_mesh((8,), ("batch",), devices=jax.devices()[:8]))
