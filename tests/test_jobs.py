"""Offline JSONL jobs: results match generate, reruns resume, interrupted work is not lost, and
files the job must not touch (the input, foreign files, another job's output) are refused.

Most tests run the job on a stand-in runner (`_Echo`), so they exercise the file handling in
milliseconds; the tests named `*_engine_*` or `test_cli_*` run the real engine on a tiny model."""

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
from rkvjax.entrypoints import cli, jobs
from rkvjax.entrypoints.jobs import openai_batch, output
from tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
# a job header: this format, no settings
_HEADER = json.dumps({jobs.HEADER_KEY: jobs.FORMAT_VERSION, "settings": {}}).encode() + b"\n"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_results(path):
    """The result lines of a job output, after checking its header (the end line of a finished
    job left out)."""
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)[jobs.HEADER_KEY] == jobs.FORMAT_VERSION
    rows = [json.loads(line) for line in lines]
    return rows[:-1] if rows and jobs.END_KEY in rows[-1] else rows


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _end(path):
    """The end line's fields of a job output (None when its last line is not one)."""
    last = json.loads(path.read_text().splitlines()[-1])
    return last.get(jobs.END_KEY)


def _settings(path):
    return json.loads(path.read_text().splitlines()[0])["settings"]


def _record(request, j):
    return {
        "sample_index": j,
        "text": str(request.prompt).upper(),
        "finish_reason": "length",
        "prompt_tokens": 1,
        "completion_tokens": request.sampling.max_tokens,
        "token_ids": [j],
    }


class _Echo(jobs.Runner):
    """Answers each request with its prompt in capitals, samples in order; optionally fails
    after `crash_after` samples."""

    def __init__(self, crash_after=None):
        self.crash_after, self.seen = crash_after, []

    def run(self, reqs):
        for r in reqs:
            for j in r.sample_indices:
                if self.crash_after is not None and len(self.seen) == self.crash_after:
                    raise _Crash
                self.seen.append((r.id, j))
                yield r, _record(r, j)


class _Never(jobs.Runner):
    def run(self, reqs):
        pytest.fail("the job must not generate anything")


class _Crash(RuntimeError):
    pass


