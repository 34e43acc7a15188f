"""Scores of an evaluation: pass@k, the outputs' repetition, and the summary of a run."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REPETITION_N = 4  # n of the n-gram repetition rate
# A sample loops when it is cut at its token limit while its last LOOP_TAIL tokens repeat at
# least LOOP_REPETITION of their n-grams: a cycle the model did not leave before the limit.
LOOP_TAIL = 256
LOOP_REPETITION = 0.5


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al.,
    2021): 1 - C(n - c, k) / C(n, k), the chance that k of the n samples, drawn without
    replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def repetition_rate(tokens: Sequence[Any], n: int = REPETITION_N) -> float:
    """The share of a sequence's n-grams that repeat an earlier one (1 - distinct / total, the
    rep-n of Welleck et al., 2019): 0 for text that never repeats itself, near 1 for a loop.
    0 for a sequence shorter than n."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def is_looping(tokens: Sequence[Any], finish_reason: str | None) -> bool:
    """Whether a sample ended in a loop: cut at the token limit (finish reason "length") with
    the 4-gram repetition rate of its last `LOOP_TAIL` tokens at least `LOOP_REPETITION`.
    Reasoning models under a too-small cache degrade this way (repeating a step until the
    limit) more often than they answer wrongly, so it is counted apart from accuracy."""
    if finish_reason != "length":
        return False
    return repetition_rate(tokens[-LOOP_TAIL:]) >= LOOP_REPETITION


def k_values(samples: int) -> list[int]:
    """The k of the pass@k table: 1, 2, 4, ... up to the samples per problem, and that."""
    ks = [1]
    while ks[-1] * 2 <= samples:
        ks.append(ks[-1] * 2)
    if ks[-1] != samples:
        ks.append(samples)
    return ks


def summarize(
    lines: Iterable[Mapping[str, Any]], problems: Sequence[Any], samples: int
) -> dict[str, Any]:
    """The scores of graded sample lines (id, correct, answer_source, completion_tokens,
    compressions, repetition, looping, finish_reason) over `problems`, each with `samples`
    samples.

    Problems without all their samples (a job stopped early) are left out of the scores and
    counted in `incomplete_problems`. `pass@1` grades by the whole rule of `grading`;
    `pass@1_boxed` counts only boxed answers (the harness's fallbacks left out).
    """
    by_id: dict[Any, list] = collections.defaultdict(list)
    for line in lines:
        by_id[line["id"]].append(line)
    complete = [p for p in problems if len(by_id.get(p.id, ())) >= samples]
    graded = [s for p in complete for s in by_id[p.id][:samples]]
    ks = k_values(samples)
    table = {}
    for k in ks:
        per = [
            pass_at_k(samples, sum(s["correct"] for s in by_id[p.id][:samples]), k)
            for p in complete
        ]
        table[str(k)] = statistics.fmean(per) if per else None

    boxed = [
        pass_at_k(samples, sum(_boxed_right(s) for s in by_id[p.id][:samples]), 1) for p in complete
    ]

    def mean(key: str) -> float | None:
        return statistics.fmean(s[key] for s in graded) if graded else None

    finish = collections.Counter(s["finish_reason"] for s in graded)
    return {
        "pass@1": table["1"],
        "pass@1_boxed": statistics.fmean(boxed) if boxed else None,
        "pass@k": table[str(samples)],
        "k": samples,
        "pass_at": table,
        "problems": len(complete),
        "incomplete_problems": len(problems) - len(complete),
        "samples": len(graded),
        "correct_samples": sum(s["correct"] for s in graded),
        "answered_samples": sum(s["extracted_answer"] is not None for s in graded),
        "answer_sources": dict(
            collections.Counter(s.get("answer_source") or "none" for s in graded)
        ),
        "mean_generated_tokens": mean("completion_tokens"),
        "mean_compressions": mean("compressions"),
        "repetition": mean("repetition"),
        "repetition_n": REPETITION_N,
        # Lines of an older run have no "looping": then it is not known.
        "looping": statistics.fmean(s["looping"] for s in graded)
        if graded and all("looping" in s for s in graded)
        else None,
        "finish_reasons": dict(finish),
    }


def _boxed_right(line: Mapping[str, Any]) -> bool:
    return bool(line["correct"]) and line.get("answer_source") == "boxed"
