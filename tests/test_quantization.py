"""The quantized KV cache (`kv_dtype`): int8 and float8_e4m3fn codes with a float32 scale per
(token, head).

Checked here: the round trip's error bounds (`rkvjax.kv.quantization`); a token's codes and scale
never change once written, whatever compressions move it; compressions keep exactly what the
NumPy reference (tests/reference) keeps from the dequantized keys and window queries;
attention with the scales folded in equals attention on dequantized keys and values;
continuous batching equals each request alone and nothing recompiles; the cache's bytes
(about half of bfloat16's, and the default slot count that follows); and the NLL cost of int8
on the default model.
"""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import layers, loading

import rkvjax
from rkvjax.kv import cache as kv
from rkvjax.kv import compress, quantization
from rkvjax.kv.config import CompressionConfig, compression_config
from rkvjax.kv.quantization import dequantize, quantize
from rkvjax.runtime import programs, sizing
from rkvjax.sampling.params import SamplingParams
from tests import reference, shared_data
from tests.hf_tiny import VOCAB
from tests.test_policy import (
    _expected_compressions,
    _full_qk,
    _hidden_qkv,
    _load,
    _prompt,
    _ref_keep,
    _simulate_layer0,
)

W = 8  # the window (the default)
BUDGET, BUFFER = 16, 8
EIGHT_BIT = ("int8", "float8_e4m3fn")
QMAX = {"int8": 127, "float8_e4m3fn": 448}
MESSAGE = "kv_dtype must be one of float32, bfloat16, int8, float8_e4m3fn, got"


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _codes(codes, dtype) -> np.ndarray:
    """An 8-bit cache's codes as float32 numbers (unscaled)."""
    return _np(quantization.codes_as_float(jnp.asarray(codes), dtype, jnp.float32))


def _dequantized(codes, scale, dtype) -> np.ndarray:
    """Stored codes [..., H] and scales [...] as numbers (float32 products, as float64),
    computed here in NumPy."""
    return np.float64(_codes(codes, dtype) * _np(scale)[..., None])


def _round_trip(x, dtype):
    """x (any float array) -> float32 dequantize(quantize(x)) as NumPy, through jit (as the
    cache always runs it)."""
    codes, scale = jax.jit(quantize, static_argnums=1)(jnp.asarray(x), dtype)
    return _np(jax.jit(dequantize, static_argnums=2)(codes, scale, dtype))


def _error_bound(x: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    """The largest |dequantize(quantize(x)) - x| per element allowed: half a code step for int8;
    for float8_e4m3fn (3 mantissa bits) half an ulp, 2^-4 of |x|, or half the subnormal step,
    2^-10 of the scale, below its smallest normal. A little slack for float32 arithmetic."""
    s = scale[..., None]
    fp8 = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s)
    bound = 0.5 * s if dtype == "int8" else fp8
    return bound * (1 + 1e-5) + 1e-6 * np.abs(x)


# ---------------------------------------------------------------------------------------------
# 1. quantize / dequantize, and the setting.


@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_round_trip_error_is_bounded(dtype, in_dtype):
    """Per element the error is at most half a code step (int8) or half an ulp of
    float8_e4m3fn; the scale is max|x| / QMAX per vector; each vector's largest element gets the
    top code; vectors whose magnitudes span many decades, in float32 and bfloat16."""
    rs = np.random.RandomState(0)
    x = rs.normal(size=(64, 3, 32)) * np.exp(rs.normal(scale=6.0, size=(64, 3, 1)))
    x = jnp.asarray(x.astype(np.float32), in_dtype)
    xf = _np(x).astype(np.float32)  # the exact input values
    codes, scale = jax.jit(quantize, static_argnums=1)(x, dtype)
    assert (
        codes.dtype
        == quantization.storage_dtype(dtype)
        == (jnp.int8 if dtype == "int8" else jnp.uint8)
    )
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    scale = _np(scale)
    # To an ulp: XLA may multiply by 1 / QMAX rather than divide.
    np.testing.assert_allclose(scale, np.max(np.abs(xf), -1) / QMAX[dtype], rtol=2e-7, atol=0)
    got = _np(dequantize(codes, scale, dtype))
    assert got.dtype == np.float32
    err = np.abs(got - xf)
    assert (err <= _error_bound(xf, scale, dtype)).all(), err.max()
    # Not a trivially loose bound: the worst error takes up most of it.
    assert (err / _error_bound(xf, scale, dtype)).max() > 0.5
    c = _codes(codes, dtype)
    assert np.abs(c).max() <= QMAX[dtype]
    top = np.argmax(np.abs(xf), axis=-1)[..., None]
    top_x = np.take_along_axis(xf, top, -1)
    np.testing.assert_array_equal(np.take_along_axis(c, top, -1), np.sign(top_x) * QMAX[dtype])
    np.testing.assert_allclose(np.take_along_axis(got, top, -1), top_x, rtol=3e-7, atol=0)
    if dtype == "int8":  # codes are the rounded ratios (ties aside)
        assert np.mean(c == np.round(xf / scale[..., None])) > 0.999


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_zero_huge_and_tiny_vectors(dtype):
    """A vector of zeros gets scale 0 and codes 0 (zeros back); magnitudes from 1e-30 up to
    near float32's largest keep the error bound; a vector so small that its scale would be
    subnormal (max|x| below ~1e-36) comes back as zeros, flushed or not: never NaN or inf."""
    rows = {"zero": 0.0, "small": 1e-30, "one": 1.0, "big": 1e30, "huge": 3e38, "tiny": 1e-38}
    base = np.array([1.0, -0.3, 0.0, 0.71, -1e-3, 0.5, 1e-6, -1.0], np.float32)
    x = np.stack([base * np.float32(m) for m in rows.values()])  # [6, 8]
    assert np.isfinite(x).all()
    codes, scale = jax.jit(quantize, static_argnums=1)(jnp.asarray(x), dtype)
    scale, got = _np(scale), _round_trip(x, dtype)
    assert np.isfinite(scale).all() and np.isfinite(got).all()
    assert np.isfinite(_codes(codes, dtype)).all()
    assert scale[0] == 0 and (_codes(codes, dtype)[0] == 0).all() and (got[0] == 0).all()
    normal = [i for i, name in enumerate(rows) if name not in ("zero", "tiny")]
    err = np.abs(got[normal] - x[normal])
    assert (err <= _error_bound(x[normal], scale[normal], dtype)).all()
    tiny = list(rows).index("tiny")
    assert (_codes(codes, dtype)[tiny] == 0).all() and (got[tiny] == 0).all()


