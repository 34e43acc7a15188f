"""Streaming and aborting: a streamed sample's deltas concatenate to its result (text, token ids,
logprobs) and never hand out a stop string; `Engine.abort` stops queued, running and waiting
samples at once and leaves every other request as it is without the abort; `reset_stats`
restarts an idle engine's counters; `TextStream` hands out only the beginning of the final
text."""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import pytest

import rkvjax
from rkvjax.kv.config import compression_config
from rkvjax.runtime import programs
from rkvjax.sampling.params import SamplingParams
from rkvjax.text.detokenize import StopWatcher, TextStream, find_stop
from tests.test_policy import _load, _prompt

# -- the default model: streaming ---------------------------------------------------------------

# Every default-model test here runs one engine configuration, so that its programs compile once
# (tens of seconds for the 30-layer model on CPU). The chat prompts (34-38 tokens) fill R-KV's
# 32 + 8 slots within a few tokens, so rows compress while they stream.
SMOL_CACHE = compression_config("rkv", 32, buffer=8)


def _smol_engine(smol) -> rkvjax.Engine:
    # One prompt per prefill and no narrowed tail: fewer program shapes to compile.
    return rkvjax.Engine(
        smol, slots=4, cache=SMOL_CACHE, logprobs=2, max_prefill_rows=1, narrow_tail=False
    )


def _greedy(m: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, **kw)


STORY = "Write a short story about a cat."
# id -> (prompt, sampling, streamed): 8 samples through 4 slots, greedy and seeded, n = 2,
# with logprobs and without.
MIX = {
    "story": (STORY, _greedy(64, logprobs=2), True),
    "sky": (
        "Why is the sky blue?",
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, n=2, max_tokens=40, logprobs=1),
        True,
    ),
    "colors": ("Name three colors.", _greedy(24), True),
    "primes": ("List two prime numbers.", _greedy(24, logprobs=2), False),
    "cat": (STORY, SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=24), False),
    "capital": ("What is the capital of France?", _greedy(40, logprobs=2), True),
}


def _by_sample(results) -> dict:
    return {(r.request_id, r.sample_index): r for r in results}


def _submit(eng: rkvjax.Engine, reqs: dict, *, stream: bool | None = None) -> None:
    """Submits {id: (prompt, sampling, streamed)}; `stream` overrides each request's own."""
    for rid, (prompt, sp, streamed) in reqs.items():
        eng.submit(prompt, sp, request_id=rid, stream=streamed if stream is None else stream)


@dataclasses.dataclass
class Drive:
    """What a run handed out, by (request id, sample index); rounds count from 0."""

    results: dict = dataclasses.field(default_factory=dict)
    deltas: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    first_delta: dict = dataclasses.field(default_factory=dict)  # the round of the first delta
    result_round: dict = dataclasses.field(default_factory=dict)


def _drive(eng: rkvjax.Engine, act=None) -> Drive:
    """Runs `eng` round by round, taking its deltas after each round as a server does;
    `act(round, drive)` runs after each round."""
    out, rnd = Drive(), 0
    while eng.has_work:
        finished = eng.step()
        for d in eng.take_deltas():
            key = (d.request_id, d.sample_index)
            out.deltas[key].append(d)
            out.first_delta.setdefault(key, rnd)
        for r in finished:
            key = (r.request_id, r.sample_index)
            assert key not in out.results
            out.results[key] = r
            out.result_round[key] = rnd
        if act is not None:
            act(rnd, out)
        rnd += 1
    return out


def _check_stream(deltas: list, result) -> None:
    """One sample's deltas against its result: they concatenate to it, and the last one, only
    it, carries it."""
    key = (result.request_id, result.sample_index)
    assert {(d.request_id, d.sample_index) for d in deltas} == {key}
    assert [d.result for d in deltas[:-1]] == [None] * (len(deltas) - 1), key
    assert deltas[-1].result is result, key
    assert all(d.token_ids for d in deltas[:-1]), key  # a delta comes with new tokens
    assert "".join(d.text for d in deltas) == result.text, key
    assert [t for d in deltas for t in d.token_ids] == result.token_ids, key
    if result.logprobs is None:
        assert all(d.logprobs is None and d.top_logprobs is None for d in deltas), key
    else:
        assert [x for d in deltas for x in d.logprobs] == result.logprobs, key
        assert [x for d in deltas for x in d.top_logprobs] == result.top_logprobs, key


