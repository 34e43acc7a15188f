"""The reasoner's task: run a small loop of mod-10 assignments, write every step, answer.

Public and independent of rkvjax (the standard library only), so that anyone can generate
problems and grade answers the way `python -m bench reasoner` does. A problem's prompt:

    vars a=5 b=2 c=6 d=0 e=1 f=8 g=1 h=5
    loop a=d+b g=g+d b=g+b d=a-a d=a+e
    rounds 14
    ask c

and its trace (what the model writes): for each round r a line `round r`, then per op
`T=X+Y=x+y=v` with the operands' values before the op and its result, mod 10; after the last
round `answer v`, the asked variable's final value; then the end of the sequence. Answering needs
what no recency window holds: values set in the `vars` line and never reassigned, the round
count and the asked variable, all at the start. Every line ends in a newline but the answer's.
"""

from __future__ import annotations

import dataclasses
import random
import re

VARIABLES = "abcdefgh"
MAX_OPS = 8
MAX_ROUNDS = 40
ANSWER = re.compile(r"answer (\d)\s*$")
_OP = re.compile(r"([a-h])=([a-h])([+-])([a-h])")
_LINE = re.compile(r"([a-h])=([a-h])([+-])([a-h])=(\d)([+-])(\d)=(\d)")


def apply(sign: str, a: int, b: int) -> int:
    """One op's result: a + b or a - b, mod 10."""
    return (a + b) % 10 if sign == "+" else (a - b) % 10


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: initial values, the loop's ops (target, x, sign, y), rounds, asked name."""

    values: tuple[int, ...]  # one per VARIABLES letter
    ops: tuple[tuple[str, str, str, str], ...]
    rounds: int
    ask: str

    def prompt(self) -> str:
        vars_ = " ".join(f"{v}={x}" for v, x in zip(VARIABLES, self.values, strict=True))
        loop = " ".join(f"{t}={x}{s}{y}" for t, x, s, y in self.ops)
        return f"vars {vars_}\nloop {loop}\nrounds {self.rounds}\nask {self.ask}\n"

    def trace(self) -> str:
        """The full correct answer text (without the end-of-sequence token)."""
        env = dict(zip(VARIABLES, self.values, strict=True))
        lines = []
        for r in range(1, self.rounds + 1):
            lines.append(f"round {r}\n")
            for t, x, s, y in self.ops:
                a, b = env[x], env[y]
                env[t] = apply(s, a, b)
                lines.append(f"{t}={x}{s}{y}={a}{s}{b}={env[t]}\n")
        return "".join(lines) + f"answer {env[self.ask]}"

    def answer(self) -> int:
        return int(ANSWER.search(self.trace())[1])

    def to_dict(self) -> dict:
        return {"prompt": self.prompt(), "answer": self.answer(), "rounds": self.rounds,
                "ops": len(self.ops)}  # fmt: skip


def sample(rng: random.Random, ops: tuple[int, int] = (3, 5), rounds: tuple[int, int] = (8, 20)):
    """A random problem with a number of ops and rounds drawn uniformly from the inclusive
    ranges."""
    if not (1 <= ops[0] <= ops[1] <= MAX_OPS and 1 <= rounds[0] <= rounds[1] <= MAX_ROUNDS):
        raise ValueError(f"ops {ops} must lie in 1..{MAX_OPS}, rounds {rounds} in 1..{MAX_ROUNDS}")
    n = rng.randint(*ops)
    return Problem(
        values=tuple(rng.randrange(10) for _ in VARIABLES),
        ops=tuple(
            (rng.choice(VARIABLES), rng.choice(VARIABLES), rng.choice("+-"), rng.choice(VARIABLES))
            for _ in range(n)
        ),
        rounds=rng.randint(*rounds),
        ask=rng.choice(VARIABLES),
    )


def problems(seed: int, count: int, **ranges) -> list[Problem]:
    """`count` problems from `seed` (the same seed gives the same problems everywhere)."""
    rng = random.Random(seed)
    return [sample(rng, **ranges) for _ in range(count)]


