"""The slot runtime: continuous batching equals each request alone, per-request sampling is
batch-invariant, n samples share a prefill, compression lanes keep the reference's keep sets,
and nothing recompiles as requests come and go."""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
import pytest

import rkvjax
from rkvjax.kv.config import compression_config
from rkvjax.runtime import programs
from rkvjax.sampling.params import SamplingParams
from rkvjax.text.detokenize import StopWatcher, find_stop
from tests.reference import sampling_numpy as sref
from tests.test_policy import _full_qk, _load, _prompt, _ref_keep, _simulate_layer0

BUDGET, BUFFER = 16, 8
COMPRESSING = dict(budget=BUDGET, buffer=BUFFER)
# 12 prompts of mixed lengths (buckets 16, 32, 64; some over the budget) and lengths.
LENGTHS = (9, 30, 12, 41, 8, 17, 25, 10, 33, 14, 20, 11)
MAX_TOKENS = (21, 5, 34, 12, 40, 9, 17, 28, 3, 25, 14, 31)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama")[0])


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


def _mixed():
    prompts = [_prompt(n, seed=100 + i) for i, n in enumerate(LENGTHS)]
    return prompts, [_greedy(m) for m in MAX_TOKENS]


def _run(model, prompts, params, *, slots, method, **kw):
    """Results of an Engine run over `slots` rows, in submission order."""
    cc = compression_config(method, BUDGET if method != "full" else None, buffer=BUFFER)
    eng = rkvjax.Engine(model, slots=slots, cache=cc, max_len=128, **kw)
    eng.submit_many(prompts, params)
    out = sorted(eng.run(), key=lambda r: r.request_id)
    return out, eng.stats


@pytest.mark.parametrize("method", ["full", "rkv", "snapkv", "streaming"])
def test_continuous_batching_equals_each_request_alone(llama, method):
    """12 prompts of mixed lengths and max_tokens through 3 slots: every request gets exactly
    the tokens, compressions and peak it gets alone (one slot, nothing else running); slots are
    refilled as requests finish."""
    prompts, params = _mixed()
    # Grouped prefills (several prompts in one call) with R-KV, where prefill compresses;
    # one prompt per prefill with the others, which then share the one-slot run's programs.
    grouped = {} if method == "rkv" else {"max_prefill_rows": 1}
    got, stats = _run(llama, prompts, params, slots=3, method=method, **grouped)
    alone, one_slot = _run(llama, prompts, params, slots=1, method=method)
    # One slot never idles while requests wait: a chunk stops when its row finishes, and the
    # next request decodes from the next chunk on (the first token of each comes from prefill).
    assert one_slot.decode_steps == sum(MAX_TOKENS) - len(MAX_TOKENS)
    assert one_slot.slot_occupancy == 1.0
    for r, (a, b) in enumerate(zip(got, alone, strict=True)):
        assert a.token_ids == b.token_ids, f"request {r}"
        assert len(a.token_ids) == MAX_TOKENS[r]
        assert a.stats.compressions == b.stats.compressions, f"request {r}"
        assert a.stats.peak_cache_slots == b.stats.peak_cache_slots, f"request {r}"
    assert stats.requests == 12 and stats.prefill_rows == 12
    assert stats.prefills >= 4  # admissions into freed slots, not one batch
    assert (stats.prefills < 12) == (method == "rkv")  # grouped prefills with R-KV
    if method != "full":
        assert sum(r.stats.compressions for r in got) >= 12
    # generate() alone (its own engine and FullKV capacity) gives the same, too.
    if method in ("full", "rkv"):
        for r in (0, 3):
            one = rkvjax.generate(
                llama, prompts[r], sampling=params[r], method=method, **COMPRESSING
            )
            assert one.token_ids == got[r].token_ids


@pytest.mark.slow
def test_continuous_batching_equals_alone_on_the_default_model(smol):
    """The same on the real default model: 8 chat prompts of mixed lengths and max_tokens
    through 3 slots, R-KV with a small budget so rows compress, equal to each request run
    alone afterwards through the same engine (its other rows empty)."""
    questions = [
        "What is 12 + 7?",
        "Name three colors.",
        "Count from one to five.",
        "Why?",
        "Hi",
        "What is the capital of Italy?",
        "Write a haiku about rain.",
        "List two prime numbers.",
    ]
    params = [_greedy(m) for m in (40, 12, 33, 20, 26, 9, 37, 28)]
    # One engine, one prompt per prefill: both runs share every program (the compiles of a
    # 30-layer model are most of this test; other batch shapes are compared on tiny models).
    cc = compression_config("rkv", 24, buffer=8)
    eng = rkvjax.Engine(smol, slots=3, cache=cc, max_prefill_rows=1)
    eng.submit_many(questions, params)
    together = sorted(eng.run(), key=lambda r: r.request_id)
    for question, sp, got in zip(questions, params, together, strict=True):
        eng.submit(question, sp)
        (alone,) = eng.run()
        assert alone.token_ids == got.token_ids
        assert alone.stats.compressions == got.stats.compressions
    assert sum(r.stats.compressions for r in together) >= 8
    assert eng.stats.prefills == 2 * len(questions)


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234, max_tokens=30)


