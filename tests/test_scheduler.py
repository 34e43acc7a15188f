"""The scheduler alone: admission by prompt-length bucket, a prompt's samples sharing its prefill,
placement over data shards, early chunk ends, freeing, aborting, narrowing and widening, driven
with fake requests and fake outcomes. No model, no device: the scheduler imports no JAX, which the
first test proves by running this file in a process where importing JAX fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rkvjax.runtime.requests import Request
from rkvjax.runtime.samples import Sample
from rkvjax.runtime.scheduler import NARROW_MIN_CHUNKS, Scheduler, SchedulerConfig
from rkvjax.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
_NO_JAX = "RKVJAX_TEST_NO_JAX"


@pytest.mark.skipif(os.environ.get(_NO_JAX) == "1", reason="this is the run without JAX")
def test_the_scheduler_runs_without_jax():
    """Every other test of this file, in a process where `import jax` raises (and without the
    suite's conftest, which imports it)."""
    code = (
        "import sys; sys.modules['jax'] = None; import pytest; "
        "sys.exit(pytest.main(['-q', '--noconftest', '-p', 'no:cacheprovider', "
        f"'-p', 'no:xdist', {str(Path(__file__))!r}]))"
    )
    env = {**os.environ, _NO_JAX: "1"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def _request(rid, prompt_len: int, max_tokens: int = 64, n: int = 1) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    return Request(rid, tuple(range(1, prompt_len + 1)), sp)


def _add(s: Scheduler, rid, prompt_len: int, max_tokens: int = 64, n: int = 1) -> list[Sample]:
    r = _request(rid, prompt_len, max_tokens, n)
    samples = [Sample(r, j, 0.0, 0.0, None) for j in range(n)]
    s.add(samples)
    return samples


def _scheduler(slots=4, data=1, **kw) -> Scheduler:
    kw.setdefault("max_prefill_rows", slots)
    return Scheduler(SchedulerConfig(slots=slots, data_shards=data, max_positions=512, **kw))


def _ids(insert) -> list:
    return [s.request.id for s in insert.samples]


def _finish(s: Scheduler, sample: Sample, tokens: int | None = None, running=False) -> None:
    """A fake outcome: the sample made `tokens` tokens (default all) and finished."""
    sample.tokens = [0] * (sample.request.max_tokens if tokens is None else tokens)
    sample.reason = "length"
    s.free(sample, running=running)


def test_admission_groups_prompts_by_length_bucket():
    s = _scheduler(slots=4)
    _add(s, "a", 10)
    _add(s, "b", 40)
    _add(s, "c", 12)
    plan = s.admit()
    assert plan.widen is None
    assert [(_ids(i), i.prefill.rows, len(i.prefill.prompts)) for i in plan.inserts] == [
        (["a", "c"], 2, 2),  # bucket 16, a power of two rows
        (["b"], 1, 1),  # bucket 64
    ]
    assert [i.dst for i in plan.inserts] == [(0, 1), (2,)]
    assert all(i.last_use and i.width == 4 for i in plan.inserts)
    assert s.busy == 3 and [x.row for x in plan.inserts[0].samples] == [0, 1]
    assert s.admit() is None  # nothing waits


def test_one_group_when_not_by_length_and_the_prefill_cap():
    s = _scheduler(slots=4, prefill_by_length=False, max_prefill_rows=2)
    for rid, n in (("a", 10), ("b", 40), ("c", 12)):
        _add(s, rid, n)
    plan = s.admit()
    # Two prompts per prefill at most, one group whatever their lengths.
    assert [_ids(i) for i in plan.inserts] == [["a", "b"], ["c"]]
    assert plan.inserts[0].prefill.prompts == (
        tuple(range(1, 11)),
        tuple(range(1, 41)),
    )


def test_samples_of_a_request_share_its_prefill():
    """n = 3 with 2 free rows: two samples go in with the prefill, the third waits with the
    group kept (no second prefill) and goes in once a row frees up."""
    s = _scheduler(slots=2)
    samples = _add(s, "a", 10, n=3)
    first = s.admit().inserts
    assert len(first) == 1 and first[0].prefill is not None and not first[0].last_use
    assert [x.index for x in first[0].samples] == [0, 1] and first[0].src == (0, 0)
    assert s.admit() is None  # no free row
    _finish(s, samples[0])
    (again,) = s.admit().inserts
    assert again.prefill is None and again.group == first[0].group and again.last_use
    assert [x.index for x in again.samples] == [2] and again.dst == (0,)
    assert not s.queue


def test_insert_pads_to_a_row_bucket():
    s = _scheduler(slots=8)
    for i in range(3):
        _add(s, i, 10)
    (ins,) = s.admit().inserts
    assert ins.rows == 4 and ins.dst == (0, 1, 2, 8) and ins.src == (0, 1, 2, 0)


def test_placement_spreads_long_rows_over_data_shards():
    """The longest sample goes first, each to the shard with the fewest rows that may outlive
    it: 100 and 90 tokens land in different shards, so the tail can narrow."""
    s = _scheduler(slots=4, data=2)
    for rid, m in (("short", 8), ("long", 100), ("longer", 90)):
        _add(s, rid, 10, max_tokens=m)
    plan = s.admit()
    rows = {x.request.id: x.row for i in plan.inserts for x in i.samples}
    shard = {rid: row // 2 for rid, row in rows.items()}
    assert shard["long"] != shard["longer"]
    # In index order instead, both long rows would have shared shard 0.
    assert sorted(rows.values()) == [0, 1, 2]


def test_refill_at_stops_a_chunk_early_only_while_requests_wait():
    s = _scheduler(slots=32)
    assert s.refill_at() == 33  # nothing waits: never
    for i in range(40):
        _add(s, i, 10)
    s.admit()
    assert s.busy == 32 and s.waiting(100) == 8
    assert s.refill_at() == 2  # 1 in 16 of the slots
    s1 = _scheduler(slots=4)
    for i in range(5):
        _add(s1, i, 10)
    s1.admit()
    assert s1.refill_at() == 1  # at least one


def test_free_is_by_row_and_releases_only_rows_still_free():
    s = _scheduler(slots=4)
    a, b = _add(s, "a", 10), _add(s, "b", 10)
    s.admit()
    _finish(s, a[0], 3, running=True)  # a stop string: the device still runs the row
    _finish(s, b[0], 3, running=True)
    assert s.busy == 0 and a[0].row is None
    _add(s, "c", 10)
    (ins,) = s.admit().inserts  # refills row 0 before the release
    assert ins.dst == (0,)
    assert s.take_release() == [1]  # row 0 holds "c" now: releasing it would stop c
    assert s.take_release() == []


def test_the_tail_narrows_a_round_late_and_widens_as_far_as_needed():
    long_tokens = NARROW_MIN_CHUNKS * 16 + 50
    s = _scheduler(slots=4, chunk=16)
    samples = [_add(s, i, 10, max_tokens=long_tokens if i == 0 else 8)[0] for i in range(4)]
    s.admit()
    for x in samples[1:]:
        _finish(s, x)
    assert s.narrow() is None  # the first round that could narrow only wishes to
    resize = s.narrow()
    assert (resize.kind, resize.width, resize.rows) == ("narrow", 1, (0,))
    assert s.width == 1 and samples[0].row == 0 and s.counts["narrowings"] == 1
    # One request arriving: the state widens 1 -> 2 rows, not back to every slot.
    _add(s, "late", 10)
    plan = s.admit()
    assert (plan.widen.kind, plan.widen.width, plan.widen.rows) == ("widen", 2, (0,))
    assert [i.dst for i in plan.inserts] == [(1,)]
    assert s.counts["widenings"] == 1
    # A burst that outnumbers the free rows widens to every slot.
    for i in range(3):
        _add(s, f"burst{i}", 10)
    plan = s.admit()
    assert plan.widen.width == 4 and s.busy == 4


def test_no_narrowing_near_the_end_or_while_requests_wait():
    s = _scheduler(slots=4, chunk=16)
    samples = [_add(s, i, 10, max_tokens=NARROW_MIN_CHUNKS * 16 - 1)[0] for i in range(4)]
    s.admit()
    for x in samples[1:]:
        _finish(s, x)
    assert s.narrow() is None and s.narrow() is None  # too few steps left to pay off
    s2 = _scheduler(slots=2, chunk=16)
    a = [_add(s2, i, 10, max_tokens=500)[0] for i in range(3)]
    s2.admit()
    _finish(s2, a[0])
    assert s2.queue and s2.narrow() is None and s2.narrow() is None


def test_narrowing_on_a_mesh_keeps_each_shards_rows():
    s = _scheduler(slots=8, data=2, chunk=16)
    samples = [_add(s, i, 10, max_tokens=500 if i in (1, 6) else 8)[0] for i in range(8)]
    s.admit()
    # The two long samples were placed first, one per shard: rows 0 and 4 of the 4-row blocks.
    assert (samples[1].row, samples[6].row) == (0, 4)
    for i, x in enumerate(samples):
        if i not in (1, 6):
            _finish(s, x)
    s.narrow()
    resize = s.narrow()
    # One busy row in each shard: one row per shard, named by its index within the shard.
    assert (resize.width, resize.rows) == (2, (0, 0))
    assert (samples[1].row, samples[6].row) == (0, 1)


def test_abort_takes_a_queued_request_out_and_only_it():
    s = _scheduler(slots=2)
    a, _ = _add(s, "a", 10), _add(s, "b", 10)
    c, d = _add(s, "c", 10), _add(s, "d", 12, n=2)
    s.admit()
    assert s.abort("c") == (c, [], [])
    assert c[0].reason == "abort" and c[0].row is None
    assert [p.samples for p in s.queue] == [d] and d[0].reason is None
    assert s.busy == 2 and s.take_release() == []  # no row held it
    assert s.abort("c") == ([], [], []) and s.abort("never") == ([], [], [])
    _finish(s, a[0])
    (ins,) = s.admit().inserts
    assert _ids(ins) == ["d"] and ins.prefill is not None


def test_abort_frees_a_running_samples_row_for_release():
    s = _scheduler(slots=3)
    a, b, c = (_add(s, rid, 10) for rid in "abc")
    s.admit()
    assert [x[0].row for x in (a, b, c)] == [0, 1, 2]
    assert s.abort("b") == ([], b, [])
    assert b[0].reason == "abort" and b[0].row is None
    assert s.owner[1] is None and s.busy == 2
    # The device runs row 1 until it is released.
    assert s.take_release() == [1] and s.take_release() == []
    assert a[0].reason is None and c[0].reason is None
    # A row aborted and refilled before the release needs none: the insert overwrites it.
    assert s.abort("a") == ([], a, [])
    _add(s, "d", 10)
    _add(s, "e", 10)
    (ins,) = s.admit().inserts
    assert ins.dst == (0, 1)
    assert s.take_release() == [] and s.busy == 3


def test_abort_of_a_partly_admitted_request_returns_its_group():
    """n = 4 in two rows: the samples not yet in a row wait with the prefilled group kept;
    aborting the request stops them all and gives the group back, to be dropped. A sample
    that finished before the abort stays as it ended."""
    s = _scheduler(slots=2)
    w = _add(s, "w", 10, n=4)
    (first,) = s.admit().inserts
    assert not first.last_use and [x.index for x in first.samples] == [0, 1]
    x = _add(s, "x", 11)
    _finish(s, w[0])
    (again,) = s.admit().inserts  # sample 2 from the kept group, x still waits
    assert again.group == first.group and again.prefill is None and not again.last_use
    queued, running, groups = s.abort("w")
    assert queued == [w[3]] and sorted(running, key=lambda r: r.index) == [w[1], w[2]]
    assert groups == [first.group]
    assert w[0].reason == "length" and all(r.reason == "abort" for r in w[1:])
    assert s.busy == 0 and s.take_release() == [0, 1]
    assert [p.samples for p in s.queue] == [x]
    (ins,) = s.admit().inserts
    assert _ids(ins) == ["x"] and ins.prefill is not None and ins.group != first.group
    # The group comes back too when none of the request's samples runs any more.
    s1 = _scheduler(slots=1)
    v = _add(s1, "v", 10, n=3)
    (ins,) = s1.admit().inserts
    _finish(s1, v[0])
    assert s1.abort("v") == (v[1:], [], [ins.group])
    assert not s1.queue and not s1.has_work
