"""The public home of one compression step on its own, `keep_indices(method, queries, keys,
budget=...)`, and of the keep rule every method shares; the code is `rkvjax.kv.selection`."""

from rkvjax.kv.selection import *  # noqa: F403
from rkvjax.kv.selection import __all__  # noqa: F401
