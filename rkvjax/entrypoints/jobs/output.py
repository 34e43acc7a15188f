"""Job output: a JSONL file that starts with a header, locked while a job writes it.

The header `{"rkvjax_job": 3, "settings": {...}}` holds the format version and the settings that
produce the results; each later line is one result. Results are appended with one write and an
fsync each, so a crash tears at most the last line, which a rerun drops. A rerun refuses other
settings, and no job touches a file without the header, nor the input itself.

A job that wrote every sample of its requests ends the file with an end line,
`{"rkvjax_job_end": {"input": ..., "input_samples": ..., "samples": ..., "keys": ...,
"content": ...}}`: a digest of the whole input's requests (every shard of one input names the
same), the input's samples, the count and a digest of the (id, sample index) keys this file must
hold, and a digest of every byte of its result lines. A file without one is unfinished. A
rerun that appends results removes the end line first and writes a new one when it finishes.
`merge` joins only finished shards of one input, and checks each against its end line.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rkvjax.entrypoints.jobs import openai_batch
from rkvjax.entrypoints.jobs.quote import show

HEADER_KEY = "rkvjax_job"
FORMAT_VERSION = 3  # 3: finished jobs end with an end line (END_KEY)
END_KEY = "rkvjax_job_end"
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


def end_line(end: Mapping[str, Any]) -> bytes:
    """The last line of a finished job's output (see the module docstring)."""
    return json.dumps({END_KEY: dict(end)}).encode("utf-8") + b"\n"


def keys_digest(keys: Iterable[tuple[Any, int]]) -> str:
    """A digest of a set of (request id, sample index) keys, whatever their order."""
    canon = sorted(json.dumps([k, j]) for k, j in keys)
    return hashlib.sha256("\n".join(canon).encode("utf-8")).hexdigest()[:16]


def line_digest(line: bytes) -> str:
    """A digest of one result line's bytes (its newline left out)."""
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def content_digest(line_digests: Iterable[str]) -> str:
    """A digest of result lines (`line_digest` each), whatever their order: a finished job's
    end line records it, so an edited line, or one added or removed, no longer matches."""
    return hashlib.sha256("\n".join(sorted(line_digests)).encode("utf-8")).hexdigest()[:16]


def _result_keys(lines: list[bytes], path: Path) -> tuple[dict, dict | None, list[str]]:
    """({key: the line's request_hash (None if it has none)} of the complete result lines, the
    end line's fields if the last of them is one, each result line's `line_digest`); lines
    are numbered from 2 (1 is the header)."""
    keys: dict = {}
    digests: list[str] = []
    end = None
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
        if end is not None:
            raise ValueError(
                f"{path}:{n}: a line after the job's end line; the file was edited: restore it, "
                f"or {NEW_FILE}"
            )
        if isinstance(obj, dict) and END_KEY in obj:
            end = obj[END_KEY]
            if not isinstance(end, dict):
                raise ValueError(f"{path}:{n}: damaged job end line; {NEW_FILE}")
            continue
        found = line_keys(obj)
        if found is None:
            raise ValueError(
                f"{path}:{n}: result line without an `id`; restore or delete that line, or "
                f"{NEW_FILE}"
            )
        keys.update(dict.fromkeys(found, obj.get(HASH_FIELD)))
        digests.append(line_digest(line))
    return keys, end, digests


@dataclasses.dataclass(frozen=True)
class Scan:
    """What an existing output holds: its settings, finished samples and the bytes to keep."""

    settings: dict[str, Any] | None  # None: empty, or a header cut short by a kill
    done: dict  # (request id, sample index) -> the request_hash its line was written with
    keep: int  # bytes up to the last complete line; the rest is a torn write
    torn: bool = False  # the file ends in a line cut short (a job killed while writing)
    end: dict[str, Any] | None = None  # the end line of a finished job (its last line)
    results_end: int = 0  # bytes up to the last result line: where the end line starts
    lines: tuple[str, ...] = ()  # `line_digest` of every result line


def scan_output(data: bytes, path: Path) -> Scan:
    """Reads an output's bytes without changing anything; refuses files rkvjax did not write."""
    if not data or _torn_header(data):
        return Scan(None, {}, 0, torn=bool(data))
    first = data.find(b"\n")
    settings = _read_header(data if first < 0 else data[:first], path)
    if first < 0:
        raise ValueError(f"{path}: its job header line is cut short; {NEW_FILE}")
    keep = data.rfind(b"\n") + 1
    done, end, lines = _result_keys(data[first + 1 : keep].split(b"\n")[:-1], path)
    results_end = keep if end is None else data.rfind(b"\n", 0, keep - 1) + 1
    return Scan(settings, done, keep, len(data) > keep, end, results_end, tuple(lines))


