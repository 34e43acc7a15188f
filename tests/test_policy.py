"""Compression inside the engine: keep sets against the NumPy reference, schedule, memory, compiles.

The keep sets the engine records (`record_kept`) are compared with `tests/reference/rkv_numpy.py`
run on the post-RoPE queries and keys of a cache-free forward (the model itself is checked against
transformers in test_models). Before a row's first compression nothing was evicted, so that
forward sees exactly the keys the cache held; at layer 0 a key depends only on its token and
position, so every later layer-0 compression can be replayed in NumPy too.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models.layers import as_storage

import rkvjax
from rkvjax.kv import cache as kv
from rkvjax.kv import compress
from rkvjax.kv import selection as C
from rkvjax.kv.config import CompressionConfig, compression_config
from rkvjax.runtime import programs
from tests import reference
from tests.hf_tiny import VOCAB

W = 8  # window (the default)
BUDGET, BUFFER = 16, 8
TRIGGER = BUDGET + BUFFER
METHODS = ("rkv", "snapkv", "streaming")

# One ragged batch, compressed with rkv, serves the decode-time checks: prompts below the budget
# (9, 14: their first compression happens while decoding) and above it (30: compressed right
# after prefill). All three share the 32 bucket in the batch but not alone (16, 16, 32).
RAGGED = (9, 14, 30)
RAGGED_NEW = 40
RAGGED_KW = dict(
    method="rkv", budget=BUDGET, buffer=BUFFER, max_new_tokens=RAGGED_NEW, record_kept=True
)


def _prompt(n: int, seed: int) -> list[int]:
    """n random token ids in which a 3-token motif recurs every 7 tokens.

    A repeated token at a nearby position has a nearly parallel key (same projection, small RoPE
    rotation), so the redundancy threshold actually decides some of the keep sets compared here.
    """
    rs = np.random.RandomState(seed)
    ids = rs.randint(3, VOCAB, n)
    motif = rs.randint(3, VOCAB, 3)
    for start in range(0, n - 3, 7):
        ids[start : start + 3] = motif
    return ids.tolist()


@jax.jit
def _hidden_qkv(decoder, tokens, positions):
    """Per-layer (q, k, v) of a cache-free forward: q [B, T, N, H], k and v [B, T, K, H]."""
    return decoder.hidden(tokens, positions, programs._causal_attend(positions), ())[1]


def _full_qk(model, seqs: list[list[int]], length: int) -> tuple[list, list]:
    """Post-RoPE queries and keys of each sequence, per layer: q [B, T, N, H], k [B, T, K, H].

    Sequences are right-padded to `length`: with a causal mask a pad after a token never changes
    it, and one shape compiles once. Returned as float64 numpy (the reference's precision).
    """
    tokens = np.zeros((len(seqs), length), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    qkv = jax.device_get(_hidden_qkv(model.decoder, jnp.asarray(tokens), jnp.asarray(positions)))
    return [np.float64(q) for q, _, _ in qkv], [np.float64(k) for _, k, _ in qkv]


def _ref_keep(method, q, k, held, *, budget, window=W, **kw) -> np.ndarray:
    """NumPy-reference keep set of one (layer, row) -> [K, budget] logical positions.

    Args:
      method: a method with a reference in tests/reference ("rkv", "keydiff", ...).
      q, k: [T, N, H] and [T, K, H] queries and keys of the row, indexed by logical position.
      held: [K][n] the logical positions each KV head holds, in slot order; the last W are the
        observation tokens whose queries score importance.
      budget: tokens kept per KV head.
      window: the observation tokens.
      kw: threshold, lam, ... passed to the reference.
    """
    kh = k.shape[1]
    g = q.shape[1] // kh
    out = []
    for h in range(kh):
        pos = np.asarray(held[h])
        keys = k[pos, h][None, None]  # [1, 1, n, H]
        queries = np.swapaxes(q[pos[-window:], h * g : (h + 1) * g], 0, 1)[None]  # [1, G, W, H]
        idx = reference.keep(method, queries, keys, budget=budget, window=window, **kw)[0, 0]
        out.append(pos[idx])
    return np.stack(out)


def _threshold_decides(q, k, held, budget) -> bool:
    """Whether the near-duplicate rule changes this R-KV keep set: threshold 0.5 against a
    threshold no cosine reaches (every row then zeroes column 0 instead of its newest match)."""
    usual = _ref_keep("rkv", q, k, held, budget=budget)
    return not np.array_equal(usual, _ref_keep("rkv", q, k, held, budget=budget, threshold=1.1))


def _expected_compressions(p: int, max_new: int, budget: int, buffer: int) -> int:
    """Compressions of one row under the spec's schedule.

    The prompt is compressed once if longer than the budget. While decoding, max_new - 1 tokens
    are appended (the last generated token is never fed back), and each append that finds the
    row holding budget + buffer tokens is preceded by one compression back to `budget`. So a
    cache that becomes full on the very last append is not compressed (nothing would read it).
    """
    count = int(p > budget)
    held, appended = min(p, budget), max_new - 1
    first = budget + buffer - held  # appends until the cache is first full
    if appended > first:
        count += (appended - first - 1) // buffer + 1
    return count


def _compression_steps(p: int, max_new: int, budget: int, buffer: int) -> list[int]:
    """Decode steps (1-based, the prefill's token is step 0) at which a row with p <= budget
    compresses: step s appends token s - 1, and compresses first if the cache is full."""
    first = budget + buffer - p
    return list(range(first + 1, max_new, buffer))


def _simulate_layer0(
    method, q0, k0, p: int, events: int, *, budget, buffer, window=W
) -> np.ndarray:
    """Replays the cache schedule of layer 0 in NumPy -> [events, K, budget] kept positions.

    The cache starts with the prompt (compressed if longer than the budget), grows by one
    position per decode step and is compressed whenever it holds budget + buffer tokens.
    """
    kh = k0.shape[1]
    held = [list(range(p)) for _ in range(kh)]
    nxt, out = p, []
    if p > budget:
        out.append(_ref_keep(method, q0, k0, held, budget=budget, window=window))
        held = [list(x) for x in out[-1]]
    while len(out) < events:
        grow = budget + buffer - len(held[0])
        held = [h + list(range(nxt, nxt + grow)) for h in held]
        nxt += grow
        out.append(_ref_keep(method, q0, k0, held, budget=budget, window=window))
        held = [list(x) for x in out[-1]]
    return np.stack(out)


def _assert_layer0_replays(method, prompts, results, qs, ks, *, budget, buffer) -> None:
    """Every layer-0 compression of each row (at least three) keeps what the NumPy replay of
    its cache schedule keeps (`_simulate_layer0`)."""
    for r, (p, res) in enumerate(zip(prompts, results, strict=True)):
        events = res.stats.compressions
        assert events >= 3
        want = _simulate_layer0(
            method, qs[0][r], ks[0][r], len(p), events, budget=budget, buffer=buffer
        )
        np.testing.assert_array_equal(res.kept_positions[:, 0], want, err_msg=f"row {r}")


def _waiting_rows_run(model, cc, prompts, params) -> list:
    """`prompts` in as many slots with one compression lane (rows that fill on the same step
    wait for it), checked against each request alone: the same tokens and kept sets. Returns
    the batch's results in request order."""
    eng = rkvjax.Engine(model, slots=len(prompts), cache=cc, max_len=128, lanes=1, record_kept=True)
    eng.submit_many(prompts, params)
    got = sorted(eng.run(), key=lambda r: r.request_id)  # run() yields in finish order
    assert eng.stats.stalled_row_steps > 0
    for r, (p, sp, res) in enumerate(zip(prompts, params, got, strict=True)):
        one = rkvjax.Engine(model, slots=1, cache=cc, max_len=128, record_kept=True)
        one.submit(p, sp)
        (alone,) = one.run()
        assert res.token_ids == alone.token_ids, f"row {r}"
        np.testing.assert_array_equal(res.kept_positions, alone.kept_positions)
    return got


@functools.cache
def _load(folder, dtype="float32"):
    """rkvjax.load, once per (folder, dtype)."""
    return rkvjax.load(folder, dtype=dtype)


@pytest.fixture(scope="module")
def model_of(tiny_checkpoint):
    """kind -> the tiny random checkpoint of that kind, loaded in float32."""
    return lambda kind: _load(tiny_checkpoint(kind)[0])


@pytest.fixture(scope="module")
def llama(model_of):
    """Tiny Llama, 2 layers, 4 query heads over 2 KV heads (G = 2), head_dim 16."""
    return model_of("llama")


@pytest.fixture(scope="module")
def ragged(llama):
    """(prompts, batch results, results of each prompt alone) of the RAGGED rkv generation."""
    prompts = [_prompt(n, seed) for seed, n in enumerate(RAGGED)]
    batch = rkvjax.generate(llama, prompts, **RAGGED_KW)
    alone = [rkvjax.generate(llama, p, **RAGGED_KW) for p in prompts]
    return prompts, batch, alone


@pytest.fixture(scope="module")
def ragged_qk(llama, ragged):
    """Full-forward (q, k) over prompt + generated tokens of each RAGGED row."""
    prompts, batch, _ = ragged
    return _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, batch, strict=True)], 80)