def test_seeded_sampling_is_batch_invariant(llama):
    """A seeded request samples the same tokens alone, in a batch of 8 with other settings, and
    admitted mid-run into a slot freed by another request."""
    p = _prompt(13, seed=7)
    alone = rkvjax.generate(llama, p, sampling=SAMPLED, method="rkv", **COMPRESSING)
    others = [_prompt(n, seed=20 + n) for n in (9, 22, 15, 31, 10, 18, 27)]
    other_params = [
        SamplingParams(temperature=t, top_p=q, top_k=k, min_p=mp, seed=s, max_tokens=m)
        for t, q, k, mp, s, m in zip(
            (0.0, 1.0, 0.5, 1.3, 0.7, 0.0, 0.9),
            (1.0, 0.5, 0.95, 1.0, 0.8, 1.0, 0.99),
            (0, 0, 5, 40, 0, 0, 3),
            (0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0),
            (1, 2, 3, 4, 5, 6, 7),
            (30, 12, 30, 25, 30, 8, 30),
            strict=True,
        )
    ]
    batch = rkvjax.generate(
        llama,
        [*others[:3], p, *others[3:]],
        sampling=[*other_params[:3], SAMPLED, *other_params[3:]],
        method="rkv",
        **COMPRESSING,
    )
    assert batch[3].token_ids == alone.token_ids
    # Two slots: the request waits for a short one to finish, then takes its slot.
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    eng.submit_many([others[0], others[1], p], [_greedy(40), _greedy(6), SAMPLED])
    late = {r.request_id: r for r in eng.run()}
    assert late[2].token_ids == alone.token_ids
    # The first two (9 and 22 tokens: one prefill per length bucket), then the late one.
    assert eng.stats.prefills == 3
    # Different seeds do differ (the check can fail).
    other = rkvjax.generate(llama, p, sampling=SAMPLED.replace(seed=99), **COMPRESSING)
    assert other.token_ids != alone.token_ids


