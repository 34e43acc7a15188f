"""Job output: a JSONL file that starts with a header, locked while a job writes it.

The header `{"rkvjax_job": 2, "settings": {...}}` holds the format version and the settings that
produce the results; each later line is one result. Results are appended with one write and an
fsync each, so a crash tears at most the last line, which a rerun drops. A rerun refuses other
settings, and no job touches a file without the header, nor the input itself.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rkvjax.jobs import openai_batch
from rkvjax.jobs.quote import show

HEADER_KEY = "rkvjax_job"
FORMAT_VERSION = 2
SUMMARY_KEY = "rkvjax_job_summary"
NEW_FILE = "pick another output path for a new job"
HASH_FIELD = "request_hash"  # of result lines: `inputs.request_hash` of the line's request


def header_line(settings: Mapping[str, Any]) -> bytes:
    """The first line of a job output: the format version and the settings of its results."""
    return json.dumps({HEADER_KEY: FORMAT_VERSION, "settings": settings}).encode("utf-8") + b"\n"


def _torn_header(data: bytes) -> bool:
    """Whether data (no newline) is the start of a header line: a job killed while creating
    the file. Only the format's own opening counts, so no other file passes."""
    opening = json.dumps({HEADER_KEY: FORMAT_VERSION}).encode("utf-8")[:-1]
    return b"\n" not in data and (data.startswith(opening) or opening.startswith(data))


def _read_header(line: bytes, path: Path) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise ValueError(
            f"{path}: exists and is not an rkvjax batch output (no job header on its first "
            f"line); it is left untouched, {NEW_FILE}"
        )
    if header[HEADER_KEY] != FORMAT_VERSION or not isinstance(header.get("settings"), dict):
        raise ValueError(
            f"{path}: written in job format {show(header[HEADER_KEY])}, this rkvjax writes "
            f"format {FORMAT_VERSION}; {NEW_FILE}"
        )
    return header["settings"]


def line_keys(obj: Any) -> list[tuple[Any, int]] | None:
    """(request id, sample index) of every sample a result line holds; None if not a result."""
    if not isinstance(obj, dict):
        return None
    keys = openai_batch.sample_keys(obj)
    if keys is not None:
        return keys
    if "id" not in obj or not isinstance(obj.get("sample_index", 0), int):
        return None
    return [(obj["id"], obj.get("sample_index", 0))]


def _result_keys(lines: list[bytes], path: Path) -> dict:
    """{key: the line's request_hash (None if it has none)} of the complete result lines
    (numbered from 2: line 1 is the header)."""
    keys: dict = {}
    for n, line in enumerate(lines, 2):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(
                f"{path}:{n}: corrupt result line (not JSON); restore or delete that line, or "
                f"{NEW_FILE}"
            ) from None
        found = line_keys(obj)
        if found is None:
            raise ValueError(
                f"{path}:{n}: result line without an `id`; restore or delete that line, or "
                f"{NEW_FILE}"
            )
        keys.update(dict.fromkeys(found, obj.get(HASH_FIELD)))
    return keys


@dataclasses.dataclass(frozen=True)
class Scan:
    """What an existing output holds: its settings, finished samples and the bytes to keep."""

    settings: dict[str, Any] | None  # None: empty, or a header cut short by a kill
    done: dict  # (request id, sample index) -> the request_hash its line was written with
    keep: int  # bytes up to the last complete line; the rest is a torn write