def _same_result(got, want) -> None:
    key = (got.request_id, got.sample_index)
    assert got.token_ids == want.token_ids, key
    assert got.text == want.text, key
    assert got.finish_reason == want.finish_reason, key
    assert (got.logprobs is None) == (want.logprobs is None), key
    if got.logprobs is not None:
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, err_msg=str(key))


@pytest.fixture(scope="module")
def reference(smol) -> dict:
    """MIX's results from an engine of their own that streams nothing."""
    eng = _smol_engine(smol)
    _submit(eng, MIX, stream=False)
    out = _by_sample(eng.run())
    assert not eng.take_deltas()
    return out


@pytest.mark.slow
def test_streamed_deltas_concatenate_to_the_results(smol, reference):
    """Streamed and plain requests together (greedy and seeded, n = 2, logprobs or not, rows
    compressing): each streamed sample's deltas concatenate to its result's text, token ids
    and logprobs, the last delta carrying the result; plain requests hand out no deltas; every
    result is the one the request gets in a run that streams nothing; and a long sample's
    first tokens come out rounds before it finishes."""
    eng = _smol_engine(smol)
    _submit(eng, MIX)
    run = _drive(eng)
    assert run.results.keys() == reference.keys() and len(run.results) == 8
    streamed = {key for key in reference if MIX[key[0]][2]}
    assert run.deltas.keys() == streamed
    for key, res in run.results.items():
        _same_result(res, reference[key])
        if key in streamed:
            _check_stream(run.deltas[key], res)
    story = run.results["story", 0]
    assert story.finish_reason == "length" and story.stats.compressions >= 3
    assert len(run.deltas["story", 0]) >= 3
    assert run.first_delta["story", 0] < run.result_round["story", 0]
    assert run.results["sky", 0].token_ids != run.results["sky", 1].token_ids
    assert eng.stats.decoded_tokens == eng.stats.generated_tokens
    assert not eng.take_deltas()


