"""Public names that load on first use (PEP 562), so importing a package imports only what is
used: `import rkvjax` imports no JAX, the scheduler none, the server's settings no HTTP stack."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def attribute_loader(
    package: str, homes: Mapping[str, str], submodules: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name in `homes` is imported from the module it
    maps to, a name in `submodules` is the module it maps to; either is then kept in the
    package."""
    namespace = sys.modules[package].__dict__
    subs = dict(submodules or {})

    def __getattr__(name: str) -> Any:
        if name in subs:
            value = importlib.import_module(subs[name])
        elif name in homes:
            value = getattr(importlib.import_module(homes[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__
