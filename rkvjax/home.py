"""Where rkvjax keeps what it makes once: `$RKVJAX_HOME` (converted models, compiled programs),
and JAX's persistent compilation cache under it, set up in one place for the command line and
the benchmarks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# Programs that compile faster than this are not worth a file.
MIN_COMPILE_S = 1.0


def rkvjax_home() -> Path:
    """`$RKVJAX_HOME`, default ~/.cache/rkvjax."""
    return Path(os.environ.get("RKVJAX_HOME") or "~/.cache/rkvjax").expanduser()


def _wanted() -> bool:
    """The cache is on unless RKVJAX_COMPILE_CACHE=0, and JAX has none set up already."""
    import jax

    return (
        os.environ.get("RKVJAX_COMPILE_CACHE", "1") != "0"
        and jax.config.jax_compilation_cache_dir is None
    )


def _set(directory: str | None, min_s: float) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)


def enable_compile_cache() -> None:
    """Keeps compiled programs in $RKVJAX_HOME/xla_cache for the rest of the process, so a
    repeated command skips XLA compilation (about 4x less compile time for the default
    model). For whoever owns the process (the command line): the library itself leaves JAX's
    global configuration alone."""
    if _wanted():
        _set(str(rkvjax_home() / "xla_cache"), MIN_COMPILE_S)


@contextlib.contextmanager
def compile_cache() -> Iterator[None]:
    """`enable_compile_cache` while the block runs, JAX's settings restored after it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not _wanted():
        yield
        return
    min_s = jax.config.jax_persistent_cache_min_compile_time_secs
    _set(str(rkvjax_home() / "xla_cache"), MIN_COMPILE_S)
    try:
        yield
    finally:
        _set(None, min_s)
        compilation_cache.reset_cache()
