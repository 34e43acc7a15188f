"""The compiled decode loop: cache vs full forward, ragged batches, sampling, compile counts."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkvjax
from rkvjax.kv import cache as kv
from rkvjax.kv.config import CompressionConfig
from rkvjax.runtime import programs
from rkvjax.sampling.params import SamplingParams
from rkvjax.sampling.sampler import SlotSampling
from tests.hf_tiny import VOCAB
from tests.tolerances import SELF_ATOL


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama3_rope")
    return rkvjax.load(folder, dtype="float32")


def _prompts(lengths, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, n).tolist() for n in lengths]


@jax.jit
def _decode_logits(decoder, c: kv.KVCache, token):
    """One cached decode step returning its logits [B, V] (test-only view of the engine step)."""
    x, c = decoder.hidden(token[:, None], c.pos[:, None], programs._cache_attend, c)
    return decoder.head(x)[:, 0], kv.advance(c)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cached_decode_equals_full_forward(tiny_checkpoint, dtype):
    """Left-padded prefill + step-by-step cached decode gives the logits of one full forward.
    In bfloat16 the cache is stored as integers (`layers.as_storage`)."""
    model = rkvjax.load(tiny_checkpoint("llama3_rope")[0], dtype=dtype)
    rows = _prompts([5, 12])
    follow = np.random.RandomState(3).randint(0, VOCAB, (2, 20))
    p = 16
    tokens = np.zeros((2, p), np.int32)
    pos = np.full((2, p), -1, np.int32)
    for r, row in enumerate(rows):
        tokens[r, p - len(row) :] = row
        pos[r, p - len(row) :] = np.arange(len(row))
    plan = programs.Plan(compression=CompressionConfig())
    group = programs.prefill(
        model.decoder, jnp.asarray(tokens), jnp.asarray(pos), capacity=p + 20, plan=plan
    )
    full = [
        np.asarray(rkvjax.logits(model, [row + follow[r].tolist()]))[0]
        for r, row in enumerate(rows)
    ]
    c = group.cache
    for t in range(follow.shape[1]):
        step_logits, c = _decode_logits(model.decoder, c, jnp.asarray(follow[:, t]))
        for r, row in enumerate(rows):
            want = full[r][len(row) + t]  # the full forward's prediction after follow[r, t]
            np.testing.assert_allclose(step_logits[r], want, atol=SELF_ATOL[dtype])
    # Prefill moves each row's tokens to the front of its slots: fill levels differ per row.
    assert np.asarray(c.length).tolist() == [5 + 20, 12 + 20]
    assert np.asarray(c.pos).tolist() == [5 + 20, 12 + 20]


def _top_level_ops(hlo: str) -> list[tuple[str, int, str]]:
    """(opcode, element count, element type) of every instruction outside fusion bodies and
    conditional branches in optimized HLO. Weights are read outside conditionals (only the
    sampler's filters and compressions run under `lax.cond`), and the sampler's own temporaries
    may share a weight's element count."""
    fused = set(re.findall(r"calls=(%[\w.-]+)", hlo))
    for branches in re.findall(r"branch_computations=\{([^}]*)\}", hlo):
        fused |= {b.strip() for b in branches.split(",")}
    fused |= set(re.findall(r"(?:true|false)_computation=(%[\w.-]+)", hlo))
    ops, inside_fusion = [], False
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.-]+) ", line)
        if head:
            inside_fusion = head.group(1) in fused
        m = re.match(r"\s+(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(", line)
        if m and not inside_fusion:
            dims = [int(d) for d in m.group(2).split(",") if d]
            ops.append((m.group(3), int(np.prod(dims)), m.group(1)))
    return ops


def _admitted(decoder, batch: int, capacity: int, plan: programs.Plan) -> programs.SlotState:
    """A runtime state whose `batch` slots each hold a 5-token prompt (8 tokens to make)."""
    state = programs.init_state(
        decoder, slots=batch, capacity=capacity, stop_width=1, given_len=0, plan=plan
    )
    tokens = jnp.asarray(_prompts([5] * batch), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (batch, 5))
    group = programs.prefill(decoder, tokens, pos, capacity=capacity, plan=plan)
    none = jnp.full((batch, 1), -1, jnp.int32)
    new = programs.NewRows(
        max_tokens=jnp.full((batch,), 8, jnp.int32),
        stop_ids=none,
        block_ids=none,
        sampling=SlotSampling.from_params([SamplingParams(temperature=0.0)] * batch),
        given=jnp.zeros((batch, 0), jnp.int32),
    )
    rows = jnp.arange(batch, dtype=jnp.int32)
    return programs.insert(state, group, rows, rows, new, plan=plan)[0]