def settings_diff(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    old_name: str = "in the file",
    new_name: str = "now",
) -> list[str]:
    """`key=OLD in the file, NEW now` for every setting that differs."""

    def value(settings: Mapping[str, Any], key: str) -> str:
        return show(settings[key]) if key in settings else "(not set)"

    keys = list(old) + [k for k in new if k not in old]
    return [
        f"{k}={value(old, k)} {old_name}, {value(new, k)} {new_name}"
        for k in keys
        if k not in old or k not in new or old[k] != new[k]
    ]


class JobOutput:
    """A job's results file, locked while open: header, settings check, resume and appends."""

    def __init__(self, path: Path, file, scan: Scan):
        self.path, self._file = path, file
        # (request id, sample index) of every sample written -> its line's request_hash
        # (None: none)
        self.hashes = dict(scan.done)
        self.end = scan.end  # the end line's fields while the file ends with one
        self._results_end = scan.results_end
        self._lines = list(scan.lines)  # `line_digest` of every result line

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
                scan = Scan(settings, {}, 0, results_end=f.tell())
            elif scan.torn:
                f.truncate(scan.keep)  # the last write was cut short: drop its partial line
                os.fsync(f.fileno())
        except BaseException:
            f.close()
            raise
        return cls(path, f, scan)

    def _reopen(self) -> None:
        """Removes the end line before more results: the job is not finished until it writes
        a new one."""
        if self.end is not None:
            self._file.truncate(self._results_end)
            os.fsync(self._file.fileno())
            self.end = None

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends result lines with one write and an fsync, so a crash tears at most the last."""
        records = list(records)
        lines = [json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records]
        self._reopen()
        _write(self._file, b"".join(lines), self.path)
        for r, line in zip(records, lines, strict=True):
            self.hashes.update(dict.fromkeys(line_keys(r) or (), r.get(HASH_FIELD)))
            self._lines.append(line_digest(line))

    def finish(self, end: Mapping[str, Any]) -> None:
        """Ends the file with the end line of a finished job (unless it already ends so), the
        digest of its result lines added."""
        end = json.loads(json.dumps({**end, "content": content_digest(self._lines)}))
        if end == self.end:
            return
        self._reopen()
        self._results_end = self._file.seek(0, os.SEEK_END)
        _write(self._file, end_line(end), self.path)
        self.end = end

    def close(self) -> None:
        """Releases the lock."""
        self._file.close()

    def __enter__(self) -> JobOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Results:
    """A job output as read back: the settings of its header, its result lines, and its end
    line's fields (None while the job is unfinished)."""

    settings: dict[str, Any]
    lines: list[dict[str, Any]]
    end: dict[str, Any] | None


def read_output(path: str | Path) -> Results:
    """Reads a job output (a line cut short by a kill is left out); refuses other files."""
    path = Path(path)
    data = path.read_bytes()
    scan = scan_output(data, path)
    if scan.settings is None:
        raise ValueError(f"{path}: holds no job header (empty, or its job was stopped at once)")
    body = data[data.find(b"\n") + 1 : scan.results_end]
    lines = [json.loads(x) for x in body.split(b"\n") if x.strip()]
    return Results(scan.settings, lines, scan.end)


def refuse_input(input_path: str | Path, path: Path) -> None:
    """Refuses an output path that is the input (also through a link)."""
    if path.exists() and os.path.samefile(input_path, path):
        raise ValueError(f"{path}: is the input file itself; give the results another path")


def check_folder(path: Path) -> None:
    """Refuses a directory as an output, or a parent folder that is missing, is a file, or
    cannot be written to."""
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give a file path for the results")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{path}: {parent} is a file, not a folder; pick another output path")
    if not parent.is_dir():
        raise FileNotFoundError(
            f"{path}: folder {parent} does not exist; create it or pick another output path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: folder {parent} is not writable; pick another output path")


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
    # Not mkstemp: its files are private (0600); a summary is as readable as the results
    # beside it (0666 less the umask).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