def _stop_token(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """How many tokens end at the first stop string, from decoding every prefix."""
    return next(
        (n for n in range(1, len(ids) + 1) if find_stop(tokenizer.decode(ids[:n]), stop)),
        None,
    )


@pytest.mark.slow
def test_streamed_stop_strings_are_never_handed_out(smol, reference, monkeypatch):
    """Stop strings taken from the greedy story: a word that ends with its token, a word less
    its last letter (it ends inside a token whose text runs past it), a single character, and
    words that the first chunk ends one character short of. Streamed, each sample's deltas
    concatenate to its result, none holds any part of its stop string, and the result is the
    story cut at the stop string, as a run that streams nothing gives it."""
    tok = smol.tokenizer
    full = reference["story", 0]
    pieces = [tok.decode([t]) for t in full.token_ids]

    def first_at(lo: int, make) -> str:
        # From the first token at `lo` or later whose text gives one (make(text) -> a stop
        # string or None) that the story has not reached before that token.
        for k in range(lo, len(pieces)):
            s = make(pieces[k].strip())
            if s and find_stop(tok.decode(full.token_ids[:k]), [s]) is None:
                return s
        raise AssertionError(f"no stop string from token {lo} on in {full.text!r}")

    def word(w: str) -> str | None:
        return w if w.isalpha() and len(w) >= 4 else None

    # Tokens 13-16 and the first character of token 17, the first of the second chunk (the
    # insert makes token 0, the first chunk tokens 1-16): all of it but its last character
    # is in the first chunk's text.
    head = tok.decode(full.token_ids[:17])
    edge = tok.decode(full.token_ids[13:17]) + pieces[17][:1]
    assert find_stop(full.text, [edge]) + len(edge) == len(head) + 1
    stops = {
        "word": [first_at(24, word)],
        "inside": [first_at(36, lambda w: word(w) and w[:-1])],
        "char": [first_at(10, lambda w: w[0] if len(w) >= 2 and w[0].isalnum() else None)],
        "edge": [edge],
    }
    reqs = {rid: (STORY, _greedy(64, logprobs=2, stop=s), True) for rid, s in stops.items()}
    eng = _smol_engine(smol)
    decoders = []  # incremental decoders made: one per streamed sample, stop strings or not
    make = tok.stream
    monkeypatch.setattr(tok, "stream", lambda: decoders.append(1) or make())
    _submit(eng, {rid: r for rid, r in reqs.items() if rid != "edge"})
    assert len(decoders) == 3
    monkeypatch.undo()
    run = _drive(eng)
    # Alone in its engine, so that no row waits for a compression lane and the first chunk
    # makes 16 tokens.
    _submit(eng, {"edge": reqs["edge"]})
    edge_run = _drive(eng)
    run.results |= edge_run.results
    run.deltas |= edge_run.deltas
    plain = _smol_engine(smol)
    _submit(plain, reqs, stream=False)
    want = _by_sample(plain.run())
    for rid, stop in stops.items():
        res = run.results[rid, 0]
        n = _stop_token(tok, full.token_ids, stop)
        assert n is not None and n < len(full.token_ids), rid
        assert res.finish_reason == "stop", rid
        assert res.token_ids == full.token_ids[:n], rid
        assert res.text == full.text[: find_stop(full.text, stop)], rid
        _same_result(res, want[rid, 0])
        deltas = run.deltas[rid, 0]
        assert not any(s in d.text for d in deltas for s in stop), (rid, [d.text for d in deltas])
        _check_stream(deltas, res)
    assert len(run.deltas["word", 0]) >= 3  # it streamed for a few rounds before its stop
    assert [len(d.token_ids) for d in run.deltas["edge", 0]] == [1, 16, 1]


@pytest.mark.slow
def test_an_aborted_stream_ends_without_a_result(smol, reference):
    """A streamed request aborted mid-run hands out nothing more and has no result: its rows
    free up at once, the tokens it streamed are its greedy tokens so far, and the others run
    on as they would without it."""
    keep = ("colors", "primes", "capital")
    reqs = {"story": MIX["story"], **{rid: MIX[rid] for rid in keep}}
    eng = _smol_engine(smol)
    _submit(eng, reqs)
    at = {}

    def act(rnd, run):
        if not at and len(run.deltas["story", 0]) >= 2:
            busy = eng.busy_slots
            assert eng.abort("story") == 1
            assert eng.busy_slots == busy - 1
            at["deltas"] = len(run.deltas["story", 0])

    run = _drive(eng, act)
    assert ("story", 0) not in run.results
    story = run.deltas["story", 0]
    assert len(story) == at["deltas"]  # none after the abort
    assert all(d.result is None for d in story)
    streamed = [t for d in story for t in d.token_ids]
    assert streamed == reference["story", 0].token_ids[: len(streamed)]
    assert reference["story", 0].text.startswith("".join(d.text for d in story))
    assert run.results.keys() == {(rid, 0) for rid in keep}
    for key, res in run.results.items():
        _same_result(res, reference[key])
        if MIX[key[0]][2]:
            _check_stream(run.deltas[key], res)
    st = eng.stats
    assert st.aborted == 1
    # The aborted sample's tokens were made but are no result's.
    assert st.decoded_tokens == st.generated_tokens + len(streamed)
    assert eng.abort("story") == 0 and eng.abort("colors") == 0


# -- the default model's tokenizer: TextStream ----------------------------------------------------

# Characters of two, three and four UTF-8 bytes, which byte-level tokens split.
TEXT = "Wait, 12 × 7 = 84. Déjà vu! 你好，世界 🙂🙂 The end.\n\nDone"


@pytest.mark.slow
def test_text_stream_hands_out_the_final_text_as_it_comes(smol):
    """Pushed token by token, in threes or all at once, every prefix of a text's tokens gives
    pieces that are the beginning of its decoded text, without a partial character, and the
    rest completes it."""
    tok = smol.tokenizer
    assert not tok.cleans_up  # a BPE tokenizer: the pieces are decoded text as it is
    ids = [*tok.encode(TEXT), tok.eos_token_ids[0]]
    assert tok.decode(ids) == TEXT
    # The text does split characters between tokens.
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(len(ids)))
    for n in range(len(ids) + 1):
        head = ids[:n]
        final = tok.decode(head)
        for size in (1, 3, max(n, 1)):
            ts = TextStream(tok)
            out = "".join(ts.push(head[i : i + size]) for i in range(0, n, size))
            assert final.startswith(out), (n, size)
            assert "\ufffd" not in out, (n, size)
            # Only a character the next token completes is held back.
            assert out == final.rstrip("\ufffd"), (n, size)
            assert out + ts.rest(final) == final