# ---------------------------------------------------------------------------------------------
# 1. Keep sets equal the NumPy reference, end to end.


@pytest.mark.parametrize("method", METHODS)
def test_prefill_compression_matches_reference(model_of, method):
    """Prompts longer than the budget are compressed once after prefill, per (layer, KV head),
    exactly as the reference selects from each prompt's keys and its last W queries.

    Qwen2 with G = 3 query heads per KV head (the G = 2 Llama is covered by the RAGGED batch),
    two rows left-padded by different amounts in a 64 bucket.
    """
    model = model_of("qwen2_gqa3")
    budget, lengths = 24, (40, 52)
    prompts = [_prompt(n, seed=11 + n) for n in lengths]
    outs = rkvjax.generate(
        model, prompts, method=method, budget=budget, max_new_tokens=1, record_kept=True
    )
    cfg = model.config
    assert cfg.q_heads // cfg.kv_heads == 3
    qs, ks = _full_qk(model, prompts, max(lengths))
    decisive = False
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        assert out.stats.compressions == 1
        kept = out.kept_positions  # [E, L, K, budget]
        assert kept.shape == (1, cfg.num_layers, cfg.kv_heads, budget)
        held = [list(range(n))] * cfg.kv_heads
        for layer in range(cfg.num_layers):
            q, k = qs[layer][r], ks[layer][r]
            want = _ref_keep(method, q, k, held, budget=budget)
            np.testing.assert_array_equal(kept[0, layer], want, err_msg=f"row {r} layer {layer}")
            if method == "rkv":
                decisive |= _threshold_decides(q, k, held, budget)
    # The prompts' near-duplicate keys cross the threshold and change what R-KV keeps, so the
    # comparison covers the newest-match zeroing, not only the smooth part of the score.
    assert decisive or method != "rkv"


