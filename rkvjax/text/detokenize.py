"""Stop strings: only the tokens that can complete one are decoded, and only the text near them.

Decoding a request's whole output after every chunk to look for stop strings is quadratic in
its length (a 32K-token trace decoded 500 times), and decoding every token once (vLLM's
incremental detokenizer) is still about 2 us a token on the host. `StopWatcher` decodes only
around the tokens whose text holds a stop string's last character; a streamed sample, whose
deltas need every token's text anyway, decodes each token once (`Tokenizer.stream`, the
tokenizers library's DecodeStream) and searches the tail its new characters can complete. A
token that ends inside a multi-byte character yields its text with the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` of the earliest stop string that begins at or after `start`."""
    cut = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(cut) if cut else None


class StopWatcher:
    """Follows one generation token by token and reports the token that completes a stop string.

    A stop string can only be completed by a token whose text holds its last character
    (`Tokenizer.stop_candidates`, one table per stop set). Tokens that cannot are counted and
    remembered, not decoded: most chunks of a sample decode nothing. At a candidate, the text of
    the tokens before it (back far enough to hold the longest stop string) and of it is decoded
    and searched. With `keep_text` (a streamed sample, whose deltas need every token's text)
    each token is decoded once instead, by an incremental decoder, and the text it added is
    searched.

    Args:
      tokenizer: the model's `Tokenizer`.
      stop: non-empty stop strings.
      keep_text: also keep the text each `push` decoded (`text`), for a streamed sample's
        `TextStream`, so that its tokens are decoded once, not once per reader.
    """

    def __init__(self, tokenizer, stop: Sequence[str], *, keep_text: bool = False):
        self._stop = tuple(stop)
        self._keep = max(map(len, self._stop)) - 1  # a stop string may start this far back
        self._count = 0  # tokens pushed
        self._keep_text = keep_text
        self.text = ""  # with keep_text: what the last `push` decoded, up to a stop string
        if keep_text:
            self._step = tokenizer.stream()
            self._tail = ""  # the text's last characters: all a new stop string can overlap
        else:
            self._tokenizer = tokenizer
            # [V + 1] each: ids past the vocabulary clip onto the last entry (looked at; no text).
            self._candidates = tokenizer.stop_candidates(self._stop)
            self._bytes = tokenizer.token_byte_lengths()
            # A stop string spans at most 4 bytes a character; one more character of margin,
            # whose bytes the window's first token may only partly hold.
            self._reach = 4 * (self._keep + 2)
            self._recent: list[np.ndarray] = []  # pushed tokens, trimmed to a window now and then
            self._held = 0  # tokens in _recent

    def push(self, ids) -> int | None:
        """Appends tokens (ints, a list or a 1-D array); returns how many of all tokens pushed so
        far end at the first stop string (that token included), or None while no stop string
        has appeared."""
        if not self._keep_text:
            return self._push_skipping(np.asarray(ids))
        return self._push_decoding(ids.tolist() if isinstance(ids, np.ndarray) else ids)

    def _push_skipping(self, ids: np.ndarray) -> int | None:
        # The common case, kept to two NumPy calls: no token of the chunk can end a stop string.
        hit = self._candidates.take(ids, mode="clip")
        if hit.any() and self._completes(ids, js := np.flatnonzero(hit)):
            for j in js:
                # What the candidate completes starts in its own text or at most `_reach`
                # bytes before it: the window holds that much before it, whatever its length.
                before = self._window(np.concatenate([*self._recent, ids[:j]]))
                text = self._tokenizer.decode_raw([*before.tolist(), int(ids[j])])
                if any(s in text for s in self._stop):
                    self._count += int(j) + 1
                    return self._count
        self._count += len(ids)
        self._recent.append(ids)
        self._held += len(ids)
        if self._held > 4 * self._reach + 256:  # trimmed now and then, not on every push
            kept = self._window(np.concatenate(self._recent))
            self._recent, self._held = [kept], len(kept)
        return None

    def _completes(self, ids: np.ndarray, js: np.ndarray) -> bool:
        """Whether a stop string may end at one of the candidates `js` of `ids`: one decode,
        from the first candidate's window to the last candidate. Each candidate's own window
        lies inside that span (it starts no earlier than the first's), and text decoded from
        an earlier start holds the same complete characters (UTF-8 finds its place again), so
        no stop string there means none at any candidate. Where a chunk has many candidates
        (a byte-level vocabulary's partial characters), most pushes decode once, not once per
        candidate."""
        first, last = int(js[0]), int(js[-1])
        before = self._window(np.concatenate([*self._recent, ids[:first]]))
        text = self._tokenizer.decode_raw([*before.tolist(), *ids[first : last + 1].tolist()])
        return any(s in text for s in self._stop)

    def _window(self, ids: np.ndarray) -> np.ndarray:
        """The shortest tail of `ids` holding `_reach` bytes of text (all of it if shorter)."""
        size = self._bytes.take(ids, mode="clip")[::-1]
        enough = np.flatnonzero(np.cumsum(size) >= self._reach)
        return ids if not enough.size else ids[len(ids) - 1 - enough[0] :]

    def _push_decoding(self, ids) -> int | None:
        step, stop, keep = self._step, self._stop, self._keep
        tail, count = self._tail, self._count
        pieces = []
        for t in ids:  # the host's hottest loop for a streamed sample: kept to the bone
            count += 1
            text = step(t)
            if not text:
                continue  # no complete character yet
            pieces.append(text)
            tail += text
            if stop[0] in tail or (len(stop) > 1 and any(s in tail for s in stop)):
                self._count = count
                self.text = "".join(pieces)
                return count
            if len(tail) > keep:
                tail = tail[len(tail) - keep :] if keep else ""
        self._tail, self._count = tail, count
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