def test_n_samples_share_one_prefill(llama):
    """n = 4 prefills the prompt once; greedy gives 4 identical completions, sampling 4
    different ones (each sample its own stream), each reproducible alone."""
    p = _prompt(12, seed=3)
    eng = rkvjax.Engine(llama, slots=4, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    eng.submit(p, SamplingParams(n=4, temperature=0.0, max_tokens=30, ignore_eos=True))
    outs = sorted(eng.run(), key=lambda r: r.sample_index)
    assert eng.stats.prefill_rows == 1 and eng.stats.samples == 4
    assert [r.sample_index for r in outs] == [0, 1, 2, 3]
    assert all(r.token_ids == outs[0].token_ids for r in outs)
    assert outs[0].stats.compressions >= 2
    sampled = rkvjax.generate(llama, p, sampling=SAMPLED.replace(n=4), slots=4, **COMPRESSING)
    assert len(sampled) == 4 and len({tuple(r.token_ids) for r in sampled}) == 4
    # generate() returns the n results in sample order; each sample alone in its slot is the same
    again = rkvjax.generate(llama, p, sampling=SAMPLED.replace(n=4), slots=1, **COMPRESSING)
    assert [r.token_ids for r in again] == [r.token_ids for r in sampled]


def test_prompts_admitted_together_prefill_per_length_bucket(llama):
    """Prompts admitted at once share a prefill per length bucket (9 and 12 tokens pad to 16,
    22 and 30 to 32), or share one padded to the longest; the tokens are the same either way,
    and a request whose second sample finds no slot keeps its prefill until one frees up."""
    prompts = [_prompt(n, seed=n) for n in (9, 22, 12, 30)]
    params = [_greedy(m) for m in (6, 20, 9, 20)]
    params[3] = params[3].replace(n=2)
    runs = {}
    for by_length in (True, False):
        eng = rkvjax.Engine(
            llama,
            slots=4,
            cache=compression_config("rkv", BUDGET, buffer=BUFFER),
            prefill_by_length=by_length,
        )
        eng.submit_many(prompts, params)
        runs[by_length] = sorted((r.request_id, r.sample_index, r.token_ids) for r in eng.run())
        assert eng.stats.prefill_rows == 4  # the waiting sample reused its request's prefill
        assert eng.stats.prefills == (2 if by_length else 1)
    assert runs[True] == runs[False]
    assert runs[True][3][2] == runs[True][4][2]  # request 3's two greedy samples


def test_no_recompilation_across_admissions_and_compressions(llama):
    """Admissions into freed slots, compressions, and requests with other settings reuse the
    compiled programs: one trace each of init, prefill, insert and decode for the whole run."""
    cc = compression_config("rkv", BUDGET, buffer=BUFFER, lam=0.3)  # a plan of its own
    eng = rkvjax.Engine(llama, slots=2, cache=cc, max_prefill_rows=1)
    prompts = [_prompt(n, seed=200 + n) for n in (10, 12, 9, 15, 11, 13)]
    settings = [(0.0, 1.0, 30), (0.9, 0.9, 12), (0.5, 1.0, 40), (0.0, 1.0, 20), (1.0, 0.7, 25)]
    params = [
        SamplingParams(temperature=t, top_p=q, seed=i, max_tokens=m, ignore_eos=True)
        for i, (t, q, m) in enumerate([*settings, (0.0, 1.0, 33)])
    ]
    before = collections.Counter(programs.TRACES)
    eng.submit_many(prompts, params)
    out = eng.run()
    traced = collections.Counter(programs.TRACES) - before
    assert eng.stats.prefills == 6 >= 3
    assert sum(r.stats.compressions for r in out) >= 10
    assert traced == collections.Counter(init_state=1, prefill=1, insert=1, decode=1)


def test_stalled_rows_keep_the_reference_keep_sets(llama):
    """Four rows of one length fill up on the same step; with one lane, three wait. Every
    compression still keeps exactly what the NumPy reference keeps (layer 0 replayed through
    every compression, every layer at the first) and the rows decode exactly as alone."""
    prompts = [_prompt(11, seed=300 + i) for i in range(4)]
    params = [_greedy(60)] * 4
    got, stats = _run(llama, prompts, params, slots=4, method="rkv", lanes=1, record_kept=True)
    alone, _ = _run(llama, prompts, params, slots=1, method="rkv", record_kept=True)
    assert stats.stalled_row_steps > 0 and stats.lanes == 1
    assert max(r.stats.stalled_steps for r in got) >= 3
    qs, ks = _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, got, strict=True)], 80)
    for r, (res, ref) in enumerate(zip(got, alone, strict=True)):
        assert res.token_ids == ref.token_ids, f"row {r}"
        events = res.stats.compressions
        assert events >= 5
        np.testing.assert_array_equal(res.kept_positions, ref.kept_positions)
        want = _simulate_layer0("rkv", qs[0][r], ks[0][r], 11, events, budget=BUDGET, buffer=BUFFER)
        np.testing.assert_array_equal(res.kept_positions[:, 0], want, err_msg=f"row {r}")
        held = [list(range(BUDGET + BUFFER))] * ks[0].shape[2]
        for layer in range(len(ks)):
            first = _ref_keep("rkv", qs[layer][r], ks[layer][r], held, budget=BUDGET)
            np.testing.assert_array_equal(res.kept_positions[0, layer], first)


def test_logprobs_match_score(llama):
    """logprobs=N: each generated token's log-probability is what `score` gives the same
    tokens under the same cache policy, and the top N are the most likely, in order."""
    p = _prompt(14, seed=9)
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=40, logprobs=3, ignore_eos=True)
    out = rkvjax.generate(llama, p, sampling=sp, method="rkv", **COMPRESSING)
    assert out.stats.compressions >= 2
    scored = rkvjax.score(llama, p + out.token_ids, prompt_len=len(p), method="rkv", **COMPRESSING)
    np.testing.assert_allclose(out.logprobs, scored.logprobs, atol=1e-5)
    for chosen, top in zip(out.logprobs, out.top_logprobs, strict=True):
        lps = [lp for _, lp in top]
        assert len(top) == 3 and lps == sorted(lps, reverse=True) and chosen <= lps[0] + 1e-6
    first = jax.nn.log_softmax(np.asarray(rkvjax.logits(llama, p))[0, -1])
    np.testing.assert_allclose(
        [lp for _, lp in out.top_logprobs[0]], np.sort(np.asarray(first))[::-1][:3], atol=1e-5
    )


