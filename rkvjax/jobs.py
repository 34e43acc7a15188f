"""Offline generation jobs: JSONL prompts in, JSONL completions out, resumable, never losing work.

Each input line is a JSON object with `prompt` (text) or `prompt_token_ids` (ids), and optionally
`id` (default: the line number). Each output line repeats `id` and adds the result. Results are
appended one batch at a time with a single write followed by fsync, so a crash loses at most the
batch in flight; a rerun skips the ids already in the output (a torn last line is dropped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Parses the input JSONL, checking every line before any work starts."""
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict) or ("prompt" in row) == ("prompt_token_ids" in row):
                raise ValueError(f"{path}:{n}: need an object with `prompt` or `prompt_token_ids`")
            row.setdefault("id", n)
            if row["id"] in seen:
                raise ValueError(f"{path}:{n}: duplicate id {row['id']!r}")
            seen.add(row["id"])
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def finished_ids(path: Path) -> set:
    """Ids already in the output; truncates a torn final line left by an interrupted write."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # the last write was cut short: drop its partial line
        with open(path, "r+b") as f:
            f.truncate(end)
    return {json.loads(line)["id"] for line in data[:end].splitlines() if line.strip()}


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _batches(rows: list[dict], size: int) -> Iterator[list[dict]]:
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def run_job(
    generate: Callable[[list], list],
    input_path: str | Path,
    output_path: str | Path,
    *,
    batch_size: int = 8,
    progress: bool = True,
) -> tuple[int, int]:
    """Runs every prompt of `input_path` not yet in `output_path`.

    Args:
      generate: prompts (str or token id lists) -> GenerationResults, e.g. a
        `functools.partial(rkvjax.generate, model, max_new_tokens=...)`.
      input_path, output_path: JSONL files.
      batch_size: prompts per generate call.
      progress: show a progress bar over prompts.

    Returns:
      (prompts run now, prompts skipped because they were already done).
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    input_path, output_path = Path(input_path), Path(output_path)
    rows = read_prompts(input_path)
    # On several processes every one runs every batch (the model is split over all of them);
    # process 0 owns the output and decides which prompts are left.
    primary = jax.process_index() == 0
    done = finished_ids(output_path) if primary else set()
    left = np.array([r["id"] not in done for r in rows])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        left = np.asarray(multihost_utils.broadcast_one_to_all(left))
    todo = [r for r, x in zip(rows, left, strict=True) if x]
    bar = tqdm(
        total=len(rows),
        initial=len(rows) - len(todo),
        unit="prompt",
        disable=not (progress and primary),
    )
    for batch in _batches(todo, batch_size):
        prompts = [r.get("prompt", r.get("prompt_token_ids")) for r in batch]
        results = generate(prompts)
        if primary:
            _append(
                output_path,
                [{"id": r["id"], **res.to_dict()} for r, res in zip(batch, results, strict=True)],
            )
        bar.update(len(batch))
    bar.close()
    return len(todo), len(rows) - len(todo)
