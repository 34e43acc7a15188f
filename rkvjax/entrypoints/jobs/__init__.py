"""Offline generation jobs: JSONL requests in, JSONL results out, one continuous job that keeps
every slot busy, resumable, never losing finished work.

- `inputs`: the request lines (rkvjax or OpenAI batch shape), each checked before any work.
- `output`: the results file (header, lock, appends, resume, the end line of a finished job),
  its summary, merging shards.
- `openai_batch`: the OpenAI batch request and response shapes.
- `run`: `run_job`, and `EngineRunner`, which runs a job on `rkvjax.Engine`.
"""

from rkvjax.entrypoints.jobs.inputs import (
    JobRequest,
    default_id,
    in_shard,
    parse_shard,
    read_requests,
    request_seed,
    resolve_sampling,
)
from rkvjax.entrypoints.jobs.output import (
    END_KEY,
    FORMAT_VERSION,
    HEADER_KEY,
    JobOutput,
    Results,
    check_output,
    merge,
    read_output,
    summary_path,
)
from rkvjax.entrypoints.jobs.run import (
    DEFAULT_JOB_SLOTS,
    ORDERS,
    EngineRunner,
    Runner,
    preflight,
    run_job,
    run_requests,
    sample_record,
)

__all__ = [
    "DEFAULT_JOB_SLOTS",
    "END_KEY",
    "FORMAT_VERSION",
    "HEADER_KEY",
    "ORDERS",
    "EngineRunner",
    "JobOutput",
    "JobRequest",
    "Results",
    "Runner",
    "check_output",
    "default_id",
    "in_shard",
    "merge",
    "parse_shard",
    "preflight",
    "read_output",
    "read_requests",
    "request_seed",
    "resolve_sampling",
    "run_job",
    "run_requests",
    "sample_record",
    "summary_path",
]
