"""`rkvjax eval`: the R1 recipe over a problem file, as a resumable job, graded as it goes.

Each problem becomes one request of `samples` samples: the problem and the R1 instruction as the
only user message of a chat (no system prompt), sampled at temperature 0.6 / top-p 0.95 unless told
otherwise. The samples run through the offline-job runtime (`rkvjax.entrypoints.jobs`), so the run
keeps every slot busy, appends each graded sample to `OUT_DIR/samples.jsonl` the moment it finishes
and resumes where it stopped; `OUT_DIR/summary.json` holds the scores when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rkvjax.entrypoints import jobs
from rkvjax.entrypoints.evaluation import grading, metrics
from rkvjax.entrypoints.evaluation.problems import Problem, read_problems
from rkvjax.entrypoints.jobs import output

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
R1_SAMPLING = {"temperature": 0.6, "top_p": 0.95}  # DeepSeek-R1's evaluation settings
MAX_TOKENS = 32768  # the R1 recipe's generation length (less where the model's context ends)
SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_KEY = "rkvjax_eval"


def prompt_of(problem: Problem, instruction: str = R1_INSTRUCTION) -> list[dict[str, str]]:
    """The chat of one problem: a single user message, the problem then the instruction."""
    return [{"role": "user", "content": f"{problem.problem}\n{instruction}"}]


class GradingRunner(jobs.Runner):
    """Another runner's samples, each graded against its problem's answer before it is written
    (extracted answer, correct, repetition rate)."""

    def __init__(self, inner: jobs.Runner, problems: list[Problem]):
        self.inner = inner
        self.model_name = inner.model_name
        self._answers = {p.id: p.answer for p in problems}
        self._graded = self._correct = 0

    def prepare(self, reqs, where: Callable) -> dict[str, Any]:
        return self.inner.prepare(reqs, where)

    def check(self, r, where: str) -> None:
        self.inner.check(r, where)

    def run(self, reqs) -> Iterator[tuple[Any, dict[str, Any]]]:
        for r, rec in self.inner.run(reqs):
            gold = self._answers[r.id]
            g = grading.grade(rec["text"], gold, truncated=rec["finish_reason"] == "length")
            self._graded += 1
            self._correct += g.correct
            yield (
                r,
                {
                    **rec,
                    "answer": gold,
                    "extracted_answer": g.answer,
                    "answer_source": g.source,
                    "correct": g.correct,
                    "repetition": round(metrics.repetition_rate(rec["token_ids"]), 6),
                    "looping": metrics.is_looping(rec["token_ids"], rec["finish_reason"]),
                },
            )

    def postfix(self) -> dict[str, str]:
        acc = {"acc": f"{self._correct / self._graded:.2f}"} if self._graded else {}
        return {**self.inner.postfix(), **acc}

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def token_text(self, token: int) -> str:
        return self.inner.token_text(token)


def default_max_tokens(model, problems: list[Problem], instruction: str = R1_INSTRUCTION) -> int:
    """The default generation length: the recipe's, less where the longest prompt would pass
    the model's context."""
    from rkvjax.runtime import requests

    longest = max(
        len(requests.encode(model.tokenizer, prompt_of(p, instruction), None, f"problem {p.id!r}"))
        for p in problems
    )
    return max(1, min(MAX_TOKENS, model.config.max_positions - longest))


def run_eval(
    model,
    data: str | Path,
    out_dir: str | Path,
    *,
    limit: int | None = None,
    samples: int = 1,
    cache: Mapping[str, Any] | None = None,
    sampling: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    slots: int | None = None,
    instruction: str = R1_INSTRUCTION,
    token_ids: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Generates, grades and scores `samples` samples of each of the first `limit` problems.

    Args:
      model: from `rkvjax.load`.
      data: JSONL of problems (`problem.read_problems`).
      out_dir: the folder for samples.jsonl and summary.json (created if missing; a rerun
        resumes the samples there, and refuses other settings).
      samples: samples per problem (k of pass@k).
      cache: the cache-policy keywords of `generate` (method, budget, buffer, ...).
      sampling: `SamplingParams` fields for every sample (default: R1_SAMPLING, seed 0, and
        max_tokens up to MAX_TOKENS within the model's context); `n` is `samples`. The seed is
        the job's: each problem's samples draw from a seed hashed from it and the problem's id.
      settings: more JSON-able settings that shape the results (kept in the header).
      slots: rows decoded at once (default: what memory allows).
      token_ids: also write each sample's generated token ids.

    Returns:
      The summary (also in out_dir/summary.json): pass@1, pass@k, problems, samples,
      mean_generated_tokens, repetition, ... and the job's runtime counters.
    """
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples}")
    t0 = time.perf_counter()
    data, out_dir = Path(data), Path(out_dir)
    problems = read_problems(data, limit)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: is a file; give a folder for the evaluation's outputs")
    summary_path = out_dir / SUMMARY_FILE
    output.read_summary(summary_path, SUMMARY_KEY)  # refuses a foreign file before any work
    cache = dict(cache or {"method": "full"})
    inner = jobs.EngineRunner(model, cache=cache, slots=slots)
    # A job seed by default: each problem samples with a seed hashed from it and the problem's
    # id, so a resumed or re-sliced run draws the same samples.
    defaults = {**R1_SAMPLING, "seed": 0, **(sampling or {}), "n": samples}
    if defaults.get("max_tokens") is None:
        # Over the whole file, not the first `limit`: a rerun with a larger limit keeps the
        # length (a setting of the header) and adds problems.
        every = problems if limit is None else read_problems(data)
        defaults["max_tokens"] = default_max_tokens(model, every, instruction)
    reqs = [
        jobs.JobRequest(p.line, p.id, prompt_of(p, instruction), sampling=sp)
        for p in problems
        for sp in [jobs.resolve_sampling({}, defaults, p.id, f"{data}:{p.line}")]
    ]
    eval_settings = {
        "data": str(data.resolve()),  # not the limit: a rerun may add problems
        "instruction": instruction,
        **cache,
        **(settings or {}),
        **defaults,
    }
    job = jobs.run_requests(
        GradingRunner(inner, problems),
        reqs,
        out_dir / SAMPLES_FILE,
        input_path=data,
        settings=eval_settings,
        token_ids=token_ids,
        progress=progress,
        desc="eval",
        summary_file=False,
        create_folder=True,
    )
    lines = read_samples(out_dir / SAMPLES_FILE)
    budget = job["settings"].get("cache_budget")  # as the engine resolved it (None: FullKV)
    summary = {
        **metrics.summarize(lines, problems, samples),
        "method": "full" if budget is None else cache.get("method", "rkv"),
        "budget": budget,
        # What the cache stored: the --kv-dtype given, else the model's dtype.
        "kv_dtype": cache.get("kv_dtype") or (settings or {}).get("dtype"),
        "data": str(data),
        "output": str(out_dir / SAMPLES_FILE),
        "samples_written": job["samples_written"],
        "samples_already_done": job["samples_already_done"],
        "wall_s": time.perf_counter() - t0,
        "runtime": job["runtime"],
        "settings": job["settings"],
    }
    output.write_summary(summary_path, summary, SUMMARY_KEY)
    return summary


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The graded sample lines of an evaluation's samples.jsonl."""
    return output.read_output(path).lines
