"""The public home of the cache policies: `names()`, `build`, `register` and `Policy` for a
method of your own; the code is `rkvjax.kv.policies`."""

from rkvjax.kv.policies import *  # noqa: F403
from rkvjax.kv.policies import __all__  # noqa: F401
