"""Stop strings: each new token is decoded once, and only the text it can complete is searched.

Decoding a request's whole output after every chunk to look for stop strings is quadratic in
its length (a 32K-token trace decoded 500 times). `StopWatcher` feeds each token to the
tokenizer's incremental decoder (`Tokenizer.stream`, the tokenizers library's DecodeStream, as
vLLM's fast detokenizer does) and searches only the tail of the text that the new characters can
complete. A token that ends inside a multi-byte character yields its text with the next one.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` of the earliest stop string that begins at or after `start`."""
    cut = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(cut) if cut else None


class StopWatcher:
    """Follows one generation token by token and reports the token that completes a stop string.

    Args:
      tokenizer: the model's `Tokenizer` (its `stream()`).
      stop: non-empty stop strings.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._step = tokenizer.stream()
        self._stop = tuple(stop)
        self._keep = max(map(len, self._stop)) - 1  # a stop string may start this far back
        self._tail = ""  # the text's last characters: all a new stop string can overlap
        self._count = 0  # tokens pushed

    def push(self, ids: Sequence[int]) -> int | None:
        """Appends tokens (Python ints); returns how many of all tokens pushed so far end at the
        first stop string (that token included), or None while no stop string has appeared."""
        step, stop, keep = self._step, self._stop, self._keep
        tail, count = self._tail, self._count
        for t in ids:  # the host's hottest loop with stop strings on: kept to the bone
            count += 1
            text = step(t)
            if not text:
                continue  # no complete character yet
            tail += text
            if stop[0] in tail or (len(stop) > 1 and any(s in tail for s in stop)):
                self._count = count
                return count
            if len(tail) > keep:
                tail = tail[len(tail) - keep :] if keep else ""
        self._tail, self._count = tail, count
        return None
