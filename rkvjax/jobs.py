"""Offline generation jobs: JSONL prompts in, JSONL completions out, resumable, never losing work.

Input: one JSON object per line with `prompt` (non-empty text) or `prompt_token_ids` (a
non-empty list of ints), not both, and optionally `id` (a string or an integer). Any other field
is an error. A line without `id` gets the first 16 hex digits of the SHA-256 of its own JSON
without `id` (keys sorted, no spaces, UTF-8), so editing, adding or removing other lines never
moves an id onto another prompt; two such lines with the same prompt are refused (give them
ids). Every line is checked, and every prompt left to run is checked against the model, before
any work.

Output: a header line `{"rkvjax_job": 1, "settings": {...}}` (the format version and the
settings that produce the results), then one line per prompt that repeats `id` and adds the
result. The file is locked for the whole job, so a second job on it is refused. Results are
appended one batch at a time with a single write followed by fsync, so a crash loses at most the
batch in flight. A rerun checks the header, refuses other settings, skips the ids already there
and drops a torn last line; it never touches a file without the header, nor the input itself.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

HEADER_KEY = "rkvjax_job"
FORMAT_VERSION = 1
INPUT_FIELDS = ("id", "prompt", "prompt_token_ids")
_NEW_FILE = "pick another output path for a new job"


@dataclasses.dataclass(frozen=True)
class Row:
    """One input line: its number, its id and its prompt (text or token ids)."""

    line: int
    id: str | int
    prompt: str | list[int]


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_id(obj: Mapping[str, Any]) -> str:
    """The id of a line without one: a short hash of the line's canonical JSON."""
    request = {k: v for k, v in obj.items() if k != "id"}
    canon = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _prompt_of(obj: dict[str, Any], where: str) -> str | list[int]:
    if "prompt" in obj and "prompt_token_ids" in obj:
        raise ValueError(f"{where}: has both `prompt` and `prompt_token_ids`; give one, not both")
    if "prompt" in obj:
        p = obj["prompt"]
        if not isinstance(p, str) or not p:
            raise ValueError(f"{where}: `prompt` must be a non-empty string, got {_show(p)}")
        return p
    if "prompt_token_ids" in obj:
        p = obj["prompt_token_ids"]
        if not isinstance(p, list) or not p or not all(map(_is_int, p)):
            raise ValueError(
                f"{where}: `prompt_token_ids` must be a non-empty list of ints, got {_show(p)}"
            )
        return p
    raise ValueError(f"{where}: needs `prompt` (text) or `prompt_token_ids` (a list of token ids)")