def test_kv_dtype_names_and_refusals():
    """check_kv_dtype takes the four names and their NumPy / JAX dtypes, giving the name (None
    stays None: the model's dtype); anything else is refused with one message listing them."""
    check = quantization.check_kv_dtype
    assert check(None) is None
    for name in quantization.KV_DTYPES:
        for spelling in (name, np.dtype(name), jnp.dtype(name), getattr(jnp, name)):
            assert check(spelling) == name
    for bad in ("int4", "float16", np.float16, jnp.int4, "fp8", "float8_e5m2", "e4m3", 8, 1.5):
        with pytest.raises(ValueError) as err:
            check(bad)
        assert str(err.value) == f"{MESSAGE} {bad!r}"
    assert quantization.cache_dtype(None, jnp.bfloat16) == jnp.bfloat16
    assert quantization.cache_dtype("int8", jnp.bfloat16) == jnp.int8
    quantized = [d for d in quantization.KV_DTYPES if quantization.is_quantized(d)]
    assert quantized == list(EIGHT_BIT)


def test_compression_config_kv_dtype():
    """A bad kv_dtype fails in compression_config and CompressionConfig alike; a good one is kept
    by its name for every method, FullKV included (a None budget too), so configs that spell it
    differently are equal and hash alike (one compiled program)."""
    for make in (
        lambda: compression_config("rkv", 64, kv_dtype="int4"),
        lambda: compression_config("full", kv_dtype="int4"),
        lambda: CompressionConfig(kv_dtype="int4"),
        lambda: CompressionConfig(method="rkv", budget=64, kv_dtype=np.float16),
    ):
        with pytest.raises(ValueError, match=MESSAGE):
            make()
    assert compression_config("full", kv_dtype=np.int8).kv_dtype == "int8"
    none_budget = compression_config("rkv", None, kv_dtype="float8_e4m3fn")
    assert (none_budget.method, none_budget.kv_dtype) == ("full", "float8_e4m3fn")
    assert compression_config("snapkv", 64).kv_dtype is None
    a = compression_config("rkv", 64, kv_dtype=jnp.int8)
    b = compression_config("rkv", 64, kv_dtype="int8")
    assert a.kv_dtype == "int8" and a == b and hash(a) == hash(b)
    assert a != compression_config("rkv", 64, kv_dtype="float8_e4m3fn")


# ---------------------------------------------------------------------------------------------
# 2, 3. Compressions move codes and scales as they are, and score the dequantized keys.

B, K, N, C, H = 3, 2, 4, BUDGET + BUFFER, 16


def _vectors(rs, shape, duplicates=True) -> np.ndarray:
    """Random vectors [..., T, H] whose magnitudes spread over two decades per token (so scales
    matter), with near-duplicates of earlier tokens (R-KV's threshold decides)."""
    x = rs.normal(size=shape) * np.exp(rs.normal(scale=1.2, size=(*shape[:-1], 1)))
    if duplicates:
        t = shape[-2]
        for j in range(7, t - W, 5):  # a scaled, slightly perturbed copy of token j - 7
            x[..., j, :] = 2.5 * x[..., j - 7, :] + 0.4 * rs.normal(size=x[..., j, :].shape)
    return x.astype(np.float32)


