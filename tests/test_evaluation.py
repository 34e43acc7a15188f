"""Evaluation: answer extraction and grading (math-verify), pass@k, repetition, the problem
file's checks, and `rkvjax eval` end to end (kill and resume) on a tiny checkpoint."""

from __future__ import annotations

import itertools
import json
import random
import types
from pathlib import Path

import pytest

from rkvjax.entrypoints import cli, evaluation, jobs
from rkvjax.entrypoints.evaluation import grading, hub, metrics

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


@pytest.mark.parametrize(
    ("text", "gold", "truncated", "answer", "source", "correct"),
    [
        # An echoed problem, cut off at max_tokens: no answer, wrong (math-verify would
        # evaluate "2 + 2" to 4, and once did).
        ("2 + 2", "4", True, None, None, False),
        ("We need to compute $\\dbinom{31}{28}$. Let", "4495", True, None, None, False),
        # Ended by itself: the harness's last-number fallback reads 2 and 28.
        ("2 + 2", "4", False, "2", "last_number", False),
        ("We need to compute $\\dbinom{31}{28}$. Let", "4495", False, "28", "last_number", False),
        ("So 2 + 2 = 4", "4", False, "4", "last_number", True),
        ("So 2 + 2 = 4", "4", True, None, None, False),
        # A stated answer, to the end of its sentence; thousands separators read as one number.
        ("The answer is 12. Then we check 7.", "12", False, "12", "phrase", True),
        ("The final answer is 32,348.", "32348", False, "32,348", "phrase", True),
        ("The answer is:\n\n$\\frac{1}{2}$", "0.5", False, "$\\frac{1}{2}$", "phrase", True),
        ("The answer is 12. Then", "12", True, None, None, False),
        # A box counts even in a sample cut off after it; the last box wins.
        ("so $\\boxed{4495}$. Let me check: 31 choose", "4495", True, "4495", "boxed", True),
        ("\\boxed{3} or maybe \\boxed{5}", "3", False, "5", "boxed", False),
    ],
)
def test_a_sample_without_a_final_answer_is_never_correct(
    text, gold, truncated, answer, source, correct
):
    g = grading.grade(text, gold, truncated=truncated)
    assert (g.answer, g.source, g.correct) == (answer, source, correct)


class _Echoes(jobs.Runner):
    """Stands in for the engine: every sample echoes "2 + 2" and is cut off at max_tokens."""

    model_name = "stub"

    def __init__(self, model, *, cache, slots):
        pass

    def run(self, reqs):
        for r in reqs:
            for j in r.sample_indices:
                rec = {"sample_index": j, "text": "2 + 2", "finish_reason": "length"}
                rec.update(prompt_tokens=5, completion_tokens=4, compressions=0)
                rec.update(peak_cache_slots=9, stalled_steps=0, time_to_first_token_s=0.0)
                yield r, {**rec, "token_ids": [17, 1009, 17, 1009]}


def test_eval_never_credits_an_echoed_problem(tmp_path, monkeypatch):
    """`rkvjax eval` on "What is 2+2?" whose sample echoes "2 + 2" until max_tokens: no answer,
    pass@1 0 (it was 100%: math-verify read the echo as an expression worth 4)."""
    data = _write(tmp_path / "p.jsonl", [{"problem": "What is 2+2?", "answer": "4"}])
    monkeypatch.setattr(jobs, "EngineRunner", _Echoes)
    out = tmp_path / "out"
    summary = evaluation.run_eval(
        types.SimpleNamespace(path=tmp_path), data, out, sampling={"max_tokens": 4}, progress=False
    )
    assert (summary["pass@1"], summary["pass@1_boxed"], summary["answered_samples"]) == (0, 0, 0)
    [line] = evaluation.read_samples(out / "samples.jsonl")
    assert (line["extracted_answer"], line["answer_source"], line["correct"]) == (None, None, False)


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


