"""The OpenAI batch format: request lines in, response lines out.

A request line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body":
{"messages": [...], ...}}` (or "/v1/completions" with a `prompt` in the body, sent as raw text
without the chat template). The body's `model` is accepted, not used: the job's model
answers, and its name is the response's `model`.
Its sampling fields map onto `SamplingParams`: OpenAI's names (`max_tokens` or
`max_completion_tokens`, `temperature`, `top_p`, `n`, `seed`, `stop`, `presence_penalty`,
`frequency_penalty`; `logprobs` and `top_logprobs`) and vLLM's extensions of that API (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`). Fields the job
does not honour (`stream`, `tools`, `response_format`, ...) are errors, not silently ignored.

An output line is `{"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
"request_id": ..., "body": <a chat.completion or text_completion object with every sample as
a choice and the token usage>}, "error": null}`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rkvjax.entrypoints.jobs.quote import show, unknown
from rkvjax.runtime import requests

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
LINE_FIELDS = ("custom_id", "method", "url", "body")
# Body fields that map one to one onto SamplingParams.
_SAME = (
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
)
BODY_FIELDS = {
    "chat": ("model", "messages", "max_tokens", "max_completion_tokens", "logprobs",
             "top_logprobs", *_SAME),
    "completions": ("model", "prompt", "max_tokens", "logprobs", *_SAME),
}  # fmt: skip
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs


def is_batch_line(obj: Mapping[str, Any]) -> bool:
    """Whether a JSON line is in the OpenAI batch shape."""
    return "custom_id" in obj or "body" in obj


def _logprobs_field(body: Mapping[str, Any], kind: str, where: str, prefix: str) -> int | None:
    if kind == "completions":
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise ValueError(f"{where}: {prefix}`logprobs` must be an int >= 0, got {show(lp)}")
        return lp
    want, top = body.get("logprobs", False), body.get("top_logprobs")
    if not isinstance(want, bool):
        raise ValueError(f"{where}: {prefix}`logprobs` must be true or false, got {show(want)}")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"{where}: {prefix}`top_logprobs` must be an int in [0, {MAX_TOP_LOGPROBS}], got "
                f"{show(top)}"
            )
        if not want:
            raise ValueError(f"{where}: {prefix}`top_logprobs` needs `logprobs: true`")
    return (top or 0) if want else None


def parse_line(obj: Mapping[str, Any], where: str) -> tuple[str, Any, dict[str, Any], str]:
    """An OpenAI batch request line -> (custom_id, prompt, SamplingParams fields, endpoint kind).

    The prompt is a chat for "chat" and text (or token ids) for "completions".
    """
    extra = [k for k in obj if k not in LINE_FIELDS]
    if extra:
        raise ValueError(
            f"{where}: unknown field(s) {unknown(extra, LINE_FIELDS)} in an OpenAI batch line "
            f"(it holds {', '.join(LINE_FIELDS)})"
        )
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"{where}: `custom_id` must be a non-empty string, got {show(cid)}")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f'{where}: `method` must be "POST", got {show(obj["method"])}')
    url = obj.get("url", "/v1/chat/completions")
    if url not in ENDPOINTS:
        raise ValueError(
            f"{where}: `url` {show(url)} is not served; use {' or '.join(map(repr, ENDPOINTS))}"
        )
    kind = ENDPOINTS[url]
    prompt, fields = parse_body(obj.get("body"), kind, where, prefix="body ")
    return cid, prompt, fields, kind


def is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _one_prompt(x: Any) -> bool:
    """A non-empty string or list of token ids."""
    return bool(x) and (isinstance(x, str) or is_ids(x))


def _prompts(prompt: Any, where: str, url: str, prefix: str) -> list:
    """A completions `prompt` in any of OpenAI's forms (a string, a list of ids, a list of
    strings, a list of id lists) -> the list of prompts, one choice group each."""
    if _one_prompt(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        for i, p in enumerate(prompt):
            if not _one_prompt(p):
                raise ValueError(
                    f"{where}: {prefix}`prompt[{i}]` must be a non-empty string or list of "
                    f"token ids, got {show(p)}"
                )
        return prompt
    raise ValueError(
        f"{where}: a {url} {prefix or 'request '}needs `prompt`: a non-empty string, a list "
        f"of token ids, or a non-empty list of either, got {show(prompt)}"
    )


def parse_body(
    body: Any,
    kind: str,
    where: str,
    *,
    extra: Sequence[str] = (),
    prefix: str = "",
    many: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """A request body of `kind` ("chat" or "completions") -> (prompt, SamplingParams fields).

    Args:
      body: the decoded JSON body.
      where: how errors name the request.
      extra: more fields the caller reads itself (a server's `stream`), allowed here.
      prefix: how errors name a field: "body " for a batch line's body.
      many: completions: `prompt` may also be a list of strings or of id lists, and the
        prompt returned is the list of prompts (a server's request; a batch line holds one).
    """
    url = f"/v1/{'chat/' if kind == 'chat' else ''}completions"
    if not isinstance(body, dict):
        name = f"`{prefix.strip()}`" if prefix else "the body"
        raise ValueError(f"{where}: {name} must be a JSON object, got {show(body)}")
    known = (*BODY_FIELDS[kind], *extra)
    unknown_fields = [k for k in body if k not in known]
    if unknown_fields:
        raise ValueError(
            f"{where}: {prefix}field(s) {unknown(unknown_fields, known)} not supported for "
            f"{url} (supported: {', '.join(known)})"
        )
    if "model" in body and not isinstance(body["model"], str):
        raise ValueError(f"{where}: {prefix}`model` must be a string, got {show(body['model'])}")
    if kind == "chat":
        if "messages" not in body:
            raise ValueError(f"{where}: a {url} {prefix or 'request '}needs `messages`")
        prompt = requests.joined_parts(body["messages"], where, field="messages")
        requests.check_messages(prompt, where, field="messages")
    else:
        prompt = body.get("prompt")
        if many:
            prompt = _prompts(prompt, where, url, prefix)
        elif not _one_prompt(prompt):
            raise ValueError(
                f"{where}: a {url} {prefix or 'request '}needs `prompt`: a non-empty string or "
                f"list of token ids, got {show(prompt)}"
            )
    fields = {k: body[k] for k in _SAME if k in body}
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise ValueError(f"{where}: {prefix}has `max_tokens` and `max_completion_tokens`; give one")
    for k in ("max_tokens", "max_completion_tokens"):
        if k in body:
            fields["max_tokens"] = body[k]
    lp = _logprobs_field(body, kind, where, prefix)
    if lp is not None:
        fields["logprobs"] = lp
    return prompt, fields


def _hex(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:24]


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(sample: Mapping[str, Any], token_text: Callable[[int], str]):
    """A chat choice's `logprobs` from a sample's `token_ids`, `logprobs`, `top_logprobs`."""
    content = []
    for t, lp, top in zip(
        sample["token_ids"], sample["logprobs"], sample["top_logprobs"], strict=True
    ):
        entry = _token_entry(token_text(t), lp)
        entry["top_logprobs"] = [_token_entry(token_text(i), v) for i, v in top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    sample: Mapping[str, Any], token_text: Callable[[int], str], offset: int = 0
):
    """A completion choice's `logprobs`; `offset`: the text before these tokens (a stream)."""
    tokens = [token_text(t) for t in sample["token_ids"]]
    return {
        "tokens": tokens,
        "token_logprobs": sample["logprobs"],
        "top_logprobs": [{token_text(i): v for i, v in top} for top in sample["top_logprobs"]],
        "text_offset": text_offsets(tokens, offset),
    }


def text_offsets(tokens: Sequence[str], offset: int = 0) -> list[int]:
    """Where each token's text starts in the text they make, after `offset` characters."""
    offsets, at = [], offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return offsets


def choice(sample: Mapping[str, Any], *, chat: bool, token_text: Callable[[int], str]):
    """One sample (a record of `run.sample_record`) as a choice of a response body."""
    out: dict[str, Any] = {"index": sample["sample_index"]}
    if chat:
        out["message"] = {"role": "assistant", "content": sample["text"]}
    else:
        out["text"] = sample["text"]
    if "logprobs" in sample:
        out["logprobs"] = (chat_logprobs if chat else completion_logprobs)(sample, token_text)
    else:
        out["logprobs"] = None
    out["finish_reason"] = sample["finish_reason"]
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    samples: Sequence[Mapping[str, Any]],
    *,
    chat: bool,
    body_id: str,
    model_name: str,
    token_text: Callable[[int], str],
    created: int | None = None,
) -> dict[str, Any]:
    """A chat.completion (or text_completion) object with every sample as a choice, in
    sample order, and the token usage."""
    ordered = sorted(samples, key=lambda s: s["sample_index"])
    return {
        "id": body_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model_name,
        "choices": [choice(s, chat=chat, token_text=token_text) for s in ordered],
        "usage": usage(samples[0]["prompt_tokens"], sum(s["completion_tokens"] for s in samples)),
    }


def response_line(
    request,
    samples: Sequence[Mapping[str, Any]],
    *,
    model_name: str,
    token_text: Callable[[int], str],
    created: int | None = None,
) -> dict[str, Any]:
    """The output line of one request, its samples (records of `run.sample_record`) as the
    choices of one chat.completion (or text_completion) body."""
    chat = request.openai == "chat"
    body = completion_body(
        samples,
        chat=chat,
        body_id=("chatcmpl-" if chat else "cmpl-") + _hex("body", request.id),
        model_name=model_name,
        token_text=token_text,
        created=created,
    )
    return {
        "id": "batch_req_" + _hex("line", request.id),
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": _hex("req", request.id), "body": body},
        "error": None,
    }


def sample_keys(obj: Mapping[str, Any]) -> list[tuple[Any, int]] | None:
    """(custom_id, choice index) of every sample in an output line; None if it is not one."""
    if "custom_id" not in obj:
        return None
    try:
        choices = obj["response"]["body"]["choices"]
        return [(obj["custom_id"], int(c["index"])) for c in choices]
    except (KeyError, TypeError, ValueError):
        return None
