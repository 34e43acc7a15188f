"""Running a job: every request of the input not yet in the output, through one runtime, each
finished sample appended (and fsynced) the moment it finishes."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rkvjax.entrypoints.jobs import openai_batch, output
from rkvjax.entrypoints.jobs.inputs import (
    JobRequest,
    in_shard,
    input_digest,
    read_requests,
    request_hash,
)

DEFAULT_JOB_SLOTS = 256  # slots at most when a job does not say (vLLM's max_num_seqs)
ORDERS = ("longest", "input")  # EngineRunner's admission orders


class Runner:
    """What a job runs its requests on; `EngineRunner` is the real one.

    `prepare` sees every request of the input (done or not) and returns the settings it
    resolved from them (e.g. a fractional budget), raising ValueError prefixed with
    `where(request)` for one it cannot read; `check` raises ValueError for a request it
    cannot run; `run` yields (request, sample record) as samples finish, in any order, for the
    samples `request.sample_indices` names (a runner that runs all n of each request is
    correct too: the job writes only the missing ones).
    """

    model_name = "rkvjax"

    def prepare(
        self, requests: list[JobRequest], where: Callable[[JobRequest], str]
    ) -> dict[str, Any]:
        return {}

    def check(self, request: JobRequest, where: str) -> None:
        pass

    def run(self, requests: list[JobRequest]) -> Iterator[tuple[JobRequest, dict[str, Any]]]:
        raise NotImplementedError

    def postfix(self) -> dict[str, str]:
        """Live numbers for the progress bar."""
        return {}

    def stats(self) -> dict[str, Any]:
        """The run's counters, for the summary."""
        return {}

    def token_text(self, token: int) -> str:
        """One token's text (OpenAI logprobs name tokens by their text)."""
        return str(token)


def sample_record(result) -> dict[str, Any]:
    """A GenerationResult as the fields of a job's result line (token ids always included;
    the writer drops them unless asked)."""
    st = result.stats
    rec = {
        "sample_index": result.sample_index,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.generated_tokens,
        "compressions": st.compressions,
        "peak_cache_slots": st.peak_cache_slots,
        "stalled_steps": st.stalled_steps,
        "time_to_first_token_s": round(st.time_to_first_token_s, 4),
        "token_ids": list(result.token_ids),
    }
    if result.logprobs is not None:
        rec["logprobs"] = list(result.logprobs)
        rec["top_logprobs"] = [[[int(t), float(v)] for t, v in top] for top in result.top_logprobs]
    return rec


class EngineRunner(Runner):
    """Runs a job's requests through one `rkvjax.Engine`, built for the whole input.

    Args:
      model: from `rkvjax.load`.
      cache: the cache keywords of `rkvjax.api.engine_for` (method, budget, buffer, ...).
      slots: rows decoded at once (default: every sample when memory allows, at most
        DEFAULT_JOB_SLOTS).
      chat: as in `generate`, for text prompts (OpenAI completions are always raw text).
      order: the order requests take free slots: "longest" (largest max_tokens first, ties in
        input order) or "input". Longest first is the classic makespan rule: a long request
        admitted last would decode alone in an emptied batch at the job's end, while short
        ones admitted last fill the slots the long ones free. On the job bench's mixed file
        (max_tokens 32..1024, 16 slots) it takes 2,448 decode steps down to 2,231.
        Neither changes a request's tokens (they do not depend on their neighbours).
    """

    def __init__(
        self,
        model,
        *,
        cache: Mapping[str, Any],
        slots: int | None = None,
        chat=None,
        order: str = "longest",
    ):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.model, self._cache, self._slots, self._chat = model, dict(cache), slots, chat
        self.order = order
        self.model_name = model.path.name
        self._ids: dict[Any, list[int]] = {}
        self._ready: dict[Any, Any] = {}  # id -> the engine's checked request (`check`)
        self.engine = None

    def _encode(self, r: JobRequest, where: str) -> list[int]:
        from rkvjax.runtime import requests

        chat = self._chat if r.chat is None else r.chat
        return requests.encode(self.model.tokenizer, r.prompt, chat, where)

    def prepare(self, reqs: list[JobRequest], where: Callable[[JobRequest], str]) -> dict[str, Any]:
        from rkvjax import api

        ids = _each_checked(reqs, lambda r: self._encode(r, where(r)))
        self._ids = {r.id: row for r, row in zip(reqs, ids, strict=True)}
        self.engine = api.engine_for(
            self.model,
            [self._ids[r.id] for r in reqs],
            [r.sampling for r in reqs],
            slots=self._slots,
            slot_cap=DEFAULT_JOB_SLOTS,
            **self._cache,
        )
        cc = self.engine.compression
        return {"cache_budget": cc.budget if cc.compressing else None}

    def check(self, r: JobRequest, where: str) -> None:
        # Kept: the run submits what was checked here, without checking it again.
        self._ready[r.id] = self.engine.prepare(
            self._ids[r.id], r.sampling, request_id=r.id, where=where
        )

    def run(self, reqs: list[JobRequest]) -> Iterator[tuple[JobRequest, dict[str, Any]]]:
        if not reqs:
            return
        if self.order == "longest":
            reqs = sorted(reqs, key=lambda r: -r.sampling.max_tokens)  # stable: ties keep order
        by_id = {r.id: r for r in reqs}
        self.engine.submit_many(
            [self._ready[r.id] for r in reqs], samples=[r.sample_indices for r in reqs]
        )
        for res in self.engine.results():
            yield by_id[res.request_id], sample_record(res)

    def postfix(self) -> dict[str, str]:
        st = self.engine.stats
        busy_s = max(st.wall_s - st.compile_s, 1e-9)
        return {
            "tok/s": f"{st.tokens_per_s:.1f}",
            "comp/s": f"{st.compressions / busy_s:.1f}",
            "slots": f"{self.engine.busy_slots}/{self.engine.slots}",
        }

    def stats(self) -> dict[str, Any]:
        return self.engine.stats.to_dict() if self.engine is not None else {}

    def token_text(self, token: int) -> str:
        if self.model.tokenizer is None:
            return str(token)
        return self.model.tokenizer.decode([token], skip_special_tokens=False)


