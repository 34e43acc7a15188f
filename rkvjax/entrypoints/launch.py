"""The `rkvjax` command's process entry point: the allocator chosen (`rkvjax.allocator`, a
restart under jemalloc where it is installed), then the command line. Nothing here imports JAX,
so the restart costs an interpreter start, not an import of JAX."""

from __future__ import annotations

import sys

from rkvjax import allocator


def main() -> int:
    allocator.exec_tuned()
    from rkvjax.entrypoints.cli.main import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
