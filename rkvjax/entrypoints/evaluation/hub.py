"""Problem files named by a Hugging Face Hub dataset, fetched once into a local cache.

`rkvjax eval` takes a local JSONL file, or a dataset on the Hub: `owner/name` (for example
`HuggingFaceH4/MATH-500` or `HuggingFaceH4/aime_2024`), or `hf://datasets/owner/name/FILE` for
one file of a dataset that holds several. The dataset's data file (JSONL, or Parquet, read with
pyarrow: `pip install 'rkvjax[hub]'`) is written once as JSONL under
`$RKVJAX_HOME/datasets/owner--name/`, and every later run reads that file without the network,
so an evaluation resumes on the same problems (the output's header names that file). A name that
is a local path is always the local file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from rkvjax.home import rkvjax_home

PREFIX = "hf://datasets/"
DATA_SUFFIXES = (".jsonl", ".parquet")  # data files rkvjax reads, in order of preference
_PART = r"[A-Za-z0-9][\w.-]*"
_REPO = re.compile(rf"(?:{re.escape(PREFIX)})?({_PART}/{_PART})(?:/(.+))?")


def parse_name(data: str) -> tuple[str, str | None] | None:
    """`owner/name` or `hf://datasets/owner/name[/FILE]` -> (repo id, file or None); None for
    anything else, or a local path that exists."""
    if not data.startswith(PREFIX) and (Path(data).exists() or data.endswith(DATA_SUFFIXES)):
        return None
    m = _REPO.fullmatch(data)
    if m is None or (m.group(2) is not None and not data.startswith(PREFIX)):
        return None
    return m.group(1), m.group(2)


def problem_file(data: str | os.PathLike) -> Path:
    """The local JSONL file of `data`: the path itself, or a Hub dataset's file (fetched into
    the cache the first time).

    Raises:
      ValueError: naming `data`, when the Hub cannot be reached or the dataset has no single
        data file rkvjax can read.
    """
    text = os.fspath(data)
    parsed = parse_name(text)
    if parsed is None:
        return Path(data)
    repo, file = parsed
    folder = rkvjax_home() / "datasets" / repo.replace("/", "--")
    if file is not None:
        cached = folder / _cached_name(file)
        if cached.is_file():
            return cached
    else:
        found = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
        if len(found) == 1:
            return found[0]
    return _fetch(text, repo, file, folder)


def _cached_name(file: str) -> str:
    """The cache's JSONL name for a file of the dataset (its path flattened)."""
    stem = file
    for suffix in DATA_SUFFIXES:
        stem = stem.removesuffix(suffix)
    return stem.replace("/", "--") + ".jsonl"


def _fetch(text: str, repo: str, file: str | None, folder: Path) -> Path:
    import huggingface_hub

    def hub(call, *args, **kw):
        log = logging.getLogger("huggingface_hub")
        level = log.level
        log.setLevel(logging.ERROR)  # not a warning per retry: the error below says it once
        try:
            return call(*args, **kw)
        except Exception as e:  # no network, no such dataset, a gated one: the library says
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{text}: no such local file, and fetching the dataset from the Hugging Face Hub "
                f"failed ({reason}); download its JSONL file and pass that file's path"
            ) from None
        finally:
            log.setLevel(level)

    if file is None:
        file = _data_file(
            text, repo, hub(huggingface_hub.list_repo_files, repo, repo_type="dataset")
        )
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / _cached_name(file)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        local = hub(huggingface_hub.hf_hub_download, repo, file, repo_type="dataset", local_dir=tmp)
        rows = _rows(Path(local), text)
        part = Path(tmp) / out.name
        with part.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        os.replace(part, out)  # whole or not at all: a later run trusts what it finds there
    return out


def _data_file(text: str, repo: str, files: list[str]) -> str:
    """The one data file of a dataset's repository: its JSONL file, else its Parquet file."""
    for suffix in DATA_SUFFIXES:
        found = [f for f in files if f.endswith(suffix)]
        if len(found) == 1:
            return found[0]
        if found:
            raise ValueError(
                f"{text}: the dataset has several data files ({', '.join(sorted(found)[:6])}); "
                f"name one as {PREFIX}{repo}/FILE"
            )
    raise ValueError(f"{text}: the dataset holds no JSONL or Parquet file rkvjax can read")


def _rows(path: Path, text: str) -> list:
    if path.suffix != ".parquet":
        with path.open("rb") as f:
            return [json.loads(line) for line in f if line.strip()]
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            f"{text}: its data is a Parquet file, which needs pyarrow: pip install 'rkvjax[hub]'"
        ) from None
    return pyarrow.parquet.read_table(path).to_pylist()
