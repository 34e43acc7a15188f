"""`python -m rkvjax.entrypoints.cli`: the `rkvjax` command (`python -m rkvjax` starts faster:
this package imports JAX before the allocator's restart, `rkvjax.entrypoints.launch`)."""

import sys

from rkvjax.entrypoints.launch import main

sys.exit(main())