def test_penalties_and_min_tokens_follow_the_reference(llama):
    """Greedy decoding under repetition / presence / frequency penalties and min_tokens equals a
    loop that applies the NumPy reference of vLLM's definitions to full-forward logits: the
    engine's per-slot counts and prompt masks are right."""
    p = _prompt(10, seed=11)
    eos = 7  # a stop token the penalised greedy run would otherwise emit early
    sp = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.4,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        max_tokens=24,
        min_tokens=20,
        stop_token_ids=[eos],
        ignore_eos=True,
    )
    out = rkvjax.generate(llama, p, sampling=sp, method="full")
    vocab = llama.config.vocab_size
    seq, want = list(p), []
    prompt_mask = np.zeros((1, vocab), bool)
    prompt_mask[0, p] = True
    for _ in range(sp.max_tokens):
        row = np.asarray(rkvjax.logits(llama, seq + [0] * (64 - len(seq))))[0, len(seq) - 1]
        counts = np.bincount(want, minlength=vocab)[None]
        x = sref.apply_penalties(row[None], counts, prompt_mask, [1.4], [0.5], [0.3])
        if len(want) < sp.min_tokens:
            x[0, eos] = -np.inf
        tok = int(np.argmax(x[0]))
        want.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    assert out.token_ids == want
    plain = rkvjax.generate(llama, p, sampling=_greedy(24), method="full")
    assert plain.token_ids != want  # the penalties changed something


def test_engine_streams_results_as_they_finish(llama):
    """Results come out in the order requests finish, and a request submitted while iterating
    is picked up."""
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    eng.submit(_prompt(10, 1), _greedy(80), request_id="long")
    eng.submit(_prompt(12, 2), _greedy(5), request_id="short")
    order = []
    for res in eng.results():
        order.append(res.request_id)
        if res.request_id == "short":
            eng.submit(_prompt(9, 3), _greedy(8), request_id="late")
    assert order == ["short", "late", "long"]
    assert eng.stats.samples == 3 and eng.stats.generated_tokens == 93


def _rounds(eng: rkvjax.Engine, events) -> dict:
    """Runs `eng` round by round as `results()` does; after a round in which events[0]'s
    condition first holds, runs its action (a submission between rounds, as a server makes
    them), then waits for the next event's. -> {request id: result}."""
    got, events = {}, list(events)
    while eng.has_work:
        got |= {res.request_id: res for res in eng.step()}
        if events and events[0][0](got):
            events.pop(0)[1]()
    assert not events, "an event's condition never held"
    return got


def _as_alone(llama, cc, got: dict, reqs: dict) -> None:
    for rid, (prompt, sp) in reqs.items():
        alone = rkvjax.Engine(llama, slots=1, cache=cc)
        alone.submit(prompt, sp, request_id=rid)
        (want,) = alone.run()
        assert got[rid].token_ids == want.token_ids, rid
        assert got[rid].stats.compressions == want.stats.compressions, rid


def test_tail_narrows_and_widens_with_each_request_as_alone(llama):
    """With nothing waiting, the batch halves as rows finish (4 -> 2 -> 1 rows: the long row
    then decodes and compresses alone); a request submitted then widens it as far as it needs
    (1 -> 2 rows, not back to the 4 slots). Another, submitted when that one ends (as a
    server would), refills its row before the state narrows; when it ends, the state narrows
    again. Every request, greedy or seeded, gets the tokens and compressions it gets alone,
    and the device decodes fewer rows than slots x steps."""
    cc = compression_config("rkv", BUDGET, buffer=BUFFER)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    reqs = {
        "a": (_prompt(9, 401), _greedy(8)),
        "b": (_prompt(14, 402), seeded),
        "c": (_prompt(11, 403), _greedy(12)),
        "long": (_prompt(10, 404), _greedy(250)),
    }
    late = {
        "late": (_prompt(13, 405), SamplingParams(temperature=0.7, seed=9, max_tokens=20)),
        "later": (_prompt(12, 406), _greedy(20)),
    }
    eng = rkvjax.Engine(llama, slots=4, cache=cc)
    for rid, (prompt, sp) in reqs.items():
        eng.submit(prompt, sp, request_id=rid)

    def submit(rid):
        eng.submit(*late[rid], request_id=rid)

    got = _rounds(
        eng,
        [
            (lambda got: eng.stats.narrowings == 2, lambda: submit("late")),
            (lambda got: "late" in got, lambda: submit("later")),
        ],
    )
    stats = eng.stats
    assert (stats.narrowings, stats.widenings) == (3, 1)
    assert stats.decoded_row_steps < stats.slots * stats.decode_steps
    assert stats.decoded_row_steps >= stats.slot_occupancy * stats.slots * stats.decode_steps
    _as_alone(llama, cc, got, {**reqs, **late})
    assert got["long"].stats.compressions > 5  # it compressed in the narrow batch too
    wide = rkvjax.Engine(llama, slots=4, cache=cc, narrow_tail=False)
    for rid, (prompt, sp) in reqs.items():
        wide.submit(prompt, sp, request_id=rid)
    assert {r.request_id: r.token_ids for r in wide.run()} == {
        rid: got[rid].token_ids for rid in reqs
    }
    assert wide.stats.narrowings == 0
    assert wide.stats.decoded_row_steps == 4 * wide.stats.decode_steps