@pytest.mark.slow
def test_prefill_compression_matches_reference_smollm2(smol):
    """The same on the real default model (30 layers, G = 3, head_dim 64), whose keys are far
    from random: a reasoning-style prompt that repeats itself gives many near-duplicates."""
    text = (
        "Wait, let me check that again. 12 + 7 = 19. Wait, let me check that again: 12 + 7 = 19. "
        "So the answer is 19. Let me verify once more: 12 + 7 = 19."
    )
    ids = smol.tokenizer.encode(text)
    budget, n = 24, len(ids)
    out = rkvjax.generate(smol, ids, budget=budget, max_new_tokens=1, record_kept=True)
    qs, ks = _full_qk(smol, [ids], n)
    held = [list(range(n))] * smol.config.kv_heads
    decisive = 0
    for layer in range(smol.config.num_layers):
        q, k = qs[layer][0], ks[layer][0]
        want = _ref_keep("rkv", q, k, held, budget=budget)
        np.testing.assert_array_equal(out.kept_positions[0, layer], want, err_msg=f"layer {layer}")
        decisive += _threshold_decides(q, k, held, budget)
    assert decisive >= 1


def test_first_decode_compression_matches_reference(ragged, ragged_qk):
    """Each row's first compression, every layer: rows below the budget first compress while
    decoding, when their cache holds budget + buffer tokens (prompt + the tokens generated so
    far, none evicted yet); the long row compresses its prompt. Also covers 1d: the threshold
    rule decides at least one of these keep sets."""
    prompts, batch, _ = ragged
    qs, ks = ragged_qk
    decisive = False
    for r, (p, res) in enumerate(zip(prompts, batch, strict=True)):
        n = len(p) if len(p) > BUDGET else TRIGGER  # tokens held at the first compression
        held = [list(range(n))] * ks[0].shape[2]
        for layer in range(len(ks)):
            q, k = qs[layer][r], ks[layer][r]
            want = _ref_keep("rkv", q, k, held, budget=BUDGET)
            np.testing.assert_array_equal(
                res.kept_positions[0, layer], want, err_msg=f"row {r} layer {layer}"
            )
            decisive |= _threshold_decides(q, k, held, BUDGET)
    assert decisive


