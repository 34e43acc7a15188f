"""rkvjax's benchmark suite: `python -m bench --list` names the suites, `bench/README.md` holds
their results. Shared helpers live in `bench.common`, random checkpoints in `bench.checkpoints`."""