def _full_cache(dtype: str, layers_: int = 2, seed: int = 0) -> kv.KVCache:
    """B rows of C tokens each (slot = position), stored as `dtype`: keys, values and the
    window's queries quantized per (token, head) by `cache.store`."""
    rs = np.random.RandomState(seed)
    ks, vs, ksc, vsc, qs, qsc = [], [], [], [], [], []
    for _ in range(layers_):
        k, k_scale = kv.store(jnp.asarray(_vectors(rs, (B, K, C, H))), dtype)
        v, v_scale = kv.store(jnp.asarray(_vectors(rs, (B, K, C, H), False)), dtype)
        q, q_scale = kv.store_queries(jnp.asarray(_vectors(rs, (B, N, W, H), False)), dtype)
        ks.append(k), vs.append(v), ksc.append(k_scale), vsc.append(v_scale)
        qs.append(q), qsc.append(q_scale)
    return kv.KVCache(
        k=tuple(ks),
        v=tuple(vs),
        slot_pos=(jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C)),) * layers_,
        q_win=tuple(qs),
        acc=(),
        length=jnp.full((B,), C, jnp.int32),
        pos=jnp.full((B,), C, jnp.int32),
        prompt=jnp.zeros((B,), jnp.int32),
        seed=jnp.zeros((B,), jnp.uint32),
        dtype=dtype,
        k_scale=tuple(ksc),
        v_scale=tuple(vsc),
        q_scale=tuple(qsc),
    )


FULL = jnp.array([True, False, True])  # row 1 is not compressed


@pytest.fixture(scope="module")
def compressed():
    """(dtype, method) -> (input cache, the cache after compress_lanes of rows 0 and 2)."""
    made = {}

    def make(dtype, method):
        if (dtype, method) not in made:
            cache = _full_cache(dtype)
            cc = CompressionConfig(method=method, budget=BUDGET, buffer=BUFFER, window=W)
            out, fired, _, _, _ = jax.jit(
                lambda x: compress.compress_lanes(x, FULL, cc, lanes=2, start=jnp.int32(0))
            )(cache)
            assert fired.tolist() == FULL.tolist()
            made[dtype, method] = cache, out
        return made[dtype, method]

    return make


