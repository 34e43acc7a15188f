"""Evaluation: answer extraction and grading (math-verify), pass@k, repetition, the problem
file's checks, and `rkvjax eval` end to end (kill and resume) on a tiny checkpoint."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from rkvjax import cli, evaluation, jobs
from rkvjax.evaluation import grading, metrics

# (reference, completion, correct): the pairs a MATH grader must get right.
GRADES = [
    # fractions
    ("\\frac{1}{2}", "so the answer is $\\boxed{\\frac{2}{4}}$", True),
    ("\\frac{1}{2}", "$\\boxed{\\dfrac12}$", True),
    ("\\frac{1}{2}", "$\\boxed{\\frac{1}{3}}$", False),
    # decimals
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$.", True),
    ("0.25", "$\\boxed{\\frac{1}{4}}$", True),
    ("\\frac{1}{3}", "$\\boxed{0.5}$", False),
    # intervals
    ("[2,5)", "$\\boxed{[2, 5)}$", True),
    ("[2,5)", "$\\boxed{(2, 5)}$", False),
    ("(-\\infty, 3]", "$\\boxed{(-\\infty,3]}$", True),
    # sets and tuples
    ("\\{1,2,3\\}", "$\\boxed{\\{3, 2, 1\\}}$", True),
    ("\\{1,2,3\\}", "$\\boxed{\\{1, 2\\}}$", False),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "$\\boxed{(3, \\pi/2)}$", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "$\\boxed{(\\pi/2, 3)}$", False),
    # units and text around the number
    ("10\\text{ cm}", "$\\boxed{10}$", True),
    ("10", "$\\boxed{10 \\text{ cm}}$", True),
    ("10", "$\\boxed{12\\text{ cm}}$", False),
    # nesting and several boxes: the last box of the final part counts
    ("204", "so \\boxed{\\boxed{204}}", True),
    ("204", "$\\boxed{\\frac{408}{2}}$", True),
    ("5", "first \\boxed{3}, then, checking again, \\boxed{5}", True),
    ("3", "first \\boxed{3}, then, checking again, \\boxed{5}", False),
    ("5", "<think>maybe \\boxed{4}?</think> The answer is $\\boxed{5}$.", True),
    ("4", "<think>maybe \\boxed{4}?</think> The answer is $\\boxed{5}$.", False),
    # no answer at all
    ("5", "I do not know.", False),
    ("5", "", False),
]


@pytest.mark.parametrize(("gold", "text", "correct"), GRADES)
def test_grade(gold, text, correct):
    assert grading.grade(text, gold).correct is correct


def test_extracted_answer_text():
    assert grading.grade("so $\\boxed{\\frac{1}{2}}$", "0.5").answer == "\\frac{1}{2}"
    assert grading.grade("no idea", "1").answer is None
    assert grading.last_boxed("\\boxed{\\frac{a}{b}} and \\fbox{x^{2}}") == "x^{2}"
    assert grading.last_boxed("\\boxed{unclosed") is None
    assert grading.final_part("a</think>b</think>c") == "c"
    assert grading.is_equivalent("\\frac{1}{2}", "0.5")
    assert not grading.is_equivalent("\\frac{1}{2}", "0.6")


def _brute_pass_at_k(flags: list[bool], k: int) -> float:
    """The share of k-subsets of the samples that hold a correct one, counted."""
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_a_brute_force_count():
    rng = random.Random(0)
    for n in range(1, 9):
        for c in range(n + 1):
            flags = [True] * c + [False] * (n - c)
            rng.shuffle(flags)
            for k in range(1, n + 1):
                assert metrics.pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(flags, k))
    assert metrics.pass_at_k(4, 1, 1) == 0.25
    with pytest.raises(ValueError, match="pass@k"):
        metrics.pass_at_k(2, 3, 1)


def test_repetition_and_k_values():
    assert metrics.repetition_rate(list(range(10))) == 0.0
    assert metrics.repetition_rate([1, 2, 3]) == 0.0
    loop = [1, 2, 3, 4] * 10  # 37 4-grams, 4 distinct
    assert metrics.repetition_rate(loop) == pytest.approx(1 - 4 / 37)
    assert metrics.k_values(1) == [1]
    assert metrics.k_values(6) == [1, 2, 4, 6]
    assert metrics.k_values(8) == [1, 2, 4, 8]


def test_summary_scores_complete_problems():
    problems = [evaluation.Problem(i + 1, i, "p", "1") for i in range(3)]
    lines = [
        {"id": 0, "correct": True, "completion_tokens": 10, "compressions": 1},
        {"id": 0, "correct": False, "completion_tokens": 20, "compressions": 3},
        {"id": 1, "correct": False, "completion_tokens": 30, "compressions": 0},
        {"id": 1, "correct": False, "completion_tokens": 40, "compressions": 0},
        {"id": 2, "correct": True, "completion_tokens": 50, "compressions": 0},  # 1 of 2
    ]
    for line in lines:
        line.update(finish_reason="length", extracted_answer="1", repetition=0.5)
    s = metrics.summarize(lines, problems, samples=2)
    assert (s["problems"], s["incomplete_problems"], s["samples"]) == (2, 1, 4)
    assert s["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["pass@k"] == pytest.approx((1.0 + 0.0) / 2)
    assert s["mean_generated_tokens"] == 25
    assert s["mean_compressions"] == 1
    assert s["finish_reasons"] == {"length": 4}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", ":2: not valid JSON"),
        ({"answer": "1"}, ":2: needs `problem`"),
        ({"problem": "x"}, ":2: needs `answer`"),
        ({"problem": "", "answer": "1"}, ":2: `problem` must be a non-empty string"),
        ({"problem": "x", "answer": ["1"]}, ":2: `answer` must be a string or a number"),
        ({"id": 7, "problem": "x", "answer": "1"}, ":2: duplicate id 7 \\(line 1 has it\\)"),
    ],
)
def test_bad_problem_lines_name_the_line(tmp_path, row, message):
    path = _write(tmp_path / "p.jsonl", [{"id": 7, "problem": "y", "answer": 2}, row])
    with pytest.raises(ValueError, match=message):
        evaluation.read_problems(path)


def test_problem_ids_and_limit(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"unique_id": "test/a.json", "problem": "a", "answer": "1", "level": 2},
            {"id": 60, "question": "b", "answer": 204},
            {"problem": "c", "answer": "3"},
        ],
    )
    ps = evaluation.read_problems(path)
    assert [p.id for p in ps] == ["test/a.json", 60, 3]
    assert ps[1].problem == "b" and ps[1].answer == "204" and ps[0].extra == {"level": 2}
    assert len(evaluation.read_problems(path, limit=2)) == 2
    with pytest.raises(ValueError, match="--limit"):
        evaluation.read_problems(path, limit=0)


def test_shared_data_files_parse(shared_data):
    math500 = evaluation.read_problems(shared_data / "math500.jsonl")
    aime = evaluation.read_problems(shared_data / "aime24.jsonl")
    assert (len(math500), len(aime)) == (500, 30)
    # Every reference answer, boxed in a completion, grades correct: no problem is scored
    # wrong for its reference's sake (`\\$36`, `32,\\!348`, tuples, intervals, ...).
    wrong = [
        p.answer
        for p in math500 + aime
        if not grading.grade(f"The answer is $\\boxed{{{p.answer}}}$.", p.answer).correct
    ]
    assert wrong == []


# -- end to end on the default model ---------------------------------------------------------

_FLAGS = ["--limit", "3", "--samples", "2", "--max-tokens", "16", "--slots", "4", "--no-progress"]
_RKV = ["--method", "rkv", "--budget", "64", "--buffer", "16"]


def _samples(folder):
    return {
        (s["id"], s["sample_index"]): s for s in evaluation.read_samples(folder / "samples.jsonl")
    }


def test_eval_end_to_end_resumes_after_a_kill(
    smol, smol_dir, shared_data, tmp_path, monkeypatch, capsys
):
    """`rkvjax eval` on 3 MATH-500 problems (two prompt-length buckets), 2 samples, R-KV and
    FullKV: graded samples and a summary; interrupted after 3 samples and run again, it writes
    only the other 3, and the whole equals an uninterrupted run (seeded sampling is
    batch-invariant)."""
    data = shared_data / "math500.jsonl"
    model = ["--model", str(smol_dir), "--dtype", "float32"]
    whole = tmp_path / "rkv_whole"
    assert cli.main(["eval", str(data), str(whole), *_FLAGS, *_RKV, *model]) == 0
    assert "pass@1" in capsys.readouterr().err
    summary = json.loads((whole / "summary.json").read_text())
    assert (summary["problems"], summary["samples"], summary["k"]) == (3, 6, 2)
    assert summary["method"] == "rkv" and summary["budget"] == 64
    assert summary["mean_compressions"] > 0  # the prompts alone pass the budget
    assert 0 < summary["mean_generated_tokens"] <= 16
    assert set(summary["pass_at"]) == {"1", "2"}
    want = _samples(whole)
    assert len(want) == 6
    problems = {p.id: p for p in evaluation.read_problems(data, 3)}
    for s in want.values():
        assert s["answer"] == problems[s["id"]].answer
        assert s["correct"] == grading.grade(s["text"], s["answer"]).correct
        assert 0.0 <= s["repetition"] <= 1.0
    header = json.loads((whole / "samples.jsonl").read_text().splitlines()[0])["settings"]
    assert (header["temperature"], header["top_p"], header["n"]) == (0.6, 0.95, 2)

    # Interrupted after 3 graded samples (as Ctrl-C would), then the same call again.
    cut = tmp_path / "rkv_cut"
    real, calls = grading.grade, []

    def grade_then_stop(text, gold):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(text)
        return real(text, gold)

    kw = dict(
        limit=3,
        samples=2,
        slots=4,
        progress=False,
        sampling={"max_tokens": 16},
        cache={"method": "rkv", "budget": 64, "buffer": 16},
        settings={"model": str(smol.path.resolve()), "dtype": "float32"},
    )
    monkeypatch.setattr(grading, "grade", grade_then_stop)
    with pytest.raises(KeyboardInterrupt):
        evaluation.run_eval(smol, data, cut, **kw)
    assert len(_samples(cut)) == 3 and not (cut / "summary.json").exists()
    monkeypatch.setattr(grading, "grade", real)
    again = evaluation.run_eval(smol, data, cut, **kw)
    assert (again["samples_already_done"], again["samples_written"]) == (3, 3)
    got = _samples(cut)
    assert {k: v["text"] for k, v in got.items()} == {k: v["text"] for k, v in want.items()}
    assert again["pass@1"] == summary["pass@1"]

    # Another setting on the same folder is refused; FullKV gets its own (one problem: a
    # second cache method compiles every program again).
    full_kw = {**kw, "cache": {"method": "full"}}
    with pytest.raises(ValueError, match="other settings"):
        evaluation.run_eval(smol, data, cut, **full_kw)
    full = evaluation.run_eval(smol, data, tmp_path / "full", **{**full_kw, "limit": 1})
    assert full["method"] == "full" and full["budget"] is None
    assert full["mean_compressions"] == 0 and full["samples"] == 2


def test_default_length_leaves_room_for_the_instruction_used(
    smol, shared_data, tmp_path, monkeypatch
):
    """Without max_tokens an evaluation generates what the context leaves after the file's
    longest prompt, the instruction it was given included: the same length (a setting of the
    output's header) whatever --limit, so a rerun with a larger limit adds problems."""
    data = shared_data / "aime24.jsonl"
    lengths = []

    def record(runner, reqs, output_path, *, settings, **kw):
        lengths.append(settings["max_tokens"])
        raise KeyboardInterrupt  # before any work

    monkeypatch.setattr(jobs, "run_requests", record)
    for limit in (1, 5):
        with pytest.raises(KeyboardInterrupt):
            evaluation.run_eval(smol, data, tmp_path / "out", limit=limit, progress=False)
    assert lengths == [evaluation.default_max_tokens(smol, evaluation.read_problems(data))] * 2
    # (the first problem alone would leave more room: the check can tell the two apart)
    assert evaluation.default_max_tokens(smol, evaluation.read_problems(data, 1)) > lengths[0]
    problems = evaluation.read_problems(shared_data / "math500.jsonl", 3)
    words = "Think very carefully about every step before you answer. " * 8
    extra = len(smol.tokenizer.encode(" " + words.strip()))
    plain = evaluation.default_max_tokens(smol, problems)
    longer = evaluation.default_max_tokens(smol, problems, evaluation.R1_INSTRUCTION + " " + words)
    assert plain == smol.config.max_positions - max(
        len(smol.tokenizer.chat_ids(evaluation.prompt_of(p))) for p in problems
    )
    assert abs((plain - longer) - extra) <= 2  # BPE merges at the seam move a token or two


def test_eval_refuses_a_foreign_summary_before_work(smol, shared_data, tmp_path):
    (tmp_path / "summary.json").write_text('{"mine": 1}\n')
    with pytest.raises(ValueError, match="not an rkvjax eval summary"):
        evaluation.run_eval(smol, shared_data / "aime24.jsonl", tmp_path, limit=1)
    assert (tmp_path / "summary.json").read_text() == '{"mine": 1}\n'
    assert not (tmp_path / "samples.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [([], ":1: needs `answer`"), (["--samples", "0"], "sampling flags: n must")],
)
def test_cli_eval_checks_its_input_before_loading_the_model(tmp_path, capsys, flags, message):
    data = tmp_path / "p.jsonl"
    data.write_text('{"problem": "x"}\n' if not flags else '{"problem": "x", "answer": 1}\n')
    out = tmp_path / "out"
    argv = ["eval", str(data), str(out), "--model", str(tmp_path / "no-model"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()