def test_tail_admits_late_requests_into_its_free_rows(llama):
    """A narrowed state with a free row takes a late request there instead of widening: four
    rows of eight slots narrow to four, and one ends; a request submitted then runs in its
    row. Three requests submitted when that one ends are more than the free row: the state
    widens for them, and narrows again when they end. Each request gets its tokens alone."""
    cc = compression_config("rkv", BUDGET, buffer=BUFFER)
    reqs = {f"long{i}": (_prompt(9 + i, 410 + i), _greedy(260 + 4 * i)) for i in range(3)}
    reqs |= {f"short{i}": (_prompt(10 + i, 420 + i), _greedy(8)) for i in range(4)}
    reqs["mid"] = (_prompt(15, 425), _greedy(40))
    late = {"late": (_prompt(12, 430), SamplingParams(temperature=0.7, seed=3, max_tokens=20))}
    burst = {f"burst{i}": (_prompt(9 + 2 * i, 440 + i), _greedy(8)) for i in range(3)}
    eng = rkvjax.Engine(llama, slots=8, cache=cc)
    for rid, (prompt, sp) in reqs.items():
        eng.submit(prompt, sp, request_id=rid)

    def submit(named):
        for rid, (prompt, sp) in named.items():
            eng.submit(prompt, sp, request_id=rid)

    def counts(narrowings, widenings, busy):
        st = eng.stats
        assert (st.narrowings, st.widenings, eng.busy_slots) == (narrowings, widenings, busy)
        return True

    got = _rounds(
        eng,
        [
            (lambda got: "mid" in got and counts(1, 0, 3), lambda: submit(late)),
            (lambda got: "late" in got and counts(1, 0, 3), lambda: submit(burst)),
        ],
    )
    assert (eng.stats.narrowings, eng.stats.widenings) == (2, 1)
    _as_alone(llama, cc, got, {**late, **burst, "long2": reqs["long2"]})


