"""Answers out of a completion, graded against the reference with math-verify.

The answer is read from the text after the last `</think>` (a reasoning model's final part;
the whole text when there is none): the content of its last `\\boxed{...}` (or `\\fbox{...}`),
braces matched, so nested boxes and `\\frac{}{}` inside survive; without a box, math-verify's own
extraction (the last expression it can parse). Grading calls `math_verify.verify(gold, answer)`
with the gold first (the library's order: the gold decides how the answer is read, e.g. as a set
or an interval).
"""

from __future__ import annotations

import dataclasses
import functools
import re

THINK_END = "</think>"
_BOXES = ("\\boxed", "\\fbox")
_DOLLAR = re.compile(r"(?<!\\)\$")  # a math delimiter, not an escaped dollar sign


@dataclasses.dataclass(frozen=True)
class Grade:
    """answer: the extracted answer as text (None when nothing could be read);
    correct: whether it equals the reference."""

    answer: str | None
    correct: bool


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError:  # a dependency of rkvjax; only a broken install gets here
        raise ImportError(
            "grading needs math-verify: pip install 'math-verify[antlr4_13_2]'"
        ) from None
    return math_verify


def final_part(text: str) -> str:
    """The text after the last `</think>`, or all of it."""
    i = text.rfind(THINK_END)
    return text if i < 0 else text[i + len(THINK_END) :]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` in text, braces matched; None when
    there is none or it is not closed."""
    start = max(text.rfind(b + "{") for b in _BOXES)
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _parse(text: str) -> list:
    return _math_verify().parse(text)


def _as_math(answer: str) -> str:
    """A bare answer (a reference, `\\$36` included) inside math delimiters, unless it has
    its own."""
    return answer if _DOLLAR.search(answer) else f"${answer}$"


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> tuple:
    """A reference answer, parsed once per distinct answer (as LaTeX math)."""
    parsed = _parse(_as_math(answer))
    if not parsed:
        parsed = _parse(answer)
    return tuple(parsed)


def extract(text: str) -> tuple[list, str | None]:
    """A completion -> (math-verify's parse of its answer, the answer as text or None)."""
    part = final_part(text)
    boxed = last_boxed(part)
    parsed = _parse(f"$\\boxed{{{boxed}}}$") if boxed is not None else _parse(part)
    if not parsed:
        return [], boxed
    shown = next((p for p in parsed if isinstance(p, str)), None)
    return parsed, shown if shown is not None else str(parsed[0])


def is_equivalent(gold: str, answer: str) -> bool:
    """Whether the answer (LaTeX or plain text) equals the reference `gold`."""
    parsed = _parse(_as_math(answer))
    return bool(parsed) and bool(_math_verify().verify(list(_gold(gold)), parsed))


def grade(text: str, gold: str) -> Grade:
    """One completion against its reference answer."""
    parsed, shown = extract(text)
    if not parsed:
        return Grade(answer=shown, correct=False)
    return Grade(answer=shown, correct=bool(_math_verify().verify(list(_gold(gold)), parsed)))