@pytest.mark.slow
def test_text_stream_holds_back_what_a_stop_string_may_cut(smol):
    """Tokens pushed one by one up to the one completing a stop string (where the engine cuts
    the sample) hand out only text before the stop string, and hold back no more than its
    length less one character (and a partial character); the rest is the text cut there."""
    tok = smol.tokenizer
    ids = tok.encode(TEXT * 2)
    text = tok.decode(ids)
    stops = (["84"], ["vu!"], ["你好"], ["世界 🙂"], ["🙂"], ["\n\n"], ["×", "The end"], ["nope"])
    for stop in stops:
        cut = find_stop(text, stop)
        final = text if cut is None else text[:cut]
        end = _stop_token(tok, ids, stop) or len(ids) + 1
        hold = max(map(len, stop)) - 1
        ts, out = TextStream(tok, stop), ""
        # A streamed sample with stop strings: one decoder, the watcher's, feeds its text.
        watcher, shared = (
            StopWatcher(tok, stop, keep_text=True),
            TextStream(tok, stop, decode=False),
        )
        for n in range(1, end):
            piece = ts.push([ids[n - 1]])
            out += piece
            assert final.startswith(out), (stop, n, out)
            assert len(out) >= len(tok.decode(ids[:n]).rstrip("\ufffd")) - hold, (stop, n)
            assert watcher.push([ids[n - 1]]) is None, (stop, n)
            assert shared.push_text(watcher.text) == piece, (stop, n)
        assert out + ts.rest(final) == final
        if end <= len(ids):
            assert watcher.push([ids[end - 1]]) == end, stop


# -- a tiny random model: aborting ----------------------------------------------------------------

TINY_CACHE = compression_config("rkv", 16, buffer=8)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama")[0])


def _tiny_engine(llama) -> rkvjax.Engine:
    # Without a narrowed tail every program of a run has the full width: an abort run and a
    # run without it compile the same shapes.
    return rkvjax.Engine(llama, slots=4, cache=TINY_CACHE, max_prefill_rows=1, narrow_tail=False)


def _tiny(m: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, n=n, ignore_eos=True)


# 12 samples through 4 slots; all prompts in one length bucket.
ABORT_MIX = {
    "a": (_prompt(10, 501), _tiny(60)),
    "b": (_prompt(12, 502), _tiny(60)),  # aborted while it runs
    "c": (_prompt(9, 503), _tiny(20)),
    "d": (_prompt(11, 504), _tiny(44)),
    "wide": (_prompt(13, 505), _tiny(30, n=6)),  # aborted while its prefilled group waits
    "q": (_prompt(14, 506), _tiny(10)),  # aborted while queued
    "e": (_prompt(15, 507), _tiny(25)),  # takes a row an abort freed
}


def _submit_tiny(eng: rkvjax.Engine, reqs: dict) -> None:
    for rid, (prompt, sp) in reqs.items():
        eng.submit(prompt, sp, request_id=rid)


def _active(eng: rkvjax.Engine) -> np.ndarray:
    """Which rows of the device state still generate."""
    return np.asarray(eng.executor.state.active)


def _running(eng: rkvjax.Engine, rid) -> list:
    return [s for s in eng.scheduler.owner if s is not None and s.request.id == rid]