@pytest.mark.parametrize("method", ["rkv", "snapkv"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_compression_moves_codes_and_scales_unchanged(compressed, dtype, method):
    """Every kept slot holds the codes and scales (key and value) its token was written with,
    bit for bit; the window's queries and a row not compressed are untouched."""
    cache, out = compressed(dtype, method)
    assert out.dtype == jnp.dtype(dtype) and out.quantized
    assert out.length.tolist() == [BUDGET, C, BUDGET]
    for i in range(len(cache.k)):
        pos = _np(out.slot_pos[i])  # [B, K, C]; slot = position in the input
        moved = 0
        for name in ("k", "v", "k_scale", "v_scale"):
            before, after = _np(getattr(cache, name)[i]), _np(getattr(out, name)[i])
            np.testing.assert_array_equal(after[1], before[1])  # the row left alone
            for b in (0, 2):
                for h in range(K):
                    kept = pos[b, h, :BUDGET]
                    assert (kept >= 0).all() and (pos[b, h, BUDGET:] == -1).all()
                    np.testing.assert_array_equal(
                        after[b, h, :BUDGET], before[b, h, kept], err_msg=f"{name} {i} {b} {h}"
                    )
                    moved += int((kept != np.arange(BUDGET)).sum())
        assert moved > 0  # tokens really changed slots
        np.testing.assert_array_equal(_np(out.q_win[i]), _np(cache.q_win[i]))
        np.testing.assert_array_equal(_np(out.q_scale[i]), _np(cache.q_scale[i]))


@pytest.mark.parametrize("method", ["rkv", "snapkv"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_compression_keeps_the_reference_set_of_dequantized_keys(compressed, dtype, method):
    """The kept set of every (layer, row, KV head) is the NumPy reference's on the dequantized
    keys and window queries; the codes read without their scales would select otherwise (the
    inputs tell the two apart)."""
    cache, out = compressed(dtype, method)
    differs = False
    for i in range(len(cache.k)):
        keys = _dequantized(cache.k[i], cache.k_scale[i], dtype)  # [B, K, C, H]
        queries = _dequantized(cache.q_win[i], cache.q_scale[i], dtype)  # [B, N, W, H]
        want = reference.keep(method, queries, keys, budget=BUDGET, window=W)
        got = _np(out.slot_pos[i])[:, :, :BUDGET]
        for b in (0, 2):
            np.testing.assert_array_equal(got[b], want[b], err_msg=f"layer {i} row {b}")
        raw = reference.keep(
            method,
            _codes(cache.q_win[i], dtype),
            _codes(cache.k[i], dtype),
            budget=BUDGET,
            window=W,
        )
        differs |= not np.array_equal(raw[[0, 2]], want[[0, 2]])
    assert differs


def _prompt_qkv(rs, b, p, layers_=2):
    """L x (q [B, P, N, H], k and v [B, P, K, H]) random float32 prompt projections."""
    out = []
    for _ in range(layers_):
        q = np.swapaxes(_vectors(rs, (b, N, p, H), False), 1, 2)
        k = np.swapaxes(_vectors(rs, (b, K, p, H)), 1, 2)
        v = np.swapaxes(_vectors(rs, (b, K, p, H), False), 1, 2)
        out.append((jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    return out


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_prefill_compression_keeps_written_codes_and_the_reference_set(dtype):
    """A prompt longer than the budget is stored, then compressed: each kept token's codes and
    scales equal those the FullKV cache of the same prompt holds for it (nothing evicted there),
    and the kept set is the reference's on that cache's dequantized keys and the window's
    dequantized queries. One row is left-padded."""
    rs = np.random.RandomState(5)
    p, pads = 40, (0, 9)
    qkv = _prompt_qkv(rs, len(pads), p)
    positions = np.stack([np.where(np.arange(p) >= n, np.arange(p) - n, -1) for n in pads])
    positions = jnp.asarray(positions, jnp.int32)
    qs, ks, vs = (tuple(x[j] for x in qkv) for j in range(3))

    def place(cc, capacity):
        return jax.jit(
            lambda ks, vs, qs: compress.prefill_cache(ks, vs, qs, positions, cc, capacity)
        )(ks, vs, qs)

    full, squeezed = place(CompressionConfig(kv_dtype=dtype), p)
    assert not squeezed.any()
    cc = CompressionConfig(method="rkv", budget=BUDGET, buffer=BUFFER, window=W, kv_dtype=dtype)
    cache, squeezed = place(cc, cc.capacity)
    assert squeezed.all() and cache.length.tolist() == [BUDGET, BUDGET]
    for i in range(len(ks)):
        pos, full_pos = _np(cache.slot_pos[i]), _np(full.slot_pos[i])
        keys = _dequantized(full.k[i], full.k_scale[i], dtype)
        queries = _dequantized(cache.q_win[i], cache.q_scale[i], dtype)  # [B, N, W, H]
        for b, n in enumerate(pads):
            length = p - n
            assert (full_pos[b, :, :length] == np.arange(length)).all()  # pads moved out
            want = reference.keep(
                "rkv", queries[b : b + 1], keys[b : b + 1, :, :length], budget=BUDGET, window=W
            )[0]
            np.testing.assert_array_equal(pos[b, :, :BUDGET], want, err_msg=f"{i} {b}")
            for name in ("k", "v", "k_scale", "v_scale"):
                got, written = _np(getattr(cache, name)[i]), _np(getattr(full, name)[i])
                for h in range(K):
                    np.testing.assert_array_equal(
                        got[b, h, :BUDGET], written[b, h, want[h]], err_msg=f"{name} {i} {b}"
                    )


# ---------------------------------------------------------------------------------------------
# 4. Attention folds the scales in: the same as attention on dequantized keys and values.


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_attention_with_scales_equals_dequantized(dtype, q_dtype):
    """layers.attention on an 8-bit cache's codes with k_scale / v_scale gives the output and
    received weights of the same call on float32 dequantized keys and values, to float32
    rounding (bfloat16 queries: to bfloat16's); empty slots (codes 0, scale 0, masked) and a
    query that sees nothing (a pad) included."""
    rs = np.random.RandomState(3)
    b, t, s = 2, 3, 20
    q = jnp.asarray(rs.normal(size=(b, t, N, H)) * 2, q_dtype)
    k = _vectors(rs, (b, K, s, H))
    v = _vectors(rs, (b, K, s, H), False)
    k_codes, k_scale = quantize(jnp.asarray(k), dtype)
    v_codes, v_scale = quantize(jnp.asarray(v), dtype)
    valid = np.ones((b, K, s), bool)
    valid[1, :, 15:] = False  # empty slots
    k_scale = jnp.where(valid, k_scale, 0.0)
    v_scale = jnp.where(valid, v_scale, 0.0)
    k_codes = jnp.where(valid[..., None], k_codes, jnp.zeros_like(k_codes))
    v_codes = jnp.where(valid[..., None], v_codes, jnp.zeros_like(v_codes))
    mask = np.broadcast_to(valid[:, :, None, :], (b, K, t, s)).copy()
    mask[1, :, 0] = False  # a query with nothing to attend to
    mask = jnp.asarray(mask)

    @jax.jit
    def both(q, k_codes, v_codes, k_scale, v_scale):
        scaled = layers.attention(
            q,
            layers.from_storage(k_codes, jnp.dtype(dtype)),
            layers.from_storage(v_codes, jnp.dtype(dtype)),
            mask,
            kv_axis=2,
            weights=True,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        plain = layers.attention(
            q.astype(jnp.float32),
            dequantize(k_codes, k_scale, dtype),
            dequantize(v_codes, v_scale, dtype),
            mask,
            kv_axis=2,
            weights=True,
        )
        return scaled, plain

    (out, w), (want, want_w) = both(q, k_codes, v_codes, k_scale, v_scale)
    assert out.dtype == q.dtype and w.dtype == jnp.float32
    out, w, want, want_w = (_np(x).astype(np.float32) for x in (out, w, want, want_w))
    assert np.isfinite(out).all() and np.isfinite(w).all()
    tol = 1e-5 if q_dtype == "float32" else 2e-2
    scale = np.abs(want).max()
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(w, want_w, rtol=tol, atol=tol)
    assert (w[1, :, 15:] == 0).all()
    # The scales matter here: the codes alone attend elsewhere.
    raw = layers.attention(
        q.astype(jnp.float32),
        jnp.asarray(_codes(k_codes, dtype)),
        jnp.asarray(_codes(v_codes, dtype)),
        mask,
        kv_axis=2,
        weights=True,
    )[1]
    assert np.abs(_np(raw) - want_w).max() > 0.1


# ---------------------------------------------------------------------------------------------
# 5. Through the engine: continuous batching equals each request alone, nothing recompiles,
# the recorded keep sets are the reference's, and nothing written is ever rewritten.

INT8 = compression_config("rkv", BUDGET, buffer=BUFFER, kv_dtype="int8")
# One decode step per round alone, so a test can read the cache after every step; a default
# chunk in the batch (where rows are refilled).
ALONE = dict(cache=INT8, record_kept=True, narrow_tail=False, max_prefill_rows=1, logprobs=1)
LENGTHS = (9, 30, 12, 20, 14)  # prompt buckets 16 and 32; 30 and 20 compressed at prefill
MAX_TOKENS = (30, 12, 40, 25, 8)


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    """Tiny Llama, 2 layers, 4 query heads over 2 KV heads, head_dim 16, float32."""
    return _load(tiny_checkpoint("llama")[0])


@pytest.fixture(scope="module")
def int8_runs(llama):
    """The LENGTHS requests through two slots of an int8 R-KV engine, then each alone in one
    slot: (prompts, batch results, the programs the batch traced, its stats, results alone),
    results in request order. Every other engine test of the file comes after this."""
    prompts = [_prompt(n, seed=500 + i) for i, n in enumerate(LENGTHS)]
    params = [_greedy(m).replace(logprobs=1) for m in MAX_TOKENS]
    eng = rkvjax.Engine(llama, slots=2, **ALONE)
    before = collections.Counter(programs.TRACES)
    eng.submit_many(prompts, params)
    batch = sorted(eng.run(), key=lambda r: r.request_id)
    traced = collections.Counter(programs.TRACES) - before
    alone = []
    for p, sp in zip(prompts, params, strict=True):
        one = rkvjax.Engine(llama, slots=1, chunk=1, **ALONE)
        one.submit(p, sp)
        alone += one.run()
    return prompts, batch, traced, eng.stats, alone


def test_continuous_batching_equals_each_request_alone(int8_runs):
    """Five requests of mixed lengths (two prompt buckets, two prompts above the budget)
    through two slots: each gets exactly the tokens, compressions and kept sets it gets alone
    in one slot (and its log-probabilities, to rounding). The batch traced each
    program once (prefill once per bucket): neither compressions nor refilled slots
    recompile anything."""
    prompts, batch, traced, stats, alone = int8_runs
    assert traced == collections.Counter(init_state=1, prefill=2, insert=1, decode=1)
    assert stats.compiled_programs == sum(traced.values())
    expected = [
        _expected_compressions(n, m, BUDGET, BUFFER)
        for n, m in zip(LENGTHS, MAX_TOKENS, strict=True)
    ]
    prefilled = sum(n > BUDGET for n in LENGTHS)  # compressed in prefill, not in a decode step
    assert stats.prefills == len(prompts)
    assert stats.compressions == sum(expected) - prefilled >= 8
    for r, (res, one) in enumerate(zip(batch, alone, strict=True)):
        assert res.stats.kv_dtype == one.stats.kv_dtype == "int8"
        assert res.token_ids == one.token_ids, f"request {r}"
        assert res.stats.compressions == one.stats.compressions == expected[r], f"request {r}"
        np.testing.assert_array_equal(res.kept_positions, one.kept_positions)
        # Other batch shapes round float32 products otherwise, and a code on a rounding
        # boundary amplifies that to a step of the int8 grid.
        np.testing.assert_allclose(res.logprobs, one.logprobs, rtol=0, atol=1e-3)


def _quantized(xs: list, dtype: str = "int8") -> list:
    """Per-layer [B, T, heads, H] arrays as an 8-bit cache reads them back, float64."""
    return [np.float64(_round_trip(np.float32(x), dtype)) for x in xs]


def test_engine_keep_sets_match_reference_on_quantized_keys(llama, int8_runs):
    """The keep sets the batch recorded, against the reference on the quantized keys and
    queries of a cache-free forward over each generated sequence:
    - a prompt above the budget is compressed after prefill, which attends in full precision,
      so that forward gives every layer's stored keys: every layer matches;
    - at layer 0 a key or query depends only on its token and position, so every layer-0
      compression of every row replays in NumPy (the deeper layers attend through the int8
      cache while decoding, which no cache-free forward reproduces).
    The reference on the unquantized keys keeps another set somewhere."""
    prompts, batch, _, _, _ = int8_runs
    seqs = [p + r.token_ids for p, r in zip(prompts, batch, strict=True)]
    qs, ks = _full_qk(llama, seqs, 64)
    qq, kq = _quantized(qs), _quantized(ks)
    heads = llama.config.kv_heads
    differs, above, replayed = False, 0, 0
    for r, (p, res) in enumerate(zip(prompts, batch, strict=True)):
        if len(p) > BUDGET:
            above += 1
            held = [list(range(len(p)))] * heads
            for layer in range(llama.config.num_layers):
                want = _ref_keep("rkv", qq[layer][r], kq[layer][r], held, budget=BUDGET)
                np.testing.assert_array_equal(
                    res.kept_positions[0, layer], want, err_msg=f"row {r} layer {layer}"
                )
                plain = _ref_keep("rkv", qs[layer][r], ks[layer][r], held, budget=BUDGET)
                differs |= not np.array_equal(plain, want)
        events = res.stats.compressions
        if not events:
            continue
        replayed += events
        want = _simulate_layer0(
            "rkv", qq[0][r], kq[0][r], len(p), events, budget=BUDGET, buffer=BUFFER
        )
        np.testing.assert_array_equal(res.kept_positions[:, 0], want, err_msg=f"row {r}")
        plain = _simulate_layer0(
            "rkv", qs[0][r], ks[0][r], len(p), events, budget=BUDGET, buffer=BUFFER
        )
        differs |= not np.array_equal(plain, want)
    # The comparison sees int8's rounding: on the unquantized keys and queries the reference
    # keeps another set somewhere.
    assert above == 2 and replayed >= 8 and differs


def test_decode_never_rewrites_a_written_token(llama, int8_runs):
    """Through a whole generation (prefill compression, then a compression every BUFFER steps),
    one decode step per round: every (layer, KV head, position) the cache holds has the codes
    and scales (key and value) it had when first seen, at whatever slot compressions moved it
    to; so does each query of the observation window. And what was written is right: each
    layer-0 vector is the quantized vector of a cache-free forward."""
    eng = rkvjax.Engine(llama, slots=1, chunk=1, **ALONE)  # the programs run alone above
    before = collections.Counter(programs.TRACES)
    prompt = _prompt(30, 7)
    eng.submit(prompt, _greedy(50))
    first: dict = {}  # (layer, head, position) -> (slot, (k, v, k_scale, v_scale))
    q_first: dict = {}  # (layer, query head, position) -> (q, q_scale)
    checked = moved = 0
    results = []
    while eng.has_work:
        results += eng.step()
        cache = jax.device_get(eng.executor.state.cache)
        pos = int(cache.pos[0])
        assert int(cache.length[0]) <= BUDGET + BUFFER
        for i in range(len(cache.k)):
            sp = cache.slot_pos[i][0]  # [K, C]
            leaves = [cache.k[i][0], cache.v[i][0], cache.k_scale[i][0], cache.v_scale[i][0]]
            for h in range(K):
                for slot in np.flatnonzero(sp[h] >= 0):
                    key = (i, h, int(sp[h, slot]))
                    now = tuple(np.asarray(x[h, slot]) for x in leaves)
                    if key not in first:
                        first[key] = (slot, now)
                        continue
                    for a, b in zip(now, first[key][1], strict=True):
                        np.testing.assert_array_equal(a, b, err_msg=str(key))
                    checked += 1
                    moved += slot != first[key][0]
            # The ring holds the queries of positions pos - W .. pos - 1, oldest first.
            for n in range(cache.q_win[i].shape[1]):
                for j in range(W):
                    key = (i, n, pos - W + j)
                    now = (cache.q_win[i][0, n, j], cache.q_scale[i][0, n, j])
                    if key in q_first:
                        np.testing.assert_array_equal(now[0], q_first[key][0], err_msg=str(key))
                        assert now[1] == q_first[key][1], key
                    else:
                        q_first[key] = now
    assert collections.Counter(programs.TRACES) == before
    (res,) = results
    assert res.stats.compressions == _expected_compressions(30, 50, BUDGET, BUFFER) == 7
    assert checked > 1000 and moved > 100
    # At layer 0 a token's key, value and query depend only on the token and its position:
    # each stored vector is the forward's, quantized (to float32 drift between the two).
    seq = prompt + res.token_ids[:-1]  # the last token is never appended
    tokens = jnp.asarray([seq], jnp.int32)
    positions = jnp.arange(len(seq), dtype=jnp.int32)[None]
    q0, k0, v0 = (_np(x)[0] for x in _hidden_qkv(llama.decoder, tokens, positions)[0])

    def close(codes, scale, want, where):
        np.testing.assert_allclose(scale, np.abs(want).max() / 127, rtol=1e-4)
        got = _dequantized(codes, scale, "int8")
        assert (np.abs(got - want) <= 0.5 * scale + 1e-4 * np.abs(want).max()).all(), where

    layer0 = [(key, value) for key, value in first.items() if key[0] == 0]
    assert len(layer0) > 100
    for (_, h, p), (_, (k, v, k_scale, v_scale)) in layer0:
        close(k, k_scale, k0[p, h], ("k", h, p))
        close(v, v_scale, v0[p, h], ("v", h, p))
    ring0 = [(key, value) for key, value in q_first.items() if key[0] == 0]
    assert len(ring0) > 100
    for (_, n, p), (q, q_scale) in ring0:
        close(q, q_scale, q0[p, n], ("q", n, p))


def test_kv_dtype_is_refused_before_tracing(llama):
    """generate and score refuse a bad kv_dtype before anything is traced."""
    before = collections.Counter(programs.TRACES)
    with pytest.raises(ValueError, match=MESSAGE):
        rkvjax.generate(llama, _prompt(12, 0), max_new_tokens=4, kv_dtype="int4")
    with pytest.raises(ValueError, match=MESSAGE):
        rkvjax.score(llama, _prompt(20, 0), prompt_len=12, kv_dtype="float16")
    assert collections.Counter(programs.TRACES) == before


def test_score_with_random_eviction_is_reproducible(llama):
    """`score` fixes every row's seed, so random eviction keeps the same tokens on every call:
    a comparison of two caches (as the fidelity suite makes between storage types) sees only
    what differs between them, not two different draws."""
    ids = _prompt(60, 3)
    runs = [
        rkvjax.score(llama, ids, prompt_len=12, method="random", budget=16, buffer=8)
        for _ in range(2)
    ]
    assert runs[0].compressions >= 2
    np.testing.assert_array_equal(runs[0].logprobs, runs[1].logprobs)


def test_8bit_decode_scores_close_to_the_model_dtype(llama):
    """Teacher-forced through the decode path with a FullKV cache: kv_dtype="float32" on a
    float32 model is the model's dtype (the same numbers as None, bit for bit); an int8 cache
    moves each token's log-probability by less than 0.01, a float8_e4m3fn one by less than
    0.03 (and each does move it)."""
    seq = _prompt(12, 3) + np.random.RandomState(4).randint(0, VOCAB, 60).tolist()
    runs = {}
    for d in (None, "float32", *EIGHT_BIT):
        res = rkvjax.score(llama, seq, prompt_len=12, method="full", kv_dtype=d)
        runs[d] = np.asarray(res.logprobs)
    np.testing.assert_array_equal(runs["float32"], runs[None])
    for d, bound in (("int8", 0.01), ("float8_e4m3fn", 0.03)):
        diff = np.abs(runs[d] - runs[None]).max()
        assert 0 < diff < bound, (d, diff)


# ---------------------------------------------------------------------------------------------
# 6. Bytes: an 8-bit cache holds about half of bfloat16's.

REAL_8B = "DeepSeek-R1-Distill-Llama-8B.json"


def _cache_bytes(model, cc, slots=4, max_len=1024) -> int:
    """Bytes of every leaf of an engine's cache (keys, values, scales, positions, query ring,
    per-row counters), from its state's shapes (nothing allocated)."""
    eng = rkvjax.Engine(model, slots=slots, cache=cc, max_len=max_len)
    cache = eng.state_shapes().cache
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def _abstract(cfg, dtype="bfloat16") -> loading.Model:
    """A weightless model of `cfg`'s shape (compile-only)."""
    from rkvjax.models.decoder import abstract_decoder

    dtype = loading.as_dtype(dtype)
    return loading.Model(
        config=cfg, decoder=abstract_decoder(cfg, dtype), tokenizer=None, path=None, dtype=dtype
    )


def _ratios(model) -> dict:
    """method -> {kv_dtype: cache bytes / the bfloat16 cache's} for FullKV and R-KV 128."""
    out = {}
    for method, budget in (("full", None), ("rkv", 128)):
        sizes = {
            d: _cache_bytes(model, compression_config(method, budget, kv_dtype=d))
            for d in ("bfloat16", "float32", *EIGHT_BIT)
        }
        out[method] = {d: n / sizes["bfloat16"] for d, n in sizes.items()}
    return out


def test_cache_bytes_default_model_shape(smol):
    """On the default model's shape (head_dim 64): int8 and float8 caches take at most 0.55x of
    bfloat16's bytes, FullKV and R-KV (budget 128) alike, and more than half (their scales are
    counted); codes are one byte, scales float32 [B, K, C] (R-KV: the query ring's too)."""
    model = _abstract(smol.config)
    ratios = _ratios(model)
    for method, r in ratios.items():
        assert r["float32"] == pytest.approx(2.0, rel=0.01), method
        for d in EIGHT_BIT:
            assert 0.5 < r[d] <= 0.55, (method, d, r[d])
    eng = rkvjax.Engine(model, slots=2, cache=compression_config("rkv", 128, kv_dtype="int8"))
    cache = eng.state_shapes().cache
    n = smol.config.num_layers
    assert {x.dtype for x in (*cache.k, *cache.v, *cache.q_win)} == {jnp.dtype(jnp.int8)}
    assert len(cache.k_scale) == len(cache.v_scale) == len(cache.q_scale) == n
    assert cache.k_scale[0].shape == cache.slot_pos[0].shape
    assert cache.q_scale[0].shape == cache.q_win[0].shape[:3]
    assert {x.dtype for x in (*cache.k_scale, *cache.v_scale, *cache.q_scale)} == {
        jnp.dtype(jnp.float32)
    }


def _real_8b(layers_: int | None = None) -> loading.Model:
    path = shared_data.need("real_configs", REAL_8B)
    config = json.loads(path.read_text())
    if layers_ is not None:
        config["num_hidden_layers"] = layers_
    return loading.abstract(config, dtype="bfloat16")


def test_cache_bytes_r1_llama_8b_shape():
    """At R1-Llama-8B's shape (head_dim 128, 8 KV heads): at most 0.53x of bfloat16's."""
    model = _real_8b()
    assert model.config.head_dim == 128
    for method, r in _ratios(model).items():
        for d in EIGHT_BIT:
            assert 0.5 < r[d] <= 0.53, (method, d, r[d])


def test_compiled_decode_memory_r1_llama_8b_shape():
    """The compiled FullKV decode step (compile-only, R1-Llama-8B's layer shape with 2 of its
    layers: the ratio is per layer, and fewer layers compile in seconds) needs the int8
    cache's bytes, not bfloat16's: its peak drops by at least 0.47x of the bfloat16 cache,
    and XLA's temporaries do not grow (attention makes no dequantized copy of the cache)."""
    model = _real_8b(layers_=2)
    mem = {}
    for d in ("bfloat16", "int8"):
        cc = compression_config("full", kv_dtype=d)
        # The same products for both (an 8-bit cache would be batch-invariant by default, its
        # products on tiles of their own): only the cache differs.
        eng = rkvjax.Engine(model, slots=16, cache=cc, max_len=1024, chunk=1, batch_invariant=False)
        mem[d] = eng.memory_analysis(prompt_len=128, parts=("decode",))
    bf, i8 = mem["bfloat16"], mem["int8"]
    assert i8["cache_bytes"] <= 0.53 * bf["cache_bytes"]
    drop = bf["decode"]["peak_bytes"] - i8["decode"]["peak_bytes"]
    assert drop >= 0.47 * bf["cache_bytes"], (drop, bf["cache_bytes"])
    temp_growth = i8["decode"]["temp_bytes"] - bf["decode"]["temp_bytes"]
    assert temp_growth <= 0.01 * i8["cache_bytes"], temp_growth


def test_default_slots_follow_the_cache_bytes(smol, monkeypatch):
    """sizing.slot_bytes sizes a slot by its kv_dtype: exactly the bytes the engine's cache
    holds per row (less the row's four int32 counters), so an 8-bit cache gets about twice the
    rows; default_slots then gives twice bfloat16's where the memory holds twice the int8 rows."""
    model = _abstract(smol.config)
    for method, budget in (("full", None), ("rkv", 128)):
        per = {}
        for d in ("bfloat16", *EIGHT_BIT):
            cc = compression_config(method, budget, kv_dtype=d)
            capacity = cc.capacity if cc.compressing else 1024
            per[d] = sizing.slot_bytes(model, cc, capacity, penalties=False)
            assert per[d] == _cache_bytes(model, cc, slots=1) - 16, (method, d)
        assert per["int8"] == per["float8_e4m3fn"] <= 0.55 * per["bfloat16"]
    ccs = {
        d: compression_config("rkv", 128, buffer=8, kv_dtype=d) for d in ("bfloat16", *EIGHT_BIT)
    }
    per8 = sizing.slot_bytes(model, ccs["int8"], 136, penalties=False)
    memory = 256 * per8 / sizing.MEMORY_SHARE  # 256 int8 rows, under 256 bfloat16 ones
    monkeypatch.setattr(sizing, "device_memory", lambda m: int(memory) + 1)
    rows = {
        d: sizing.default_slots(model, cc, samples=10_000, capacity=136, penalties=False)
        for d, cc in ccs.items()
    }
    assert rows == {"bfloat16": 128, "int8": 256, "float8_e4m3fn": 256}


# ---------------------------------------------------------------------------------------------
# 7. What int8 costs: teacher-forced NLL on the default model.

NLL_TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Let me think step by "
    "step. In April she sold 48 clips. In May she sold half as many, which is 48 / 2 = 24 "
    "clips. Wait, let me check that again: half of 48 is 24. So altogether she sold "
    "48 + 24 = 72 clips in April and May. The answer is 72."
)


@pytest.mark.slow
def test_int8_nll_close_to_unquantized_default_model(smol):
    """Teacher-forced mean NLL over about 100 tokens of the default model's own kind of text:
    an int8 cache moves it by less than 0.01 nats per token from the model's-dtype cache under
    FullKV, and by less than 0.02 under R-KV (budget 64, buffer 16: compressions while scoring),
    where int8 rounding can change which tokens are kept and so every later logprob (0.005 on
    one CPU, 0.012 on another: the rounding of ties follows the machine's vector code). The
    numbers do change (the int8 cache is really used)."""
    ids = smol.tokenizer.encode(NLL_TEXT)
    assert 90 <= len(ids) <= 130
    prompt = 16
    nll = {}
    for method, budget in (("full", None), ("rkv", 64)):
        runs = {}
        for d in (None, "int8"):
            res = rkvjax.score(
                smol, ids, prompt_len=prompt, method=method, budget=budget, buffer=16, kv_dtype=d
            )
            runs[d] = np.asarray(res.logprobs, np.float64)
            if method == "rkv":
                assert res.compressions >= 2
        nll[method] = {d: -x.mean() for d, x in runs.items()}
        assert not np.array_equal(runs[None], runs["int8"])
        bound = 0.01 if method == "full" else 0.02
        assert abs(nll[method]["int8"] - nll[method][None]) < bound, nll