def _finished_shard(path: Path) -> tuple[Scan, bytes]:
    """A shard output's scan and bytes, refused unless its job finished and its results are
    the ones its end line names."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a shard output of `rkvjax batch`)")
    data = path.read_bytes()
    scan = scan_output(data, path)
    if scan.settings is None:
        raise ValueError(f"{path}: holds no job header (an unfinished or empty shard)")
    shard = scan.settings.get("shard")
    if not isinstance(shard, str):
        raise ValueError(f"{path}: not a shard output (its settings have no `shard`)")
    rerun = f"rerun its job (`rkvjax batch ... --shard {shard}`) to finish it"
    if scan.torn:
        raise ValueError(
            f"{path}: its last line is cut short: its job was stopped while writing; {rerun}"
        )
    if scan.end is None:
        raise ValueError(f"{path}: unfinished shard (no job end line); {rerun}")
    want = (scan.end.get("samples"), scan.end.get("keys"))
    if want != (len(scan.done), keys_digest(scan.done)):
        raise ValueError(
            f"{path}: its results are not the {scan.end.get('samples')} samples its end line "
            "names (edited after its job ended?); " + rerun
        )
    if "content" not in scan.end:
        raise ValueError(
            f"{path}: its end line has no digest of its results (written by an older rkvjax), "
            f"so edits cannot be ruled out; {rerun} (a rerun rewrites the end line)"
        )
    if scan.end["content"] != content_digest(scan.lines):
        raise ValueError(
            f"{path}: its result lines are not the ones its job wrote (edited after the job "
            "ended: their digest differs from the end line's); restore the file or " + rerun
        )
    return scan, data


def merge(output: str | Path, shards: Iterable[str | Path]) -> tuple[int, int]:
    """Merges the outputs of a job's shards (`--shard I/N`) into one new output.

    Every shard must be finished (its file ends with the job's end line, and holds exactly the
    samples that line names), come from the same job (equal settings but the shard, and the
    same input), and every shard of it must be there once. The merged file holds every sample
    of the input once, and ends with the end line of the whole input. The output must not
    exist.

    Returns:
      (shards merged, result lines written).
    """
    output = Path(output)
    paths = [Path(p) for p in shards]
    if not paths:
        raise ValueError("merge needs the shard outputs to merge")
    check_folder(output)
    if output.exists():
        raise FileExistsError(f"{output}: exists; merge writes a new file")
    parts, seen = [], {}
    for p in paths:
        scan, data = _finished_shard(p)
        shard = scan.settings["shard"]
        if parts:
            first, base = parts[0][0], parts[0][1]
            diff = settings_diff(
                _unsharded(scan.settings),
                _unsharded(base.settings),
                f"in {p.name}",
                f"in {first.name}",
            )
            if diff:
                raise ValueError(f"{p}: another job's shard ({'; '.join(diff)})")
            if scan.end.get("input") != base.end.get("input"):
                raise ValueError(
                    f"{p}: a shard of another input than {first} (their end lines name "
                    "different request lines)"
                )
        if shard in seen:
            raise ValueError(f"{p}: shard {shard} again ({seen[shard]} is shard {shard} too)")
        seen[shard] = p
        parts.append((p, scan, data))
    want = int(parts[0][1].settings["shard"].split("/")[1])
    missing = sorted(set(f"{i}/{want}" for i in range(want)) - set(seen), key=_shard_index)
    if missing:
        raise ValueError(f"shards {', '.join(missing)} missing (every one of the {want} is needed)")
    keys: dict = {}
    for p, scan, _ in parts:
        for key in scan.done:
            if key in keys:
                raise ValueError(f"{p}: sample {key} again ({keys[key]} has it)")
            keys[key] = p
    end = parts[0][1].end
    if len(keys) != end.get("input_samples"):
        raise ValueError(
            f"the shards hold {len(keys)} samples, their input {end.get('input_samples')}"
        )
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise FileExistsError(f"{output}: exists; merge writes a new file") from None
    lines = 0
    with os.fdopen(fd, "wb") as f:
        f.write(header_line(_unsharded(parts[0][1].settings)))
        for _, scan, data in parts:
            body = data[data.find(b"\n") + 1 : scan.results_end]
            f.write(body)
            lines += sum(1 for line in body.split(b"\n") if line.strip())
        digest = content_digest(d for _, scan, _ in parts for d in scan.lines)
        merged_end = {**end, "samples": len(keys), "keys": keys_digest(keys), "content": digest}
        f.write(end_line(merged_end))
        f.flush()
        os.fsync(f.fileno())
    return len(parts), lines


def _shard_index(shard: str) -> int:
    return int(shard.split("/")[0])


def _unsharded(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k != "shard"}
