"""`python -m rkvjax`: the `rkvjax` command."""

import sys

from rkvjax.entrypoints.launch import main

sys.exit(main())