def test_every_layer0_compression_matches_replay(ragged, ragged_qk):
    """All compressions of layer 0, replayed in NumPy: after the first one each KV head holds
    its own token set, and the physical slots no longer match logical positions."""
    prompts, batch, _ = ragged
    qs, ks = ragged_qk
    _assert_layer0_replays("rkv", prompts, batch, qs, ks, budget=BUDGET, buffer=BUFFER)
    # The heads really diverge, so per-head slot positions are exercised.
    assert any(
        not np.array_equal(res.kept_positions[-1, 0, 0], res.kept_positions[-1, 0, 1])
        for res in batch
    )


def test_ragged_rows_compress_on_their_own_schedule(ragged):
    """Rows at different fill levels give exactly what each prompt gives alone: tokens,
    compression counts and kept positions (each row compresses when its own cache is full)."""
    _, batch, alone = ragged
    assert len({res.stats.compressions for res in batch}) == len(batch)  # three schedules
    for r, (got, want) in enumerate(zip(batch, alone, strict=True)):
        assert got.token_ids == want.token_ids, f"row {r}"
        assert got.stats.compressions == want.stats.compressions, f"row {r}"
        assert got.stats.peak_cache_slots == want.stats.peak_cache_slots, f"row {r}"
        np.testing.assert_array_equal(got.kept_positions, want.kept_positions, err_msg=f"row {r}")


# ---------------------------------------------------------------------------------------------
# 2. No eviction, no difference.


@pytest.fixture(scope="module")
def no_eviction_prompts():
    """Two prompts of different lengths (one bucket) for the budget-above-generation runs."""
    return [_prompt(10, 21), _prompt(21, 22)]


@pytest.fixture(scope="module")
def fullkv_run(llama, no_eviction_prompts):
    """FullKV greedy generation of 64 tokens for no_eviction_prompts."""
    return rkvjax.generate(llama, no_eviction_prompts, method="full", max_new_tokens=64)


# 1.0 is a float budget: the whole generation of the longest row, 21 + 64 = 85 tokens.
@pytest.mark.parametrize("method, budget", [("rkv", 1.0), ("snapkv", 86), ("streaming", 86)])
def test_budget_above_generation_equals_fullkv(
    llama, no_eviction_prompts, fullkv_run, method, budget
):
    """A budget that holds the whole generation never evicts: every method is FullKV."""
    out = rkvjax.generate(
        llama, no_eviction_prompts, method=method, budget=budget, buffer=BUFFER, max_new_tokens=64
    )
    for got, want in zip(out, fullkv_run, strict=True):
        assert got.stats.budget == (85 if budget == 1.0 else budget)
        assert got.token_ids == want.token_ids
        assert got.stats.compressions == 0
        assert got.stats.peak_cache_slots == want.stats.peak_cache_slots
        assert got.stats.peak_cache_slots == got.stats.prompt_tokens + 63


# ---------------------------------------------------------------------------------------------
# 3-5. Flat memory, one compile, the compression schedule.

# lam=0.2 gives this run a plan no other test compiles, so the trace counts are its own.
LONG_KW = dict(method="rkv", budget=BUDGET, buffer=BUFFER, lam=0.2, max_new_tokens=300)