def parse(prompt: str) -> Problem:
    """The problem a prompt states (ValueError naming the line that is not in the format)."""
    lines = prompt.rstrip("\n").split("\n")
    if len(lines) != 4:
        raise ValueError(f"a prompt has 4 lines (vars, loop, rounds, ask), this one {len(lines)}")
    m = re.fullmatch(r"vars " + " ".join(f"{v}=(\\d)" for v in VARIABLES), lines[0])
    if not m:
        raise ValueError(f"line 1 is not `vars a=D ... h=D`: {lines[0]!r}")
    values = tuple(int(x) for x in m.groups())
    words = lines[1].split(" ")
    ops = tuple(_OP.fullmatch(w) for w in words[1:])
    if words[0] != "loop" or not 1 <= len(ops) <= MAX_OPS or not all(ops):
        raise ValueError(f"line 2 is not `loop` and 1..{MAX_OPS} ops T=X+Y or T=X-Y: {lines[1]!r}")
    m_rounds = re.fullmatch(r"rounds (\d+)", lines[2])
    if not m_rounds or not 1 <= int(m_rounds[1]) <= MAX_ROUNDS:
        raise ValueError(f"line 3 is not `rounds N` with N in 1..{MAX_ROUNDS}: {lines[2]!r}")
    m_ask = re.fullmatch(r"ask ([a-h])", lines[3])
    if not m_ask:
        raise ValueError(f"line 4 is not `ask V` with V in a..h: {lines[3]!r}")
    return Problem(values, tuple(o.groups() for o in ops), int(m_rounds[1]), m_ask[1])


@dataclasses.dataclass(frozen=True)
class Grade:
    """How an answer text fared. `correct`: the answer is the run's. `failure`: None when the
    whole text is right (trace and answer), else the first thing wrong:
    "no answer" (no `answer D` line at the end), "value" (an op line read an operand or wrote a
    result that the run does not give: a value lost), "rounds" (every op line right but the
    number of rounds written is not the prompt's: the round count lost), "format" (a line that
    is not `round r` nor an op line, or an op out of the loop's order) or "answer" (a wrong
    answer after a correct trace)."""

    correct: bool
    answer: int | None
    expected: int
    failure: str | None
    rounds_written: int
    first_wrong_line: int | None  # 1-based, in the answer text


def grade(problem: Problem, text: str) -> Grade:
    """Grades a model's answer text against the problem's run."""
    expected = problem.answer()
    found = ANSWER.search(text)
    answer = int(found[1]) if found else None
    env = dict(zip(VARIABLES, problem.values, strict=True))
    rounds = op_i = 0
    failure, wrong = None, None
    body = (text[: found.start()] if found else text).split("\n")
    last = max((i for i, line in enumerate(body, 1) if line), default=0)
    for i, line in enumerate(body, 1):
        if not line:
            continue
        done = rounds == problem.rounds and op_i == len(problem.ops)
        if i == last and done and not found and not line.startswith("round "):
            failure, wrong = "no answer", i  # a complete run, then no `answer D`
            break
        if m := re.fullmatch(r"round (\d+)", line):
            rounds += 1
            if int(m[1]) != rounds or op_i not in (0, len(problem.ops)):
                failure, wrong = "format", i
                break
            op_i = 0
            continue
        m = _LINE.fullmatch(line)
        if not m or rounds == 0 or op_i >= len(problem.ops):
            failure, wrong = "format", i
            break
        t, x, s, y = problem.ops[op_i]
        if (m[1], m[2], m[3], m[4]) != (t, x, s, y) or m[6] != s:
            failure, wrong = "format", i
            break
        a, b = env[x], env[y]
        env[t] = apply(s, a, b)
        if (int(m[5]), int(m[7]), int(m[8])) != (a, b, env[t]):
            failure, wrong = "value", i
            break
        op_i += 1
    if failure is None:
        if answer is None:
            failure = "no answer"
        elif rounds != problem.rounds or op_i != len(problem.ops):
            failure = "rounds"
        elif answer != expected:
            failure = "answer"
    return Grade(answer == expected, answer, expected, failure, rounds, wrong)