def _run(runner, src, dst, **kw):
    kw.setdefault("progress", False)
    return jobs.run_job(runner, src, dst, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


# -- the real engine -------------------------------------------------------------------------


def test_cli_batch_matches_generate_and_resumes(tiny, tmp_path, capsys):
    prompts = [{"id": f"p{i}", "prompt_token_ids": [3 + i, 5, 7, 11 + i]} for i in range(5)]
    prompts[4]["n"] = 2  # greedy: two identical samples
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, prompts[:3])
    argv = ["batch", str(src), str(dst), "--model", str(tiny), "--slots", "2", "--token-ids"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--no-progress"]
    assert cli.main(argv) == 0
    _write_jsonl(src, prompts)  # two more prompts arrive; the first three are done
    capsys.readouterr()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "3 samples written, 3 already done" in err and err.count("\n") == 1
    out = _read_results(dst)
    assert sorted((r["id"], r["sample_index"]) for r in out) == [
        *[(f"p{i}", 0) for i in range(4)],
        ("p4", 0),
        ("p4", 1),
    ]
    model = rkvjax.load(tiny)
    want = rkvjax.generate(
        model, [p["prompt_token_ids"] for p in prompts], max_new_tokens=6, ignore_eos=True
    )
    got = {(r["id"], r["sample_index"]): r for r in out}
    for i, w in enumerate(want):
        assert got[f"p{i}", 0]["token_ids"] == w.token_ids
        assert got[f"p{i}", 0]["completion_tokens"] == 6
    assert got["p4", 1]["token_ids"] == want[4].token_ids
    summary = json.loads(jobs.summary_path(dst).read_text())
    assert summary["samples_written"] == 3 and summary["samples_already_done"] == 3
    assert summary["runtime"]["generated_tokens"] == 18 and summary["requests"] == 5


def test_cli_batch_refuses_other_settings_and_checks_rows_before_work(tiny, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt_token_ids": [3, 5, 7]}])
    argv = ["batch", str(src), str(dst), "--model", str(tiny), "--slots", "1"]
    argv += ["--ignore-eos", "--no-progress"]
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 0
    settings = _settings(dst)
    assert settings["max_tokens"] == 4 and settings["model"] == str(tiny.resolve())
    capsys.readouterr()
    assert cli.main([*argv, "--max-new-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens=4 in the file, 5 now" in err and "another output path" in err
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
        f"max_tokens=4 exceed the model's {config.max_positions} positions "
        "(1 more line fails too)\n"
    )
    assert dst.read_bytes() == before  # "b" was not generated either
    _write_jsonl(src, [rows[0], rows[1], rows[3]])
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3 (id 'oov'): token id(s) [{config.vocab_size}] outside the vocabulary" in err
    assert dst.read_bytes() == before
    # More logprobs than the vocabulary: the line is named before the output exists.
    v = config.vocab_size
    _write_jsonl(src, [rows[0], {"id": "lp", "prompt_token_ids": [4], "logprobs": v + 1}])
    fresh = tmp_path / "fresh.jsonl"
    assert cli.main(["batch", str(src), str(fresh), *argv[3:], "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"rkvjax: error: {src}:2 (id 'lp'): logprobs={v + 1} asks for more tokens than the "
        f"vocabulary's {v}\n"
    )
    assert not fresh.exists() and not jobs.summary_path(fresh).exists()


def test_engine_job_honours_per_request_settings(tiny, tmp_path):
    """A line's sampling fields override the job's defaults; an unseeded sampled request gets
    the seed `request_seed(job seed, id)`, so its tokens equal generate with that seed."""
    rows = [
        {"id": "short", "prompt_token_ids": [3, 5, 7, 9], "max_tokens": 3},
        {"id": "hot", "prompt_token_ids": [4, 6, 8], "temperature": 0.9, "top_p": 0.8},
        {"id": "seeded", "prompt_token_ids": [4, 6, 8], "temperature": 0.9, "seed": 7, "n": 2},
        {"id": "plain", "prompt_token_ids": [2, 3, 4, 5, 6]},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, rows)
    model = rkvjax.load(tiny)
    defaults = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "seed": 11}
    runner = jobs.EngineRunner(model, cache={"method": "full"}, slots=2)
    _run(runner, src, dst, defaults=defaults, token_ids=True)
    got = {(r["id"], r["sample_index"]): r["token_ids"] for r in _read_results(dst)}
    sp = rkvjax.SamplingParams
    want = {
        "short": sp(temperature=0.0, max_tokens=3, ignore_eos=True),
        "hot": sp(
            temperature=0.9,
            top_p=0.8,
            max_tokens=8,
            ignore_eos=True,
            seed=jobs.request_seed(11, "hot"),
        ),
        "seeded": sp(temperature=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True),
        "plain": sp(temperature=0.0, max_tokens=8, ignore_eos=True),
    }
    outs = rkvjax.generate(model, [r["prompt_token_ids"] for r in rows], sampling=[*want.values()])
    assert len(got["short", 0]) == 3 and len(got["plain", 0]) == 8
    for row, out in zip(rows, outs, strict=True):
        for res in out if isinstance(out, list) else [out]:
            assert got[row["id"], res.sample_index] == res.token_ids, row["id"]
    assert got["seeded", 0] != got["seeded", 1]  # two draws of one prompt


def test_engine_job_admits_the_longest_requests_first(tiny, tmp_path):
    """By default a freed slot takes the request with the largest max_tokens (ties in input
    order); `order="input"` keeps the file's order. One slot finishes requests in the order
    they were admitted, and the tokens do not depend on it."""
    budgets = {"a": 3, "b": 9, "c": 5, "d": 9}
    rows = [
        {"id": k, "prompt_token_ids": [3, 4 + i], "max_tokens": m}
        for i, (k, m) in enumerate(budgets.items())
    ]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    model = rkvjax.load(tiny)
    tokens = {}
    for order, want in [("longest", "bdca"), ("input", "abcd")]:
        dst = tmp_path / f"{order}.jsonl"
        runner = jobs.EngineRunner(model, cache={"method": "full"}, slots=1, order=order)
        _run(runner, src, dst, defaults={"temperature": 0.0, "ignore_eos": True}, token_ids=True)
        got = _read_results(dst)
        assert "".join(r["id"] for r in got) == want
        tokens[order] = {r["id"]: r["token_ids"] for r in got}
    assert tokens["longest"] == tokens["input"]
    assert {k: len(v) for k, v in tokens["input"].items()} == budgets
    with pytest.raises(ValueError, match="order must be one of longest, input"):
        jobs.EngineRunner(model, cache={"method": "full"}, order="shortest")


def test_engine_job_answers_openai_batch_lines(tiny, tmp_path):
    """OpenAI batch lines in, the OpenAI batch output shape out: every sample a choice of one
    response, logprobs when asked, usage summed."""
    lines = [
        {
            "custom_id": "req-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": [3, 5, 7, 9], "max_tokens": 4, "logprobs": 2},
        },
        {
            "custom_id": "req-2",
            "url": "/v1/completions",
            "body": {"prompt": [4, 6, 8], "max_tokens": 3, "n": 2, "temperature": 0.0},
        },
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, lines)
    model = rkvjax.load(tiny)
    runner = jobs.EngineRunner(model, cache={"method": "full"}, slots=2)
    _run(runner, src, dst, defaults={"temperature": 0.0, "ignore_eos": True})
    out = {r["custom_id"]: r for r in _read_results(dst)}
    assert set(out) == {"req-1", "req-2"}
    first = out["req-1"]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    body = first["response"]["body"]
    assert first["response"]["status_code"] == 200 and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 4
    want = rkvjax.generate(
        model,
        [3, 5, 7, 9],
        sampling=rkvjax.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2),
    )
    assert choice["logprobs"]["tokens"] == [str(t) for t in want.token_ids]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs)
    assert [len(t) for t in choice["logprobs"]["top_logprobs"]] == [2] * 4
    second = out["req-2"]["response"]["body"]
    assert [c["index"] for c in second["choices"]] == [0, 1]
    assert second["choices"][0]["text"] == second["choices"][1]["text"]
    assert second["usage"]["completion_tokens"] == 6


# `rkvjax batch IN OUT` on the tiny model, as a user runs it; the test kills it.
_ENGINE_JOB = [sys.executable, "-m", "rkvjax", "batch"]


def _key(r):
    return r["id"], r["sample_index"]


def _timeless(results):
    """Result lines in (id, sample) order, without what depends on the run rather than the
    sample: time to first token, and steps spent waiting for a compression lane (which rows
    shared the lanes)."""
    drop = ("time_to_first_token_s", "stalled_steps")
    return sorted(({k: v for k, v in r.items() if k not in drop} for r in results), key=_key)


