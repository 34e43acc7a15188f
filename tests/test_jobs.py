"""Offline JSONL jobs: results match generate, reruns resume, interrupted work is not lost."""

import functools
import json

import pytest

import rkvjax
from rkvjax import cli, jobs


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


def test_cli_batch_matches_generate_and_resumes(tiny, tmp_path, capsys):
    prompts = [{"id": f"p{i}", "prompt_token_ids": [3 + i, 5, 7, 11 + i]} for i in range(5)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, prompts[:3])
    argv = ["batch", str(src), str(dst), "--model", str(tiny), "--batch-size", "2"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--no-progress"]
    assert cli.main(argv) == 0
    _write_jsonl(src, prompts)  # two more prompts arrive; the first three are done
    assert cli.main(argv) == 0
    assert "2 prompts generated, 3 already done" in capsys.readouterr().err
    out = _read_jsonl(dst)
    assert [r["id"] for r in out] == [p["id"] for p in prompts]
    model = rkvjax.load(tiny)
    want = rkvjax.generate(
        model, [p["prompt_token_ids"] for p in prompts], max_new_tokens=6, ignore_eos=True
    )
    assert [r["token_ids"] for r in out] == [w.token_ids for w in want]


class _Crash(RuntimeError):
    pass


def test_crash_keeps_finished_batches_and_torn_line_is_dropped(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": f"q{i}"} for i in range(6)])
    calls = []

    class Result:
        def __init__(self, p):
            self.p = p

        def to_dict(self):
            return {"text": self.p.upper()}

    def flaky(prompts):
        calls.append(list(prompts))
        if len(calls) == 2:
            raise _Crash
        return [Result(p) for p in prompts]

    with pytest.raises(_Crash):
        jobs.run_job(flaky, src, dst, batch_size=2, progress=False)
    assert [r["id"] for r in _read_jsonl(dst)] == [1, 2]  # the first batch survived
    with open(dst, "a") as f:
        f.write('{"id": 3, "te')  # a write torn by a crash mid-line
    ran, skipped = jobs.run_job(flaky, src, dst, batch_size=2, progress=False)
    assert (ran, skipped) == (4, 2)
    rows = _read_jsonl(dst)
    assert [r["id"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[2]["text"] == "Q2"


@pytest.mark.parametrize(
    "lines, match",
    [
        (["{not json"], "not valid JSON"),
        ([json.dumps({"text": "x"})], "`prompt` or `prompt_token_ids`"),
        ([json.dumps({"id": 1, "prompt": "a"}), json.dumps({"id": 1, "prompt": "b"})], "duplicate"),
        ([], "no prompts"),
    ],
)
def test_bad_input_is_rejected_before_work(tmp_path, lines, match):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    never = functools.partial(pytest.fail, "generate must not run")
    with pytest.raises(ValueError, match=match):
        jobs.run_job(never, src, tmp_path / "out.jsonl", progress=False)