def test_engine_rejects_what_it_cannot_run(llama):
    """Bad requests fail at submit with a line naming the request, before anything runs."""
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    before = collections.Counter(programs.TRACES)
    cases = [
        (dict(prompt=_prompt(12, 0), sampling=SamplingParams(logprobs=2)), "logprobs=2"),
        (dict(prompt=_prompt(12, 0), sampling=SamplingParams(presence_penalty=1.0)), "penalties"),
        (dict(prompt=_prompt(12, 0), sampling=SamplingParams(stop_token_ids=[500])), "vocabulary"),
        (dict(prompt=_prompt(12, 0), sampling=SamplingParams(max_tokens=600)), "positions"),
        (dict(prompt="text"), "no tokenizer"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.submit(**kw, request_id="bad")
    with pytest.raises(ValueError, match="max_len"):
        rkvjax.Engine(llama, slots=2)
    with pytest.raises(ValueError, match="need 139 FullKV cache slots"):
        rkvjax.Engine(llama, slots=2, max_len=64).submit(_prompt(12, 0), _greedy(128))
    with pytest.raises(ValueError, match="either as sampling"):
        rkvjax.generate(llama, _prompt(12, 0), sampling=_greedy(4), temperature=0.5)
    assert collections.Counter(programs.TRACES) == before


@pytest.mark.slow
@pytest.mark.parametrize("keep_text", [False, True], ids=["skipping", "decoding"])
def test_stop_watcher_finds_what_a_full_decode_finds(smol, keep_text, monkeypatch):
    """Pushed in chunks of 1, 5 and 16 tokens, a watcher finds a stop string at the same token
    as decoding the whole output again after every token would (the quadratic way it replaces):
    stop strings of one and several characters, across tokens, after a space, multi-byte ones
    and ones behind special tokens (no text of their own). Without `keep_text` it decodes only
    around the tokens that can complete a stop string."""
    tok = smol.tokenizer
    text = "Wait, 12 × 7 = 84. Let me double-check: 12 × 7 is 84, so the answer is 84. Déjà vu! 🙂 "
    eos = tok.eos_token_ids[0]
    ids = tok.encode(text * 3)
    ids = ids[:40] + [eos] * 3 + ids[40:]  # special tokens within the text
    decodes = []
    real = type(tok).decode_raw
    monkeypatch.setattr(type(tok), "decode_raw", lambda t, x: decodes.append(x) or real(t, x))
    stops = (["84"], ["answer is"], ["vu!"], ["🙂"], ["not there"], ["×", "check"], [" so the"],
             ["double"], ["?!", "Wait, 12"], ["é"], [". L"])  # fmt: skip
    for stop in stops:
        brute = next(
            (n for n in range(1, len(ids) + 1) if find_stop(tok.decode(ids[:n]), stop) is not None),
            None,
        )
        for chunk in (1, 5, 16):
            watcher = StopWatcher(tok, stop, keep_text=keep_text)
            found = None
            for i in range(0, len(ids), chunk):
                found = watcher.push(np.asarray(ids[i : i + chunk]))
                if found is not None:
                    break
            assert found == brute, (stop, chunk)
    if not keep_text:
        pushed_tokens = sum(len(ids) for _ in stops) * 3
        assert sum(map(len, decodes)) < pushed_tokens, "decodes everything, and more"
        never = StopWatcher(tok, ["\u2603 never \u2603"])
        decodes.clear()
        assert never.push(np.asarray(ids)) is None and not decodes  # no token can end it


@pytest.mark.slow
def test_stop_strings_end_requests_early(smol):
    """A stop string ends its request at the token that completes it (text cut before it), while
    the other requests run on; its stats are those of a request that stopped at that token
    (the row decodes and compresses a little longer on device before the host stops it)."""
    q = "What is the capital of France?"
    # The engine of the default-model test above (its programs are compiled already).
    cc = compression_config("rkv", 24, buffer=8)

    def run(params):
        eng = rkvjax.Engine(smol, slots=3, cache=cc, max_prefill_rows=1)
        eng.submit_many([q] * len(params), params)
        return sorted(eng.run(), key=lambda r: r.request_id)

    full = run([_greedy(30), _greedy(30)])
    word = "Paris"
    assert word in full[0].text
    stopped = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[word])
    out = run([stopped, _greedy(30)])
    assert out[0].text == full[0].text[: full[0].text.index(word)]
    assert out[0].finish_reason == "stop"
    n = len(out[0].token_ids)
    assert out[0].token_ids == full[0].token_ids[:n]
    assert word in smol.tokenizer.decode(out[0].token_ids)
    assert word not in smol.tokenizer.decode(out[0].token_ids[:-1])
    assert out[1].token_ids == full[1].token_ids
    (short,) = run([_greedy(n)])
    assert short.token_ids == out[0].token_ids
    # The row ran on for the rest of its chunk and compressed again at 8 tokens; those
    # compressions, and the slots it filled meanwhile, are not the sample's.
    assert n < 8 and out[0].stats.compressions == short.stats.compressions == 1
    assert out[0].stats.peak_cache_slots == short.stats.peak_cache_slots < cc.budget + cc.buffer
    # Row 1 waits a step for the one compression lane when both rows fill together (at 8
    # tokens): run in row 1, the cut sample is past its end by then, and that wait is not its.
    swapped = run([_greedy(30), stopped])
    assert swapped[1].token_ids == out[0].token_ids
    assert (full[1].stats.stalled_steps, swapped[1].stats.stalled_steps) == (1, 0)
    assert swapped[1].stats.peak_cache_slots == short.stats.peak_cache_slots


def test_score_and_stop_ids_with_several_eos_ids(llama):
    """A model with several end-of-sequence ids: generation stops at the first of any of them,
    and `score` (which never stops) takes continuations that contain them."""
    import dataclasses
    import types

    p = _prompt(12, seed=41)
    free = rkvjax.generate(llama, p, sampling=_greedy(40))
    first = free.token_ids[5]
    never = next(t for t in range(llama.config.vocab_size) if t not in free.token_ids)
    tok = types.SimpleNamespace(
        eos_token_ids=(never, first), has_chat_template=False, decode=lambda ids: ""
    )
    model = dataclasses.replace(llama, tokenizer=tok)
    out = rkvjax.generate(model, p, max_new_tokens=40)
    assert out.token_ids == free.token_ids[: free.token_ids.index(first) + 1]
    assert out.finish_reason == "stop"
    seq = [*p, first, never, 5, first]
    scored = rkvjax.score(model, seq, prompt_len=len(p), method="full")
    want = rkvjax.score(llama, seq, prompt_len=len(p), method="full")
    np.testing.assert_allclose(scored.logprobs, want.logprobs, atol=1e-6)
    assert len(scored.logprobs) == 4


def test_logprobs_follow_each_requests_count(llama):
    """Requests asking for different numbers of alternatives each get their own count."""
    p = _prompt(12, seed=42)
    asks = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=n) for n in (0, 1, 4)]
    outs = rkvjax.generate(llama, [p, p, p], sampling=[*asks])
    plain = rkvjax.generate(llama, p, sampling=_greedy(6))
    assert plain.logprobs is None and plain.top_logprobs is None
    for n, res in zip((0, 1, 4), outs, strict=True):
        assert len(res.top_logprobs) == 6 and {len(t) for t in res.top_logprobs} == {n}
        assert res.logprobs == outs[2].logprobs