def _lines(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize(
    ("cache", "order"),
    [
        (["--method", "rkv"], []),
        # Sampled, through an 8-bit cache, the interrupted run in input order: its rows run
        # beside other neighbours, at other widths, and wait for lanes at other steps.
        (["--method", "h2o", "--kv-dtype", "int8", "--temperature", "0.8"], ["--order", "input"]),
    ],
)
def test_engine_job_killed_mid_run_resumes_to_the_uninterrupted_result(
    tiny, tmp_path, cache, order
):
    """SIGKILL while results are being written, then the same command again: every (id, sample
    index) exactly once, equal to a job that was never interrupted."""
    rows = [{"id": i, "prompt_token_ids": [3 + i, *range(5, 14)]} for i in range(12)]
    for r in rows[::3]:
        r["n"] = 2
    for r in rows[1::4]:
        r["max_tokens"] = 30
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    flags = ["--model", str(tiny), "--slots", "2", "--max-new-tokens", "48", "--ignore-eos"]
    flags += [*cache, "--budget", "16", "--buffer", "8", "--token-ids", "--no-progress"]
    whole = tmp_path / "whole.jsonl"
    assert cli.main(["batch", str(src), str(whole), *flags]) == 0
    dst = tmp_path / "out.jsonl"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RKVJAX_COMPILE_CACHE": "0"}
    flags += order
    job = subprocess.Popen(
        [*_ENGINE_JOB, str(src), str(dst), *flags], cwd=ROOT, env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + HANG_S
    while _lines(dst) < 4 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # the header and a few results
    job.send_signal(signal.SIGKILL)
    err = job.communicate()[1]
    assert job.returncode == -signal.SIGKILL, err.decode()
    assert 3 <= len(_read_results(dst)) < 16  # killed with work left
    assert cli.main(["batch", str(src), str(dst), *flags]) == 0
    key = _key
    got, want = _read_results(dst), _read_results(whole)
    assert len(got) == len({key(r) for r in got}) == 16
    assert _timeless(got) == _timeless(want)


def test_engine_job_raising_n_decodes_only_the_new_samples(tiny, tmp_path):
    """n 2 -> 3 on a rerun decodes the one new sample (seeds depend on the sample index), and
    it equals the third sample of a job that asked for 3 at once."""
    row = {"id": "a", "prompt_token_ids": [3, *range(5, 14)], "temperature": 0.8, "seed": 3}
    src = tmp_path / "in.jsonl"
    flags = ["--model", str(tiny), "--max-new-tokens", "8", "--ignore-eos", "--token-ids"]
    flags += ["--no-progress"]
    whole, dst = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{**row, "n": 3}])
    assert cli.main(["batch", str(src), str(whole), *flags]) == 0
    _write_jsonl(src, [{**row, "n": 2}])
    assert cli.main(["batch", str(src), str(dst), *flags]) == 0
    _write_jsonl(src, [{**row, "n": 3}])
    assert cli.main(["batch", str(src), str(dst), *flags]) == 0
    summary = json.loads(jobs.summary_path(dst).read_text())
    assert (summary["samples_written"], summary["samples_already_done"]) == (1, 2)
    assert (summary["runtime"]["samples"], summary["runtime"]["generated_tokens"]) == (1, 8)
    assert _timeless(_read_results(dst)) == _timeless(_read_results(whole))


# -- the file: resume, crashes and kills -----------------------------------------------------