def _compiled_decode(decoder, batch: int, capacity: int) -> str:
    """The optimized HLO of a 4-step decode call after a 5-token prefill of `batch` rows."""
    plan = programs.Plan(compression=CompressionConfig())
    state = _admitted(decoder, batch, capacity, plan)
    return programs.decode.lower(decoder, state, steps=4, plan=plan).compile().as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's own fusion decisions")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_writes_the_cache_in_place(tiny_checkpoint, batch, dtype):
    """Per layer, the full-size results in the compiled decode step are the K and V appends,
    in place: no copy, transpose or conversion of a layer's cache, which costs as much as
    reading it. A bfloat16 cache is stored as uint16, and attention's products read one
    same-width bfloat16 view each of K and V (XLA:CPU's bitcast-convert is a copy). Before,
    XLA converted every bfloat16 cache to float32 and back around each append."""
    decoder = rkvjax.load(tiny_checkpoint("llama3_rope")[0], dtype=dtype).decoder
    cfg = decoder.cfg
    capacity = 37  # a size no weight shares
    hlo = _compiled_decode(decoder, batch, capacity)
    layer_cache = batch * cfg.kv_heads * capacity * cfg.head_dim
    full_size = [(op, t) for op, n, t in _top_level_ops(hlo) if n == layer_cache]
    results = [(op, t) for op, t in full_size if op not in ("get-tuple-element", "bitcast")]
    types = sorted(t for op, t in results if op != "parameter")
    n = 2 * cfg.num_layers
    if dtype == "float32":
        assert types == ["f32"] * n, sorted(results)
    else:  # the appends (u16) and attention's views of them (bf16)
        assert types == ["bf16"] * n + ["u16"] * n, sorted(results)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's own lowering")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_copies_no_weight(tiny_checkpoint, batch, dtype):
    """The compiled decode reads every weight where it lies. The one copy is the bfloat16
    embedding's uint16 view that the lookup gathers from (`layers.embed_lookup`); float32
    decode used to copy its table too (113 MB for the default model, on every call). In
    bfloat16 this also rules out float32 copies of weights: widened copies are loop-invariant,
    so XLA hoists them out of the loop and every step reads float32. Batch 1 checks the padded
    matrix-vector case (`layers.project`)."""
    decoder = rkvjax.load(tiny_checkpoint("llama3_rope")[0], dtype=dtype).decoder
    sizes = {x.size for x in jax.tree.leaves(decoder) if x.ndim >= 2}
    hlo = _compiled_decode(decoder, batch, capacity=37)
    moved = ("parameter", "get-tuple-element", "bitcast", "tuple")
    copies = [(op, n, t) for op, n, t in _top_level_ops(hlo) if n in sizes and op not in moved]
    table = decoder.embed[...].size
    assert copies == ([] if dtype == "float32" else [("fusion", table, "u16")])


def test_decode_compiles_once_across_chunks(model):
    programs.TRACES.clear()
    rkvjax.generate(model, _prompts([7, 7]), max_new_tokens=200, ignore_eos=True)  # 4 chunks
    rkvjax.generate(model, _prompts([6, 5], seed=1), max_new_tokens=200, ignore_eos=True)
    assert programs.TRACES == {"init_state": 1, "prefill": 1, "insert": 1, "decode": 1}


def test_stop_token_ends_row_and_others_continue(model):
    prompts = _prompts([6, 9], seed=2)
    free = rkvjax.generate(model, prompts, max_new_tokens=30, ignore_eos=True)
    stop_tok = free[0].token_ids[4]
    first = free[0].token_ids.index(stop_tok)
    out = rkvjax.generate(
        model, prompts, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok]
    )
    assert out[0].token_ids == free[0].token_ids[: first + 1]
    assert out[0].finish_reason == "stop"
    if stop_tok not in free[1].token_ids:
        assert out[1].token_ids == free[1].token_ids
        assert out[1].finish_reason == "length"


def test_sampling_is_seeded_and_filters_apply(model):
    prompt = _prompts([8], seed=5)[0]
    greedy = rkvjax.generate(model, prompt, max_new_tokens=24, ignore_eos=True).token_ids
    kw = dict(max_new_tokens=24, ignore_eos=True, temperature=1.0)
    a = rkvjax.generate(model, prompt, seed=1, **kw).token_ids
    assert a == rkvjax.generate(model, prompt, seed=1, **kw).token_ids
    assert a != rkvjax.generate(model, prompt, seed=2, **kw).token_ids
    # top_k=1 and a tiny nucleus both leave only the argmax.
    assert rkvjax.generate(model, prompt, top_k=1, seed=3, **kw).token_ids == greedy
    assert rkvjax.generate(model, prompt, top_p=1e-6, seed=3, **kw).token_ids == greedy


def test_top_k_restricts_support():
    from rkvjax.sampling.sampler import sample_rows, token_keys

    logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4]] * 2000))
    n = logits.shape[0]
    keys = token_keys(jnp.zeros(n, jnp.uint32), jnp.zeros(n, jnp.int32), jnp.arange(n))

    def draws(**kw):
        rows = SlotSampling.from_params([SamplingParams(temperature=1.0, seed=0, **kw)] * n)
        return np.asarray(sample_rows(logits, rows, keys))

    assert set(draws(top_k=2).tolist()) == {2, 3}
    draws = draws(top_p=0.5)
    # Nucleus 0.5 over (0.4, 0.3, ...): 0.4 alone is below 0.5, so {3, 2} remain.
    assert set(draws.tolist()) == {2, 3}
    freq = np.mean(draws == 3)
    assert abs(freq - 0.4 / 0.7) < 0.05


def test_prefer_memory_on_cpu(monkeypatch):
    from rkvjax import xla_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_flags.prefer_memory_on_cpu()
    assert os.environ["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=8 "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    # A setting the user made is theirs.
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    assert not xla_flags.prefer_memory_on_cpu()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flags.prefer_memory_on_cpu()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