def _each_checked(reqs: list[JobRequest], fn: Callable[[JobRequest], Any]) -> list:
    """fn(r) for every request; if some raise ValueError, the first one's message is raised,
    saying how many more lines fail too (so a file is fixed in one pass, not line by line)."""
    out, failures = [], []
    for r in reqs:
        try:
            out.append(fn(r))
        except ValueError as e:
            failures.append(str(e))
    if failures:
        raise ValueError(_first_of(failures))
    return out


def _first_of(failures: list[str]) -> str:
    k = len(failures) - 1
    more = "" if k == 0 else f" ({k} more {'line fails' if k == 1 else 'lines fail'} too)"
    return failures[0] + more


def _from_process_0(flags: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(flags))


def _line_of(request: JobRequest, rec: Mapping[str, Any], token_ids: bool) -> dict[str, Any]:
    line = {"id": request.id, **rec, output.HASH_FIELD: request_hash(request)}
    if not token_ids:
        line.pop("token_ids")
    return line


def _changed_requests(reqs: list[JobRequest], out: output.JobOutput, where) -> list[str]:
    """An error for every request whose written samples came from another version of its
    line (prompt or sampling edited under the same id)."""
    errors = []
    for r in reqs:
        if r.openai:  # OpenAI response lines keep OpenAI's shape: no hash to compare
            continue
        h = request_hash(r)
        old = {out.hashes.get((r.id, j)) for j in range(r.n)} - {None}
        if old - {h}:
            errors.append(
                f"{where(r)}: {out.path} holds samples of id {r.id!r} made from another "
                f"version of this line (its prompt or sampling changed); restore the line, give "
                f"it a new id, or {output.NEW_FILE}"
            )
    return errors


def _left_to_run(reqs: list[JobRequest], left: np.ndarray) -> list[JobRequest]:
    """The requests with samples left (`left`: a flag per sample, request by request), each
    with only those samples to run: their seeds depend on the sample index alone, so they are
    the samples a whole run would draw. An OpenAI line holds all n samples of its request: it
    runs them all again."""
    todo, at = [], 0
    for r in reqs:
        mine = tuple(j for j in range(r.n) if left[at + j])
        at += r.n
        if mine:
            whole = r.openai or len(mine) == r.n
            todo.append(r if whole else dataclasses.replace(r, samples=mine))
    return todo


def _end_of(every: list[JobRequest], reqs: list[JobRequest]) -> dict[str, Any]:
    """The end line of a finished job over `reqs`, a shard of the input `every` (or all of
    it)."""
    return {
        "input": input_digest(every),
        "input_samples": sum(r.n for r in every),
        "samples": sum(r.n for r in reqs),
        "keys": output.keys_digest((r.id, j) for r in reqs for j in range(r.n)),
    }