def parse_line(raw: bytes, where: str, line: int) -> Row:
    """One input line -> a Row, or a ValueError naming `where` and what is wrong."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with `prompt`, got {_show(obj)}")
    unknown = [k for k in obj if k not in INPUT_FIELDS]
    if unknown:
        # Per-request generation settings are not read yet: ignoring them would be silent.
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; a line holds `prompt` "
            "or `prompt_token_ids` and an optional `id` (settings apply to the whole job)"
        )
    prompt = _prompt_of(obj, where)
    if "id" not in obj:
        return Row(line, default_id(obj), prompt)
    if not (_is_int(obj["id"]) or isinstance(obj["id"], str)):
        raise ValueError(f"{where}: `id` must be a string or an integer, got {_show(obj['id'])}")
    return Row(line, obj["id"], prompt)


def _open_input(path: Path):
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give the JSONL file of prompts")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (the JSONL file of prompts)")
    try:
        return open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None


def read_prompts(path: str | Path) -> list[Row]:
    """Parses the input JSONL, checking every line (and that ids are unique) before any work."""
    path = Path(path)
    rows: list[Row] = []
    line_of: dict[str | int, int] = {}
    with _open_input(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            row = parse_line(raw, f"{path}:{n}", n)
            if row.id in line_of:
                first = line_of[row.id]
                if "id" in json.loads(raw):
                    raise ValueError(f"{path}:{n}: duplicate id {row.id!r} (line {first} has it)")
                raise ValueError(
                    f"{path}:{n}: same prompt as line {first}; give each of them an `id` to run "
                    "it more than once"
                )
            line_of[row.id] = n
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return rows


def header_line(settings: Mapping[str, Any]) -> bytes:
    """The first line of a job output: the format version and the settings of its results."""
    return json.dumps({HEADER_KEY: FORMAT_VERSION, "settings": settings}).encode("utf-8") + b"\n"


def _read_header(line: bytes, path: Path) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise ValueError(
            f"{path}: exists and is not an rkvjax batch output (no job header on its first "
            f"line); it is left untouched, {_NEW_FILE}"
        )
    if header[HEADER_KEY] != FORMAT_VERSION or not isinstance(header.get("settings"), dict):
        raise ValueError(
            f"{path}: written in job format {_show(header[HEADER_KEY])}, this rkvjax writes "
            f"format {FORMAT_VERSION}; {_NEW_FILE}"
        )
    return header["settings"]


def _result_ids(lines: list[bytes], path: Path) -> set:
    """Ids of the complete result lines (numbered from 2: line 1 is the header)."""
    ids = set()
    for n, line in enumerate(lines, 2):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(
                f"{path}:{n}: corrupt result line (not JSON); restore or delete that line, or "
                f"{_NEW_FILE}"
            ) from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise ValueError(
                f"{path}:{n}: result line without an `id`; restore or delete that line, or "
                f"{_NEW_FILE}"
            )
        ids.add(obj["id"])
    return ids


@dataclasses.dataclass(frozen=True)
class Scan:
    """What an existing output holds: its settings, finished ids and the bytes worth keeping."""

    settings: dict[str, Any] | None  # None: an empty file
    done: set
    keep: int  # bytes up to the last complete line; the rest is a torn write


def scan_output(data: bytes, path: Path) -> Scan:
    """Reads an output's bytes without changing anything; refuses files rkvjax did not write."""
    if not data:
        return Scan(None, set(), 0)
    first = data.find(b"\n")
    settings = _read_header(data if first < 0 else data[:first], path)
    if first < 0:
        raise ValueError(f"{path}: its job header line is cut short; {_NEW_FILE}")
    keep = data.rfind(b"\n") + 1
    return Scan(settings, _result_ids(data[first + 1 : keep].split(b"\n")[:-1], path), keep)


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key=OLD in the file, NEW now` for every setting that differs."""
    missing = "(not set)"
    keys = list(old) + [k for k in new if k not in old]
    return [
        f"{k}={_show(old.get(k, missing))} in the file, {_show(new.get(k, missing))} now"
        for k in keys
        if old.get(k, missing) != new.get(k, missing)
    ]


class JobOutput:
    """A job's results file, locked while open: header, settings check, resume and appends."""

    def __init__(self, path: Path, file, done: set):
        self.path, self._file, self.done = path, file, done

    @classmethod
    def open(
        cls,
        path: str | Path,
        settings: Mapping[str, Any],
        *,
        input_path: str | Path | None = None,
    ) -> JobOutput:
        """Locks `path` for appends; refuses the input, foreign files and other settings."""
        path = Path(path)
        settings = json.loads(json.dumps(dict(settings)))  # compare as they read back
        if input_path is not None:
            _refuse_input(input_path, path)
        f = _open_locked(path)
        try:
            f.seek(0)
            scan = scan_output(f.read(), path)
            if scan.settings is not None and scan.done:
                diff = settings_diff(scan.settings, settings)
                if diff:
                    raise ValueError(
                        f"{path}: made with other settings ({'; '.join(diff)}); rerun with the "
                        f"file's settings to resume, or {_NEW_FILE}"
                    )
            if scan.settings is None or (not scan.done and scan.settings != settings):
                # No results yet: the header is (re)written for this run's settings.
                f.truncate(0)
                _write(f, header_line(settings), path)
            elif scan.keep < f.tell():
                f.truncate(scan.keep)  # the last write was cut short: drop its partial line
                os.fsync(f.fileno())
        except BaseException:
            f.close()
            raise
        return cls(path, f, set(scan.done))

    def append(self, results: list[dict[str, Any]]) -> None:
        """Appends result lines with one write and an fsync, so a crash tears at most the last."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
        _write(self._file, text.encode("utf-8"), self.path)
        self.done.update(r["id"] for r in results)

    def close(self) -> None:
        """Releases the lock."""
        self._file.close()

    def __enter__(self) -> JobOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refuse_input(input_path: str | Path, path: Path) -> None:
    if path.exists() and os.path.samefile(input_path, path):
        raise ValueError(f"{path}: is the input file itself; give the results another path")


def _check_folder(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give a file path for the results")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path}: folder {path.parent} does not exist; create it or pick another output path"
        )


def _open_locked(path: Path):
    _check_folder(path)
    try:
        f = open(path, "a+b")  # noqa: SIM115 (held open: the lock lasts as long as the job)
    except OSError as e:
        raise ValueError(
            f"{path}: cannot write it ({e.strerror}); pick another output path"
        ) from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if isinstance(e, BlockingIOError):
            raise ValueError(
                f"{path}: another rkvjax batch job is writing it; wait for that one to finish, "
                "or pick another output path"
            ) from None
        raise ValueError(
            f"{path}: cannot lock it ({e.strerror}); pick another output path"
        ) from None
    return f


def _write(f, data: bytes, path: Path) -> None:
    try:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(
            f"{path}: writing results failed ({e.strerror}); finished batches are kept, rerun "
            "to resume once it is fixed"
        ) from None


def preflight(input_path: str | Path, output_path: str | Path) -> None:
    """Checks the input and (on process 0) the output without writing, before a slow start."""
    read_prompts(input_path)
    path = Path(output_path)
    if jax.process_index() != 0:
        return
    _refuse_input(input_path, path)
    if path.exists():
        with _open_locked(path) as f:
            scan_output(f.read(), path)
        return
    _check_folder(path)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"{path}: cannot create it (folder not writable); pick another output path"
        )


def check_rows(rows: list[Row], check: Callable[[Any], None], input_path: Path) -> None:
    """Runs `check` on every prompt; raises the first failure naming its line and id."""
    failures = []
    for row in rows:
        try:
            check(row.prompt)
        except ValueError as e:
            failures.append(f"{input_path}:{row.line} (id {row.id!r}): {e}")
    if failures:
        k = len(failures) - 1
        more = "" if k == 0 else f" ({k} more {'line fails' if k == 1 else 'lines fail'} too)"
        raise ValueError(failures[0] + more)


def _from_process_0(flags: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(flags))


def _batches(rows: list[Row], size: int) -> Iterator[list[Row]]:
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def run_job(
    generate: Callable[[list], list],
    input_path: str | Path,
    output_path: str | Path,
    *,
    batch_size: int = 8,
    progress: bool = True,
    settings: Mapping[str, Any] | None = None,
    check: Callable[[Any], None] | None = None,
) -> tuple[int, int]:
    """Runs every prompt of `input_path` not yet in `output_path`.

    Args:
      generate: prompts (str or token id lists) -> GenerationResults, e.g. a
        `functools.partial(rkvjax.generate, model, max_new_tokens=...)`.
      input_path, output_path: JSONL files (the output starts with a job header).
      batch_size: prompts per generate call.
      progress: show a progress bar over prompts.
      settings: JSON-able settings that produce the results (model, sampling, ...), recorded in
        the output's header; a rerun with other settings is refused.
      check: prompt -> None, raising ValueError for a prompt `generate` cannot run; called on
        every prompt left before any generation.

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
    out, error = None, None
    if primary:
        try:
            out = JobOutput.open(output_path, settings or {}, input_path=input_path)
        except (ValueError, OSError) as e:
            error = e
    done = out.done if out is not None else set()
    # The first flag tells the other processes whether process 0 could open the output.
    flags = _from_process_0(np.array([error is None] + [r.id not in done for r in rows]))
    if error is not None:
        raise error
    if not flags[0]:
        raise ValueError(f"{output_path}: process 0 could not open it (its error says why)")
    try:
        todo = [r for r, x in zip(rows, flags[1:], strict=True) if x]
        if check is not None:
            check_rows(todo, check, input_path)
        bar = tqdm(
            total=len(rows),
            initial=len(rows) - len(todo),
            unit="prompt",
            disable=not (progress and primary),
        )
        for batch in _batches(todo, batch_size):
            results = generate([r.prompt for r in batch])
            if out is not None:
                out.append(
                    [{"id": r.id, **res.to_dict()} for r, res in zip(batch, results, strict=True)]
                )
            bar.update(len(batch))
        bar.close()
    finally:
        if out is not None:
            out.close()
    return len(todo), len(rows) - len(todo)
