"""Offline JSONL jobs: results match generate, reruns resume, interrupted work is not lost, and
files the job must not touch (the input, foreign files, another job's output) are refused."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from jax.experimental import multihost_utils

import rkvjax
from rkvjax import cli, jobs

ROOT = Path(__file__).resolve().parents[1]
_HEADER = b'{"rkvjax_job": 1, "settings": {}}\n'  # a job header: format 1, no settings


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_results(path):
    """The result lines of a job output, after checking its header."""
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)[jobs.HEADER_KEY] == jobs.FORMAT_VERSION
    return [json.loads(line) for line in lines]


class _Result:
    def __init__(self, prompt):
        self.prompt = prompt

    def to_dict(self):
        return {"text": str(self.prompt).upper()}


def _echo(prompts):
    return [_Result(p) for p in prompts]


_never = functools.partial(pytest.fail, "generate must not run")


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
    out = _read_results(dst)
    assert [r["id"] for r in out] == [p["id"] for p in prompts]
    model = rkvjax.load(tiny)
    want = rkvjax.generate(
        model, [p["prompt_token_ids"] for p in prompts], max_new_tokens=6, ignore_eos=True
    )
    assert [r["token_ids"] for r in out] == [w.token_ids for w in want]


def test_cli_batch_refuses_other_settings_and_checks_rows_before_work(tiny, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt_token_ids": [3, 5, 7]}])
    argv = ["batch", str(src), str(dst), "--model", str(tiny), "--batch-size", "1"]
    argv += ["--ignore-eos", "--no-progress"]
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 0
    settings = json.loads(dst.read_text().splitlines()[0])["settings"]
    assert settings["max_new_tokens"] == 4 and settings["model"] == str(tiny.resolve())
    capsys.readouterr()
    assert cli.main([*argv, "--max-new-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens=4 in the file, 5 now" in err and "another output path" in err
    assert err.count("\n") == 1
    config = rkvjax.load(tiny).config
    rows = [{"id": "a", "prompt_token_ids": [3, 5, 7]}, {"id": "b", "prompt_token_ids": [4]}]
    rows += [{"id": "long", "prompt_token_ids": [1] * (config.max_positions - 3)}]
    rows += [{"id": "oov", "prompt_token_ids": [1, config.vocab_size]}]
    _write_jsonl(src, rows)
    before = dst.read_bytes()
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"rkvjax: error: {src}:3 (id 'long'): {config.max_positions - 3} prompt tokens + "
        f"max_new_tokens=4 exceed the model's {config.max_positions} positions "
        "(1 more line fails too)\n"
    )
    assert dst.read_bytes() == before  # "b" was not generated either
    _write_jsonl(src, [rows[0], rows[1], rows[3]])
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3 (id 'oov'): token id(s) [{config.vocab_size}] outside the vocabulary" in err
    assert dst.read_bytes() == before


def test_cli_checks_files_before_loading_the_model(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    dst = tmp_path / "missing" / "out.jsonl"
    assert cli.main(["batch", str(src), str(dst), "--model", str(tmp_path / "no_model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rkvjax: error: ") and err.count("\n") == 1
    assert f"folder {dst.parent} does not exist" in err


@pytest.mark.parametrize("command", ["batch", "generate"])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys, command):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_{command}", interrupted)
    out = tmp_path / "out.jsonl"
    argv = ["batch", "in.jsonl", str(out)] if command == "batch" else ["generate", "hi"]
    try:
        assert cli.main(argv) == 130
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped rkvjax.cli.main")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rkvjax: interrupted")
    if command == "batch":
        assert f"finished results are in {out}, rerun the same command to resume" in err


class _Crash(RuntimeError):
    pass


def test_crash_keeps_finished_batches_and_torn_line_is_dropped(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": f"q{i}"} for i in range(6)])
    ids = [r.id for r in jobs.read_prompts(src)]
    calls = []

    def flaky(prompts):
        calls.append(list(prompts))
        if len(calls) == 2:
            raise _Crash
        return _echo(prompts)

    with pytest.raises(_Crash):
        jobs.run_job(flaky, src, dst, batch_size=2, progress=False)
    assert [r["id"] for r in _read_results(dst)] == ids[:2]  # the first batch survived
    with open(dst, "a") as f:
        f.write(f'{{"id": "{ids[2]}", "te')  # a write torn by a crash mid-line
    ran, skipped = jobs.run_job(flaky, src, dst, batch_size=2, progress=False)
    assert (ran, skipped) == (4, 2)
    rows = _read_results(dst)
    assert [r["id"] for r in rows] == ids
    assert rows[2]["text"] == "Q2"


# `rkvjax batch IN OUT` with a generate that takes 0.3 s a batch instead of a model.
_SLOW_JOB = """
import sys, time
from rkvjax import cli, jobs

