"""OpenAI's HTTP shapes: request bodies in, completion objects, stream chunks and errors out.

A body is checked as an OpenAI batch line's body is (`jobs.openai_batch.parse_body`: the same
fields, names and messages), plus `stream` and `stream_options`. Responses reuse the batch
format's choices and logprobs, with rkvjax's own numbers per choice in an extra `rkvjax` field
(`compressions`, `peak_cache_slots`, `stalled_steps`), which OpenAI's clients keep as an extra
attribute.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rkvjax.entrypoints.jobs import openai_batch
from rkvjax.entrypoints.jobs.quote import show
from rkvjax.entrypoints.jobs.run import sample_record
from rkvjax.runtime import requests
from rkvjax.runtime.results import GenerationResult, StreamDelta

STREAM_FIELDS = ("stream", "stream_options")
STREAM_OPTIONS = ("include_usage",)
ECHO_FIELDS = ("echo", "prompt_logprobs")  # completions only


MAX_MESSAGE_CHARS = 500


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry: bool = True,
    ):
        if len(message) > MAX_MESSAGE_CHARS:  # a reply never carries back a client's kilobytes
            cut = len(message) - MAX_MESSAGE_CHARS
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = (
            status,
            message,
            kind,
            code,
            param,
        )
        # OpenAI's clients retry 408, 409, 429 and 5xx unless told not to: a timed-out request
        # would run again twice.
        self.headers = {} if retry else {"x-should-retry": "false"}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, code=self.code, param=self.param)


def error_body(
    message: str, *, kind: str = "invalid_request_error", code=None, param=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked request body."""

    kind: str  # "chat" or "completions"
    prompts: list  # [messages] (chat); texts or token id lists (completions), one choice group each
    fields: dict[str, Any]  # the SamplingParams fields it gives
    model: str | None
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt leads each choice's text (and logprobs)
    prompt_logprobs: int | None = None  # completions: vLLM's per-prompt-token log-probabilities


def parse_request(raw: bytes, kind: str) -> CompletionRequest:
    """A request's body (bytes) -> CompletionRequest; APIError 400 saying what is wrong."""
    where = "request"
    body = _load_body(raw, where)
    chat = kind == "chat"
    extra = STREAM_FIELDS if chat else (*STREAM_FIELDS, *ECHO_FIELDS)
    try:
        prompt, fields = openai_batch.parse_body(body, kind, where, extra=extra, many=not chat)
        stream, include_usage = _stream_fields(body, where)
        if "logprobs" in body and "logprobs" not in fields:  # `false` overrides a default
            fields["logprobs"] = None
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ValueError(f"{where}: `echo` must be true or false, got {show(echo)}")
        prompt_lp = body.get("prompt_logprobs")
        if prompt_lp is not None and (
            isinstance(prompt_lp, bool) or not isinstance(prompt_lp, int) or prompt_lp < 0
        ):
            raise ValueError(
                f"{where}: `prompt_logprobs` must be an int >= 0 (the most likely tokens to "
                f"list beside each prompt token), got {show(prompt_lp)}"
            )
        prompts = [prompt] if chat else prompt
        if stream and (echo or prompt_lp is not None or len(prompts) > 1):
            what = (
                "`echo`" if echo else "`prompt_logprobs`" if prompt_lp is not None
                else "a list of prompts"
            )  # fmt: skip
            raise ValueError(
                f"{where}: {what} is served without `stream` only; send `stream: false`"
            )
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return CompletionRequest(
        kind,
        prompts,
        fields,
        body.get("model"),
        stream,
        include_usage,
        echo=echo,
        prompt_logprobs=prompt_lp,
    )


TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens")
DETOKENIZE_FIELDS = ("model", "tokens")


def _load_body(raw: bytes, where: str) -> Any:
    """A request body decoded (APIError 400 saying why it cannot be); an object's nulls
    dropped: null means not given, as in OpenAI's API."""
    try:
        body = requests.load_json(raw, where)
    except UnicodeDecodeError as e:
        raise APIError(400, f"{where}: the body is not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}: the body is not valid JSON ({e.msg})") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
    return body


def _json_object(raw: bytes, where: str, known: Sequence[str]) -> dict[str, Any]:
    """A body that must be a JSON object of `known` fields (nulls count as absent)."""
    body = _load_body(raw, where)
    if not isinstance(body, dict):
        raise APIError(400, f"{where}: the body must be a JSON object, got {show(body)}")
    extra = [k for k in body if k not in known]
    if extra:
        raise APIError(
            400,
            f"{where}: field(s) {', '.join(map(repr, extra))} not supported (supported: "
            f"{', '.join(known)})",
        )
    if "model" in body and not isinstance(body["model"], str):
        raise APIError(400, f"{where}: `model` must be a string, got {show(body['model'])}")
    return body