def test_engine_request_ids_and_prompt_lists(llama):
    """Default ids never collide with ids given explicitly; one prompt (even a str-like list of
    ids) is one request; a continuation needs a scoring engine."""
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    assert eng.submit(_prompt(10, 1), _greedy(3), request_id=0) == 0
    auto = eng.submit(_prompt(10, 2), _greedy(3))
    assert auto != 0
    pair = eng.submit_many([_prompt(10, 3), _prompt(10, 4)], _greedy(3), ids=[None, 5])
    assert pair[1] == 5 and pair[0] not in (0, auto, 5)
    (single,) = eng.submit_many(_prompt(11, 5), _greedy(3))  # one prompt of token ids
    assert single not in (0, auto, *pair)
    with pytest.raises(ValueError, match="already queued or running"):
        eng.submit(_prompt(10, 6), request_id=5)
    with pytest.raises(ValueError, match="continuation needs a scoring engine"):
        eng.submit(_prompt(10, 7), continuation=[1, 2])
    got = {r.request_id for r in eng.run()}
    assert got == {0, auto, *pair, single}
    eng.submit(_prompt(10, 8), _greedy(2), request_id=5)  # finished ids can be used again
    assert [r.request_id for r in eng.run()] == [5]


class _CountingIds(dict):
    """The engine's live requests, counting the ids any pass over them visits."""

    visited = 0

    def __iter__(self):
        for k in super().__iter__():
            _CountingIds.visited += 1
            yield k

    def keys(self):
        return list(iter(self))


def test_admission_does_not_grow_with_the_queue(llama):
    """A `submit` visits none of the queued requests' ids (it tests membership): with 4,096
    requests queued it does what it does with 16. Counted, not timed."""
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    eng._live = _CountingIds(eng._live)
    prompt = _prompt(10, 1)
    visits = {}
    for queued in range(4097):
        if queued in (16, 4096):
            before = _CountingIds.visited
            eng.submit(prompt, _greedy(2))
            visits[queued] = _CountingIds.visited - before
        else:
            eng.submit(prompt, _greedy(2))
    assert visits == {16: 0, 4096: 0}, visits
    assert len(eng.scheduler.queue) == 4097


# -- the executor: transfers, compile time, profiles ------------------------------------------


def test_a_workload_runs_with_only_the_executors_transfers(llama):
    """Continuous batching (5 requests through 2 rows, R-KV compressing, n = 2, a row refilled
    after each finishes) under `jax.transfer_guard("disallow")`: every host-to-device transfer
    is one of the executor's explicit ones, one per insert (its prefill's prompts included),
    and the tokens are those of a run without the guard."""
    cc = compression_config("rkv", BUDGET, buffer=BUFFER)
    prompts = [_prompt(n, seed=300 + i) for i, n in enumerate((9, 30, 12, 20, 11))]
    params = [_greedy(m) for m in (21, 5, 14, 9, 12)]
    params[2] = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=10, ignore_eos=True)

    def run(guard: str):
        eng = rkvjax.Engine(llama, slots=2, cache=cc)
        calls = collections.Counter()
        for name in ("insert", "dispatch"):
            real = getattr(eng.executor, name)
            setattr(eng.executor, name, _counted(real, name, calls))
        eng.submit_many(prompts, params)
        with jax.transfer_guard(guard):
            out = sorted(eng.run(), key=lambda r: (r.request_id, r.sample_index))
        return [r.token_ids for r in out], eng, calls

    want, _, _ = run("allow")
    got, eng, calls = run("disallow")
    assert got == want
    t = eng.executor.transfers
    assert calls["insert"] >= 5 and t["insert"] == calls["insert"]  # one per insert
    # Each early-stop count moves once and stays on the device; at 2 slots the scheduler asks
    # for two values (1 with samples waiting, 3 with none), and chunks outnumber them.
    assert calls["dispatch"] > 2 and 1 <= t["chunk"] <= 2
    assert set(t) <= {"insert", "chunk", "release", "resize"}


def test_on_one_device_inserts_and_chunks_move_one_buffer_per_dtype(llama):
    """What an insert sends (its rows' settings and its prefill's prompts) and what an insert
    or a chunk returns are packed (`runtime.packing`): a handful of buffers each way where
    the trees hold about twenty arrays, and the same tokens as each request alone."""
    from rkvjax.runtime import packing

    cc = compression_config("rkv", BUDGET, buffer=BUFFER)
    prompts = [_prompt(n, seed=310 + i) for i, n in enumerate((9, 30, 12))]
    params = [_greedy(m) for m in (12, 5, 9)]
    eng = rkvjax.Engine(llama, slots=2, cache=cc)
    sent, returned = [], []
    put, fetch = eng.executor.put, eng.executor.fetch

    def counted_put(tree, where, kind):
        if kind == "insert":
            sent.append((tree, jax.tree.leaves(tree)))
        return put(tree, where, kind)

    def counted_fetch(tree):
        returned.append(tree)
        return fetch(tree)

    eng.executor.put, eng.executor.fetch = counted_put, counted_fetch
    ids = eng.submit_many(prompts, params)
    got = {r.request_id: r for r in eng.run()}
    assert len(sent) >= 3 and len(returned) >= 5
    for tree, leaves in sent:
        assert all(isinstance(part, packing.Packed) for part in tree.values())
        assert len(leaves) <= 3 * len(tree)  # int32, float32, uint32 at most per part
    for tree in returned:
        packs = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, packing.Packed))
                 if isinstance(x, packing.Packed)]  # fmt: skip
        assert len(packs) == 1 and len(jax.tree.leaves(packs[0])) <= 3
        assert len(packs[0].layout.leaves) == len(dataclasses.fields(programs.Tokens))
    for prompt, sp, rid in zip(prompts, params, ids, strict=True):
        alone = rkvjax.Engine(llama, slots=1, cache=cc)
        alone.submit(prompt, sp)
        assert alone.run()[0].token_ids == got[rid].token_ids