def test_abort_stops_queued_running_and_waiting_samples(llama):
    """Through 4 slots: a queued request, a running one and one of n = 6 whose prefilled group
    waits for rows are aborted. Each abort frees its rows at once, for the next request; the
    others get the tokens of a run without aborts; aborted requests have no results; the only
    program the run adds to those of a run without aborts is the release of rows."""
    base = _tiny_engine(llama)
    _submit_tiny(base, ABORT_MIX)
    want = _by_sample(base.run())
    assert len(want) == 12 and base.stats.aborted == 0
    assert base.stats.decoded_tokens == base.stats.generated_tokens
    traces = collections.Counter(programs.TRACES)

    eng = _tiny_engine(llama)
    _submit_tiny(eng, ABORT_MIX)
    got = {}

    def step():
        got.update(_by_sample(eng.step()))

    step()  # a, b, c and d take the four rows
    assert eng.busy_slots == 4 and {s.request.id for s in eng.scheduler.owner} == set("abcd")
    waiting = eng.scheduler.waiting(99)
    assert eng.abort("q") == 1
    assert eng.scheduler.waiting(99) == waiting - 1 and eng.busy_slots == 4

    step()
    (b,) = _running(eng, "b")
    b_row, b_made = b.row, len(b.tokens)
    assert b_made > 0
    assert eng.abort("b") == 1
    assert eng.busy_slots == 3 and eng.scheduler.owner[b_row] is None
    assert not _active(eng)[b_row]  # released on the device, before its 60 tokens

    step()  # wide takes the free rows, b's among them; the rest of its samples wait
    wide = _running(eng, "wide")
    assert b_row in [s.row for s in wide]
    head = eng.scheduler.queue[0]
    assert head.group is not None and head.samples[0].request.id == "wide"
    assert len(wide) + len(head.samples) == 6
    # The prefilled group stays on the device while samples wait on it.
    assert set(eng.executor._groups) == {head.group}
    wide_rows, wide_made = [s.row for s in wide], sum(len(s.tokens) for s in wide)
    busy = eng.busy_slots
    assert eng.abort("wide") == 6
    assert eng.busy_slots == busy - len(wide)
    assert [p.samples[0].request.id for p in eng.scheduler.queue] == ["e"]
    assert not eng.executor._groups
    assert not _active(eng)[wide_rows].any()
    free = [r for r, s in enumerate(eng.scheduler.owner) if s is None]

    step()
    (e,) = _running(eng, "e")
    assert e.row in free and e.row in wide_rows
    while eng.has_work:
        step()

    assert got.keys() == {(rid, 0) for rid in "acde"}
    for key, res in got.items():
        assert res.token_ids == want[key].token_ids, key
    st = eng.stats
    assert st.aborted == 3 and st.requests == 7
    # The aborted samples' tokens of the chunks in flight were dropped.
    assert len(b.tokens) == b_made and sum(len(s.tokens) for s in wide) == wide_made
    assert st.decoded_tokens == st.generated_tokens + b_made + wide_made
    # A stop string compiles the release of rows too.
    traced = collections.Counter(programs.TRACES) - traces
    assert traced <= collections.Counter(release=1), traced
    assert st.compiled_programs == sum(traced.values())
    # Finished, aborted or unknown ids stop nothing; an aborted id can be used again.
    assert [eng.abort(rid) for rid in ("b", "c", "q", "never")] == [0, 0, 0, 0]
    assert eng.stats.aborted == 3
    eng.submit(*ABORT_MIX["b"], request_id="b")
    (again,) = eng.run()
    assert again.token_ids == want["b", 0].token_ids


def test_abort_in_a_narrowed_tail(llama):
    """Two long rows of four slots narrow to two; aborting one frees its row of the narrow state,
    where a request submitted next runs without widening it. Both remaining requests get their
    tokens of a full-width run."""
    reqs = {
        "long0": (_prompt(10, 601), _tiny(200)),
        "long1": (_prompt(11, 602), _tiny(190)),
        "s0": (_prompt(12, 603), _tiny(8)),
        "s1": (_prompt(13, 604), _tiny(8)),
    }
    late = {"late": (_prompt(9, 605), _tiny(40))}
    base = _tiny_engine(llama)
    _submit_tiny(base, {**reqs, **late})
    want = _by_sample(base.run())
    eng = rkvjax.Engine(llama, slots=4, cache=TINY_CACHE, max_prefill_rows=1)
    _submit_tiny(eng, reqs)
    got = {}
    while eng.stats.narrowings == 0:
        got.update(_by_sample(eng.step()))
    assert eng.executor.width == 2 and eng.busy_slots == 2
    (row,) = [s.row for s in _running(eng, "long1")]
    assert eng.abort("long1") == 1 and eng.busy_slots == 1
    assert not _active(eng)[row]
    _submit_tiny(eng, late)
    got.update(_by_sample(eng.step()))
    (new,) = _running(eng, "late")
    assert new.row == row and eng.executor.width == 2
    while eng.has_work:
        got.update(_by_sample(eng.step()))
    assert got.keys() == {("long0", 0), ("s0", 0), ("s1", 0), ("late", 0)}
    for key, res in got.items():
        assert res.token_ids == want[key].token_ids, key
    assert eng.stats.widenings == 0 and eng.stats.aborted == 1


_TIMES = ("wall_s", "compile_s", "tokens_per_s", "compiled_programs")


def _counters(st) -> dict:
    return {k: v for k, v in st.to_dict().items() if k not in _TIMES}


