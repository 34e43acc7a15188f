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
      keep_text: also keep the text each `push` decoded (`text`), for a streamed sample's
        `TextStream`, so that its tokens are decoded once, not once per reader.
    """

    def __init__(self, tokenizer, stop: Sequence[str], *, keep_text: bool = False):
        self._step = tokenizer.stream()
        self._stop = tuple(stop)
        self._keep = max(map(len, self._stop)) - 1  # a stop string may start this far back
        self._tail = ""  # the text's last characters: all a new stop string can overlap
        self._count = 0  # tokens pushed
        self._keep_text = keep_text
        self.text = ""  # with keep_text: what the last `push` decoded, up to a stop string

    def push(self, ids: Sequence[int]) -> int | None:
        """Appends tokens (Python ints); returns how many of all tokens pushed so far end at the
        first stop string (that token included), or None while no stop string has appeared."""
        step, stop, keep = self._step, self._stop, self._keep
        tail, count = self._tail, self._count
        pieces = [] if self._keep_text else None
        for t in ids:  # the host's hottest loop with stop strings on: kept to the bone
            count += 1
            text = step(t)
            if not text:
                continue  # no complete character yet
            if pieces is not None:
                pieces.append(text)
            tail += text
            if stop[0] in tail or (len(stop) > 1 and any(s in tail for s in stop)):
                self._count = count
                self.text = "".join(pieces) if pieces is not None else ""
                return count
            if len(tail) > keep:
                tail = tail[len(tail) - keep :] if keep else ""
        self._tail, self._count = tail, count
        if pieces is not None:
            self.text = "".join(pieces)
        return None


# transformers' clean-up removes the space of patterns up to four characters long (" n't").
_CLEAN_UP_REACH = 3


class TextStream:
    """A generation's text as its tokens arrive, in pieces that concatenate to its final text.

    Each token is decoded once (`Tokenizer.stream`). A piece holds back what may still change or
    be cut: a character the next token completes, and the last `max(len(stop)) - 1` characters
    (a stop string that begins there is not in the final text). For a tokenizer that cleans up
    spaces before punctuation, a piece never ends within three characters after a space, so no
    clean-up pattern straddles two pieces. The last piece is the final text less what was
    handed out (`rest`).

    Args:
      tokenizer: the model's `Tokenizer`.
      stop: the request's stop strings.
      decode: decode the tokens itself (`push`); False when the text comes decoded from the
        sample's `StopWatcher` (`push_text`).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), *, decode: bool = True):
        self._step = tokenizer.stream() if decode else None
        self._clean_up = tokenizer.clean_up if tokenizer.cleans_up else None
        self._hold = max(map(len, stop)) - 1 if stop else 0
        self._pending = ""  # decoded, not handed out
        self._sent = 0  # characters handed out

    def push(self, ids: Sequence[int]) -> str:
        """Appends tokens (Python ints); returns the text that may be handed out now."""
        return self.push_text("".join(t for t in map(self._step, ids) if t))

    def push_text(self, text: str) -> str:
        """Appends the text the next tokens decoded to; returns what may be handed out now."""
        raw = self._pending + text
        cut = len(raw) - self._hold
        # Backing off to a space can put another within reach (" ' " ends with one).
        while self._clean_up is not None and cut > 0:
            space = raw.find(" ", max(0, cut - _CLEAN_UP_REACH), cut)
            if space < 0:
                break
            cut = space
        cut = max(cut, 0)
        out, self._pending = raw[:cut], raw[cut:]
        if self._clean_up is not None:
            out = self._clean_up(out)
        self._sent += len(out)
        return out

    def rest(self, final_text: str) -> str:
        """The final text's end, after everything handed out (which is its beginning)."""
        return final_text[self._sent :]
