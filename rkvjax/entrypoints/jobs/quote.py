"""How job errors quote a value from a file."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any


def show(value: Any) -> str:
    """A JSON value for a message, cut to 40 characters."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: printed as its escape
        text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def unknown(fields: Iterable[str], known: Iterable[str]) -> str:
    """'a' (did you mean 'b'?), 'c' -- the unknown fields, with the closest known name."""
    known = list(known)
    parts = []
    for f in fields:
        close = difflib.get_close_matches(f, known, n=1, cutoff=0.75)
        parts.append(f"{f!r} (did you mean {close[0]!r}?)" if close else repr(f))
    return ", ".join(parts)
