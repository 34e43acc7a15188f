"""The `rkvjax` command line: one module per command (`generate`, `batch` with `merge`,
`evaluate`, `convert`, `calibrate`, `serve`), the flags they share (`flags`), and `main`."""

from rkvjax.entrypoints.cli.main import main, parser

__all__ = ["main", "parser"]
