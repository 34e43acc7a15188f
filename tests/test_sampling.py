"""Per-request sampling: SamplingParams, slot arrays, keys, the filters against an independent
NumPy reference, greedy rows, batch invariance, the drawn distribution, logprobs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rkvjax.sampling import sampler as S
from tests.reference import sampling_numpy as ref

# float32 masses of up to V terms against float64 ones: rows whose nearest decision lies closer
# than this to its boundary can go either way, and are left out (and counted).
MARGIN = 1e-5


def _slots(params, **kw):
    return S.SlotSampling.from_params(params, rng=np.random.default_rng(0), **kw)


def _keys(sp, token_index=0):
    idx = jnp.full(sp.seed.shape, token_index, jnp.int32)  # [B]
    return S.token_keys(sp.seed, sp.sample_index, idx)


_filter = jax.jit(S.filter_logits)
_sample = jax.jit(S.sample_rows)


def _flat(rs, v, scale=1.0):
    return (rs.randn(v) * scale).astype(np.float32)  # [V]


def _peaked(rs, v, hot=3, boost=12.0):
    x = _flat(rs, v)  # [V]
    x[rs.choice(v, hot, replace=False)] += boost * rs.uniform(0.8, 1.2, hot)
    return x


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


def test_sampling_params_defaults_are_vllms():
    p = S.SamplingParams()
    expected = dict(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=None,
        max_tokens=256,
        min_tokens=0,
        stop=[],
        stop_token_ids=[],
        ignore_eos=False,
        logprobs=None,
    )
    assert p.to_dict() == expected
    assert not p.greedy and not p.uses_penalties


def test_sampling_params_is_frozen_hashable_and_round_trips():
    p = S.SamplingParams(temperature=0.7, top_p=0.9, stop=["</s>", "\n\n"], stop_token_ids=[5, 2])
    assert p.stop == ("</s>", "\n\n") and p.stop_token_ids == (5, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_p = 0.5
    same = S.SamplingParams(**json.loads(json.dumps(p.to_dict())))
    assert same == p and hash(same) == hash(p) and len({p, same}) == 1
    q = p.replace(top_k=40)
    assert q.top_k == 40 and q.top_p == 0.9 and p.top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        p.replace(top_k=-2)


def test_sampling_params_normalises_like_vllm():
    assert S.SamplingParams(stop="END").stop == ("END",)
    assert S.SamplingParams(top_k=-1).top_k == 0
    assert S.SamplingParams(seed=-1).seed is None
    assert S.SamplingParams(stop_token_ids=[7, 3, 7]).stop_token_ids == (7, 3)
    # numpy scalars are fine and come out as Python numbers
    p = S.SamplingParams(top_k=np.int64(5), seed=np.uint32(9), temperature=np.float32(0.5))
    assert type(p.top_k) is int and type(p.seed) is int and type(p.temperature) is float
    g = S.SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)


def test_greedy_is_below_vllms_epsilon():
    assert S.SamplingParams(temperature=0.0).greedy
    assert S.SamplingParams(temperature=5e-6).greedy
    assert not S.SamplingParams(temperature=1e-5).greedy


def test_stop_id_helpers():
    p = S.SamplingParams(stop_token_ids=[4, 9], ignore_eos=True)
    assert p.min_tokens_stop_ids([2, 9]) == (4, 9, 2)  # EOS still blocked by min_tokens
    assert p.stopping_token_ids([2]) == (4, 9)
    assert p.replace(ignore_eos=False).stopping_token_ids([2]) == (4, 9, 2)


BAD_FIELDS = [
    ("n", 0, r"n must be an int >= 1"),
    ("n", True, r"n must be an int >= 1"),
    ("temperature", -0.1, r"temperature must be a finite float in \[0, 2\]"),
    ("temperature", 2.5, r"temperature must be a finite float in \[0, 2\]"),
    ("temperature", float("nan"), r"temperature must be a finite float"),
    ("top_p", 0.0, r"top_p must be a finite float in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be a finite float in \(0, 1\]"),
    ("top_k", -2, r"top_k must be an int >= 1, or 0 or -1 for off"),
    ("top_k", 2.0, r"top_k must be an int"),
    ("min_p", 1.1, r"min_p must be a finite float in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite float > 0"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be a finite float > 0"),
    ("presence_penalty", 2.1, r"presence_penalty must be a finite float in \[-2, 2\]"),
    ("frequency_penalty", -2.1, r"frequency_penalty must be a finite float in \[-2, 2\]"),
    ("frequency_penalty", "1", r"frequency_penalty must be a finite float"),
    ("seed", "x", r"seed must be an int in \[0, 4294967295\] or None"),
    ("seed", 2**32, r"seed must be an int in \[0, 4294967295\] or None"),
    ("seed", False, r"seed must be an int"),
    ("max_tokens", 0, r"max_tokens must be an int >= 1"),
    ("min_tokens", -1, r"min_tokens must be an int in \[0, 256\]"),
    ("min_tokens", 300, r"min_tokens must be an int in \[0, 256\] \(at most max_tokens\)"),
    ("stop", ["ok", ""], r"stop must be a str or a list of non-empty str"),
    ("stop", 3, r"stop must be a str or a list of non-empty str"),
    ("stop_token_ids", [1, -1], r"stop_token_ids must be a list of ints >= 0"),
    ("stop_token_ids", "12", r"stop_token_ids must be a list of ints >= 0"),
    ("ignore_eos", 1, r"ignore_eos must be a bool"),
    ("logprobs", -1, r"logprobs must be None or an int >= 0"),
    ("logprobs", True, r"logprobs must be None or an int >= 0"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_FIELDS)
def test_sampling_params_rejects_bad_field(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}") as err:
        S.SamplingParams(**{field: value})
    assert "\n" not in str(err.value) and repr(value) in str(err.value)


def test_sampling_params_covers_every_field_in_validation():
    tested = {field for field, _, _ in BAD_FIELDS}
    assert tested == {f.name for f in dataclasses.fields(S.SamplingParams)}


def test_greedy_allows_several_samples():
    """n > 1 greedy samples are identical, and allowed: a prompt's n rows share one prefill, so
    it is how a benchmark fills slots with one prompt."""
    assert S.SamplingParams(temperature=0.0, n=2).n == 2
    assert S.SamplingParams(temperature=0.5, n=2).n == 2


# --------------------------------------------------------------------------------------------
# SlotSampling, SamplerConfig, keys, helpers
# --------------------------------------------------------------------------------------------


def test_slot_sampling_from_params_pads_with_empty_rows():
    params = [
        S.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3, n=2),
        S.SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25),
        S.SamplingParams(temperature=0.0, min_tokens=4, seed=2**32 - 1),
    ]
    sp = _slots(params, batch=5, sample_indices=[1, 0, 0])
    assert len(jax.tree.leaves(sp)) == 10 and sp.batch_size == 5
    np.testing.assert_allclose(sp.temperature, [0.7, 1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(sp.top_k, [40, 0, 0, 0, 0])
    np.testing.assert_allclose(sp.top_p, [0.9, 1, 1, 1, 1])
    np.testing.assert_allclose(sp.min_p, [0.05, 0, 0, 0, 0])
    np.testing.assert_allclose(sp.repetition_penalty, [1, 1.3, 1, 1, 1])
    np.testing.assert_allclose(sp.presence_penalty, [0, 0.5, 0, 0, 0])
    np.testing.assert_allclose(sp.frequency_penalty, [0, -0.25, 0, 0, 0])
    np.testing.assert_array_equal(sp.min_tokens, [0, 0, 4, 0, 0])
    np.testing.assert_array_equal(sp.sample_index, [1, 0, 0, 0, 0])
    assert int(sp.seed[0]) == 3 and int(sp.seed[2]) == 2**32 - 1
    dtypes = {"top_k": jnp.int32, "min_tokens": jnp.int32, "seed": jnp.uint32}
    dtypes["sample_index"] = jnp.int32
    for f in dataclasses.fields(sp):
        assert getattr(sp, f.name).dtype == dtypes.get(f.name, jnp.float32), f.name
    huge = _slots([S.SamplingParams(top_k=2**40, max_tokens=2**40, min_tokens=2**35)])
    assert int(huge.top_k[0]) == int(huge.min_tokens[0]) == 2**31 - 1  # top-k off, never reached
    with pytest.raises(ValueError, match="sample index"):
        _slots(params, sample_indices=[2, 0, 0])  # n=2: 0 or 1
    with pytest.raises(ValueError, match="batch"):
        _slots(params, batch=2)


def test_fresh_seeds_come_from_the_host():
    rows = [S.SamplingParams()] * 6
    a = S.SlotSampling.from_params(rows, rng=np.random.default_rng(1)).seed
    b = S.SlotSampling.from_params(rows, rng=np.random.default_rng(1)).seed
    c = S.SlotSampling.from_params(rows).seed  # OS entropy
    np.testing.assert_array_equal(a, b)
    assert len(set(np.asarray(a).tolist())) == 6 and len(set(np.asarray(c).tolist())) == 6


def test_set_rows_scatters_and_drops_out_of_range_slots():
    base = S.SlotSampling.empty(4)
    rows = _slots([S.SamplingParams(temperature=t, seed=s) for t, s in [(0.5, 1), (0.6, 2)] * 2])
    out = jax.jit(S.SlotSampling.set_rows)(base, jnp.array([2, -1, 0, 4]), rows)
    np.testing.assert_allclose(out.temperature, [0.5, 0.0, 0.5, 0.0])  # -1 and 4 dropped
    np.testing.assert_array_equal(out.seed, [1, 0, 1, 0])
    np.testing.assert_allclose(out.top_p, [1, 1, 1, 1])


def test_sampler_config_for_requests():
    plain = S.SamplingParams()
    assert S.SamplerConfig.for_requests([plain]) == S.SamplerConfig()
    cfg = S.SamplerConfig.for_requests(
        [plain, plain.replace(logprobs=3), plain.replace(presence_penalty=0.1, logprobs=0)]
    )
    assert cfg == S.SamplerConfig(penalties=True, logprobs=3)
    with pytest.raises(ValueError, match="logprobs"):
        S.SamplerConfig(logprobs=-1)


def test_token_keys_fold_seed_sample_and_token():
    seed = jnp.array([0, 7, 7, 2**32 - 1], jnp.uint32)
    sample = jnp.array([0, 0, 1, 3], jnp.int32)
    token = jnp.array([5, 5, 5, 0], jnp.int32)
    keys = jax.jit(S.token_keys)(seed, sample, token)
    for b in range(4):
        k = jax.random.key(int(seed[b]))
        k = jax.random.fold_in(jax.random.fold_in(k, int(sample[b])), int(token[b]))
        np.testing.assert_array_equal(jax.random.key_data(keys[b]), jax.random.key_data(k))
    data = jax.random.key_data(keys)
    assert len({tuple(np.asarray(d).tolist()) for d in data}) == 4
    # a row's key does not depend on its neighbours or its position
    flipped = S.token_keys(seed[::-1], sample[::-1], token[::-1])
    np.testing.assert_array_equal(jax.random.key_data(flipped), data[::-1])


def test_token_mask_and_output_counts():
    ids = jnp.array([[3, 1, 3, -1], [0, 5, 9, 6]], jnp.int32)  # -1 and 9 (>= V) are padding
    mask = S.token_mask(ids, 6)
    np.testing.assert_array_equal(mask, np.array([[0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 1]], bool))
    counts = jnp.zeros((2, 6), jnp.int32)
    counts = S.update_output_counts(counts, jnp.array([4, 2]), jnp.array([True, False]))
    counts = S.update_output_counts(counts, jnp.array([4, 1]), jnp.array([True, True]))
    counts = S.update_output_counts(counts, jnp.array([-1, 5]), jnp.array([True, False]))
    np.testing.assert_array_equal(counts, [[0, 0, 0, 0, 2, 0], [0, 1, 0, 0, 0, 0]])


# --------------------------------------------------------------------------------------------
# Penalties and min_tokens
# --------------------------------------------------------------------------------------------


def test_penalties_match_reference():
    rs = np.random.RandomState(0)
    b, v = 6, 500
    logits = (rs.randn(b, v) * 3).astype(np.float32)  # [B, V] both signs
    counts = rs.randint(0, 4, (b, v)) * (rs.rand(b, v) < 0.1)  # [B, V]
    prompt = rs.rand(b, v) < 0.05  # [B, V]
    rep = [1.0, 1.3, 0.7, 1.0, 1.0, 1.8]
    pres = [0.0, 0.0, 0.5, -1.0, 0.0, 2.0]
    freq = [0.0, 0.0, 0.0, 0.3, -0.5, 1.0]
    sp = _slots(
        [
            S.SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
            for r, p, f in zip(rep, pres, freq, strict=True)
        ]
    )
    got = jax.jit(S.apply_penalties)(
        jnp.asarray(logits), sp, jnp.asarray(counts, jnp.int32), jnp.asarray(prompt)
    )
    want = ref.apply_penalties(logits, counts, prompt, rep, pres, freq)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])  # every penalty off: untouched
    assert np.abs(want - logits).max(axis=-1)[1:].min() > 0.1  # and the others did change
    # the output-only variant: no prompt mask
    got = S.apply_penalties(jnp.asarray(logits), sp, jnp.asarray(counts, jnp.int32))
    want = ref.apply_penalties(logits, counts, None, rep, pres, freq)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    rs = np.random.RandomState(1)
    b, v = 4, 300
    logits = (rs.randn(b, v)).astype(np.float32)  # [B, V]
    top = logits.argmax(-1)
    counts = np.zeros((b, v), np.int32)
    counts[np.arange(b), top] = 1  # every row has already made its favourite token
    rep = [1.0, 5.0, 1.0, 1.0]
    pres = [0.0, 0.0, 1.5, 0.0]
    sp = _slots(
        [
            S.SamplingParams(temperature=0.0, repetition_penalty=r, presence_penalty=p)
            for r, p in zip(rep, pres, strict=True)
        ]
    )
    toks = _sample(jnp.asarray(logits), sp, _keys(sp), output_counts=jnp.asarray(counts))
    want = ref.apply_penalties(logits, counts, None, rep, pres, [0.0] * b).argmax(-1)
    np.testing.assert_array_equal(toks, want)
    assert toks[0] == top[0] and toks[1] != top[1] and toks[2] != top[2]


def test_min_tokens_blocks_stop_tokens_until_reached():
    rs = np.random.RandomState(2)
    b, v = 4, 200
    logits = rs.randn(b, v).astype(np.float32)  # [B, V]
    eos = logits.argmax(-1)  # each row's favourite is its stop token
    stop_ids = [[int(eos[i]), 7] for i in range(b)]
    sp = _slots([S.SamplingParams(temperature=0.0, min_tokens=m) for m in [3, 3, 0, 5]])
    num_generated = np.array([0, 3, 0, 4], np.int32)
    stop_mask = S.token_mask(jnp.asarray(stop_ids, jnp.int32), v)
    toks = _sample(
        jnp.asarray(logits),
        sp,
        _keys(sp),
        num_generated=jnp.asarray(num_generated),
        stop_mask=stop_mask,
    )
    want = ref.apply_min_tokens(logits, [3, 3, 0, 5], num_generated, stop_ids).argmax(-1)
    np.testing.assert_array_equal(toks, want)
    assert toks[0] != eos[0] and toks[1] == eos[1] and toks[2] == eos[2] and toks[3] != eos[3]
    with pytest.raises(ValueError, match="num_generated"):
        S.sample_rows(jnp.asarray(logits), sp, _keys(sp), stop_mask=stop_mask)


def test_min_tokens_holds_for_sampled_rows():
    v = 50
    logits = np.zeros((1, v), np.float32)
    logits[0, 3] = 8.0  # the stop token takes ~98% of the mass
    sp = _slots([S.SamplingParams(temperature=1.0, min_tokens=10)])
    stop_mask = S.token_mask(jnp.array([[3]]), v)
    for i in range(20):
        tok = _sample(
            jnp.asarray(logits),
            sp,
            _keys(sp, i),
            num_generated=jnp.array([i % 10]),
            stop_mask=stop_mask,
        )
        assert int(tok[0]) != 3


# --------------------------------------------------------------------------------------------
# min_p, top-k, top-p against the sort-based reference
# --------------------------------------------------------------------------------------------


def _known(sizes):
    return [s for s in sizes if s is not None]


def _check_rows(rows, params, *, min_checked=0.9):
    """Filters `rows` ([B, V]) with per-row `params` in one batch and compares each row's kept set
    and values with the reference. Returns the reference kept-set sizes (None for a skipped row)."""
    logits = np.stack(rows).astype(np.float32)  # [B, V]
    got = np.asarray(_filter(jnp.asarray(logits), _slots(params)))  # [B, V]
    sizes, skipped = [], 0
    for b, p in enumerate(params):
        want, margin = ref.filter_row(
            logits[b], temperature=p.temperature, min_p=p.min_p, top_k=p.top_k, top_p=p.top_p
        )
        if margin < MARGIN:
            skipped += 1
            sizes.append(None)
            continue
        kept = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got[b]), kept, err_msg=f"row {b}: {p}")
        # XLA scales by the reciprocal of the temperature: within an ulp of the division
        np.testing.assert_allclose(got[b][kept], want[kept], rtol=3e-7)
        sizes.append(int(kept.sum()))
    allowed = round((1 - min_checked) * len(params), 6)
    assert skipped <= allowed, f"{skipped} of {len(params)} rows skipped"
    return sizes


def test_min_p_matches_reference():
    rs = np.random.RandomState(3)
    rows, params = [], []
    for i in range(40):
        rows.append(_peaked(rs, 1000) if i % 2 else _flat(rs, 1000, 2.0))
        params.append(S.SamplingParams(temperature=rs.uniform(0.3, 1.5), min_p=rs.uniform(0, 0.5)))
    rows.append(_flat(rs, 1000))
    params.append(S.SamplingParams(min_p=1.0))  # only the maximum (and its ties) stays
    sizes = _check_rows(rows, params)
    assert sizes[-1] == 1 and min(_known(sizes)) < max(_known(sizes)) / 10


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_top_k_matches_reference(vocab):
    """Every k within the candidates (read off lax.top_k), then some past them (bisection)."""
    rs = np.random.RandomState(4)
    for ks in ([1, 2, 5, 50, 63, 64, 0], [1, 64, 65, 100, 777, vocab - 1, vocab, vocab + 5]):
        rows = [_flat(rs, vocab, 3.0) for _ in ks]
        sizes = _check_rows(rows, [S.SamplingParams(top_k=k) for k in ks], min_checked=1.0)
        assert sizes == [min(k, vocab) if k else vocab for k in ks]  # continuous: no ties


def test_top_k_keeps_ties_and_skips_minus_inf():
    rs = np.random.RandomState(5)
    v = 400
    tied = (np.round(rs.randn(v) * 2) / 2).astype(np.float32)  # [V] steps of 0.5: many ties
    holes = _flat(rs, v)
    holes[rs.rand(v) < 0.9] = -np.inf  # ~40 finite
    equal = np.full(v, 0.25, np.float32)
    for rows, ks in [
        ([tied, tied, holes, equal], [1, 10, 5, 1]),  # within the candidates
        ([tied, tied, holes, equal], [10, 200, 300, 399]),  # bisection
    ]:
        sizes = _check_rows(rows, [S.SamplingParams(top_k=k) for k in ks], min_checked=1.0)
        assert sizes[-1] == v  # all tied: all kept
        for size, k in zip(sizes[:2], ks[:2], strict=True):
            assert size > k or k == 1  # the ties at the k-th stayed
    assert sizes[2] == int(np.isfinite(holes).sum())  # fewer finite than k: all of them


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_top_p_matches_reference(vocab):
    """Flat rows have top-p sets far past the 64 candidates (the bisection); peaked rows within
    them; both in one batch."""
    rs = np.random.RandomState(6)
    rows, params = [], []
    for i in range(24):
        kind = i % 3
        rows.append(_flat(rs, vocab, 1.0 + i / 12) if kind < 2 else _peaked(rs, vocab))
        params.append(
            S.SamplingParams(temperature=rs.uniform(0.5, 1.2), top_p=rs.uniform(0.05, 0.99))
        )
    sizes = _check_rows(rows, params)
    assert min(_known(sizes)) < S.CANDIDATES < max(_known(sizes))


def test_top_p_only_within_candidates():
    """A batch that never leaves the candidates (no bisection)."""
    rs = np.random.RandomState(7)
    rows = [_peaked(rs, 2000, hot=h, boost=15.0) for h in (1, 2, 3, 5, 8, 13)]
    params = [S.SamplingParams(top_p=p) for p in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
    sizes = _check_rows(rows, params, min_checked=1.0)
    assert 1 < max(sizes) < S.CANDIDATES


def test_top_p_edge_cases():
    rs = np.random.RandomState(8)
    v = 300
    tied = np.round(rs.randn(v) * 2, 0).astype(np.float32)  # [V] a handful of distinct values
    tied[:3] = tied.max()  # the maximum tied too
    holes = _flat(rs, v)
    holes[rs.rand(v) < 0.7] = -np.inf
    equal = np.zeros(v, np.float32)
    one_hot = np.full(v, -30.0, np.float32)
    one_hot[17] = 30.0
    straddle = np.full(v, -20.0, np.float32)  # 10 tokens, then a tie of 200 from the 11th on
    straddle[:10] = np.linspace(3.0, 2.0, 10)
    straddle[50:250] = 0.0
    cases = [
        (tied, 1.0),  # off
        (tied, 1e-6),  # only the max (with its ties)
        (tied, 0.3),
        (tied, 0.97),
        (holes, 0.5),
        (holes, 0.999),
        (equal, 0.1),  # all tied: all kept
        (one_hot, 0.99),  # one token already holds the mass
        (_flat(rs, v, 0.01), 0.5),  # nearly flat
        (_flat(rs, v, 20.0), 0.9),  # very peaked
        (straddle, 0.5),  # the answer: the tie that runs past the 64 candidates...
        (straddle, 0.7),  # ...whose 54 candidates alone fall short of p (so: the search)
        (straddle, 0.2),  # the answer: among the 10 above it
    ]
    sizes = _check_rows([r for r, _ in cases], [S.SamplingParams(top_p=p) for _, p in cases])
    assert sizes[0] == v and sizes[6] == v and sizes[7] == 1
    assert sizes[1] == int((tied == tied.max()).sum()) > 1
    assert sizes[-3] == sizes[-2] == 210 and sizes[-1] < 10


def test_filters_compose_in_vllms_order():
    """min_p, then top-k, then top-p over what top-k kept (renormalised)."""
    rs = np.random.RandomState(9)
    rows, params = [], []
    for i in range(30):
        rows.append(_peaked(rs, 3000, hot=4) if i % 3 == 0 else _flat(rs, 3000, 1.5))
        params.append(
            S.SamplingParams(
                temperature=rs.uniform(0.4, 1.3),
                min_p=[0.0, 0.001, 0.02][i % 3],
                top_k=[0, 20, 100, 1000, 64][i % 5],
                top_p=[1.0, 0.9, 0.5, 0.99][i % 4],
            )
        )
    sizes = _check_rows(rows, params)
    assert min(_known(sizes)) < 20 and max(_known(sizes)) > S.CANDIDATES
    # top-p renormalises over top-k: a lone top-p would keep more than top-k then top-p
    x = _flat(rs, 3000, 1.5)
    lone = ref.filter_row(x, top_p=0.5)[0]
    both = ref.filter_row(x, top_k=100, top_p=0.5)[0]
    got = np.asarray(
        _filter(jnp.asarray(x[None]), _slots([S.SamplingParams(top_k=100, top_p=0.5)]))
    )
    np.testing.assert_array_equal(np.isfinite(got[0]), np.isfinite(both))
    assert np.isfinite(both).sum() < min(100, np.isfinite(lone).sum())


def test_each_row_is_filtered_with_its_own_settings():
    """The same rows alone and in a mixed batch give identical filtered logits."""
    rs = np.random.RandomState(10)
    v = 5000
    rows = [_flat(rs, v, 2.0), _peaked(rs, v), _flat(rs, v), _peaked(rs, v, hot=1), _flat(rs, v)]
    params = [
        S.SamplingParams(top_p=0.9),
        S.SamplingParams(top_p=0.9, temperature=0.6),
        S.SamplingParams(top_k=500),
        S.SamplingParams(top_k=10, min_p=0.1),
        S.SamplingParams(temperature=0.0),
    ]
    batch = np.asarray(_filter(jnp.asarray(np.stack(rows)), _slots(params)))
    for b, (row, p) in enumerate(zip(rows, params, strict=True)):
        alone = np.asarray(_filter(jnp.asarray(row[None]), _slots([p])))
        np.testing.assert_array_equal(alone[0], batch[b])


@pytest.mark.parametrize("wrong_estimate", [False, True], ids=["gathered", "whole_row"])
@pytest.mark.parametrize("weights", ["mass", "count"])
def test_search_ends_on_the_exact_threshold(weights, wrong_estimate):
    """The threshold search against a sorted cumulative sum, with targets halfway between two
    levels so float32 cannot tip them. A wrong token-count estimate (far too low) stops the
    whole-row phase at once, so the rows do not fit the gathered chunks and must go on over the
    whole row, still exactly."""
    rs = np.random.RandomState(17)
    b, v = 6, 10_000  # 157 chunks of 64, the last one padded
    x = (rs.randn(b, v) * 3).astype(np.float32)  # [B, V]
    x[1] = np.round(x[1])  # ties
    x[2, rs.rand(v) < 0.5] = -np.inf
    m = x.max(-1, keepdims=True)  # [B, 1]
    w = np.exp(x - m) if weights == "mass" else np.ones_like(x)  # [B, V]
    targets, want = [], []
    for r in range(b):
        values = np.unique(x[r][np.isfinite(x[r])])[::-1]  # [U] descending
        level = np.array([w[r][x[r] >= u].astype(np.float64).sum() for u in values])  # [U]
        j = rs.randint(1, min(len(values), 400))
        targets.append((level[j - 1] + level[j]) / 2)
        want.append(values[j])
    target = jnp.asarray(targets, jnp.float32)
    lo = jnp.full((b,), S._NEG_INF_KEY, jnp.int32)
    hi = S._float_key(jnp.asarray(m[:, 0])) + 1
    total = jnp.asarray(w.sum(-1), jnp.float32)
    bracket = (lo, hi, total, jnp.zeros((b,), jnp.float32))
    if wrong_estimate:
        least = lambda t: jnp.full_like(t, 1e30)
    elif weights == "mass":
        least = lambda t: jnp.exp(t - jnp.asarray(m[:, 0]))
    else:
        least = jnp.ones_like
    w_arg = jnp.asarray(w) if weights == "mass" else None

    @jax.jit
    def search(x, w, target, bracket):
        return S._largest_feasible(x, w, target, bracket, least)

    got = search(jnp.asarray(x), w_arg, target, bracket)
    np.testing.assert_array_equal(got, np.array(want, np.float32))


# --------------------------------------------------------------------------------------------
# Sampling: greedy, batch invariance, the distribution
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [100, 1000, 49152])
def test_argmax_is_jnps_first_index_of_the_max(vocab):
    rs = np.random.RandomState(16)
    x = rs.randn(5, vocab).astype(np.float32)  # [5, V]
    x[1, [3, vocab // 2, vocab - 1]] = 9.0  # ties across chunks: the first wins
    x[2, [vocab - 2, vocab - 1]] = 9.0  # in the last (padded) chunk
    x[3] = -np.inf  # nothing left: index 0, as jnp.argmax
    x[4, vocab // 3] = np.inf
    got = jax.jit(S.argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), axis=-1))
    assert got.dtype == jnp.int32


def test_greedy_rows_equal_argmax_in_mixed_and_greedy_batches():
    rs = np.random.RandomState(11)
    logits = jnp.asarray(rs.randn(6, 4000).astype(np.float32))  # [B, V]
    argmax = np.asarray(logits).argmax(-1)
    greedy = _slots([S.SamplingParams(temperature=t) for t in [0.0, 0.0, 1e-6, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(_sample(logits, greedy, _keys(greedy)), argmax)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 2.0]
    mixed = _slots([S.SamplingParams(temperature=t, top_p=0.9 if t else 1.0) for t in temps])
    toks = np.asarray(_sample(logits, mixed, _keys(mixed)))
    is_greedy = np.array(temps) == 0.0
    np.testing.assert_array_equal(toks[is_greedy], argmax[is_greedy])
    assert (toks[~is_greedy] != argmax[~is_greedy]).any()  # the sampled rows did sample


def test_a_rows_token_does_not_depend_on_the_batch():
    """Each row alone (batch 1) and in a batch of 8 with other settings, shuffled, over several
    tokens: the same token every time."""
    rs = np.random.RandomState(12)
    v = 49152
    rows = np.stack(
        [
            _flat(rs, v, 3.0),
            _peaked(rs, v),
            _flat(rs, v),
            _peaked(rs, v, hot=6),
            _flat(rs, v, 2),
            _flat(rs, v),
            _peaked(rs, v),
            _flat(rs, v, 5.0),
        ]
    )  # [8, V]
    params = [
        S.SamplingParams(temperature=0.6, top_p=0.95, seed=1),  # flat: bisection
        S.SamplingParams(temperature=0.6, top_p=0.95, seed=2),  # peaked: candidates
        S.SamplingParams(temperature=1.0, top_k=50, seed=3),
        S.SamplingParams(temperature=0.8, top_k=300, min_p=0.05, seed=4),  # k > 64: bisection
        S.SamplingParams(temperature=0.0),
        S.SamplingParams(temperature=1.0, seed=5),
        S.SamplingParams(temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.5, seed=6),
        S.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, seed=7),
    ]
    counts = (rs.rand(8, v) < 0.001).astype(np.int32) * 2  # [8, V]
    perm = np.array([5, 2, 7, 0, 3, 6, 1, 4])
    batch = _slots(params)
    shuffled = _slots([params[i] for i in perm])
    seen = set()
    for token in range(3):
        kw = dict(output_counts=jnp.asarray(counts))
        toks = np.asarray(_sample(jnp.asarray(rows), batch, _keys(batch, token), **kw))
        kw = dict(output_counts=jnp.asarray(counts[perm]))
        moved = np.asarray(_sample(jnp.asarray(rows[perm]), shuffled, _keys(shuffled, token), **kw))
        np.testing.assert_array_equal(moved, toks[perm])
        for b in range(8):
            one = _slots([params[b]])
            alone = _sample(
                jnp.asarray(rows[b : b + 1]),
                one,
                _keys(one, token),
                output_counts=jnp.asarray(counts[b : b + 1]),
            )
            assert int(alone[0]) == toks[b], (token, b, params[b])
        seen.add(tuple(toks.tolist()))
    assert len(seen) == 3  # the keys move with the token index
    # batch 16: two blocks of ROW_BLOCK rows, sampled one after the other
    assert 16 // S.ROW_BLOCK == 2
    both = _slots(params + [params[i] for i in perm])
    kw = dict(output_counts=jnp.asarray(np.concatenate([counts, counts[perm]])))
    toks16 = _sample(jnp.asarray(np.concatenate([rows, rows[perm]])), both, _keys(both, 2), **kw)
    np.testing.assert_array_equal(toks16, np.concatenate([toks, toks[perm]]))


def test_sample_index_and_seed_choose_the_stream():
    logits = jnp.zeros((4, 1000), jnp.float32)  # uniform
    p = S.SamplingParams(seed=42, n=2)
    sp = _slots([p, p, p, p.replace(seed=43)], sample_indices=[0, 0, 1, 0])
    toks = np.stack([np.asarray(_sample(logits, sp, _keys(sp, t))) for t in range(8)])  # [T, 4]
    np.testing.assert_array_equal(toks[:, 0], toks[:, 1])  # same seed, sample and token
    assert (toks[:, 0] != toks[:, 2]).sum() >= 6 and (toks[:, 0] != toks[:, 3]).sum() >= 6


def test_nothing_recompiles_when_settings_change():
    traces = []

    @jax.jit
    def step(logits, sp, keys):
        traces.append(1)
        return S.sample_rows(logits, sp, keys)

    logits = jnp.asarray(np.random.RandomState(13).randn(3, 500).astype(np.float32))
    for params in [
        [S.SamplingParams(temperature=0.0)] * 3,
        [S.SamplingParams(top_p=0.5), S.SamplingParams(top_k=3), S.SamplingParams()],
        [S.SamplingParams(min_p=0.2, temperature=0.3)] * 2,
    ]:
        sp = _slots(params, batch=3)
        step(logits, sp, _keys(sp))
    assert len(traces) == 1


@pytest.mark.parametrize(
    "params",
    [
        S.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01),
        S.SamplingParams(temperature=1.0),
        S.SamplingParams(temperature=0.9, top_p=0.8),
    ],
    ids=["filters", "plain", "top_p"],
)
def test_draws_follow_the_filtered_distribution(params):
    """Many keys on one row of 300 tokens (three draw chunks, the last one padded): the counts
    match the reference's filtered softmax (chi-square), and nothing filtered out is drawn."""
    rs = np.random.RandomState(14)
    v, n = 300, 40_000
    row = _flat(rs, v, 1.5)  # [V]
    want = ref.softmax(
        ref.filter_row(
            row, **{k: getattr(params, k) for k in ("temperature", "min_p", "top_k", "top_p")}
        )[0]
    )  # [V]
    sp = _slots([params] * n)
    keys = S.token_keys(sp.seed, sp.sample_index, jnp.zeros(n, jnp.int32))
    toks = np.asarray(_sample(jnp.asarray(np.broadcast_to(row, (n, v))), sp, keys))
    counts = np.bincount(toks, minlength=v)  # [V]
    assert counts[want == 0].sum() == 0
    big = want * n >= 5  # chi-square bins: the rare tokens pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(want[big], want[~big].sum()) * n
    keep = expected > 0
    _, pvalue = stats.chisquare(observed[keep], expected[keep])
    assert pvalue > 1e-4, pvalue
    assert 0.5 * np.abs(counts / n - want).sum() < 0.03
    assert (want > 0).sum() > 10  # not a trivial distribution