@pytest.fixture(scope="module")
def long_runs(llama):
    """Two 300-token rkv generations over one prompt bucket (many compressions, five decode
    chunks): (first results, second results, traces added by the first, by the second)."""
    before = collections.Counter(programs.TRACES)
    first = rkvjax.generate(llama, [_prompt(11, 31), _prompt(16, 32)], **LONG_KW)
    middle = collections.Counter(programs.TRACES)
    second = rkvjax.generate(llama, [_prompt(12, 33), _prompt(15, 34)], **LONG_KW)
    after = collections.Counter(programs.TRACES)
    return first, second, middle - before, after - middle


def _cache_shapes(model, ids, cc, max_new):
    """Capacity, and shapes and dtypes of the cache leaves, of a runtime for this generation
    (traced only)."""
    max_len = 16 + max_new - 1  # the prompt bucket + every new token but the last
    eng = rkvjax.Engine(model, slots=len(ids), cache=cc, max_len=max_len)
    return eng.capacity, jax.tree.map(lambda x: (x.shape, x.dtype), eng.state_shapes().cache)


def test_memory_is_flat_in_generation_length(llama, ragged, long_runs):
    """The rkv cache is budget + buffer slots whatever max_new_tokens; FullKV's grows with it."""
    _, batch, _ = ragged
    first, _, _, _ = long_runs
    for res in [*batch, *first]:  # 40 and 300 new tokens
        assert res.stats.cache_capacity == TRIGGER
        assert res.stats.peak_cache_slots == TRIGGER  # filled, never beyond
    ids = [_prompt(11, 41), _prompt(14, 42)]
    shapes = {}
    for method in ("rkv", "full"):
        for m in (50, 300):
            cc = compression_config(method, BUDGET, prompt_len=14, max_new_tokens=m, buffer=BUFFER)
            shapes[method, m] = _cache_shapes(llama, ids, cc, m)
    assert shapes["rkv", 50] == shapes["rkv", 300]
    assert shapes["rkv", 50][0] == TRIGGER
    # FullKV holds the prompt bucket plus every new token but the last.
    assert shapes["full", 50][0] == 16 + 49 and shapes["full", 300][0] == 16 + 299
    assert shapes["full", 50][1] != shapes["full", 300][1]


def test_long_run_compiles_once(long_runs):
    """Dozens of compressions over several decode chunks trace prefill and decode once; another
    batch of the same bucket adds no trace (compression is a `lax.cond`, not a recompile)."""
    first, second, traced_first, traced_second = long_runs
    assert min(res.stats.compressions for res in first) >= 30
    assert traced_first == collections.Counter(init_state=1, prefill=1, insert=1, decode=1)
    assert traced_second == collections.Counter()
    assert all(res.stats.generated_tokens == 300 for res in [*first, *second])


def test_compression_count_follows_schedule(ragged, long_runs):
    """stats.compressions = the prompt's compression (when longer than the budget) + one per
    append that finds the cache full. Covers p < budget, p == budget, p > budget, and row 9 of
    RAGGED whose cache becomes full on the very last append (no compression for it)."""
    _, batch, _ = ragged
    first, second, _, _ = long_runs
    runs = [(batch, RAGGED_NEW), (first, 300), (second, 300)]
    seen = set()
    for results, m in runs:
        for res in results:
            p = res.stats.prompt_tokens
            want = _expected_compressions(p, m, BUDGET, BUFFER)
            assert res.stats.compressions == want, (p, m)
            seen.add((p > BUDGET, p == BUDGET))
    assert seen == {(False, False), (False, True), (True, False)}
    for res in batch:  # the log holds one entry per compression
        assert res.kept_positions.shape[0] == res.stats.compressions
    # The boundary case: 9 + 39 appended tokens fill the cache exactly at the end.
    assert (RAGGED_NEW - 1 - (TRIGGER - 9)) % BUFFER == 0