def test_reset_stats_restarts_the_counters_of_an_idle_engine(llama):
    """reset_stats refuses while a request waits, runs, or its chunk is still to be parsed;
    on an idle engine it zeroes every counter, and the next run counts what a fresh engine
    counts for the same requests."""
    reqs = {rid: ABORT_MIX[rid] for rid in ("a", "c", "e")}
    fresh = _tiny_engine(llama)
    _submit_tiny(fresh, reqs)
    first = _by_sample(fresh.run())
    want = fresh.stats

    eng = _tiny_engine(llama)
    eng.submit(*ABORT_MIX["b"], request_id="b")
    with pytest.raises(RuntimeError, match="idle"):
        eng.reset_stats()  # queued
    eng.step()
    with pytest.raises(RuntimeError, match="idle"):
        eng.reset_stats()  # running
    assert eng.abort("b") == 1 and eng.busy_slots == 0
    assert eng.has_work  # the chunk in flight is parsed next round
    with pytest.raises(RuntimeError, match="idle"):
        eng.reset_stats()
    # One request more than the fresh run: four rows busy at once, not three.
    _submit_tiny(eng, {**reqs, "d": ABORT_MIX["d"]})
    out = _by_sample(eng.run())
    assert {k: out[k].token_ids for k in first} == {k: r.token_ids for k, r in first.items()}
    before = eng.stats
    assert before.aborted == 1 and before.requests == 5
    assert out["a", 0].stats.batch_size == 4 > first["a", 0].stats.batch_size
    assert before.decoded_tokens > before.generated_tokens > 0
    eng.reset_stats()
    zero = eng.stats
    assert {k: v for k, v in _counters(zero).items() if k not in ("slots", "lanes")} == {
        k: 0 for k in _counters(zero) if k not in ("slots", "lanes")
    }
    assert zero.wall_s == zero.compile_s == zero.tokens_per_s == 0
    assert zero.compiled_programs == before.compiled_programs  # programs stay compiled
    _submit_tiny(eng, reqs)
    t0 = time.perf_counter()
    again = _by_sample(eng.run())
    assert _counters(eng.stats) == _counters(want)
    assert 0 < eng.stats.wall_s <= time.perf_counter() - t0
    assert [r.stats.batch_size for r in again.values()] == [
        first[k].stats.batch_size for k in again
    ]


def test_warm_widths_leaves_nothing_to_compile_when_the_load_changes(llama):
    """A server's warm-up: after `warm_widths` (which compiles ahead of time and runs
    nothing), a run whose batch narrows to one row, takes a new arrival into the narrowed
    batch, then widens for a burst (every prompt in the warmed length bucket, one per prefill)
    compiles nothing more, and its tokens equal each request alone."""
    eng = rkvjax.Engine(llama, slots=4, cache=TINY_CACHE, max_prefill_rows=1)
    assert eng.warm_widths(_prompt(12, 600)) == [1, 2, 4]
    traces = collections.Counter(programs.TRACES)
    compiled = eng.executor.compile.programs  # a program traced once compiles per placement
    reqs = {"long": (_prompt(10, 601), _tiny(200))}
    _submit_tiny(eng, reqs)
    done = []
    while eng.scheduler.width == 4:
        done += eng.step()
    assert eng.scheduler.width == 1
    arrivals = [
        {"one": (_prompt(11, 602), _tiny(40))},  # into the narrowed batch: it widens to 2
        {f"burst{i}": (_prompt(9 + i, 610 + i), _tiny(30)) for i in range(3)},  # to 4
    ]
    for batch in arrivals:
        _submit_tiny(eng, batch)
        reqs.update(batch)
        done += eng.step()
    done += eng.run()
    assert eng.stats.narrowings >= 1 and eng.stats.widenings >= 2
    assert collections.Counter(programs.TRACES) == traces
    assert eng.executor.compile.programs == compiled
    alone = rkvjax.Engine(llama, slots=1, cache=TINY_CACHE, narrow_tail=False)
    _submit_tiny(alone, reqs)
    want = {k: r.token_ids for k, r in _by_sample(alone.run()).items()}
    assert {k: r.token_ids for k, r in _by_sample(done).items()} == want
    # It only compiles, never touching the live state: after a run too, and with nothing
    # left to compile.
    assert eng.warm_widths(_prompt(12, 600)) == [1, 2, 4]
    assert eng.executor.compile.programs == compiled and not eng.has_work


def test_text_stream_with_a_tokenizer_that_cleans_up_spaces(tmp_path):
    """A tokenizer whose `decode` removes spaces before punctuation (transformers' clean-up):
    streamed pieces of random token sequences, one token at a time, still add up to the
    decoded text."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from rkvjax.text.tokenizer import Tokenizer

    words = ["<unk>", "it", "'", "s", "ok", ".", "don", "t", "n't", ",", "?", "!", "m", "ve"]
    backend = Backend(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.cleans_up
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(1, len(words), size=int(rng.integers(1, 12))).tolist()
        whole = tok.decode(ids)
        stream = TextStream(tok)
        pieces = "".join(stream.push([t]) for t in ids)
        assert whole.startswith(pieces), (ids, pieces, whole)
        assert pieces + stream.rest(whole) == whole