class Result:
    def __init__(self, prompt):
        self.prompt = prompt

    def to_dict(self):
        return {"text": self.prompt.upper()}

def slow(prompts):
    time.sleep(0.3)
    return [Result(p) for p in prompts]

def batch(args):
    jobs.run_job(slow, args.input, args.output, batch_size=2, progress=False)
    return 0

cli._batch = batch
sys.exit(cli.main(["batch", *sys.argv[1:]]))
"""


def _lines(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_stopped_job_reruns_to_every_id_exactly_once(tmp_path, sig):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": f"q{i}"} for i in range(8)])
    cmd = [sys.executable, "-c", _SLOW_JOB, str(src), str(dst)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RKVJAX_COMPILE_CACHE": "0"}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while _lines(dst) < 3 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # wait for the header and the first batch
    try:
        assert job.poll() is None, job.stderr.read()
        # A second job (this process) on the output of a running one is refused.
        with pytest.raises(ValueError, match="another rkvjax batch job is writing it"):
            jobs.run_job(_never, src, dst, progress=False)
    finally:
        job.send_signal(sig)
        err = job.communicate()[1]
    if sig == signal.SIGINT:
        assert job.returncode == 130
        assert err == (
            f"rkvjax: interrupted; finished results are in {dst}, rerun the same command to "
            "resume\n"
        )
    assert len(_read_results(dst)) < 8
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    ids = [r["id"] for r in _read_results(dst)]
    assert sorted(ids) == sorted(r.id for r in jobs.read_prompts(src))


def test_second_job_on_the_same_output_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])

    def generate_and_start_another(prompts):
        with pytest.raises(ValueError, match=f"{dst}: another rkvjax batch job is writing it"):
            jobs.run_job(_never, src, dst, progress=False)
        return _echo(prompts)

    assert jobs.run_job(generate_and_start_another, src, dst, progress=False) == (2, 0)
    assert jobs.run_job(_never, src, dst, progress=False) == (0, 2)  # the lock was released
    assert len(_read_results(dst)) == 2


@pytest.mark.parametrize(
    "content",
    [
        b'{"id": 1, "text": "mine"}\n{"id": 2, "text": "also mi',  # no newline at the end
        b"notes, not results",
        b'{"id": 1, "text": "mine"}\n',
        b'{"rkvjax": 1}\n',
    ],
)
def test_output_without_a_job_header_is_refused_untouched(tmp_path, content):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": 1, "prompt": "a"}, {"id": 3, "prompt": "b"}])
    dst.write_bytes(content)
    with pytest.raises(ValueError, match=f"{dst}: exists and is not an rkvjax batch output"):
        jobs.run_job(_never, src, dst, progress=False)
    assert dst.read_bytes() == content


def test_other_job_format_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    dst.write_text(json.dumps({jobs.HEADER_KEY: 99, "settings": {}}) + "\n")
    with pytest.raises(ValueError, match="job format 99"):
        jobs.run_job(_never, src, dst, progress=False)


@pytest.mark.parametrize("link", ["same path", "symlink", "hard link"])
def test_input_as_output_is_refused_untouched(tmp_path, link):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}')  # no newline after the last prompt
    before = src.read_bytes()
    dst = src if link == "same path" else tmp_path / "out.jsonl"
    if link == "symlink":
        dst.symlink_to(src)
    elif link == "hard link":
        dst.hardlink_to(src)
    with pytest.raises(ValueError, match="is the input file itself"):
        jobs.run_job(_never, src, dst, progress=False)
    assert src.read_bytes() == before


def test_rerun_with_other_settings_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])
    settings = {"model": "m", "max_new_tokens": 4, "method": "rkv"}
    assert jobs.run_job(_echo, src, dst, batch_size=1, progress=False, settings=settings) == (2, 0)
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    before = dst.read_bytes()
    other = {**settings, "max_new_tokens": 8, "method": "snapkv"}
    with pytest.raises(ValueError) as e:
        jobs.run_job(_never, src, dst, progress=False, settings=other)
    diff = 'max_new_tokens=4 in the file, 8 now; method="rkv" in the file, "snapkv" now'
    assert diff in str(e.value) and "pick another output path for a new job" in str(e.value)
    assert dst.read_bytes() == before
    assert jobs.run_job(_echo, src, dst, progress=False, settings=dict(settings)) == (1, 2)


def test_output_without_results_takes_the_new_settings(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])

    def too_long(prompt):
        raise ValueError("too long")

    with pytest.raises(ValueError, match="too long"):
        jobs.run_job(_never, src, dst, progress=False, settings={"n": 1}, check=too_long)
    assert jobs.run_job(_echo, src, dst, progress=False, settings={"n": 2}) == (1, 0)
    assert json.loads(dst.read_text().splitlines()[0])["settings"] == {"n": 2}


def test_default_ids_follow_the_prompt_through_edits(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}, {"prompt_token_ids": [1, 2]}])
    assert jobs.run_job(_echo, src, dst, progress=False) == (3, 0)
    # A prompt inserted at the top and another removed: the others keep their ids.
    _write_jsonl(src, [{"prompt": "new"}, {"prompt": "a"}, {"prompt_token_ids": [1, 2]}])
    assert jobs.run_job(_echo, src, dst, progress=False) == (1, 2)
    texts = {r["id"]: r["text"] for r in _read_results(dst)}
    rows = jobs.read_prompts(src)
    assert [texts[r.id] for r in rows] == ["NEW", "A", "[1, 2]"]
    assert rows[1].id == jobs.default_id({"prompt": "a"}) and len(rows[1].id) == 16


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"text": "x"}', "unknown field\\(s\\) 'text'"),
        (
            '{"prompt": "x", "max_new_tokens": 5, "temperature": 1}',
            "unknown field\\(s\\) 'max_new_tokens', 'temp",
        ),
        (
            '{"prompt": "x", "prompt_token_ids": [1]}',
            "has both `prompt` and `prompt_token_ids`; give one, not both",
        ),
        ('{"id": 7}', "needs `prompt` \\(text\\) or `prompt_token_ids`"),
        ('{"prompt": 5}', "`prompt` must be a non-empty string, got 5"),
        ('{"prompt": ""}', "`prompt` must be a non-empty string"),
        ('{"prompt_token_ids": [1, "2"]}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"prompt_token_ids": [true]}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"prompt_token_ids": []}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"prompt_token_ids": 3}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"id": [1], "prompt": "x"}', "`id` must be a string or an integer"),
        ('{"id": 1, "prompt": "b"}', "duplicate id 1 \\(line 1 has it\\)"),
        ('{"prompt": "a"}', "same prompt as line 3; give each of them an `id`"),
    ],
)
def test_bad_line_is_rejected_before_work(tmp_path, line, match):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n\n{"prompt": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{src}:4: {match}"):
        jobs.run_job(_never, src, tmp_path / "out.jsonl", progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_input_without_prompts_is_rejected(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        jobs.run_job(_never, src, tmp_path / "out.jsonl", progress=False)


def test_check_runs_on_every_prompt_before_work(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "ok"}, {"id": "x", "prompt": "long"}, {"prompt": "long!"}])

    def check(prompt):
        if prompt.startswith("long"):
            raise ValueError("too many tokens")

    with pytest.raises(ValueError) as e:
        jobs.run_job(_never, src, dst, batch_size=1, progress=False, check=check)
    assert str(e.value) == f"{src}:2 (id 'x'): too many tokens (1 more line fails too)"
    assert _read_results(dst) == []


@pytest.mark.parametrize(
    "where, error, match",
    [
        ("missing/out.jsonl", FileNotFoundError, "folder .*missing does not exist"),
        (".", ValueError, "is a directory; give a file path for the results"),
    ],
)
def test_bad_output_path_fails_before_work(tmp_path, where, error, match):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    with pytest.raises(error, match=match):
        jobs.run_job(_never, src, tmp_path / where, progress=False)
    with pytest.raises(error, match=match):
        jobs.preflight(src, tmp_path / where)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_unwritable_output_fails_before_work(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    dst.write_text("")
    dst.chmod(0o444)
    with pytest.raises(ValueError, match="cannot write it"):
        jobs.run_job(_never, src, dst, progress=False)


def test_directory_or_missing_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}: is a directory; give the JSONL file"):
        jobs.run_job(_never, tmp_path, tmp_path / "out.jsonl", progress=False)
    with pytest.raises(FileNotFoundError, match="no such file"):
        jobs.run_job(_never, tmp_path / "nope.jsonl", tmp_path / "out.jsonl", progress=False)


@pytest.mark.parametrize(
    "results, match",
    [
        (['{"id": "a", "text": "A"}', "garbage", '{"id": "b"}'], ":3: corrupt result line"),
        (['{"text": "A"}'], ":2: result line without an `id`"),
        (["[1]"], ":2: result line without an `id`"),
    ],
)
def test_damaged_output_names_its_line(tmp_path, results, match):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    content = _HEADER + "".join(r + "\n" for r in results).encode()
    dst.write_bytes(content)
    with pytest.raises(ValueError, match=f"{dst}{match}"):
        jobs.run_job(_never, src, dst, progress=False)
    assert dst.read_bytes() == content


def test_other_processes_never_touch_the_output(tmp_path, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert jobs.run_job(_echo, src, dst, progress=False) == (2, 0)
    assert not dst.exists()
    # Process 0 could not open the output: the others stop instead of waiting for it.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda flags: flags * False)
    with pytest.raises(ValueError, match="process 0 could not open it"):
        jobs.run_job(_never, src, dst, progress=False)
