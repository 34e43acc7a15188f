"""Methods that read more than queries and keys: H2O and G-KV (a number per cached key, carried
in the cache and moved with it) against NumPy replays of the engine's schedule, and random
eviction (the request's seed and prompt length) against its reference draw; think-only mode,
several samples, a mesh. TriAttention (statistics of the model) is tests/test_triattention.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rkvjax
from rkvjax import defaults
from rkvjax.kv import compress
from rkvjax.kv.config import CompressionConfig, compression_config
from tests.reference import gkv_numpy, h2o_numpy, keydiff_numpy, random_numpy
from tests.test_policy import _full_qk, _load, _prompt, _waiting_rows_run
from tests.test_sharding import _random_cache, sub_mesh

W = 8
BUDGET, BUFFER = 16, 8


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama")[0])


def _greedy(m: int) -> rkvjax.SamplingParams:
    return rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


# ---------------------------------------------------------------------------------------------
# H2O and G-KV (a state per key, kept in the cache) against their replays.


# Methods with a per-key state: their NumPy replay of one layer of one row.
REPLAYS = {"h2o": h2o_numpy.simulate, "gkv": gkv_numpy.simulate}


@pytest.mark.parametrize("method", sorted(REPLAYS))
@pytest.mark.parametrize("kind", ["llama", "qwen2_gqa3", "qwen3"])
@pytest.mark.parametrize("budget", [20, 28])
def test_stateful_prefill_compression_matches_reference(tiny_checkpoint, method, kind, budget):
    """The prompt's compression at every layer: H2O ranks the prompt's keys by the attention
    the prompt's own queries gave them, G-KV by its window's (no global score yet)."""
    model = _load(tiny_checkpoint(kind)[0])
    lengths = (40, 52)
    prompts = [_prompt(n, seed=17 + n) for n in lengths]
    outs = rkvjax.generate(
        model, prompts, method=method, budget=budget, max_new_tokens=1, record_kept=True
    )
    qs, ks = _full_qk(model, prompts, max(lengths))
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        assert out.stats.compressions == 1
        for layer in range(model.config.num_layers):
            want = REPLAYS[method](
                qs[layer][r], ks[layer][r], n, 1, budget=budget, buffer=BUFFER, window=W
            )[0]
            np.testing.assert_array_equal(
                out.kept_positions[0, layer], want, err_msg=f"{r} {layer}"
            )


@pytest.mark.parametrize("method", sorted(REPLAYS))
def test_stateful_decode_compressions_match_reference_with_waiting_rows(llama, method):
    """Every compression of every row, each key's state carried from the prompt through every
    decode step (H2O) or compression (G-KV); rows of one length fill together with one lane,
    so three wait a step; each row as alone. Layer 0 at every compression; the others at the
    first (after it, their queries and keys attend a compressed cache, which the full forward
    the reference replays does not)."""
    lengths = (9, 14, 30, 11, 11, 11, 11)
    prompts = [_prompt(n, seed=900 + i) for i, n in enumerate(lengths)]
    cc = compression_config(method, BUDGET, buffer=BUFFER)
    got = _waiting_rows_run(llama, cc, prompts, [_greedy(50)] * len(prompts))
    qs, ks = _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, got, strict=True)], 80)
    for r, (p, res) in enumerate(zip(prompts, got, strict=True)):
        events = res.stats.compressions
        assert events >= 3
        for layer in range(len(ks)):
            replayed = events if layer == 0 else 1
            want = REPLAYS[method](
                qs[layer][r], ks[layer][r], len(p), replayed, budget=BUDGET, buffer=BUFFER, window=W
            )
            np.testing.assert_array_equal(
                res.kept_positions[:replayed, layer], want, err_msg=f"row {r} layer {layer}"
            )


def test_h2o_sums_move_with_their_keys():
    """A compression keeps each kept key's sum beside it and empties the rest: the state is the
    keys' own, whatever slot they move to."""
    cc = CompressionConfig(method="h2o", budget=16, buffer=8, window=8)
    rs = np.random.RandomState(3)
    cache = _random_cache(rs)
    acc = (jnp.asarray(rs.uniform(size=cache.slot_pos[0].shape), jnp.float32),)
    cache = dataclasses.replace(
        cache,
        acc=acc,
        prompt=jnp.zeros((4,), jnp.int32),
        seed=jnp.zeros((4,), jnp.uint32),
    )
    full = jnp.array([True, False, True, True])
    out = jax.jit(lambda c: compress.compress_lanes(c, full, cc, lanes=4, start=jnp.int32(0))[0])(
        cache
    )
    before_pos, before_acc = np.asarray(cache.slot_pos[0]), np.asarray(acc[0])
    after_pos, after_acc = np.asarray(out.slot_pos[0]), np.asarray(out.acc[0])
    for b in range(4):
        for h in range(after_pos.shape[1]):
            kept = after_pos[b, h] >= 0
            src = {p: a for p, a in zip(before_pos[b, h], before_acc[b, h], strict=True)}
            got = after_acc[b, h, kept]
            np.testing.assert_array_equal(got, [src[p] for p in after_pos[b, h, kept]])
            assert (after_acc[b, h, ~kept] == 0).all()
            if full[b]:
                # the 8 lowest sums of the 16 candidates are gone; the window stays
                cand = before_acc[b, h, :16]
                gone = sorted(set(range(16)) - set(after_pos[b, h, kept]))
                assert max(cand[gone]) <= min(np.delete(cand, gone))


