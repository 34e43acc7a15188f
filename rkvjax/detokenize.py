"""Incremental detokenization and stop strings: each new token is decoded once, in a window.

Decoding a request's whole output after every chunk to look for stop strings is quadratic in
its length (a 32K-token trace decoded 500 times). `StopWatcher` keeps vLLM's two offsets
instead: the text of the tokens since `prefix` is decoded with and without the newest ones, and
only the difference is appended (a token that ends inside a multi-byte character waits for the
next). Stop strings are searched for only in the tail that the new text can complete.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"  # what a byte-level BPE decode shows for a cut UTF-8 sequence


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` of the earliest stop string that begins at or after `start`."""
    cut = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(cut) if cut else None


class StopWatcher:
    """Follows one generation token by token and reports the token that completes a stop string.

    Args:
      tokenizer: the model's `Tokenizer` (its `decode(ids)`).
      stop: non-empty stop strings.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._longest = max(map(len, self._stop))
        self._ids: list[int] = []
        self._prefix = 0  # tokens before this are fully in `text`
        self._read = 0  # tokens before this have been turned into text
        self.text = ""

    def push(self, ids: Sequence[int]) -> int | None:
        """Appends tokens; returns how many of all tokens pushed so far end at the first stop
        string (that token included), or None while no stop string has appeared."""
        for t in ids:
            self._ids.append(int(t))
            before = self._tok.decode(self._ids[self._prefix : self._read])
            now = self._tok.decode(self._ids[self._prefix :])
            if len(now) <= len(before) or now.endswith(_INCOMPLETE):
                continue  # no complete character yet
            start = max(0, len(self.text) - self._longest + 1)
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            if find_stop(self.text, self._stop, start) is not None:
                return len(self._ids)
        return None
