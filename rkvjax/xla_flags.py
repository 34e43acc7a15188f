"""Process-wide XLA settings that the command line and the benchmarks opt into.

The library itself never changes them: XLA reads `XLA_FLAGS` once per process, so only the
program that owns the process may decide.
"""

from __future__ import annotations

import os

# XLA:CPU's concurrency-optimized scheduler overlaps the 30 layers' R-KV compressions and keeps
# every layer's [n, n] similarity temporaries live at once: 167 MiB per row instead of 5.5 for
# the default model at budget 256 (the compiled compression's buffer assignment), which held
# R-KV to 19 rows under a 4 GiB cap where 125 fit without it. Without it decode ran as fast and
# the compression itself faster (109 vs 143 ms). It cannot be set per `jax.jit`
# (`compiler_options` accepts it, but the CPU scheduler does not read it from there). Other
# backends ignore it.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def prefer_memory_on_cpu() -> bool:
    """Turns XLA:CPU's concurrency-optimized scheduler off for this process, unless `XLA_FLAGS`
    already sets it. Must run before JAX compiles anything.

    Returns:
      Whether `XLA_FLAGS` was changed.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}=false".strip()
    return True