def test_a_sample_loops_when_cut_off_inside_a_cycle():
    """Cut at the limit in a cycle: looping; the same cycle ending by itself, or text that
    only repeated itself earlier and then moved on: not."""
    prose = list(range(1000, 1400))  # no 4-gram twice
    cycle = [7, 8, 9, 10, 11] * 60
    assert metrics.is_looping(prose + cycle, "length")
    assert not metrics.is_looping(prose + cycle, "stop")
    assert not metrics.is_looping(cycle + prose, "length")
    assert not metrics.is_looping(prose, "length")
    half = prose[:128] + [7, 8, 9, 10] * 32  # the last 256 tokens: 128 fresh, a 4-cycle
    assert metrics.repetition_rate(half) == pytest.approx(1 - (125 + 4 + 3) / 253)  # 0.478
    assert not metrics.is_looping(half, "length")
    assert metrics.is_looping(prose[:100] + [7, 8, 9, 10] * 39, "length")  # 0.589


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
        line["answer_source"] = "boxed" if line["completion_tokens"] == 10 else "last_number"
    lines[1]["answer_source"] = None
    s = metrics.summarize(lines, problems, samples=2)
    assert (s["problems"], s["incomplete_problems"], s["samples"]) == (2, 1, 4)
    assert s["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["pass@1_boxed"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["answer_sources"] == {"boxed": 1, "none": 1, "last_number": 2}
    lines[0]["answer_source"] = "phrase"  # right, but not boxed
    assert metrics.summarize(lines, problems, samples=2)["pass@1_boxed"] == 0.0
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
        ('{"problem": "x", "answer": NaN}', ":2: `answer` must be a finite number, got nan"),
        ('{"problem": "x", "answer": -Infinity}', ":2: `answer` must be a finite number"),
        ({"id": 7, "problem": "x", "answer": "1"}, ":2: duplicate id 7 \\(line 1 has it\\)"),
        ({"problem": "x", "question": "y", "answer": "1"}, ":2: has `problem` and `question` wi"),
        ('{"problem": "\\ud83d", "answer": "1"}', ":2: not valid Unicode text: a lone surrogate"),
        ('{"id": "\\ud83d", "problem": "x", "answer": "1"}', ":2: not valid Unicode text"),
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
        truncated = s["finish_reason"] == "length"
        assert s["correct"] == grading.grade(s["text"], s["answer"], truncated=truncated).correct
        assert 0.0 <= s["repetition"] <= 1.0
    header = json.loads((whole / "samples.jsonl").read_text().splitlines()[0])["settings"]
    assert (header["temperature"], header["top_p"], header["n"]) == (0.6, 0.95, 2)

    # Interrupted after 3 graded samples (as Ctrl-C would), then the same call again.
    cut = tmp_path / "rkv_cut"
    real, calls = grading.grade, []

    def grade_then_stop(text, gold, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(text)
        return real(text, gold, **kw)

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


# -- problem files named by a Hub dataset (the Hub itself is never reached in tests) ----------


def test_hub_names_are_told_from_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "local").write_text("{}\n")
    assert hub.parse_name("HuggingFaceH4/MATH-500") == ("HuggingFaceH4/MATH-500", None)
    assert hub.parse_name("hf://datasets/a/b/data/t.parquet") == ("a/b", "data/t.parquet")
    for local in ("owner/local", "math.jsonl", "runs/x.jsonl", "./a/b", "/a/b", "a/b/c"):
        assert hub.parse_name(local) is None, local
        assert evaluation.problem_file(local) == Path(local)


def _fake_hub(monkeypatch, files: dict, calls: list):
    """The hub library's two calls, serving `files` (repo path -> bytes) of one dataset."""
    import huggingface_hub

    def list_repo_files(repo, *, repo_type):
        calls.append(("list", repo, repo_type))
        return sorted(files)

    def hf_hub_download(repo, file, *, repo_type, local_dir):
        calls.append(("download", repo, file))
        path = Path(local_dir) / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[file])
        return str(path)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)


def _offline(monkeypatch):
    import huggingface_hub

    def fail(*args, **kw):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", fail)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)


def test_a_hub_dataset_is_fetched_once_then_read_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path / "home"))
    rows = [{"problem": "What is 2+2?", "answer": "4", "unique_id": "a"}]
    calls = []
    _fake_hub(monkeypatch, {"README.md": b"", "test.jsonl": _jsonl(rows)}, calls)
    path = evaluation.problem_file("HuggingFaceH4/MATH-500")
    assert path == tmp_path / "home" / "datasets" / "HuggingFaceH4--MATH-500" / "test.jsonl"
    assert [p.answer for p in evaluation.read_problems(path)] == ["4"]
    assert calls == [
        ("list", "HuggingFaceH4/MATH-500", "dataset"),
        ("download", "HuggingFaceH4/MATH-500", "test.jsonl"),
    ]
    assert sorted(p.name for p in path.parent.iterdir()) == ["test.jsonl"]  # no leftovers
    _offline(monkeypatch)
    assert evaluation.problem_file("HuggingFaceH4/MATH-500") == path  # from the cache
    with pytest.raises(ValueError) as e:
        evaluation.problem_file("HuggingFaceH4/aime_2024")
    assert str(e.value) == (
        "HuggingFaceH4/aime_2024: no such local file, and fetching the dataset from the Hugging "
        "Face Hub failed (Failed to resolve 'huggingface.co'); download its JSONL file and pass "
        "that file's path"
    )


def test_a_parquet_hub_dataset_becomes_jsonl(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import io

    import pyarrow

    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path / "home"))
    table = pyarrow.table({"id": [60, 61], "problem": ["p", "q"], "answer": ["204", "25"]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    files = {"data/train-00000-of-00001.parquet": buf.getvalue(), ".gitattributes": b""}
    _fake_hub(monkeypatch, files, [])
    path = evaluation.problem_file("HuggingFaceH4/aime_2024")
    assert path.name == "data--train-00000-of-00001.jsonl"
    assert [(p.id, p.answer) for p in evaluation.read_problems(path)] == [(60, "204"), (61, "25")]


def test_a_hub_dataset_with_several_files_asks_for_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path / "home"))
    rows = _jsonl([{"problem": "p", "answer": "1"}])
    _fake_hub(monkeypatch, {"train.jsonl": rows, "test.jsonl": rows}, [])
    with pytest.raises(ValueError, match=r"several data files \(test\.jsonl, train\.jsonl\); name"):
        evaluation.problem_file("o/d")
    assert evaluation.problem_file("hf://datasets/o/d/train.jsonl").name == "train.jsonl"
    _fake_hub(monkeypatch, {"README.md": b""}, [])
    with pytest.raises(ValueError, match="holds no JSONL or Parquet file"):
        evaluation.problem_file("o/e")


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
