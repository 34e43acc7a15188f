"""`python -m rkvjax.entrypoints.cli`: the `rkvjax` command."""

import sys

from rkvjax.entrypoints.cli.main import main

sys.exit(main())