def test_crash_keeps_finished_samples_and_torn_line_is_dropped(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": f"q{i}"} for i in range(6)])
    ids = [r.id for r in jobs.read_requests(src)]
    with pytest.raises(_Crash):
        _run(_Echo(crash_after=2), src, dst)
    assert [r["id"] for r in _read_results(dst)] == ids[:2]  # each sample is written at once
    with open(dst, "a") as f:
        f.write(f'{{"id": "{ids[2]}", "te')  # a write torn by a crash mid-line
    summary = _run(_Echo(), src, dst)
    assert (summary["samples_written"], summary["samples_already_done"]) == (4, 2)
    rows = _read_results(dst)
    assert [r["id"] for r in rows] == ids
    assert rows[2]["text"] == "Q2"


@pytest.mark.parametrize("left", [b"", b'{"rkvjax_j', _HEADER[:-1], _HEADER + b'{"id": "x", "s'])
def test_kill_during_the_first_write_reruns_cleanly(tmp_path, left):
    """A job killed while creating its output (empty, a header cut short, a first result cut
    short): the same command again writes every sample once."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b", "n": 2}])
    dst.write_bytes(left)
    _run(_Echo(), src, dst)
    got = sorted((r["id"], r["sample_index"]) for r in _read_results(dst))
    assert got == [("x", 0), ("y", 0), ("y", 1)]


def test_rerun_writes_only_the_missing_samples_of_a_request(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt": "a", "n": 3}, {"id": "b", "prompt": "b"}])
    with pytest.raises(_Crash):
        _run(_Echo(crash_after=1), src, dst)
    assert [(r["id"], r["sample_index"]) for r in _read_results(dst)] == [("a", 0)]
    echo = _Echo()
    summary = _run(echo, src, dst)
    assert summary["samples_written"] == 3 and summary["samples_already_done"] == 1
    assert echo.seen == [("a", 1), ("a", 2), ("b", 0)]  # only the samples not written
    got = [(r["id"], r["sample_index"]) for r in _read_results(dst)]
    assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)] and len(got) == 4


# A job whose runner takes 0.1 s per sample instead of a model; with HOLD set it stops after
# two samples until a signal ends it (a loaded machine must not let it finish first).
_SLOW_JOB = """
import os, signal, sys, time
from rkvjax.entrypoints import jobs
from rkvjax.entrypoints.cli import batch as batch_command, main

# A shell starts background commands with SIGINT ignored, and a child inherits that: Ctrl-C
# is what this job must see, whoever ran the tests.
signal.signal(signal.SIGINT, signal.default_int_handler)

class Slow(jobs.Runner):
    def run(self, reqs):
        for i, r in enumerate(reqs):
            time.sleep(600 if i == 2 and os.environ.get("HOLD") else 0.1)
            yield r, {"sample_index": 0, "text": r.prompt.upper(), "finish_reason": "length",
                      "prompt_tokens": 1, "completion_tokens": 1, "token_ids": [1]}

def batch(args):
    jobs.run_job(Slow(), args.input, args.output, progress=False)
    return 0

batch_command.run = batch
sys.exit(main(["batch", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_stopped_job_reruns_to_every_id_exactly_once(tmp_path, sig):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": f"q{i}"} for i in range(12)])
    cmd = [sys.executable, "-c", _SLOW_JOB, str(src), str(dst)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RKVJAX_COMPILE_CACHE": "0"}
    job = subprocess.Popen(
        cmd, cwd=ROOT, env={**env, "HOLD": "1"}, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + HANG_S
    while _lines(dst) < 3 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # wait for the header and the first results
    try:
        assert job.poll() is None, job.stderr.read()
        # A second job (this process) on the output of a running one is refused.
        with pytest.raises(ValueError, match="another rkvjax batch job is writing it"):
            _run(_Never(), src, dst)
    finally:
        job.send_signal(sig)
        err = job.communicate()[1]
    if sig == signal.SIGINT:
        assert job.returncode == 130
        assert err == (
            f"rkvjax: interrupted; finished results are in {dst}, rerun the same command to "
            "resume\n"
        )
    assert len(_read_results(dst)) == 2
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    ids = [r["id"] for r in _read_results(dst)]
    assert sorted(ids) == sorted(r.id for r in jobs.read_requests(src))


def test_second_job_on_the_same_output_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])

    class StartsAnother(_Echo):
        def run(self, reqs):
            with pytest.raises(ValueError, match=f"{dst}: another rkvjax batch job is writing"):
                _run(_Never(), src, dst)
            yield from super().run(reqs)

    assert _run(StartsAnother(), src, dst)["samples_written"] == 2
    assert _run(_Never(), src, dst)["samples_already_done"] == 2  # the lock was released
    assert len(_read_results(dst)) == 2


# -- files the job must not touch ------------------------------------------------------------


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
        _run(_Never(), src, dst)
    assert dst.read_bytes() == content


def test_other_job_format_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    for old in (1, 99):
        dst.write_text(json.dumps({jobs.HEADER_KEY: old, "settings": {}}) + "\n")
        with pytest.raises(ValueError, match=f"job format {old}"):
            _run(_Never(), src, dst)


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
        _run(_Never(), src, dst)
    assert src.read_bytes() == before


def test_summary_is_written_beside_the_output_and_never_over_a_foreign_file(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b", "max_tokens": 3}])
    summary = _run(_Echo(), src, dst)
    path = tmp_path / "out.summary.json"
    assert jobs.summary_path(dst) == path
    # As readable as the results beside it (a private temporary file once made it 0600).
    assert path.stat().st_mode & 0o777 == dst.stat().st_mode & 0o777 == 0o666 & ~_umask()
    on_disk = json.loads(path.read_text())
    assert on_disk["samples_written"] == summary["samples_written"] == 2
    assert on_disk["generated_tokens"] == 256 + 3 and on_disk["finish_reasons"] == {"length": 2}
    other = tmp_path / "other.jsonl"
    notes = tmp_path / "other.summary.json"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="is not an rkvjax job summary"):
        _run(_Never(), src, other)
    with pytest.raises(ValueError, match="is not an rkvjax job summary"):
        jobs.preflight(src, other)
    assert notes.read_text() == "my notes" and not other.exists()


def test_rerun_with_other_settings_is_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])
    settings = {"model": "m", "method": "rkv"}
    defaults = {"temperature": 0.0, "max_tokens": 4}
    _run(_Echo(), src, dst, settings=settings, defaults=defaults)
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    before = dst.read_bytes()
    with pytest.raises(ValueError) as e:
        _run(
            _Never(),
            src,
            dst,
            settings={**settings, "method": "snapkv"},
            defaults={**defaults, "max_tokens": 8},
        )
    diff = 'method="rkv" in the file, "snapkv" now; max_tokens=4 in the file, 8 now'
    assert diff in str(e.value) and "pick another output path for a new job" in str(e.value)
    assert dst.read_bytes() == before
    summary = _run(_Echo(), src, dst, settings=dict(settings), defaults=dict(defaults))
    assert (summary["samples_written"], summary["samples_already_done"]) == (1, 2)


def test_rerun_with_an_edited_line_under_the_same_id_is_refused(tmp_path):
    """A result line remembers the version of its request (prompt and sampling, all but n):
    a rerun whose line for that id changed is refused, naming the line, before any work; a
    larger n only adds samples, and an untouched file resumes as before."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "a", "prompt": "a"}, {"id": "b", "prompt": "b", "temperature": 0.5}]
    _write_jsonl(src, rows)
    _run(_Echo(), src, dst)
    assert len({r["request_hash"] for r in _read_results(dst)}) == 2
    before = dst.read_bytes()
    for edit in ({"prompt": "B"}, {"temperature": 0.7}, {"seed": 3}, {"stop": ["x"]}):
        _write_jsonl(src, [rows[0], {**rows[1], **edit}])
        with pytest.raises(ValueError) as e:
            _run(_Never(), src, dst)
        assert str(e.value) == (
            f"{src}:2 (id 'b'): {dst} holds samples of id 'b' made from another version of "
            "this line (its prompt or sampling changed); restore the line, give it a new id, "
            "or pick another output path for a new job"
        ), edit
        assert dst.read_bytes() == before
    _write_jsonl(src, [rows[0], {**rows[1], "n": 2}])
    summary = _run(_Echo(), src, dst)
    assert (summary["samples_written"], summary["samples_already_done"]) == (1, 2)


def test_output_without_results_takes_the_new_settings(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])

    class TooLong(_Never):
        def check(self, request, where):
            raise ValueError(f"{where}: too long")

    with pytest.raises(ValueError, match="too long"):
        _run(TooLong(), src, dst, settings={"k": 1})
    _run(_Echo(), src, dst, settings={"k": 2})
    assert _settings(dst)["k"] == 2


def test_default_ids_follow_the_prompt_through_edits(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}, {"prompt_token_ids": [1, 2]}])
    _run(_Echo(), src, dst)
    # A prompt inserted at the top and another removed: the others keep their ids.
    _write_jsonl(src, [{"prompt": "new"}, {"prompt": "a"}, {"prompt_token_ids": [1, 2]}])
    assert _run(_Echo(), src, dst)["samples_written"] == 1
    texts = {r["id"]: r["text"] for r in _read_results(dst)}
    rows = jobs.read_requests(src)
    assert [texts[r.id] for r in rows] == ["NEW", "A", "[1, 2]"]
    assert rows[1].id == jobs.default_id({"prompt": "a"}) and len(rows[1].id) == 16


def test_line_settings_override_the_defaults_and_seeds_follow_the_id(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "a", "prompt": "x", "temperature": 0.7, "stop": "##", "max_tokens": 9},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "seed": 5},
        {"id": "c", "prompt_token_ids": [1, 2], "n": 3, "logprobs": 2},
    ]
    _write_jsonl(src, lines)
    a, b, c = jobs.read_requests(src, {"temperature": 0.0, "max_tokens": 4, "seed": 1})
    assert (a.sampling.temperature, a.sampling.max_tokens, a.sampling.stop) == (0.7, 9, ("##",))
    assert a.sampling.seed == jobs.request_seed(1, "a") != jobs.request_seed(1, "c")
    assert b.sampling.seed == 5 and b.prompt == lines[1]["messages"]
    assert (c.n, c.sampling.logprobs, c.sampling.max_tokens) == (3, 2, 4)
    _write_jsonl(src, [lines[1], lines[0]])  # another line order: the same seeds
    assert jobs.read_requests(src, {"seed": 1})[1].sampling.seed == a.sampling.seed


def _openai(custom_id="r1", url="/v1/chat/completions", **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_lines_map_onto_sampling_settings(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        _openai("c1", max_completion_tokens=5, temperature=0.5, logprobs=True, top_logprobs=3),
        _openai("c2", url="/v1/completions", messages=None, prompt="raw", stop=["\n"], n=2),
    ]
    del lines[1]["body"]["messages"]
    _write_jsonl(src, lines)
    chat, plain = jobs.read_requests(src, {"temperature": 0.0, "max_tokens": 7})
    assert chat.openai == "chat" and chat.chat is None and chat.prompt[0]["content"] == "hi"
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.sampling.logprobs) == (
        5,
        0.5,
        3,
    )
    assert plain.openai == "completions" and plain.chat is False and plain.prompt == "raw"
    assert (plain.n, plain.sampling.stop, plain.sampling.max_tokens) == (2, ("\n",), 7)


def test_chat_content_as_text_parts_is_one_text_in_jobs_too(tmp_path):
    """A job line's chat, plain or in OpenAI's batch shape, may give `content` as text parts
    (OpenAI's SDKs do): joined by newlines as vLLM joins them; another part is refused."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": "a", "messages": [{"role": "user", "content": parts}]}])
    (plain,) = jobs.read_requests(src)
    _write_jsonl(src, [_openai("b", messages=[{"role": "user", "content": parts}])])
    (batch,) = jobs.read_requests(src)
    assert plain.prompt == batch.prompt == [{"role": "user", "content": "Hello\nthere"}]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    _write_jsonl(src, [_openai("c", messages=[{"role": "user", "content": image}])])
    with pytest.raises(ValueError, match=r"in.jsonl:1: messages\[0\]\.content\[0\]: .*'image_url'"):
        jobs.read_requests(src)


def test_openai_chat_output_shape(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_openai("c1", n=2, logprobs=True, top_logprobs=1, max_tokens=2)])

    class WithLogprobs(_Echo):
        model_name = "tiny-model"

        def run(self, reqs):
            for r, rec in super().run(reqs):
                rec = {**rec, "token_ids": [7, 8], "logprobs": [-0.5, -1.0]}
                yield r, {**rec, "top_logprobs": [[[7, -0.5]], [[9, -0.25]]]}

        def token_text(self, token):
            return f"<{token}>"

    _run(WithLogprobs(), src, dst)
    (line,) = _read_results(dst)
    assert line["custom_id"] == "c1" and line["error"] is None
    body = line["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny-model"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    first, second = choice["logprobs"]["content"]
    assert first == {
        "token": "<7>",
        "logprob": -0.5,
        "bytes": list(b"<7>"),
        "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>")}],
    }
    assert second["top_logprobs"][0]["token"] == "<9>"
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert _run(_Never(), src, dst)["samples_already_done"] == 2  # resumes by custom_id


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"text": "x"}', "unknown field\\(s\\) 'text'"),
        (
            '{"prompt": "x", "max_new_tokens": 5, "temprature": 1}',
            "unknown field\\(s\\) 'max_new_tokens' \\(did you mean 'max_tokens'\\?\\), "
            "'temprature' \\(did you mean 'temperature'\\?\\)",
        ),
        ('{"prompt": "x", "prompt_token_ids": [1]}', "has `prompt` and `prompt_token_ids`"),
        ('{"prompt": "x", "messages": []}', "has `prompt` and `messages`; give one"),
        ('{"id": 7}', "needs `prompt` \\(text\\), `messages` \\(a chat\\) or `prompt_token_ids`"),
        ('{"prompt": 5}', "`prompt` must be a non-empty string, got 5"),
        ('{"prompt": ""}', "`prompt` must be a non-empty string"),
        ('{"messages": []}', "`messages` must be a non-empty list"),
        ('{"messages": [{"content": "x"}]}', "messages\\[0\\] has no `role`"),
        ('{"messages": [{"role": "user"}]}', "messages\\[0\\] has no `content`"),
        ('{"messages": [{"role": "user", "contnet": "x"}]}', "messages\\[0\\]: unknown key"),
        (
            '{"messages": [{"role": "user", "content": "x", "name": "al"}]}',
            "messages\\[0\\]: unknown key\\(s\\) 'name'",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}',
            "messages\\[1\\]: unknown role 'wizard' \\(roles: system, user, assistant, tool\\)",
        ),
        (
            '{"messages": [{"role": "user", "content": ["x"]}]}',
            "messages\\[0\\]\\.content\\[0\\]: only text",
        ),
        ('{"messages": [{"role": "user", "content": 7}]}', "messages\\[0\\]: `content` must"),
        ('{"prompt": "\\ud800"}', "not valid Unicode text: a lone surrogate \\(U\\+D800\\)"),
        (
            '{"id": "\\udfff", "prompt": "x"}',
            "not valid Unicode text: a lone surrogate \\(U\\+DFFF",
        ),
        ('{"prompt": "x", "stop": ["\\ud800"]}', "not valid Unicode text"),
        ('{"prompt": "x", "stop": ' + "[" * 40 + "]" * 40 + "}", "nested more than 32 levels"),
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 32 levels deep"),
        ('{"prompt_token_ids": [1, "2"]}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"prompt_token_ids": [true]}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"prompt_token_ids": []}', "`prompt_token_ids` must be a non-empty list of ints"),
        ('{"id": [1], "prompt": "x"}', "`id` must be a string or an integer"),
        ('{"id": 1, "prompt": "b"}', "duplicate id 1 \\(line 1 has it\\)"),
        ('{"prompt": "a"}', "same request as line 3; give each of them an `id`"),
        ('{"prompt": "x", "n": 0}', "n must be an int >= 1, got 0"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature must be a finite float"),
        ('{"prompt": "x", "seed": "x"}', "seed must be"),
        (json.dumps(_openai()), "an OpenAI batch line in a file whose line 1 is an rkvjax line"),
    ],
)
def test_bad_line_is_rejected_before_work(tmp_path, line, match):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n\n{"prompt": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{src}:4: {match}"):
        _run(_Never(), src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "line, match",
    [
        ({**_openai(), "extra": 1}, "unknown field\\(s\\) 'extra' in an OpenAI batch line"),
        ({**_openai(), "custom_id": 3}, "`custom_id` must be a non-empty string"),
        (_openai(custom_id="r0"), "duplicate id 'r0' \\(line 1 has it\\)"),
        (_openai(url="/v1/embeddings"), '`url` "/v1/embeddings" is not served'),
        ({**_openai(), "method": "GET"}, '`method` must be "POST"'),
        (_openai(stream=True), "body field\\(s\\) 'stream' not supported"),
        (_openai(max_tokens=3, max_completion_tokens=3), "body has `max_tokens` and `max_com"),
        (_openai(top_logprobs=2), "body `top_logprobs` needs `logprobs"),
        (_openai(messages="hi"), "`messages` must be a non-empty list"),
        (
            _openai(messages=[{"role": "user", "content": "x", "name": "a"}]),
            "messages\\[0\\]: unknown key",
        ),
        (_openai(messages=[{"role": "user"}]), "messages\\[0\\] has no `content`"),
        (_openai(url="/v1/completions"), "body field\\(s\\) 'messages' not supported for /v1/c"),
        (
            {"custom_id": "e", "url": "/v1/completions", "body": {"prompt": ""}},
            "a /v1/completions body needs `prompt`: a non-empty string",
        ),
        (_openai(n=0), "n must be an int >= 1"),
        ({"id": 1, "prompt": "x"}, "an rkvjax line in a file whose line 1 is an OpenAI batch"),
    ],
)
def test_bad_openai_line_is_rejected_before_work(tmp_path, line, match):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [_openai(custom_id="r0"), line])
    with pytest.raises(ValueError, match=f"{src}:2: {match}"):
        _run(_Never(), src, tmp_path / "out.jsonl")


