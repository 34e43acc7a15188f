"""Answers out of a completion, graded against the reference with math-verify.

The rule is the R-KV authors' evaluation harness (`evaluation/parser.py`, `extract_answer`, which
is Qwen2.5-Math's), applied to the final part of the text: what follows the last `</think>` (a
reasoning model's answer; all of the text when there is none).

1. The content of the last `\\boxed{...}` (or `\\fbox{...}`) of the final part, braces matched, so
   nested boxes and `\\frac{}{}` inside survive. This is the answer the R1 recipe asks for.
2. Without a box, and only for a sample that ended by itself (a stop or end-of-sequence token,
   not its token budget): the rest of the line after the last "the answer is" / "final answer
   is", else the last number of the final part (the harness's fallbacks, for models that state
   an answer without boxing it).
3. Otherwise the sample has no answer and is wrong. A sample cut off at its token budget without
   a box stopped mid-thought: the last number of its text is whatever it was computing then (or
   a number of the problem it was echoing), never an answer.

Grading calls `math_verify.verify(gold, answer)` with the gold first (the library's order: the
gold decides how the answer is read, e.g. as a set or an interval). Graded samples record where
their answer came from (`Grade.source`), so a summary reports pass@1 with and without the
fallbacks.
"""

from __future__ import annotations

import dataclasses
import functools
import re

THINK_END = "</think>"
_BOXES = ("\\boxed", "\\fbox")
_DOLLAR = re.compile(r"(?<!\\)\$")  # a math delimiter, not an escaped dollar sign
# The harness's answer phrases ("he answer is" also matches "The answer is").
_PHRASE = re.compile(r"(?:he|final) answer is", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.\s")  # "12. Then" ends at "12"; "3.5" does not end
_NUMBER = re.compile(r"-?\d*\.?\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 32,348 -> 32348; "1, 2" stays apart

SOURCES = ("boxed", "phrase", "last_number")  # where an answer came from, in rule order


@dataclasses.dataclass(frozen=True)
class Grade:
    """answer: the extracted answer as text (None when the sample has none);
    correct: whether it equals the reference;
    source: "boxed", "phrase" or "last_number" (see the module docstring), None without one."""

    answer: str | None
    correct: bool
    source: str | None = None


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


def stated_answer(text: str) -> str | None:
    """What follows the last "the answer is" / "final answer is" up to the end of its sentence
    or line (of the next line with text, after a colon); None when there is no such phrase, or
    nothing after it."""
    found = list(_PHRASE.finditer(text))
    if not found:
        return None
    rest = text[found[-1].end() :].strip().removeprefix(":").strip()
    rest = _SENTENCE_END.split(rest.split("\n", 1)[0], maxsplit=1)[0].strip().rstrip(".")
    return rest.strip() or None


def last_number(text: str) -> str | None:
    """The last number of text (thousands separators dropped), or None."""
    found = _NUMBER.findall(_THOUSANDS.sub("", text))
    return found[-1] if found else None


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


def extract(text: str, *, truncated: bool = False) -> tuple[list, str | None, str | None]:
    """A completion -> (math-verify's parse of its answer, the answer as text, its source),
    by the rule of the module docstring; ([], None, None) without an answer.

    Args:
      truncated: the sample was cut off at its token budget: only a boxed answer counts.
    """
    part = final_part(text)
    boxed = last_boxed(part)
    if boxed is not None:  # the answer, even one math-verify cannot read
        return _parse(f"$\\boxed{{{boxed}}}$"), boxed, "boxed"
    if truncated:
        return [], None, None
    phrase, number = stated_answer(part), last_number(part)
    found = [("phrase", phrase, _as_math(phrase))] if phrase is not None else []
    found += [("last_number", number, f"${number}$")] if number is not None else []
    for source, shown, math in found:
        parsed = _parse(math)
        if parsed:
            return parsed, shown, source
    return [], None, None


def is_equivalent(gold: str, answer: str) -> bool:
    """Whether the answer (LaTeX or plain text) equals the reference `gold`."""
    parsed = _parse(_as_math(answer))
    return bool(parsed) and bool(_math_verify().verify(list(_gold(gold)), parsed))


def grade(text: str, gold: str, *, truncated: bool = False) -> Grade:
    """One completion against its reference answer.

    Args:
      text: the completion.
      gold: the reference answer.
      truncated: the sample was cut off at its token budget (finish reason "length"): without
        a boxed answer it has none.
    """
    parsed, shown, source = extract(text, truncated=truncated)
    if not parsed:
        return Grade(answer=shown, correct=False, source=source)
    correct = bool(_math_verify().verify(list(_gold(gold)), parsed))
    return Grade(answer=shown, correct=correct, source=source)
