"""Job input: JSONL lines -> requests, every line checked (with its line number) before work.

A line is one of two shapes, and a file holds one shape only:

- rkvjax: `prompt` (text; the chat template applies as in `generate`), `messages` (a chat) or
  `prompt_token_ids`, exactly one; an optional `id` (a string or an integer); and optional
  sampling fields with `SamplingParams`' (vLLM's) names, which override the job's defaults.
- OpenAI batch: `custom_id`, `method` "POST", `url` "/v1/chat/completions" (a `body` with
  `messages`) or "/v1/completions" (a `body` with `prompt`, sent as raw text), and the body's
  sampling fields (`openai_batch.BODY_FIELDS`). Results come back in the OpenAI batch output
  shape.

Anything else on a line is an error: a misspelt field must not be silently ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rkvjax.entrypoints.jobs import openai_batch
from rkvjax.entrypoints.jobs.quote import show, unknown
from rkvjax.runtime import requests
from rkvjax.sampling.params import MAX_SEED, SamplingParams

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
INPUT_FIELDS = ("id", *PROMPT_FIELDS, *SAMPLING_FIELDS)


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """One input line, resolved: its number, id, prompt and sampling settings.

    Attributes:
      line: 1-based line number in the input.
      id: the line's `id` (`custom_id` for OpenAI lines), or `default_id` of the line.
      prompt: text, token ids or a chat (a list of {"role", "content"} messages).
      sampling: the job's defaults with the line's own fields applied.
      chat: False for text that must not get the chat template (OpenAI completions), else None
        (the job's choice).
      openai: None for an rkvjax line; "chat" or "completions" for an OpenAI batch line.
      samples: the sample indices to run, when a rerun finds some of the n written (None: all
        of them).
    """

    line: int
    id: str | int
    prompt: str | list[int] | list[dict[str, Any]]
    sampling: SamplingParams
    chat: bool | None = None
    openai: str | None = None
    samples: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def sample_indices(self) -> tuple[int, ...]:
        """The sample indices to run: `samples`, or every one of the n."""
        return tuple(range(self.n)) if self.samples is None else self.samples


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_id(obj: Mapping[str, Any]) -> str:
    """The id of a line without one: a short hash of the line's canonical JSON, so editing,
    adding or removing other lines never moves an id onto another prompt."""
    request = {k: v for k, v in obj.items() if k != "id"}
    canon = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _digest(value: Any) -> int:
    canon = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return int(hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16], 16)


def request_hash(r: JobRequest) -> str:
    """A short hash of what shapes a request's samples: its prompt, chat choice and sampling
    settings, all but `n` (raising n adds samples; the ones written stay valid). Result lines
    carry it, so a rerun whose line for an id changed is refused instead of resumed."""
    sampling = {k: v for k, v in dataclasses.asdict(r.sampling).items() if k != "n"}
    return f"{_digest([r.prompt, r.chat, r.openai, sampling]):016x}"


def input_digest(reqs: list[JobRequest]) -> str:
    """A digest of a job's whole input: every request's id, `request_hash` and n, in any line
    order. Every shard of one input records the same in its end line, so `merge` can tell
    shards of another input (or of an edited one) apart."""
    rows = sorted(json.dumps([r.id, request_hash(r), r.n]) for r in reqs)
    return f"{_digest(rows):016x}"


def request_seed(job_seed: int, request_id: str | int) -> int:
    """The seed of a request that gives none: a hash of the job's seed and the request's id,
    so its samples do not depend on its line, its neighbours or on resuming."""
    return _digest([job_seed, request_id]) % (MAX_SEED + 1)


def in_shard(request_id: str | int, shard: tuple[int, int] | None) -> bool:
    """Whether a request belongs to shard (i, n): by a hash of its id, so shards stay put when
    lines move."""
    return shard is None or _digest(request_id) % shard[1] == shard[0]


def parse_shard(text: str) -> tuple[int, int]:
    """ "I/N" -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (this process's shard of N), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: needs 0 <= I < N")
    return i, n


def _prompt_of(obj: Mapping[str, Any], where: str) -> str | list:
    given = [k for k in PROMPT_FIELDS if k in obj]
    if len(given) > 1:
        both = " and ".join(f"`{k}`" for k in given)
        raise ValueError(f"{where}: has {both}; give one of them, not several")
    if not given:
        raise ValueError(
            f"{where}: needs `prompt` (text), `messages` (a chat) or `prompt_token_ids` (a list "
            "of token ids)"
        )
    key = given[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: `prompt` must be a non-empty string, got {show(value)}")
    elif key == "messages":
        value = requests.joined_parts(value, where, field="messages")
        requests.check_messages(value, where, field="messages")
    elif not isinstance(value, list) or not value or not all(map(_is_int, value)):
        raise ValueError(
            f"{where}: `prompt_token_ids` must be a non-empty list of ints, got {show(value)}"
        )
    return value


def resolve_sampling(
    fields: Mapping[str, Any], defaults: Mapping[str, Any], request_id, where: str
) -> SamplingParams:
    """The job's default sampling settings with a line's own fields applied."""
    kw = {**defaults, **fields}
    if "seed" not in fields and kw.get("seed") is not None:
        kw["seed"] = request_seed(kw["seed"], request_id)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _rkvjax_line(obj: dict, where: str, line: int, defaults: Mapping[str, Any]) -> JobRequest:
    extra = [k for k in obj if k not in INPUT_FIELDS]
    if extra:
        raise ValueError(
            f"{where}: unknown field(s) {unknown(extra, INPUT_FIELDS)}; a line holds `prompt`, "
            "`messages` or `prompt_token_ids`, an optional `id`, and optional sampling fields "
            f"({', '.join(SAMPLING_FIELDS)})"
        )
    prompt = _prompt_of(obj, where)
    if "id" in obj:
        rid = obj["id"]
        if not (_is_int(rid) or isinstance(rid, str)):
            raise ValueError(f"{where}: `id` must be a string or an integer, got {show(rid)}")
    else:
        rid = default_id(obj)
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    return JobRequest(line, rid, prompt, resolve_sampling(fields, defaults, rid, where))


def json_line(raw: bytes, where: str) -> Any:
    """One line of a JSONL file, decoded; a ValueError naming `where` if it is not UTF-8 JSON."""
    try:
        value = requests.load_json(raw.decode("utf-8"), where)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    requests.check_strings(value, where)  # JSON escapes can spell a lone surrogate
    return value


def parse_line(raw: bytes, where: str, line: int, defaults: Mapping[str, Any]) -> JobRequest:
    """One input line -> a JobRequest, or a ValueError naming `where` and what is wrong."""
    obj = json_line(raw, where)
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with `prompt`, got {show(obj)}")
    if openai_batch.is_batch_line(obj):
        cid, prompt, fields, kind = openai_batch.parse_line(obj, where)
        sampling = resolve_sampling(fields, defaults, cid, where)
        chat = False if kind == "completions" else None
        return JobRequest(line, cid, prompt, sampling, chat=chat, openai=kind)
    return _rkvjax_line(obj, where, line, defaults)


def _open_input(path: Path):
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give the JSONL file of prompts")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (the JSONL file of prompts)")
    try:
        return open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None


def read_requests(path: str | Path, defaults: Mapping[str, Any] | None = None) -> list[JobRequest]:
    """Parses the input JSONL, checking every line (ids unique, one shape) before any work.

    Args:
      path: the input file.
      defaults: the job's sampling settings (`SamplingParams` fields) that lines override;
        default greedy.
    """
    path = Path(path)
    defaults = dict(defaults if defaults is not None else {"temperature": 0.0})
    rows: list[JobRequest] = []
    line_of: dict[str | int, int] = {}
    with _open_input(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            row = parse_line(raw, where, n, defaults)
            if rows and (row.openai is None) != (rows[0].openai is None):
                shapes = ("an OpenAI batch line", "an rkvjax line")
                this, first = shapes if row.openai else shapes[::-1]
                raise ValueError(
                    f"{where}: {this} in a file whose line {rows[0].line} is {first}; a file "
                    "holds one shape"
                )
            if row.id in line_of:
                first = line_of[row.id]
                if row.openai or "id" in json.loads(raw):
                    raise ValueError(f"{where}: duplicate id {row.id!r} (line {first} has it)")
                raise ValueError(
                    f"{where}: same request as line {first}; give each of them an `id` to run "
                    "it more than once (or ask for n samples)"
                )
            line_of[row.id] = n
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts (one JSON object per line)")
    return rows