def run_job(
    runner: Runner,
    input_path: str | Path,
    output_path: str | Path,
    *,
    defaults: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    shard: tuple[int, int] | None = None,
    token_ids: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs every request of `input_path` not yet in `output_path`, as one continuous job.

    Args:
      runner: runs the requests (`EngineRunner` for a model).
      input_path, output_path: JSONL files (the output starts with a job header).
      defaults: sampling settings (`SamplingParams` fields) for what a line does not set.
      settings: JSON-able settings that shape the results (model, cache policy, ...), kept in
        the output's header with the defaults; a rerun with other settings is refused.
      shard: (i, n): run only the requests of shard i of n (by a hash of their id).
      token_ids: also write each sample's generated token ids.
      progress: a progress bar over samples on stderr.

    Returns:
      The job's summary (also written next to the output, see `output.summary_path`).
    """
    defaults = dict(defaults if defaults is not None else {"temperature": 0.0})
    return run_requests(
        runner,
        read_requests(input_path, defaults),
        output_path,
        input_path=input_path,
        settings={**(settings or {}), **defaults},
        shard=shard,
        token_ids=token_ids,
        progress=progress,
    )


def run_requests(
    runner: Runner,
    every: list[JobRequest],
    output_path: str | Path,
    *,
    input_path: str | Path,
    settings: Mapping[str, Any],
    shard: tuple[int, int] | None = None,
    token_ids: bool = False,
    progress: bool = True,
    desc: str = "batch",
    summary_file: bool = True,
    create_folder: bool = False,
) -> dict[str, Any]:
    """`run_job` on requests already read (e.g. built from a dataset by `rkvjax eval`).

    Args:
      every: the job's requests, their `line` numbers those of `input_path` (errors name
        them so).
      settings: everything that shapes the results (sampling defaults included), kept in the
        output's header.
      desc: the progress bar's label.
      summary_file: write the summary next to the output (`output.summary_path`).
      create_folder: create the output's folder, once every request passed its checks.
      The rest as in `run_job`.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    input_path, output_path = Path(input_path), Path(output_path)

    def where(r: JobRequest) -> str:  # how errors name a request
        return f"{input_path}:{r.line} (id {r.id!r})"

    settings = dict(settings)
    # The whole input, not only this shard, resolves the settings (e.g. a fractional budget),
    # so every shard of a job runs the same program and their outputs merge.
    settings.update(runner.prepare(every, where))
    if shard is not None:
        settings["shard"] = f"{shard[0]}/{shard[1]}"
    reqs = [r for r in every if in_shard(r.id, shard)]
    # Every request this job may run is checked before the output is touched.
    _each_checked(reqs, lambda r: runner.check(r, where(r)))
    if create_folder:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    # On several processes every one runs every request (the model is split over all of them);
    # process 0 owns the output and decides which requests are left.
    primary = jax.process_index() == 0
    out, error = None, None
    if primary:
        try:
            if summary_file:
                output.read_summary(output.summary_path(output_path))  # refuses a foreign file
            out = output.JobOutput.open(output_path, settings, input_path=input_path)
            changed = _changed_requests(reqs, out, where)
            if changed:
                raise ValueError(_first_of(changed))
        except (ValueError, OSError) as e:
            error = e
            if out is not None:
                out.close()
                out = None
    done = out.done if out is not None else set()
    already = sum((r.id, j) in done for r in reqs for j in range(r.n))
    # Process 0's view of which samples are left decides for every process.
    left = [(r.id, j) not in done for r in reqs for j in range(r.n)]
    flags = _from_process_0(np.array([error is None, *left]))
    if error is not None:
        raise error
    if not flags[0]:
        raise ValueError(f"{output_path}: process 0 could not open it (its error says why)")
    counts: collections.Counter = collections.Counter()
    try:
        todo = _left_to_run(reqs, flags[1:])
        bar = tqdm(
            total=sum(r.n for r in reqs),
            initial=already,
            unit="sample",
            desc=desc,
            dynamic_ncols=True,
            disable=not (progress and primary),
        )
        waiting: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
        for r, rec in runner.run(todo) if todo else ():
            if not r.openai and (r.id, rec["sample_index"]) in done:
                continue  # written before a crash; the request ran again for its other samples
            counts["samples"] += 1
            counts["generated_tokens"] += rec["completion_tokens"]
            counts["finish_" + rec["finish_reason"]] += 1
            if r.openai:
                waiting[r.id].append(rec)
                if len(waiting[r.id]) == r.n and out is not None:
                    line = openai_batch.response_line(
                        r,
                        waiting.pop(r.id),
                        model_name=runner.model_name,
                        token_text=runner.token_text,
                    )
                    out.append([line])
                    counts["written"] += r.n
            elif out is not None:
                out.append([_line_of(r, rec, token_ids)])
                counts["written"] += 1
            bar.update(1)
            bar.set_postfix(runner.postfix(), refresh=False)
        bar.close()
        if out is not None and all((r.id, j) in out.done for r in reqs for j in range(r.n)):
            out.finish(_end_of(every, reqs))
    finally:
        if out is not None:
            out.close()
    wall = time.perf_counter() - t0
    summary = {
        "input": str(input_path),
        "output": str(output_path),
        "shard": settings.get("shard"),
        "requests": len(reqs),
        "samples": sum(r.n for r in reqs),
        "requests_run": len(todo),
        "finished": out is not None and out.end is not None,  # the file ends with its end line
        "samples_written": counts["written"],
        "samples_already_done": already,
        "generated_tokens": counts["generated_tokens"],
        "finish_reasons": {
            k[len("finish_") :]: v for k, v in counts.items() if k.startswith("finish_")
        },
        "wall_s": wall,
        "runtime": runner.stats(),
        "settings": settings,
    }
    if primary and summary_file:
        output.write_summary(output.summary_path(output_path), summary)
    return summary


def preflight(
    input_path: str | Path,
    output_path: str | Path,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Checks the input and (on process 0) the output without writing, before a slow start."""
    read_requests(input_path, defaults)
    if jax.process_index() == 0:
        output.check_output(input_path, output_path)