def test_draw_never_picks_a_removed_token():
    """A chunk whose tokens are all filtered out is never chosen; a lone survivor always is."""
    v = 1000
    logits = np.full((64, v), -np.inf, np.float32)
    logits[:, 999] = 0.0  # in the last (padded) chunk
    keys = jax.random.split(jax.random.key(3), 64)
    np.testing.assert_array_equal(jax.jit(S.draw)(keys, jnp.asarray(logits)), 999)


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5])
def test_token_logprobs_are_raw_log_softmax(n):
    rs = np.random.RandomState(15)
    logits = jnp.asarray((rs.randn(3, 700) * 4).astype(np.float32))  # [B, V]
    tokens = jnp.array([5, 0, 699], jnp.int32)
    chosen, top_ids, top_lp = jax.jit(S.token_logprobs, static_argnums=2)(logits, tokens, n)
    full = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
    np.testing.assert_allclose(chosen, full[jnp.arange(3), tokens], rtol=1e-6)
    np.testing.assert_allclose(chosen, ref.log_softmax(logits)[np.arange(3), tokens], atol=1e-5)
    assert top_ids.shape == (3, n) and top_lp.shape == (3, n) and top_ids.dtype == jnp.int32
    order = np.argsort(-np.asarray(logits), axis=-1)[:, :n]  # [B, n]
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lp, np.take_along_axis(np.asarray(full), order, -1), rtol=1e-6)
