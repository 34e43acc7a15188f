"""Requests: prompt encoding, validation, length buckets and left padding."""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rkvjax.sampling.params import SamplingParams

MIN_BUCKET = 16
# A chat message: its role, its text, and an assistant turn's reasoning (which templates of
# reasoning models render or drop). Anything else (`name`, tool calls, ...) is refused, not
# silently dropped by a template that never reads it.
MESSAGE_KEYS = ("role", "content", "reasoning_content")
CHAT_ROLES = ("system", "user", "assistant", "tool")
_TEMPLATE_ROLES = ("tool",)  # roles a chat template must name to accept them


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt and how to continue it: `sampling.n` samples, or one scored continuation.
    Made by `prepare`, which checks it against what the engine can run."""

    id: Any
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    continuation: tuple[int, ...] | None = None  # teacher forcing (`rkvjax.score`)
    stop_ids: tuple[int, ...] = ()  # token ids that end its samples (EOS unless ignore_eos)
    block_ids: tuple[int, ...] = ()  # token ids min_tokens blocks (EOS even with ignore_eos)

    @property
    def max_tokens(self) -> int:
        """Tokens emitted at most (the continuation's length when scoring)."""
        if self.continuation is not None:
            return len(self.continuation)
        return self.sampling.max_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What an engine can run: everything a request is checked against before it is queued."""

    vocab: int
    max_positions: int
    eos: tuple[int, ...]  # the model's end-of-sequence ids
    capacity: int | None  # FullKV: cache slots per row (prompt + max_tokens - 1 at most)
    logprobs: int | None  # the most logprobs a request may ask for (None: none)
    penalties: bool  # repetition / presence / frequency penalties allowed
    stop_width: int  # stop token ids per row, EOS included
    teacher: bool = False  # scores continuations instead of sampling
    given_len: int = 0  # teacher mode: the longest continuation
    # The setting that raises `logprobs`, as an error names it (a server: its flag).
    logprobs_setting: str = "Engine(logprobs=...)"


def prepare(
    prompt,
    sampling: SamplingParams,
    request_id: Any,
    *,
    tokenizer,
    limits: Limits,
    chat: bool | None = None,
    continuation: Sequence[int] | None = None,
    where: str | None = None,
) -> Request:
    """A prompt and its settings as a Request the engine can run: encoded (`encode`) and checked
    against `limits`, once.

    Raises:
      ValueError: prefixed with `where` (default "request <id>"), for anything the engine
        cannot run as asked.
    """
    where = where or f"request {request_id!r}"
    sp = sampling
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"{where}: sampling must be a SamplingParams, got {type(sp).__name__}")
    ids = encode(tokenizer, prompt, chat, where)
    if continuation is not None:
        if not limits.teacher:
            raise ValueError(
                f"{where}: a continuation needs a scoring engine (Engine(teacher=True))"
            )
        continuation = tuple(int(t) for t in continuation)
        if not continuation:
            raise ValueError(f"{where}: an empty continuation has nothing to score")
        if len(continuation) > limits.given_len:
            raise ValueError(
                f"{where}: a continuation of {len(continuation)} tokens is longer than this "
                f"engine's given_len={limits.given_len}"
            )
        bad = [t for t in continuation if not 0 <= t < limits.vocab]
        if bad:
            raise ValueError(f"{where}: continuation token id(s) {bad[:5]} outside the vocabulary")
    elif limits.teacher:
        raise ValueError(f"{where}: a scoring engine needs a continuation")
    max_tokens = len(continuation) if continuation is not None else sp.max_tokens
    validate_ids(
        ids,
        vocab=limits.vocab,
        max_positions=limits.max_positions,
        max_tokens=max_tokens,
        where=where,
    )
    if limits.capacity is not None and len(ids) + max_tokens - 1 > limits.capacity:
        raise ValueError(
            f"{where}: {len(ids)} prompt tokens + max_tokens={max_tokens} need "
            f"{len(ids) + max_tokens - 1} FullKV cache slots; this engine has "
            f"max_len={limits.capacity}"
        )
    if sp.logprobs is not None and sp.logprobs > limits.vocab:
        raise ValueError(
            f"{where}: logprobs={sp.logprobs} asks for more tokens than the vocabulary's "
            f"{limits.vocab}"
        )
    if sp.logprobs is not None and (limits.logprobs is None or sp.logprobs > limits.logprobs):
        raise ValueError(
            f"{where}: logprobs={sp.logprobs} exceeds this engine's logprobs={limits.logprobs} "
            f"({limits.logprobs_setting})"
        )
    if sp.uses_penalties and not limits.penalties:
        raise ValueError(f"{where}: penalties need Engine(penalties=True)")
    if continuation is not None:  # teacher forcing: nothing is sampled or stopped
        return Request(request_id, tuple(ids), sp, continuation)
    if sp.stop and tokenizer is None:
        raise ValueError(f"{where}: stop strings need a tokenizer; use stop_token_ids")
    for text in sp.stop:
        check_unicode(text, f"{where}: stop string")
    for t in sp.stop_token_ids:
        token_id(t, limits.vocab, f"{where}: stop_token_ids")
    stopping, block = _stop_sets(sp.stop_token_ids, sp.ignore_eos, limits.eos)
    if len(block) > limits.stop_width:
        raise ValueError(
            f"{where}: {len(block)} stop token ids (end-of-sequence included) exceed this "
            f"engine's stop_width={limits.stop_width}"
        )
    return Request(request_id, tuple(ids), sp, None, stopping, block)


@functools.lru_cache(maxsize=256)
def _stop_sets(stop_token_ids: tuple[int, ...], ignore_eos: bool, eos: tuple[int, ...]):
    """(the ids that end a sample, the ids min_tokens blocks): requests mostly share them, and
    a server admits one at a time."""
    sp = SamplingParams(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    return sp.stopping_token_ids(eos), sp.min_tokens_stop_ids(eos)


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
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes, bytearray)):
        return False
    # Plain ints first: the ABC check below costs about 1 us a token.
    return all(type(t) is int for t in x) or all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x
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


def check_unicode(text: str, where: str) -> None:
    """Raises ValueError naming `where` for text that is not valid Unicode (a lone surrogate,
    as JSON's "\\ud800" or an undecodable command-line byte gives)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: not valid Unicode text: a lone surrogate (U+{ord(text[e.start]):04X}) at "
            f"character {e.start}"
        ) from None


def check_text(prompt: str, where: str) -> None:
    """A text prompt: not empty, valid Unicode."""
    if not prompt:
        raise ValueError(f"{where}: the prompt text is empty")
    check_unicode(prompt, where)


# Deeper than any request or job line needs (a chat message's content parts are 4 levels in);
# the checks that walk a value recurse, and Python's recursion limit is 1,000.
MAX_JSON_DEPTH = 32


def check_depth(value: Any, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuses a JSON value nested more than `limit` levels, walked without recursion."""
    stack = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"{where}: nested more than {limit} levels deep")
        if isinstance(x, Mapping):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


def load_json(text: str | bytes, where: str) -> Any:
    """JSON text -> a value nested at most MAX_JSON_DEPTH levels; json.JSONDecodeError as
    json.loads raises it, or ValueError naming `where` for a value nested too deep (one past
    what the parser itself can nest, too)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep") from None
    check_depth(value, where)
    return value


def check_strings(value: Any, where: str) -> None:
    """`check_unicode` on every string (keys too) of a JSON value."""
    if isinstance(value, str):
        check_unicode(value, where)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_strings(k, where)
            check_strings(v, where)
    elif isinstance(value, list):
        for v in value:
            check_strings(v, where)


def joined_parts(messages: Any, where: str, field: str = "chat") -> Any:
    """A chat whose message `content` may be a list of text parts (`{"type": "text", "text":
    ...}`, as OpenAI's SDKs send) -> the same chat with each such content one string, the
    parts joined by newlines as vLLM joins them. Anything but a list of messages is returned
    as it is, for `check_messages` to name.

    Raises:
      ValueError: a part that is not text, naming it (`field[i].content[j]`).
    """
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        texts = []
        for j, part in enumerate(content):
            at = f"{where}: {field}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                got = f"type {kind!r}" if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f'{at}: only text parts ({{"type": "text", "text": ...}}) are supported, '
                    f"got {got}"
                )
            extra = [k for k in part if k not in ("type", "text")]
            if extra or not isinstance(part.get("text"), str):
                raise ValueError(
                    f'{at}: a text part is {{"type": "text", "text": <string>}}, got keys '
                    f"{sorted(part)}" + ("" if extra else " with a non-string `text`")
                )
            texts.append(part["text"])
        out.append({**m, "content": "\n".join(texts)})
    return out


def check_messages(messages: Any, where: str, field: str = "chat") -> None:
    """A chat: a non-empty list of messages, each {"role": ..., "content": ...} (and an
    assistant's optional "reasoning_content") with string values (keys set to null count as
    absent), its role one of CHAT_ROLES.

    Raises:
      ValueError: naming `where`, the message (`field[i]`) and what is wrong.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{where}: `{field}` must be a non-empty list of {{"role": ..., "content": ...}} '
            "messages"
        )
    for i, m in enumerate(messages):
        at = f"{where}: {field}[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f'{at} must be a {{"role": ..., "content": ...}} object')
        m = {k: v for k, v in m.items() if v is not None}  # as the template gets it
        extra = [k for k in m if k not in MESSAGE_KEYS]
        if extra:
            raise ValueError(
                f"{at}: unknown key(s) {', '.join(map(repr, extra))}; a message holds "
                f"{', '.join(MESSAGE_KEYS[:2])} (and an assistant's reasoning_content)"
            )
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{at} has no `{key}`")
        for key, value in m.items():
            if not isinstance(value, str):
                raise ValueError(f"{at}: `{key}` must be a string, got {type(value).__name__}")
            check_unicode(value, f"{at} `{key}`")
        role = m["role"]
        if role not in CHAT_ROLES:
            raise ValueError(f"{at}: unknown role {role!r} (roles: {', '.join(CHAT_ROLES)})")
        if "reasoning_content" in m and role != "assistant":
            # Chat templates render an assistant's reasoning only: anyone else's would be
            # dropped without a word.
            raise ValueError(
                f"{at}: `reasoning_content` belongs to an assistant message, not a {role!r} "
                "one; put the text in `content`"
            )


def _check_template_roles(messages: Sequence[Mapping], where: str, template: str) -> None:
    """Roles only some templates render (a "tool" message) need a template that names them."""
    for i, m in enumerate(messages):
        if m["role"] in _TEMPLATE_ROLES and m["role"] not in template:
            raise ValueError(
                f"{where}: chat[{i}]: role {m['role']!r}, which this model's chat template "
                "never uses"
            )


def encode(tokenizer, prompt, chat: bool | None, where: str = "prompt") -> list[int]:
    """One prompt -> token ids. Text gets the chat template when the tokenizer has one (unless
    `chat` is False); a chat always does.

    Raises:
      ValueError: for anything else (an empty text, invalid Unicode, a malformed chat or one
        the template refuses), naming `where`.
    """
    if type(prompt) is list and all(type(t) is int for t in prompt):  # a server's, cheaply
        return prompt.copy()
    if _is_ids(prompt):
        return [int(t) for t in prompt]
    if not isinstance(prompt, str) and not _is_chat(prompt):
        raise ValueError(
            f"{where}: expected a str, a list of token ids or a chat (list of messages), got "
            f"{type(prompt).__name__}"
        )
    if isinstance(prompt, str):
        check_text(prompt, where)
    else:
        check_messages(list(prompt), where)
    if tokenizer is None:
        raise ValueError(f"{where}: the model has no tokenizer.json: pass token ids instead")
    if isinstance(prompt, str):
        use_chat = tokenizer.has_chat_template if chat is None else chat
        if not use_chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if not tokenizer.has_chat_template:
        raise ValueError(f"{where}: a chat needs a chat template, and {tokenizer.name} has none")
    _check_template_roles(prompt, where, tokenizer.chat_template_source)
    import jinja2

    try:
        return tokenizer.chat_ids(list(prompt))
    except jinja2.TemplateError as e:  # e.g. `raise_exception("System role not supported")`
        raise ValueError(
            f"{where}: the chat template of {tokenizer.name} refuses this chat: {e}"
        ) from None


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
    bad = [t for t in ids if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
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
