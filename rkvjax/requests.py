"""Requests: prompt encoding, validation, length buckets and left padding."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rkvjax.sampling import SamplingParams

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt and how to continue it: `sampling.n` samples, or one scored continuation."""

    id: Any
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    continuation: tuple[int, ...] | None = None  # teacher forcing (`rkvjax.score`)

    @property
    def max_tokens(self) -> int:
        """Tokens emitted at most (the continuation's length when scoring)."""
        if self.continuation is not None:
            return len(self.continuation)
        return self.sampling.max_tokens


def bucket(n: int, limit: int) -> int:
    """Prompt length bucket: the next power of two (>= 16), so prefill compiles per bucket."""
    b = max(MIN_BUCKET, 1 << (n - 1).bit_length())
    return min(b, max(limit, n))


def row_bucket(k: int, limit: int, multiple: int = 1) -> int:
    """Rows of a prefill group of k prompts: the next power of two, at most `limit` (the slots),
    and a multiple of `multiple` (the mesh's data shards)."""
    b = min(1 << (k - 1).bit_length(), limit)
    b = max(b, k)
    return -(-b // multiple) * multiple


def pad_left(ids: Sequence[Sequence[int]], rows: int, limit: int) -> tuple[np.ndarray, ...]:
    """Left-pads prompts to a length bucket -> tokens, positions [rows, P] int32 (positions
    -1 at pads; rows past len(ids) are all pad)."""
    p = bucket(max(map(len, ids)), limit)
    tokens = np.zeros((rows, p), np.int32)
    positions = np.full((rows, p), -1, np.int32)
    for r, row in enumerate(ids):
        tokens[r, p - len(row) :] = row
        positions[r, p - len(row) :] = np.arange(len(row))
    return tokens, positions


def _is_ids(x) -> bool:
    """Whether x is a 1-D sequence of ints (a list, tuple or integer NumPy array)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and np.issubdtype(x.dtype, np.integer)
    return (
        isinstance(x, Sequence)
        and not isinstance(x, (str, bytes, bytearray))
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x)
    )


def _is_chat(x) -> bool:
    """Whether x is a chat: a non-empty list of {"role": ..., "content": ...} messages."""
    return (
        isinstance(x, Sequence)
        and not isinstance(x, (str, bytes))
        and bool(x)
        and all(isinstance(m, Mapping) and "role" in m for m in x)
    )


def split_prompts(prompts) -> tuple[list, bool]:
    """-> (a list of prompts, whether the input was a single prompt).

    A prompt is a str, token ids (a list of ints or a 1-D integer array) or a chat (a list of
    {"role", "content"} messages); `prompts` is one prompt or a list of them (or a 2-D integer
    array).
    """
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts], True
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 2 and np.issubdtype(prompts.dtype, np.integer):
            return [row for row in prompts], False
        if _is_ids(prompts) and prompts.size:
            return [prompts], True
        raise ValueError(
            f"a prompt array must be 1-D or 2-D integer token ids, got shape {prompts.shape} "
            f"dtype {prompts.dtype}"
        )
    if isinstance(prompts, Sequence) and prompts and _is_ids(prompts):
        return [prompts], True
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)) or not prompts:
        raise ValueError(
            "prompts must be a str, token ids, a chat (list of messages), or a non-empty list "
            "of these"
        )
    return list(prompts), False


def encode(tokenizer, prompt, chat: bool | None, where: str = "prompt") -> list[int]:
    """One prompt -> token ids. Text gets the chat template when the tokenizer has one (unless
    `chat` is False); a chat always does.

    Raises:
      ValueError: for anything else, naming `where`.
    """
    if _is_ids(prompt):
        return [int(t) for t in prompt]
    if not isinstance(prompt, str) and not _is_chat(prompt):
        raise ValueError(
            f"{where}: expected a str, a list of token ids or a chat (list of messages), got "
            f"{type(prompt).__name__}"
        )
    if tokenizer is None:
        raise ValueError(f"{where}: the model has no tokenizer.json: pass token ids instead")
    if isinstance(prompt, str):
        use_chat = tokenizer.has_chat_template if chat is None else chat
        if not use_chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if not tokenizer.has_chat_template:
        raise ValueError(f"{where}: a chat needs a chat template, and {tokenizer.name} has none")
    return tokenizer.chat_ids(list(prompt))


def validate_ids(
    ids: Sequence[int],
    *,
    vocab: int,
    max_positions: int,
    max_tokens: int,
    where: str = "",
    max_tokens_name: str = "max_tokens",
) -> None:
    """Raises ValueError (prefixed with `where`) for an empty prompt, ids outside [0, vocab)
    or a prompt that leaves no room for `max_tokens` within the model's positions."""
    prefix = f"{where}: " if where else ""
    if not len(ids):
        raise ValueError(f"{where or 'the prompt'} is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{prefix}token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    if len(ids) + max_tokens > max_positions:
        raise ValueError(
            f"{prefix}{len(ids)} prompt tokens + {max_tokens_name}={max_tokens} exceed the "
            f"model's {max_positions} positions"
        )


def token_id(value, vocab: int, name: str) -> int:
    """A token id setting checked against the vocabulary."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be token ids (ints), got {value!r}")
    if not 0 <= value < vocab:
        raise ValueError(f"{name}: token id {value} is outside the vocabulary [0, {vocab})")
    return int(value)