def test_input_without_prompts_is_rejected(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        _run(_Never(), src, tmp_path / "out.jsonl")


def test_check_runs_on_every_request_before_work(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "ok"}, {"id": "x", "prompt": "long"}, {"prompt": "long!"}])

    class Checked(_Never):
        def check(self, request, where):
            if request.prompt.startswith("long"):
                raise ValueError(f"{where}: too many tokens")

    with pytest.raises(ValueError) as e:
        _run(Checked(), src, dst)
    assert str(e.value) == f"{src}:2 (id 'x'): too many tokens (1 more line fails too)"
    assert not dst.exists()  # checked before the output is created


@pytest.mark.parametrize(
    "where, error, match",
    [
        ("missing/out.jsonl", FileNotFoundError, "folder .*missing does not exist"),
        (".", ValueError, "is a directory; give a file path for the results"),
        ("in.jsonl/out.jsonl", ValueError, "in.jsonl is a file, not a folder"),
    ],
)
def test_bad_output_path_fails_before_work(tmp_path, where, error, match):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    with pytest.raises(error, match=match):
        _run(_Never(), src, tmp_path / where)
    with pytest.raises(error, match=match):
        jobs.preflight(src, tmp_path / where)


def test_cli_checks_files_before_loading_the_model(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    dst = tmp_path / "missing" / "out.jsonl"
    assert cli.main(["batch", str(src), str(dst), "--model", str(tmp_path / "no_model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rkvjax: error: ") and err.count("\n") == 1
    assert f"folder {dst.parent} does not exist" in err
    _write_jsonl(src, [{"prompt": "a", "top_p": 0}])
    assert cli.main(["batch", str(src), str(tmp_path / "o.jsonl"), "--model", "nope"]) == 2
    assert f"{src}:1: top_p must be" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_unwritable_output_fails_before_work(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}])
    dst.write_text("")
    dst.chmod(0o444)
    with pytest.raises(ValueError, match="cannot write it"):
        _run(_Never(), src, dst)


def test_directory_or_missing_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}: is a directory; give the JSONL file"):
        _run(_Never(), tmp_path, tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError, match="no such file"):
        _run(_Never(), tmp_path / "nope.jsonl", tmp_path / "out.jsonl")


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
        _run(_Never(), src, dst)
    assert dst.read_bytes() == content