def test_stopped_row_stops_compressing(llama, ragged):
    """A row that hits a stop token while the others go on is done: its stats and kept log are
    those of its own generation, not of steps run after it stopped."""
    prompts, batch, alone = ragged
    gen = alone[0].token_ids
    # A token row 0 emits first after its first compression (step 16) and the others never.
    others = {t for res in batch[1:] for t in res.token_ids}
    at = next(i for i in range(16, len(gen)) if gen.index(gen[i]) == i and gen[i] not in others)
    out = rkvjax.generate(llama, prompts, stop_token_ids=[gen[at]], **RAGGED_KW)
    for r in (1, 2):  # unaffected rows: exactly as alone
        assert out[r].token_ids == alone[r].token_ids
        assert out[r].stats.compressions == alone[r].stats.compressions
        np.testing.assert_array_equal(out[r].kept_positions, alone[r].kept_positions)
    stopped = out[0]
    assert stopped.token_ids == gen[: at + 1] and stopped.finish_reason == "stop"
    count = _expected_compressions(len(prompts[0]), at + 1, BUDGET, BUFFER)
    assert 0 < count < alone[0].stats.compressions
    assert stopped.stats.compressions == count
    np.testing.assert_array_equal(stopped.kept_positions, alone[0].kept_positions[:count])
    # Its last append was token at - 1, at step `at`.
    assert stopped.stats.peak_cache_slots == min(TRIGGER, len(prompts[0]) + at)


# ---------------------------------------------------------------------------------------------
# 6. score(): teacher forcing through the same decode path.


def test_score_full_equals_logits(llama):
    """score(method="full") log-probs are log_softmax of one cache-free forward."""
    prompt = _prompt(12, 51)
    seq = prompt + np.random.RandomState(52).randint(0, VOCAB, 20).tolist()
    res = rkvjax.score(llama, seq, prompt_len=12, method="full")
    logp = jax.nn.log_softmax(np.asarray(rkvjax.logits(llama, seq))[0], axis=-1)  # [T, V]
    steps = np.arange(12, len(seq))
    np.testing.assert_allclose(res.logprobs, np.asarray(logp)[steps - 1, seq[12:]], atol=1e-4)
    np.testing.assert_array_equal(res.top1, np.argmax(logp, -1)[steps - 1])
    assert res.compressions == 0


CUT = 25  # scored tokens of RAGGED row 0: two compressions (steps 16, 24) where generating had 3
SCORE_KW = dict(method="rkv", budget=BUDGET, buffer=BUFFER)


@pytest.fixture(scope="module")
def ragged_scored(llama, ragged):
    """The RAGGED generations teacher-forced back under the same policy, row 0 cut to its first
    CUT tokens: (sequences, prompt lengths, batch ScoreResults)."""
    prompts, batch, _ = ragged
    seqs = [p + r.token_ids for p, r in zip(prompts, batch, strict=True)]
    seqs[0] = seqs[0][: len(prompts[0]) + CUT]
    lens = [len(p) for p in prompts]
    return seqs, lens, rkvjax.score(llama, seqs, prompt_len=lens, **SCORE_KW)


def test_score_replays_greedy_generation(ragged, ragged_scored):
    """Teacher-forcing the tokens greedy rkv generated, with the same budget and buffer, gives
    those tokens as argmax at every step and the same compressions."""
    _, batch, _ = ragged
    seqs, lens, scored = ragged_scored
    for r, (res, gen) in enumerate(zip(scored, batch, strict=True)):
        n = len(seqs[r]) - lens[r]
        assert len(res.top1) == n
        np.testing.assert_array_equal(res.top1, gen.token_ids[:n], err_msg=f"row {r}")
        assert np.all(np.isfinite(res.logprobs)) and np.all(res.logprobs <= 0)
        if n == len(gen.token_ids):  # the whole generation: the same cache history
            assert res.compressions == gen.stats.compressions, f"row {r}"
            assert res.peak_cache_slots == gen.stats.peak_cache_slots, f"row {r}"


def test_batched_score_equals_row_alone(llama, ragged_scored):
    """A batch scores a row as it scores alone, though the row sits in the 32 bucket in the batch
    and in the 16 bucket alone, and its continuation is shorter than the others': it stops at its
    own last token (no compressions after it)."""
    seqs, lens, scored = ragged_scored
    res, alone = scored[0], rkvjax.score(llama, seqs[0], prompt_len=lens[0], **SCORE_KW)
    np.testing.assert_allclose(res.logprobs, alone.logprobs, atol=1e-5)
    np.testing.assert_array_equal(res.top1, alone.top1)
    assert alone.compressions == _expected_compressions(lens[0], CUT, BUDGET, BUFFER) == 2
    assert (res.compressions, res.peak_cache_slots) == (
        alone.compressions,
        alone.peak_cache_slots,
    )