def _random_replay(p: int, seed: int, events: int, kh: int, budget: int) -> np.ndarray:
    """[events, K, budget] the random method's kept positions for a row with a p-token prompt
    (the same in every layer: each holds the same positions)."""
    held = list(range(p))
    nxt, out = p, []

    def compress():
        nonlocal held
        n = len(held)
        score = random_numpy.scores(held[: n - W], seed=seed, time=held[-1] + 1, prompt=p)
        idx = keydiff_numpy.keep_by_scores(score[None, None], budget=budget, window=W, n=n)
        held = [held[i] for i in idx[0, 0]]
        out.append(np.broadcast_to(np.asarray(held), (kh, budget)))

    if p > budget:
        compress()
    while len(out) < events:
        grow = budget + BUFFER - len(held)
        held = held + list(range(nxt, nxt + grow))
        nxt += grow
        compress()
    return np.stack(out)


def test_random_eviction_matches_reference_and_follows_the_seed(llama):
    """Every compression of ragged rows (one compressed at prefill, one lane, rows waiting)
    equals the reference draw from each request's seed, the prompt kept; another seed keeps
    other tokens; each request as alone."""
    budget = 28  # 20 candidates kept: shorter prompts leave room for drawn tokens
    lengths = (8, 14, 30, 11, 11)
    prompts = [_prompt(n, seed=950 + i) for i, n in enumerate(lengths)]
    seeds = [11, 12, 13, 14, 15]
    params = [dataclasses.replace(_greedy(60), seed=s) for s in seeds]
    cc = compression_config("random", budget, buffer=BUFFER)
    eng = rkvjax.Engine(llama, slots=len(prompts), cache=cc, max_len=128, lanes=1, record_kept=True)
    eng.submit_many(prompts, params)
    got = sorted(eng.run(), key=lambda r: r.request_id)
    for p, s, sp, res in zip(prompts, seeds, params, got, strict=True):
        events = res.stats.compressions
        assert events >= 3
        want = _random_replay(len(p), s, events, llama.config.kv_heads, budget)
        for layer in range(llama.config.num_layers):
            np.testing.assert_array_equal(res.kept_positions[:, layer], want)
        kept_prompt = set(range(min(len(p), budget - W)))
        assert kept_prompt <= set(res.kept_positions[-1, 0, 0].tolist())
        one = rkvjax.Engine(llama, slots=1, cache=cc, max_len=128, record_kept=True)
        one.submit(p, sp)
        (alone,) = one.run()
        assert res.token_ids == alone.token_ids
        np.testing.assert_array_equal(res.kept_positions, alone.kept_positions)
    other = rkvjax.Engine(llama, slots=1, cache=cc, max_len=128, record_kept=True)
    other.submit(prompts[0], dataclasses.replace(params[0], seed=99))
    (moved,) = other.run()
    assert not np.array_equal(moved.kept_positions[:2], got[0].kept_positions[:2])