# -- several processes -----------------------------------------------------------------------


def test_other_processes_never_touch_the_output(tmp_path, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"prompt": "a"}, {"prompt": "b"}])
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert _run(_Echo(), src, dst)["samples"] == 2
    assert not dst.exists() and not jobs.summary_path(dst).exists()
    # Process 0 could not open the output: the others stop instead of waiting for it.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda flags: flags * False)
    with pytest.raises(ValueError, match="process 0 could not open it"):
        _run(_Never(), src, dst)


def test_shards_merge_into_the_whole_job(tmp_path, capsys):
    """`--shard I/N` runs the requests of one shard (by id, so shards do not move when lines
    do); `rkvjax merge` joins the shard outputs into the output one job would write."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": i, "prompt": f"q{i}", "n": 1 + i % 2} for i in range(20)])
    whole = tmp_path / "whole.jsonl"
    _run(_Echo(), src, whole, settings={"model": "m"})
    parts = [tmp_path / f"part{i}.jsonl" for i in range(3)]
    sizes = [
        _run(_Echo(), src, p, settings={"model": "m"}, shard=(i, 3))["requests"]
        for i, p in enumerate(parts)
    ]
    assert sum(sizes) == 20 and min(sizes) > 0
    assert _settings(parts[1])["shard"] == "1/3"
    merged = tmp_path / "merged.jsonl"
    assert cli.main(["merge", str(merged), *map(str, parts)]) == 0
    assert "merged 3 shards, 30 lines" in capsys.readouterr().err
    key = _key
    assert sorted(_read_results(merged), key=key) == sorted(_read_results(whole), key=key)
    assert _settings(merged) == _settings(whole)
    assert _end(merged) == _end(whole) and _end(whole)["samples"] == 30
    with pytest.raises(FileExistsError, match="exists; merge writes a new file"):
        jobs.merge(merged, parts)
    with pytest.raises(ValueError, match="shards 2/3 missing"):
        jobs.merge(tmp_path / "m2.jsonl", parts[:2])
    with pytest.raises(ValueError, match="shard 1/3 again"):
        jobs.merge(tmp_path / "m3.jsonl", [*parts, parts[1]])
    other = tmp_path / "other.jsonl"
    _run(_Echo(), src, other, settings={"model": "other"}, shard=(0, 3))
    with pytest.raises(ValueError, match="another job's shard"):
        jobs.merge(tmp_path / "m4.jsonl", [parts[1], parts[2], other])
    with pytest.raises(ValueError, match="not a shard output"):
        jobs.merge(tmp_path / "m5.jsonl", [whole])
    assert not any((tmp_path / f"m{i}.jsonl").exists() for i in range(2, 6))


def _shards(tmp_path, src, n=2, **kw):
    parts = [tmp_path / f"part{i}.jsonl" for i in range(n)]
    for i, p in enumerate(parts):
        _run(_Echo(), src, p, settings={"model": "m"}, shard=(i, n), **kw)
    return parts


def _refused(tmp_path, parts, match):
    merged = tmp_path / "merged.jsonl"
    with pytest.raises(ValueError, match=match):
        jobs.merge(merged, parts)
    assert not merged.exists()


def test_merge_refuses_a_torn_or_unfinished_shard(tmp_path):
    """A shard whose job was killed (its last line cut short, or no end line) or whose file
    lost a line is refused, naming the file; nothing is written."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": i, "prompt": f"q{i}", "n": 2} for i in range(8)])
    parts = _shards(tmp_path, src)
    whole = parts[1].read_bytes()
    parts[1].write_bytes(whole[:-30])  # the job killed while writing its last line
    _refused(tmp_path, parts, f"{parts[1]}: its last line is cut short.*--shard 1/2")
    # Killed between two lines: every line whole, but no end line.
    lines = whole.splitlines(keepends=True)
    parts[1].write_bytes(b"".join(lines[:3]))
    _refused(tmp_path, parts, f"{parts[1]}: unfinished shard .no job end line.*--shard 1/2")
    # Resumed, it finishes and merges; a result line deleted by hand is caught.
    _run(_Echo(), src, parts[1], settings={"model": "m"}, shard=(1, 2))
    assert cli.main(["merge", str(tmp_path / "ok.jsonl"), *map(str, parts)]) == 0
    assert len(_read_results(tmp_path / "ok.jsonl")) == 16
    lines = parts[0].read_bytes().splitlines(keepends=True)
    parts[0].write_bytes(b"".join(lines[:1] + lines[2:]))
    _refused(tmp_path, parts, f"{parts[0]}: its results are not the {len(lines) - 2} samples")


