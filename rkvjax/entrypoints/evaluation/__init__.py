"""Reasoning evaluation: problems in, graded samples and pass@k out (`rkvjax eval`).

- `problems`: the problem file (MATH-500, AIME 2024 or any JSONL with a problem and an answer).
- `hub`: a problem file named by a Hugging Face dataset, fetched once into a local cache.
- `grading`: the answer of a completion and whether it equals the reference (math-verify).
- `metrics`: pass@k, the n-gram repetition rate, looping samples, the summary of a run.
- `run`: `run_eval`, the R1 recipe as a resumable job on the slot runtime.
"""

from rkvjax.entrypoints.evaluation.grading import (
    Grade,
    extract,
    final_part,
    grade,
    is_equivalent,
    last_boxed,
)
from rkvjax.entrypoints.evaluation.hub import problem_file
from rkvjax.entrypoints.evaluation.metrics import (
    is_looping,
    k_values,
    pass_at_k,
    repetition_rate,
    summarize,
)
from rkvjax.entrypoints.evaluation.problems import Problem, read_problems
from rkvjax.entrypoints.evaluation.run import (
    MAX_TOKENS,
    R1_INSTRUCTION,
    R1_SAMPLING,
    SAMPLES_FILE,
    SUMMARY_FILE,
    GradingRunner,
    default_max_tokens,
    prompt_of,
    read_samples,
    run_eval,
)

__all__ = [
    "MAX_TOKENS",
    "R1_INSTRUCTION",
    "R1_SAMPLING",
    "SAMPLES_FILE",
    "SUMMARY_FILE",
    "Grade",
    "GradingRunner",
    "Problem",
    "default_max_tokens",
    "extract",
    "final_part",
    "grade",
    "is_equivalent",
    "is_looping",
    "k_values",
    "last_boxed",
    "pass_at_k",
    "problem_file",
    "prompt_of",
    "read_problems",
    "read_samples",
    "repetition_rate",
    "run_eval",
    "summarize",
]