@pytest.mark.parametrize("method", ["h2o", "gkv", "random"])
def test_stateful_methods_on_a_data_x_model_mesh_equal_one_device(tiny_checkpoint, method):
    folder = tiny_checkpoint("llama")[0]
    prompts = [_prompt(n, seed=710 + n) for n in (9, 20, 33)]
    kw = dict(method=method, budget=16, buffer=8, max_new_tokens=40, record_kept=True, seed=3)
    want = rkvjax.generate(_load(folder), prompts, **kw)
    sharded = rkvjax.load(folder, dtype="float32", mesh=sub_mesh(2, 2))
    got = rkvjax.generate(sharded, prompts, **kw)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.stats.compressions == w.stats.compressions >= 2
        np.testing.assert_array_equal(g.kept_positions, w.kept_positions)


@pytest.mark.parametrize("method", sorted(REPLAYS))
def test_stateful_think_only_rolls_the_state_with_its_keys(llama, method):
    """Think-only mode compresses rows below their capacity, rotating each row's slots first:
    with an end-of-thinking token that never comes, every compression keeps what the plain
    run keeps (the per-key state rotated with its keys), and the tokens are the same."""
    p = _prompt(9, seed=77)
    kw = dict(method=method, budget=BUDGET, buffer=BUFFER, max_new_tokens=48, record_kept=True)
    plain = rkvjax.generate(llama, p, **kw)
    never = next(t for t in range(llama.config.vocab_size) if t not in plain.token_ids + p)
    think = rkvjax.generate(llama, p, think_only=True, think_end_token=never, answer_slots=16, **kw)
    assert think.stats.cache_capacity == BUDGET + BUFFER + 16
    assert think.token_ids == plain.token_ids
    assert think.stats.compressions == plain.stats.compressions >= 4
    np.testing.assert_array_equal(think.kept_positions, plain.kept_positions)


def test_the_samples_of_a_request_draw_their_own_random_evictions(llama):
    """Two greedy samples of one request under random eviction draw their own kept sets
    (sample 0 from the request's seed, as the request alone)."""
    p = _prompt(8, seed=78)
    kw = dict(method="random", budget=24, buffer=BUFFER, record_kept=True)
    two = rkvjax.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2, seed=5)
    a, b = rkvjax.generate(llama, p, sampling=two, **kw)
    assert a.stats.compressions >= 2
    assert not np.array_equal(a.kept_positions[0], b.kept_positions[0])
    one = dataclasses.replace(two, n=1)
    (alone,) = [rkvjax.generate(llama, p, sampling=one, **kw)]
    np.testing.assert_array_equal(alone.kept_positions, a.kept_positions)


def test_think_only_takes_token_id_zero():
    """Token id 0 is a token like any other: think-only mode with it gets its answer slots."""
    cc = compression_config("h2o", BUDGET, buffer=BUFFER, think_end_id=0)
    assert (cc.think_end_id, cc.answer_slots) == (0, defaults.ANSWER_SLOTS)


@pytest.mark.parametrize("kind", ["llama", "qwen2_gqa3", "qwen3"])
@pytest.mark.parametrize("budget", [20, 28])
def test_random_prefill_compression_matches_reference(tiny_checkpoint, kind, budget):
    """A prompt longer than the budget, drawn from (with `keep_prompt=False`; with it, the
    prompt's first tokens): every layer and KV head keeps the reference's draw."""
    model = _load(tiny_checkpoint(kind)[0])
    lengths, seeds = (40, 52), (21, 22)
    prompts = [_prompt(n, seed=31 + n) for n in lengths]
    params = [dataclasses.replace(_greedy(1), seed=s) for s in seeds]
    for keep_prompt in (False, True):
        outs = rkvjax.generate(
            model,
            prompts,
            sampling=params,
            method="random",
            keep_prompt=keep_prompt,
            budget=budget,
            record_kept=True,
        )
        for n, s, out in zip(lengths, seeds, outs, strict=True):
            assert out.stats.compressions == 1
            score = random_numpy.scores(
                range(n - W), seed=s, time=n, prompt=n, keep_prompt=keep_prompt
            )
            want = keydiff_numpy.keep_by_scores(score[None, None], budget=budget, window=W, n=n)
            if keep_prompt:
                assert want[0, 0].tolist() == [*range(budget - W), *range(n - W, n)]
            for layer in range(model.config.num_layers):
                for h in range(model.config.kv_heads):
                    np.testing.assert_array_equal(out.kept_positions[0, layer, h], want[0, 0])