def test_merge_refuses_a_shard_whose_result_text_was_edited(tmp_path):
    """A finished shard whose result text was edited by hand keeps its ids and counts, but not
    the digest of its lines its end line records: refused, naming the file; so is a shard
    whose end line predates that digest. A rerun of its job rewrites the end line."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": i, "prompt": f"q{i}", "n": 2} for i in range(8)])
    parts = _shards(tmp_path, src)
    whole = parts[0].read_bytes()
    lines = whole.splitlines(keepends=True)
    edited = json.loads(lines[1])
    edited["text"] += " (edited)"
    lines[1] = (json.dumps(edited) + "\n").encode()
    parts[0].write_bytes(b"".join(lines))
    _refused(tmp_path, parts, f"{parts[0]}: its result lines are not the ones its job wrote")
    # An end line without the digest (an older rkvjax's): refused until the job reruns.
    lines = whole.splitlines(keepends=True)
    end = json.loads(lines[-1])
    del end[jobs.output.END_KEY]["content"]
    parts[0].write_bytes(b"".join(lines[:-1]) + (json.dumps(end) + "\n").encode())
    _refused(tmp_path, parts, f"{parts[0]}: its end line has no digest of its results")
    _run(_Echo(), src, parts[0], settings={"model": "m"}, shard=(0, 2))
    assert parts[0].read_bytes() == whole
    assert cli.main(["merge", str(tmp_path / "ok.jsonl"), *map(str, parts)]) == 0


def test_merge_refuses_shards_of_another_input_or_settings(tmp_path, capsys):
    src, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    _write_jsonl(src, [{"id": i, "prompt": f"q{i}"} for i in range(8)])
    _write_jsonl(other, [{"id": i, "prompt": f"q{i}"} for i in range(7)])
    mine = _shards(tmp_path, src)
    foreign = tmp_path / "foreign0.jsonl"
    _run(_Echo(), other, foreign, settings={"model": "m"}, shard=(0, 2))
    _refused(tmp_path, [foreign, mine[1]], f"{mine[1]}: a shard of another input than {foreign}")
    # The same ids with an edited prompt are another input too.
    _write_jsonl(other, [{"id": i, "prompt": f"q{i}" + "!" * (i == 3)} for i in range(8)])
    foreign.unlink()
    _run(_Echo(), other, foreign, settings={"model": "m"}, shard=(0, 2))
    _refused(tmp_path, [mine[1], foreign], "a shard of another input")
    # Other settings: each file is named with its own value.
    longer = tmp_path / "longer1.jsonl"
    _run(
        _Echo(),
        src,
        longer,
        settings={"model": "m"},
        shard=(1, 2),
        defaults={"temperature": 0.0, "max_tokens": 9},
    )
    assert cli.main(["merge", str(tmp_path / "m.jsonl"), str(mine[0]), str(longer)]) == 2
    err = capsys.readouterr().err
    assert "max_tokens=9 in longer1.jsonl, (not set) in part0.jsonl" in err
    assert err.count("\n") == 1 and not (tmp_path / "m.jsonl").exists()


def test_finished_job_ends_with_one_end_line(tmp_path):
    """A job that wrote every sample ends its file with the end line; a rerun that adds
    samples moves it to the end, and a rerun with nothing to do leaves the file as it is."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": 1, "prompt": "a", "n": 2}])
    assert _run(_Echo(), src, dst)["finished"]
    first = _end(dst)
    assert (first["samples"], first["input_samples"]) == (2, 2)
    _write_jsonl(src, [{"id": 1, "prompt": "a", "n": 2}, {"id": 2, "prompt": "b"}])
    _run(_Echo(), src, dst)
    text = dst.read_text()
    assert text.count(jobs.END_KEY) == 1 and _end(dst)["samples"] == 3
    assert _end(dst)["input"] != first["input"]
    _run(_Never(), src, dst)
    assert dst.read_text() == text
    with pytest.raises(_Crash):  # a stopped job leaves no end line
        _run(_Echo(crash_after=0), src, tmp_path / "cut.jsonl")
    assert _end(tmp_path / "cut.jsonl") is None
    assert jobs.read_output(dst).end == _end(dst)
    assert len(jobs.read_output(dst).lines) == 3


def test_openai_response_ids_are_stable():
    r = jobs.JobRequest(1, "c", "x", rkvjax.SamplingParams(temperature=0.0), openai="chat")
    rec = {**_record(r, 0), "completion_tokens": 2}
    a = openai_batch.response_line(r, [rec], model_name="m", token_text=str, created=0)
    b = openai_batch.response_line(r, [rec], model_name="m", token_text=str, created=0)
    assert a == b and a["response"]["body"]["choices"][0]["logprobs"] is None
    assert output.line_keys(a) == [("c", 0)]