# ---------------------------------------------------------------------------------------------
# 7. Think-only mode.


def test_think_only_stops_compressing_after_end_token(llama, ragged):
    """With think_only, a row stops compressing once it emits the end-of-thinking token: its
    answer grows into answer_slots and is never evicted."""
    prompts, _, alone = ragged
    p, normal = prompts[0], alone[0]  # 9 tokens: compresses at decode steps 16, 24, 32
    steps = _compression_steps(len(p), RAGGED_NEW, BUDGET, BUFFER)
    assert len(steps) == normal.stats.compressions == 3
    gen = normal.token_ids
    # The first token that appears for the first time between the first and last compression.
    at = next(i for i in range(steps[0], steps[-1]) if gen.index(gen[i]) == i)
    answer_slots = 64
    think = rkvjax.generate(
        llama,
        p,
        think_only=True,
        think_end_token=gen[at],
        answer_slots=answer_slots,
        **RAGGED_KW,
    )
    assert think.stats.cache_capacity == TRIGGER + answer_slots
    # Up to the end token both runs are the same (the larger cache only adds masked slots).
    assert think.token_ids[: at + 1] == gen[: at + 1]
    done = sum(s <= at for s in steps)  # compressions while still thinking
    assert 0 < done < normal.stats.compressions
    assert think.stats.compressions == done
    np.testing.assert_array_equal(think.kept_positions, normal.kept_positions[:done])
    # The answer is not evicted: the cache grows past budget + buffer into the answer slots.
    assert think.stats.peak_cache_slots > TRIGGER


# ---------------------------------------------------------------------------------------------
# 8. Bad settings fail before anything is traced.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=8), "budget=8 must be larger than window=8"),
        (dict(budget=12, window=12), "budget=12 must be larger than window=12"),
        (dict(budget=16, buffer=0), "buffer must be an int >= 1"),
        (dict(budget=16, lam=1.5), r"lam must be in \[0, 1\]"),
        (dict(budget=16, kernel=6), "kernel must be odd"),
        (dict(budget=0.0), r"fraction in \(0, 1\]"),
        (dict(budget=1.5), r"fraction in \(0, 1\]"),
        (dict(budget="16"), "budget must be an int"),
        (dict(budget=16, think_only=True), "think_only needs a tokenizer"),
        (dict(budget=16, think_only=True, think_end_token=VOCAB), "outside the vocabulary"),
        (dict(budget=16, answer_slots=64), "answer_slots needs think_end_id"),
    ],
)
def test_bad_settings_rejected_before_tracing(llama, kwargs, match):
    """Each bad setting raises a ValueError naming it, before prefill or decode is traced."""
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", _prompt(20, 61))
    before = collections.Counter(programs.TRACES)
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(llama, prompt, max_new_tokens=16, **kwargs)
    assert before == programs.TRACES


def test_bad_score_settings_rejected_before_tracing(llama):
    """score() validates like generate(): a budget within the window."""
    seq = _prompt(30, 62)
    before = collections.Counter(programs.TRACES)
    with pytest.raises(ValueError, match="must be larger than window"):
        rkvjax.score(llama, seq, prompt_len=20, budget=8)
    assert before == programs.TRACES


@pytest.mark.parametrize("window", [8, 24])
def test_prompts_shorter_than_the_window_compress_like_the_reference(llama, window):
    """A prompt shorter than the observation window (one token, three, the window less one;
    with window 24 even the 16-token bucket is shorter) is served: its ring fills with its own
    decode queries before the first compression, so every layer-0 compression matches the
    NumPy replay, and each row is what it is alone; `score` takes such a prompt too."""
    budget = window + 8
    lengths = (1, 3, window - 1)
    prompts = [_prompt(n, seed=90 + n) for n in lengths]
    kw = dict(method="rkv", budget=budget, buffer=BUFFER, window=window, record_kept=True)
    batch = rkvjax.generate(llama, prompts, max_new_tokens=70, **kw)
    qs, ks = _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, batch, strict=True)], 96)
    for r, (p, res) in enumerate(zip(prompts, batch, strict=True)):
        events = res.stats.compressions
        assert events == _expected_compressions(len(p), 70, budget, BUFFER) >= 2
        want = _simulate_layer0(
            "rkv", qs[0][r], ks[0][r], len(p), events, budget=budget, buffer=BUFFER, window=window
        )
        np.testing.assert_array_equal(res.kept_positions[:, 0], want, err_msg=f"row {r}")
        alone = rkvjax.generate(llama, p, max_new_tokens=70, **kw)
        assert alone.token_ids == res.token_ids
        np.testing.assert_array_equal(alone.kept_positions, res.kept_positions)
    seq = prompts[1] + batch[1].token_ids
    scored = rkvjax.score(
        llama, seq, prompt_len=3, method="rkv", budget=budget, buffer=BUFFER, window=window
    )
    assert scored.compressions == batch[1].stats.compressions