def _counted(fn, name: str, calls: collections.Counter):
    def counted(*args):
        calls[name] += 1
        return fn(*args)

    return counted


def test_two_engines_in_one_process_count_their_own_compilation(llama):
    """Two engines taking turns round by round in one thread each report the programs and
    compile time of their own calls: the programs each compiles alone, and together the whole
    of the process's compilation, none of it twice (before, each counted the process's)."""
    prompts = [_prompt(n, seed=400 + i) for i, n in enumerate((9, 21, 13))]

    def engines():
        a = rkvjax.Engine(llama, slots=3, cache=compression_config("rkv", 13, buffer=7))
        b = rkvjax.Engine(llama, slots=5, cache=None, max_len=77)
        for eng in (a, b):
            eng.submit_many(prompts, [_greedy(6), _greedy(9), _greedy(4)])
        return a, b

    alone = {}
    for i in range(2):
        jax.clear_caches()  # each measurement compiles from nothing
        eng = engines()[i]
        eng.run()
        alone[i] = eng.stats.compiled_programs
    jax.clear_caches()
    a, b = engines()
    c0 = programs.compile_seconds()
    while a.has_work or b.has_work:  # taking turns
        for eng in (a, b):
            if eng.has_work:
                eng.step()
    total = programs.compile_seconds() - c0
    assert (a.stats.compiled_programs, b.stats.compiled_programs) == (alone[0], alone[1])
    assert min(alone.values()) > 0
    assert a.stats.compile_s + b.stats.compile_s == pytest.approx(total, rel=1e-6)
    assert 0 < a.stats.compile_s < total and 0 < b.stats.compile_s < total


def test_a_decode_step_profiles_by_block(llama):
    """The decode chunk's operations carry the names of the blocks they come from, so a
    profile separates attention, the MLP, compression, the cache append and sampling."""
    eng = rkvjax.Engine(llama, slots=2, cache=compression_config("rkv", BUDGET, buffer=BUFFER))
    lowered = programs.decode.lower(
        llama.decoder, eng.state_shapes(), steps=eng.chunk, plan=eng.plan
    )
    text = lowered.as_text(debug_info=True)
    for scope in ("attention", "mlp", "compress", "cache_append", "sample"):
        assert f"{scope}/" in text, scope


def test_programs_follow_the_engines_devices_not_the_process(llama, monkeypatch):
    """What compression and sampling compile to is decided from the engine's devices when it is
    built and carried in its plan, not read from the process while tracing: with the process
    claiming a TPU with no memory (where auto puts compression on its Pallas kernels), a CPU
    engine's programs still trace the CPU's jnp path and give its tokens."""
    from rkvjax.kv import kernels
    from rkvjax.kv.kernels import tuning

    cc = compression_config("rkv", BUDGET, buffer=BUFFER)
    prompts = [_prompt(n, seed=500 + i) for i, n in enumerate((40, 13))]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=20) for i in range(2)]

    def tokens():
        eng = rkvjax.Engine(llama, slots=2, chunk=5, cache=cc)  # chunk 5: programs of its own
        eng.submit_many(prompts, params)
        target = eng.plan.compression.target
        return [r.token_ids for r in sorted(eng.run(), key=lambda r: r.request_id)], target

    want, target = tokens()
    assert target == tuning.Target("cpu", tuning.dense_limit_bytes(llama.device))
    assert rkvjax.Engine(llama, slots=2, cache=cc).plan.sampler.row_blocks is True
    jax.clear_caches()  # every program traces again, under the process's claim
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(tuning, "DENSE_FALLBACK_BYTES", 0)
    assert tuning.backend() == "tpu"

    def kernel(*args, **kw):
        raise AssertionError("compression traced for the process's backend, not the engine's")

    monkeypatch.setattr(kernels, "redundancy_pallas", kernel)
    got, _ = tokens()
    assert got == want
