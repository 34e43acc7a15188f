"""The committed reasoner (bench/reasoner/model) through the engine: its answers are right with
the whole cache and wrong where a cache policy loses what they need. A change that breaks the
kept positions, RoPE after compaction or the cache's reads shows up here as lost accuracy."""

from pathlib import Path

import pytest

import rkvjax
from bench.reasoner import suite, task

MODEL = Path(__file__).resolve().parents[1] / "bench" / "reasoner" / "model"
# A fixed set of the acceptance range (3-5 ops, 8-20 rounds) from a seed of its own.
SEED, COUNT = 31_337, 32


@pytest.fixture(scope="module")
def reasoner():
    if not (MODEL / "model.safetensors").is_file():
        pytest.fail(f"{MODEL}: the committed reasoner is missing")
    return rkvjax.load(MODEL, dtype="float32")


def _accuracy(model, problems, **cache) -> float:
    params = rkvjax.SamplingParams(temperature=0.0, max_tokens=320)
    outs = rkvjax.generate(model, [p.prompt() for p in problems], sampling=params,
                           slots=len(problems), chat=False, **cache)  # fmt: skip
    return (
        100
        * sum(task.grade(p, o.text).correct for p, o in zip(problems, outs, strict=True))
        / len(problems)
    )


def test_the_reasoner_answers_with_the_whole_cache_and_not_from_a_recency_window(reasoner):
    problems = task.problems(SEED, COUNT)
    full = _accuracy(reasoner, problems)
    assert full >= 90, f"FullKV: {full:.0f}% right"
    streaming = _accuracy(reasoner, problems, method="streaming", budget=64, buffer=suite.BUFFER)
    # The task needs the vars line, the round count and the asked name, all in the prompt:
    # a window of the newest tokens and four sinks loses them.
    assert streaming <= full - 30, f"StreamingLLM at 64: {streaming:.0f}% against {full:.0f}%"


def test_answers_survive_compaction_where_the_budget_keeps_what_they_need(reasoner):
    """R-KV at 128 compresses each row about four times here and keeps most answers (25 of 32
    measured): a compaction that moved kept keys, their positions or their RoPE would leave
    it as lost as the recency window above."""
    problems = task.problems(SEED, COUNT)
    rkv = _accuracy(reasoner, problems, method="rkv", budget=128, buffer=suite.BUFFER)
    assert rkv >= 60, f"R-KV at 128: {rkv:.0f}% right"