# ---------------------------------------------------------------------------------------------
# 9. bfloat16.


def test_bfloat16_compressing_run(tiny_checkpoint):
    """A bfloat16 model compresses (scores are float32 whatever the key dtype)."""
    model = _load(tiny_checkpoint("llama")[0], "bfloat16")
    prompt = _prompt(14, 71)
    out = rkvjax.generate(model, prompt, **RAGGED_KW)
    assert out.stats.compressions == _expected_compressions(14, RAGGED_NEW, BUDGET, BUFFER) > 0
    kept = out.kept_positions  # [E, L, K, budget]
    assert ((kept >= 0) & (kept < 14 + RAGGED_NEW)).all()
    assert (np.diff(kept, axis=-1) > 0).all()
    q = jax.ShapeDtypeStruct((1, 4, W, 16), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 24, 16), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((1, 2, 24), jnp.bool_)
    assert jax.eval_shape(C.rkv_scores, q, k, valid).dtype == jnp.float32


def test_bfloat16_compaction_moves_entries_exactly():
    """A bfloat16 cache (stored as uint16) comes out of a compression with every kept key and
    value bit-identical to the slot it came from; rows not compressed are untouched."""
    rs = np.random.RandomState(0)
    b, k, c, h = 2, 2, 24, 16
    keys = jnp.asarray(rs.normal(size=(b, k, c, h)), jnp.bfloat16)  # [B, K, C, H]
    vals = jnp.asarray(rs.normal(size=(b, k, c, h)), jnp.bfloat16)
    cache = kv.KVCache(
        k=(as_storage(keys),),
        v=(as_storage(vals),),
        slot_pos=(jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, k, c)),),
        q_win=(jnp.asarray(rs.normal(size=(b, 4, W, h)), jnp.bfloat16),),
        acc=(),
        length=jnp.full((b,), c, jnp.int32),
        pos=jnp.full((b,), c, jnp.int32),
        prompt=jnp.zeros((b,), jnp.int32),
        seed=jnp.zeros((b,), jnp.uint32),
        dtype=jnp.bfloat16,
    )
    cc = CompressionConfig(method="rkv", budget=BUDGET, buffer=BUFFER, window=W)
    full = jnp.array([True, False])
    out, fired, _, _, _ = jax.jit(
        lambda x: compress.compress_lanes(x, full, cc, lanes=2, start=jnp.int32(0))
    )(cache)
    assert fired.tolist() == [True, False]
    assert out.k[0].dtype == jnp.uint16 and out.keys(0).dtype == jnp.bfloat16
    pos = np.asarray(out.slot_pos[0])  # [B, K, C], -1 at empty slots
    assert (pos[0] >= 0).sum(-1).tolist() == [BUDGET] * k
    got_k, got_v = np.asarray(out.keys(0), np.float32), np.asarray(out.values(0), np.float32)
    want_k, want_v = np.asarray(keys, np.float32), np.asarray(vals, np.float32)
    for row in range(b):
        for head in range(k):
            kept = pos[row, head][pos[row, head] >= 0]  # slot_pos = original slot here
            n = len(kept)
            np.testing.assert_array_equal(got_k[row, head, :n], want_k[row, head, kept])
            np.testing.assert_array_equal(got_v[row, head, :n], want_v[row, head, kept])
    np.testing.assert_array_equal(got_k[1], want_k[1])
