"""Evaluation data: a JSONL file of problems with reference answers, every line checked first.

A line is a JSON object with the problem under `problem` or `question` (both only with the same
text) and the reference answer under `answer` (a LaTeX string or a number), as in MATH-500 and
AIME 2024. Its id is `id`, else `unique_id`, else its line number; ids must be unique, so
resuming finds each problem's samples again.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from rkvjax.entrypoints.jobs.inputs import json_line
from rkvjax.entrypoints.jobs.quote import show

PROBLEM_FIELDS = ("problem", "question")
ID_FIELDS = ("id", "unique_id")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: its line in the file, id, text, reference answer and any other fields
    (subject, level, ...) for breakdowns."""

    line: int
    id: str | int
    problem: str
    answer: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _problem(obj: Any, where: str, line: int) -> Problem:
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: expected a JSON object with `problem` and `answer`, got {show(obj)}"
        )
    given = [k for k in PROBLEM_FIELDS if k in obj]
    if not given:
        raise ValueError(f"{where}: needs `problem` (or `question`), the text to solve")
    if len(given) > 1 and obj["problem"] != obj["question"]:
        # The same text under both names is fine (the R-KV authors' AIME 2024 file has it).
        raise ValueError(
            f"{where}: has `problem` and `question` with different texts; give one of them"
        )
    key = given[0]
    text = obj[key]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: `{key}` must be a non-empty string, got {show(text)}")
    if "answer" not in obj:
        raise ValueError(f"{where}: needs `answer`, the reference answer to grade against")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: `answer` must be a string or a number, got {show(answer)}")
    if isinstance(answer, float) and not math.isfinite(answer):
        # JSON's NaN and Infinity (Python reads them) would be graded as the text "nan".
        raise ValueError(f"{where}: `answer` must be a finite number, got {answer}")
    answer = str(answer).strip()
    if not answer:
        raise ValueError(f"{where}: `answer` is empty")
    pid: Any = line
    for k in ID_FIELDS:
        if k in obj:
            pid = obj[k]
            if isinstance(pid, bool) or not isinstance(pid, str | int):
                raise ValueError(f"{where}: `{k}` must be a string or an integer, got {show(pid)}")
            break
    skip = {key, "answer", *ID_FIELDS, "solution"}
    extra = {k: v for k, v in obj.items() if k not in skip}
    return Problem(line=line, id=pid, problem=text, answer=answer, extra=extra)


def read_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """The first `limit` problems of a JSONL file (all when None), each line checked."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give the JSONL file of problems")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (the JSONL file of problems)")
    problems: list[Problem] = []
    lines: dict[Any, int] = {}
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            p = _problem(json_line(raw, where), where, n)
            if p.id in lines:
                raise ValueError(f"{where}: duplicate id {p.id!r} (line {lines[p.id]} has it)")
            lines[p.id] = n
            problems.append(p)
            if limit is not None and len(problems) == limit:
                break
    if not problems:
        raise ValueError(f"{path}: no problems (one JSON object per line)")
    return problems