def scan_output(data: bytes, path: Path) -> Scan:
    """Reads an output's bytes without changing anything; refuses files rkvjax did not write."""
    if not data or _torn_header(data):
        return Scan(None, {}, 0)
    first = data.find(b"\n")
    settings = _read_header(data if first < 0 else data[:first], path)
    if first < 0:
        raise ValueError(f"{path}: its job header line is cut short; {NEW_FILE}")
    keep = data.rfind(b"\n") + 1
    return Scan(settings, _result_keys(data[first + 1 : keep].split(b"\n")[:-1], path), keep)


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key=OLD in the file, NEW now` for every setting that differs."""
    missing = "(not set)"
    keys = list(old) + [k for k in new if k not in old]
    return [
        f"{k}={show(old.get(k, missing))} in the file, {show(new.get(k, missing))} now"
        for k in keys
        if old.get(k, missing) != new.get(k, missing)
    ]


class JobOutput:
    """A job's results file, locked while open: header, settings check, resume and appends."""

    def __init__(self, path: Path, file, hashes: dict):
        self.path, self._file = path, file
        # (request id, sample index) of every sample written -> its line's request_hash
        # (None: none)
        self.hashes = hashes

    @property
    def done(self):
        """(request id, sample index) of every sample written."""
        return self.hashes.keys()

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
            refuse_input(input_path, path)
        f = open_locked(path)
        try:
            f.seek(0)
            scan = scan_output(f.read(), path)
            if scan.settings is not None and scan.done:
                diff = settings_diff(scan.settings, settings)
                if diff:
                    raise ValueError(
                        f"{path}: made with other settings ({'; '.join(diff)}); rerun with the "
                        f"file's settings to resume, or {NEW_FILE}"
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
        return cls(path, f, dict(scan.done))

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends result lines with one write and an fsync, so a crash tears at most the last."""
        records = list(records)
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        _write(self._file, text.encode("utf-8"), self.path)
        for r in records:
            self.hashes.update(dict.fromkeys(line_keys(r) or (), r.get(HASH_FIELD)))

    def close(self) -> None:
        """Releases the lock."""
        self._file.close()

    def __enter__(self) -> JobOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def refuse_input(input_path: str | Path, path: Path) -> None:
    """Refuses an output path that is the input (also through a link)."""
    if path.exists() and os.path.samefile(input_path, path):
        raise ValueError(f"{path}: is the input file itself; give the results another path")


def check_folder(path: Path) -> None:
    """Refuses a directory as an output, or a missing parent folder."""
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give a file path for the results")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path}: folder {path.parent} does not exist; create it or pick another output path"
        )


def open_locked(path: Path):
    """Opens (creating) path for appends and takes its lock, or says why not."""
    check_folder(path)
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
            f"{path}: writing results failed ({e.strerror}); finished results are kept, rerun "
            "to resume once it is fixed"
        ) from None


def check_output(input_path: str | Path, output_path: str | Path) -> None:
    """Checks the output (and its summary file) without writing anything."""
    path = Path(output_path)
    refuse_input(input_path, path)
    if path.exists():
        with open_locked(path) as f:
            scan_output(f.read(), path)
    else:
        check_folder(path)
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise ValueError(
                f"{path}: cannot create it (folder not writable); pick another output path"
            )
    read_summary(summary_path(path))


# -- the summary -------------------------------------------------------------------------------


def summary_path(output: str | Path) -> Path:
    """Where a job writes its summary: OUT.jsonl -> OUT.summary.json."""
    output = Path(output)
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(stem + ".summary.json")


def read_summary(path: Path, key: str = SUMMARY_KEY) -> dict[str, Any] | None:
    """An earlier summary at path (None if there is none), marked by `key` (a job's, or an
    evaluation's); refuses any other file there."""
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        obj = None
    if not isinstance(obj, dict) or key not in obj:
        kind = "job" if key == SUMMARY_KEY else key.removeprefix("rkvjax_")
        raise ValueError(
            f"{path}: exists and is not an rkvjax {kind} summary (rkvjax writes its summary "
            f"there); move it away or {NEW_FILE}"
        )
    return obj


def write_summary(path: Path, summary: Mapping[str, Any], key: str = SUMMARY_KEY) -> None:
    """Replaces the summary atomically (a temporary file in the same folder, then a rename);
    never replaces a file that is not a summary of this kind."""
    read_summary(path, key)
    data = json.dumps({key: 1, **summary}, indent=2).encode("utf-8") + b"\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- merging shards ----------------------------------------------------------------------------


def merge(output: str | Path, shards: Iterable[str | Path]) -> tuple[int, int]:
    """Merges the outputs of a job's shards (`--shard I/N`) into one new output.

    Every shard must come from the same job (equal settings but the shard) and every shard of
    it must be there once; a sample found twice is an error. The output must not exist.

    Returns:
      (shards merged, result lines written).
    """
    output = Path(output)
    paths = [Path(p) for p in shards]
    if not paths:
        raise ValueError("merge needs the shard outputs to merge")
    check_folder(output)
    parts, base, seen = [], None, {}
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such file (a shard output of `rkvjax batch`)")
        data = p.read_bytes()
        scan = scan_output(data, p)
        if scan.settings is None:
            raise ValueError(f"{p}: holds no job header (an unfinished or empty shard)")
        shard = scan.settings.get("shard")
        if not isinstance(shard, str):
            raise ValueError(f"{p}: not a shard output (its settings have no `shard`)")
        rest = {k: v for k, v in scan.settings.items() if k != "shard"}
        if base is None:
            base, want = rest, int(shard.split("/")[1])
        elif rest != base:
            diff = settings_diff(base, rest)
            raise ValueError(f"{p}: another job's shard ({'; '.join(diff)} than {paths[0]})")
        if shard in seen:
            raise ValueError(f"{p}: shard {shard} again ({seen[shard]} is shard {shard} too)")
        seen[shard] = p
        first = data.find(b"\n") + 1
        parts.append((p, data[first : scan.keep]))
    missing = sorted(set(f"{i}/{want}" for i in range(want)) - set(seen))
    if missing:
        raise ValueError(f"shards {', '.join(missing)} missing (every one of the {want} is needed)")
    keys: dict = {}
    lines = 0
    for p, body in parts:
        for n, line in enumerate(body.split(b"\n")[:-1], 2):
            for key in line_keys(json.loads(line)) or ():
                if key in keys:
                    raise ValueError(f"{p}:{n}: sample {key} again ({keys[key]} has it)")
                keys[key] = f"{p}:{n}"
            lines += 1
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise FileExistsError(f"{output}: exists; merge writes a new file") from None
    with os.fdopen(fd, "wb") as f:
        f.write(header_line(base))
        for _, body in parts:
            f.write(body)
        f.flush()
        os.fsync(f.fileno())
    return len(parts), lines