def parse_tokenize(raw: bytes) -> tuple[Any, bool, str | None]:
    """A `/tokenize` body (vLLM's shape) -> (text or chat, add_special_tokens, model)."""
    where = "/tokenize"
    body = _json_object(raw, where, TOKENIZE_FIELDS)
    given = [k for k in ("prompt", "messages") if k in body]
    if len(given) != 1:
        raise APIError(400, f"{where}: give one of `prompt` (text) or `messages` (a chat)")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError(
            400, f"{where}: `add_special_tokens` must be true or false, got {show(special)}"
        )
    try:
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"{where}: `prompt` must be a string, got {show(prompt)}")
            requests.check_unicode(prompt, f"{where}: `prompt`")
        else:
            prompt = requests.joined_parts(body["messages"], where, field="messages")
            requests.check_messages(prompt, where, field="messages")
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return prompt, special, body.get("model")


def parse_detokenize(raw: bytes, vocab: int) -> tuple[list[int], str | None]:
    """A `/detokenize` body -> (token ids, model)."""
    where = "/detokenize"
    body = _json_object(raw, where, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if not openai_batch.is_ids(ids):
        raise APIError(400, f"{where}: `tokens` must be a list of token ids, got {show(ids)}")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{where}: `tokens` holds id(s) {bad[:5]} outside [0, {vocab})")
    return ids, body.get("model")


def _stream_fields(body: Mapping[str, Any], where: str) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"{where}: `stream` must be true or false, got {show(stream)}")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ValueError(f"{where}: `stream_options` needs `stream: true`")
    if not isinstance(options, dict):
        raise ValueError(f"{where}: `stream_options` must be an object, got {show(options)}")
    extra = [k for k in options if k not in STREAM_OPTIONS]
    if extra:
        raise ValueError(
            f"{where}: `stream_options` field(s) {', '.join(map(repr, extra))} not supported "
            f"(supported: {', '.join(STREAM_OPTIONS)})"
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise ValueError(
            f"{where}: `stream_options.include_usage` must be true or false, got {show(usage)}"
        )
    return stream, usage


def rkvjax_stats(result: GenerationResult) -> dict[str, Any]:
    """A sample's cache numbers, the extra `rkvjax` field of its choice."""
    st = result.stats
    return {
        "compressions": st.compressions,
        "peak_cache_slots": st.peak_cache_slots,
        "stalled_steps": st.stalled_steps,
        "cache_capacity": st.cache_capacity,
    }


def response_body(
    results: Sequence[GenerationResult],
    *,
    kind: str,
    body_id: str,
    model_name: str,
    created: int,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A request's finished samples as one chat.completion (or text_completion) object."""
    body = openai_batch.completion_body(
        [sample_record(r) for r in results],
        chat=kind == "chat",
        body_id=body_id,
        model_name=model_name,
        token_text=token_text,
        created=created,
    )
    by_index = {r.sample_index: r for r in results}
    for c in body["choices"]:
        c["rkvjax"] = rkvjax_stats(by_index[c["index"]])
    return body


@dataclasses.dataclass(frozen=True)
class PromptGroup:
    """One prompt of a completions request and what it got: its samples (none for an echo
    with max_tokens 0) and, for an echo with logprobs, the scoring of its tokens."""

    ids: list[int]
    text: str  # the echoed prompt ("" without echo)
    n: int
    samples: Sequence[GenerationResult]
    score: Any  # ScoreResult of ids[1:] after ids[0], or None
    logprobs: int | None
    prompt_logprobs: int | None = None


def completions_body(
    groups: Sequence[PromptGroup],
    *,
    echo: bool,
    body_id: str,
    model_name: str,
    created: int,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A text_completion object for several prompts or an echo: prompt p's samples are choices
    p * n ... p * n + n - 1, as OpenAI orders them. With echo each choice's text starts with
    its prompt, and with logprobs its `logprobs` cover the prompt's tokens first (the first
    token's null: nothing comes before it), then the generated ones."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for p, g in enumerate(groups):
        prompt_tokens += len(g.ids)
        by_index = {r.sample_index: r for r in g.samples}
        for i in range(g.n):
            r = by_index.get(i)
            if r is None:  # an echo with max_tokens 0: the prompt alone
                c = {"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
                if g.logprobs is not None:
                    c["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}  # fmt: skip
            else:
                c = openai_batch.choice(sample_record(r), chat=False, token_text=token_text)
                c["rkvjax"] = rkvjax_stats(r)
                completion_tokens += len(r.token_ids)
            if echo:
                c["text"] = g.text + c["text"]
                if c["logprobs"] is not None:
                    c["logprobs"] = _echoed_logprobs(g, c["logprobs"], token_text)
            if g.prompt_logprobs is not None:
                c["prompt_logprobs"] = _prompt_logprobs(g, token_text)
            c["index"] = p * g.n + i
            choices.append(c)
    return {
        "id": body_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": openai_batch.usage(prompt_tokens, completion_tokens),
    }


def _prompt_logprobs(g: PromptGroup, token_text) -> list:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null) its id's logprob, rank
    and text, and the `prompt_logprobs` most likely tokens', keyed by token id."""
    out: list = [None]
    if g.score is None:
        return out
    k = g.prompt_logprobs
    for t, lp, rank, ids, vals in zip(
        g.ids[1:], g.score.logprobs, g.score.ranks, g.score.top_ids, g.score.top_logprobs,
        strict=True,
    ):  # fmt: skip
        entry = {str(t): {"logprob": float(lp), "rank": int(rank), "decoded_token": token_text(t)}}
        for r, (i, v) in enumerate(zip(ids[:k], vals[:k], strict=True), 1):
            entry.setdefault(
                str(int(i)), {"logprob": float(v), "rank": r, "decoded_token": token_text(int(i))}
            )
        out.append(entry)
    return out


def _echoed_logprobs(g: PromptGroup, generated: dict, token_text) -> dict:
    """A choice's completion logprobs with the prompt's tokens before the generated ones."""
    tokens = [token_text(t) for t in g.ids]
    lps: list = [None]
    tops: list = [None]
    if g.score is not None:
        lps += [float(x) for x in g.score.logprobs]
        n = g.score.top_ids.shape[1] if g.score.top_ids is not None else 0
        for ids, vals in zip(g.score.top_ids[:, :n], g.score.top_logprobs[:, :n], strict=True):
            tops.append({token_text(int(t)): float(v) for t, v in zip(ids, vals, strict=True)})
    tokens += generated["tokens"]
    return {
        "tokens": tokens,
        "token_logprobs": lps + list(generated["token_logprobs"]),
        "top_logprobs": tops + list(generated["top_logprobs"]),
        "text_offset": openai_batch.text_offsets(tokens),
    }


class ChunkWriter:
    """One streamed request's server-sent events, in OpenAI's chunk shape.

    Each event is `data: <json>` and a blank line; the stream ends with `data: [DONE]`. A chat
    choice opens with a chunk holding the assistant role. A finished sample's last chunk holds
    its `finish_reason` and its `rkvjax` numbers; with `include_usage`, every chunk has
    `usage: null` and one more chunk (no choices) holds the request's usage.
    """

    def __init__(
        self,
        *,
        kind: str,
        body_id: str,
        model_name: str,
        created: int,
        include_usage: bool,
        prompt_tokens: int,
        token_text: Callable[[int], str],
    ):
        self.chat = kind == "chat"
        self.head = {
            "id": body_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model_name,
        }
        self.include_usage = include_usage
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.token_text = token_text
        self._offsets: dict[int, int] = {}  # completions: token texts so far per choice

    def _event(self, choices: list[dict[str, Any]], **extra) -> bytes:
        chunk = {**self.head, "choices": choices, **extra}
        if self.include_usage and "usage" not in extra:
            chunk["usage"] = None
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n"

    def opening(self, n: int) -> bytes:
        """The first event: each chat choice's role (nothing for completions)."""
        if not self.chat:
            return b""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
            for i in range(n)
        ]  # fmt: skip
        return self._event(choices)

    def delta(self, d: StreamDelta) -> bytes:
        """One sample's delta as an event (nothing when it holds no text, no logprobs and
        does not finish)."""
        lp = None
        if d.logprobs is not None and d.token_ids:
            rec = {"token_ids": d.token_ids, "logprobs": d.logprobs, "top_logprobs": d.top_logprobs}
            if self.chat:
                lp = openai_batch.chat_logprobs(rec, self.token_text)
            else:
                at = self._offsets.get(d.sample_index, 0)
                lp = openai_batch.completion_logprobs(rec, self.token_text, at)
                self._offsets[d.sample_index] = at + sum(map(len, lp["tokens"]))
        if not d.text and lp is None and d.result is None:
            return b""
        choice: dict[str, Any] = {"index": d.sample_index}
        if self.chat:
            choice["delta"] = {"content": d.text} if d.text or d.result is None else {}
        else:
            choice["text"] = d.text
        choice["logprobs"] = lp
        choice["finish_reason"] = None
        if d.result is not None:
            choice["finish_reason"] = d.result.finish_reason
            choice["rkvjax"] = rkvjax_stats(d.result)
            self.completion_tokens += len(d.result.token_ids)
        return self._event([choice])

    def closing(self) -> bytes:
        """The usage event (with include_usage) and `[DONE]`."""
        out = b""
        if self.include_usage:
            usage = openai_batch.usage(self.prompt_tokens, self.completion_tokens)
            out += self._event([], usage=usage)
        return out + b"data: [DONE]\n\n"

    def error(self, err: APIError) -> bytes:
        """An error after the stream began (vLLM's way): an event with the error, then
        `[DONE]`."""
        return b"data: " + json.dumps(err.body()).encode("utf-8") + b"\n\ndata: [DONE]\n\n"
