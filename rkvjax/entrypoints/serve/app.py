"""The HTTP side of `rkvjax serve`: a Starlette app in front of one engine thread.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (behind the API
key when there is one), `GET /health`, `GET /metrics`, and vLLM's tokenizer routes
`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`. A request is read (at most
`max_body_bytes`), checked (`protocol.parse_request`), encoded and checked against the engine
(`Engine.prepare`, on a worker thread: a long prompt's tokenization does not hold up the event
loop) before anything is queued, so every bad request is a 4xx in OpenAI's error shape and
nothing reaches the engine. A client that disconnects, or a request that runs past
`request_timeout`, is aborted: its rows are freed at the engine's next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rkvjax.entrypoints.serve import DEFAULT_MAX_BODY_BYTES, protocol, scoring
from rkvjax.entrypoints.serve.metrics import CONTENT_TYPE, Metrics
from rkvjax.entrypoints.serve.protocol import APIError
from rkvjax.entrypoints.serve.worker import EngineWorker, Handle, ShutDown
from rkvjax.runtime import requests
from rkvjax.sampling.params import SamplingParams

log = logging.getLogger("rkvjax.serve")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the server answers, besides the engine it drives.

    Attributes:
      model_name: the served model's name (`model` in requests and responses).
      max_model_len: prompt + max_tokens at most; a request without max_tokens gets the rest.
      defaults: SamplingParams fields a request does not give (the command's sampling flags).
      api_key: required as `Authorization: Bearer <key>` on /v1 routes (None: open).
      max_body_bytes: a larger request body is a 413.
      request_timeout: seconds a request may run before it is aborted (None: no limit).
    """

    model_name: str
    max_model_len: int
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float | None = None

    def __post_init__(self):
        check_api_key(self.api_key)


def check_api_key(key: str | None) -> None:
    """An API key is printable ASCII without spaces: what an HTTP header carries as it is."""
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError("the API key must be printable ASCII without spaces")


@dataclasses.dataclass(frozen=True)
class _Part:
    """One prompt of a request, prepared: its token ids, the sampling request (None for an
    echo with max_tokens 0) and the scoring of its tokens (an echo with logprobs)."""

    ids: list[int]
    text: str  # what an echo shows: the prompt as given, or its ids decoded
    sampling: SamplingParams
    sample: requests.Request | None
    score: requests.Request | None


class _Server:
    """The app's state: the engine, its thread once started, the metrics."""

    def __init__(self, engine, config: ServeConfig, scorer=None):
        self.engine = engine
        self.config = config
        self.scorer = scorer
        self.worker: EngineWorker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics(lambda: self.worker.current() if self.worker else _idle(engine))
        self.accepting = False
        self.created = int(time.time())
        tok = engine.model.tokenizer
        self._token_text = (
            (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
        )

    # -- lifecycle ------------------------------------------------------------------------

    def shut_down(self, grace_s: float) -> None:
        """Stops admitting; requests still running after `grace_s` seconds are aborted and
        told so (their streams end cleanly). Callable from any thread (a signal handler)."""
        if self.loop is None:
            return
        self.loop.call_soon_threadsafe(self._drain, grace_s)

    def _drain(self, grace_s: float) -> None:
        if not self.accepting:
            return
        self.accepting = False
        self.loop.call_later(grace_s, self.worker.abort_all)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        self.worker = EngineWorker(self.engine, self.loop, self.metrics, scorer=self.scorer)
        self.worker.start()
        self.accepting = True
        try:
            yield
        finally:
            # The server stopped listening and its open requests ended (finished, or cut after
            # the graceful shutdown timeout): whatever the engine still runs is aborted.
            self.accepting = False
            await anyio.to_thread.run_sync(self.worker.stop)

    # -- helpers --------------------------------------------------------------------------

    def _check_key(self, request: HTTPRequest) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # Header values arrive decoded as latin-1: compared as the bytes that were sent.
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1", "replace"), key.encode("ascii")
        )
        if not ok:
            raise APIError(
                401,
                "invalid or missing API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )

    def _check_ready(self) -> None:
        if not self.accepting:
            raise APIError(503, "the server is shutting down", kind="server_error")
        if self.worker is None or not self.worker.alive:
            raise APIError(
                500,
                f"the engine stopped: {self.worker.error if self.worker else 'not started'}",
                kind="server_error",
                retry=False,
            )

    async def _body(self, request: HTTPRequest) -> bytes:
        limit = self.config.max_body_bytes
        size = request.headers.get("content-length")
        too_big = APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
        if size is not None and size.isdigit() and int(size) > limit:
            raise too_big
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _prepare(self, req: protocol.CompletionRequest, request_id: str) -> list[_Part]:
        """The request's prompts encoded and checked against the engine (runs on a worker
        thread): one `_Part` each, in order."""
        parts, one = [], len(req.prompts) == 1
        for p, prompt in enumerate(req.prompts):
            where = "request" if one else f"request prompt[{p}]"
            rid = request_id if one else f"{request_id}-{p}"
            try:
                parts.append(self._prepare_one(req, prompt, rid, where))
            except ValueError as e:
                raise APIError(400, str(e)) from None
        return parts

    def _prepare_one(self, req, prompt, request_id: str, where: str) -> _Part:
        engine, cfg = self.engine, self.config
        tok = engine.model.tokenizer
        chat = None if req.kind == "chat" else False  # completions: raw text, as OpenAI's
        ids = requests.encode(tok, prompt, chat, where)
        fields = {**cfg.defaults, **req.fields}
        if "max_tokens" not in req.fields:  # the server's default, within the context
            left = cfg.max_model_len - len(ids)
            if left < 1:
                raise ValueError(
                    f"{where}: a prompt of {len(ids)} tokens leaves no room for output in "
                    f"the {cfg.max_model_len}-token context"
                )
            fields["max_tokens"] = min(fields.get("max_tokens") or left, left)
        sample_ok = not (req.echo and fields["max_tokens"] == 0)  # vLLM's echo-only request
        if not sample_ok:
            fields["max_tokens"] = 1  # checked as one token; none is generated
        try:
            sampling = SamplingParams(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        if sampling.n > engine.slots:
            raise ValueError(
                f"{where}: n={sampling.n} is more samples than the server's {engine.slots} slots"
            )
        if len(ids) + sampling.max_tokens > cfg.max_model_len:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens + max_tokens={sampling.max_tokens} is "
                f"more than the served context of {cfg.max_model_len} tokens"
            )
        sample = engine.prepare(ids, sampling, request_id=request_id, where=where)
        score = None
        asked = [sampling.logprobs if req.echo else None, req.prompt_logprobs]
        asked = [n for n in asked if n is not None]
        if asked and len(ids) > 1:
            if self.scorer is None:
                raise ValueError(
                    f"{where}: this server scores no prompts (`echo` with `logprobs`, "
                    "`prompt_logprobs`)"
                )
            most = engine.limits.logprobs or 0
            if (req.prompt_logprobs or 0) > most:
                raise ValueError(
                    f"{where}: prompt_logprobs={req.prompt_logprobs} exceeds the server's "
                    f"--max-logprobs {most}"
                )
            score = scoring.prompt_request(self.scorer, ids, max(asked), f"{request_id}-prompt")
        text = ""
        if req.echo:
            text = prompt if isinstance(prompt, str) else tok.decode(ids) if tok else ""
        return _Part(ids, text, sampling, sample if sample_ok else None, score)

    # -- routes ---------------------------------------------------------------------------

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, "completions")

    async def _complete(self, request: HTTPRequest, kind: str) -> Response:
        self._check_key(request)
        self._check_ready()
        # Off the event loop, like the encoding: a large body's JSON takes a while.
        req = await anyio.to_thread.run_sync(
            protocol.parse_request, await self._body(request), kind
        )
        self._check_model(req.model)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        parts = await anyio.to_thread.run_sync(self._prepare, req, rid)
        self._check_ready()  # again: the server may have begun to shut down meanwhile
        if req.stream:  # one prompt, no echo (protocol.parse_request)
            handle = self.worker.submit(parts[0].sample, stream=True)
            return StreamingResponse(
                self._stream(handle, req), media_type="text/event-stream", headers=_NO_CACHE
            )
        handles = [
            self.worker.submit(r, stream=False)
            for part in parts
            for r in (part.score, part.sample)
            if r is not None
        ]
        results = await self._collect(handles, request)
        if results is None:  # the client left; nobody reads this
            return Response(status_code=499)
        common = dict(
            body_id=rid,
            model_name=self.config.model_name,
            created=int(time.time()),
            token_text=self._token_text,
        )
        if len(parts) == 1 and not req.echo and req.prompt_logprobs is None:
            body = protocol.response_body(results[parts[0].sample.id], kind=kind, **common)
            return JSONResponse(body)
        groups = [
            protocol.PromptGroup(
                ids=part.ids,
                text=part.text,
                n=part.sampling.n,
                samples=results[part.sample.id] if part.sample else [],
                score=results[part.score.id][0] if part.score else None,
                logprobs=part.sampling.logprobs,
                prompt_logprobs=req.prompt_logprobs,
            )
            for part in parts
        ]
        return JSONResponse(protocol.completions_body(groups, echo=req.echo, **common))

    async def _collect(self, handles: list[Handle], request: HTTPRequest):
        """Each request's results by its id; None if the client disconnected first (they are
        aborted)."""

        async def results():
            out = {}
            for handle in handles:
                got = out.setdefault(handle.request.id, [])
                while (ev := await handle.events.get()) is not None:
                    if isinstance(ev, BaseException):
                        raise _engine_error(ev)
                    got.append(ev)
            return out

        waiting = asyncio.ensure_future(results())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait(
                {waiting, gone},
                timeout=self.config.request_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for task in (waiting, gone):
                if not task.done():
                    task.cancel()
        if waiting in done and waiting.exception() is None:
            return waiting.result()
        for handle in handles:  # the others of a failed prompt too: nobody reads them
            self.worker.abort(handle.request.id)
        if waiting in done:
            return waiting.result()  # raises the prompt's error
        if gone in done:
            return None
        raise self._timed_out()

    def _timed_out(self) -> APIError:
        return APIError(
            408,
            f"request timed out after {self.config.request_timeout} s and was aborted",
            code="timeout",
            retry=False,
        )

    async def _stream(self, handle: Handle, req: protocol.CompletionRequest):
        r = handle.request
        writer = protocol.ChunkWriter(
            kind=req.kind,
            body_id=r.id,
            model_name=self.config.model_name,
            created=int(time.time()),
            include_usage=req.include_usage,
            prompt_tokens=len(r.prompt_token_ids),
            token_text=self._token_text,
        )
        deadline = None
        if self.config.request_timeout is not None:
            deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        done = False
        try:
            opening = writer.opening(r.sampling.n)
            if opening:
                yield opening
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        ev = await handle.events.get()
                except TimeoutError:
                    yield writer.error(self._timed_out())
                    return
                if ev is None:
                    break
                if isinstance(ev, BaseException):
                    done = True
                    yield writer.error(_engine_error(ev))
                    return
                chunk = writer.delta(ev)
                if chunk:
                    yield chunk
            done = True
            yield writer.closing()
        finally:
            if not done:  # disconnected (the response task was cancelled) or timed out
                self.worker.abort(r.id)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.config.model_name}`",
                code="model_not_found",
                param="model",
            )

    def _tokenizer(self):
        tok = self.engine.model.tokenizer
        if tok is None:
            raise APIError(400, "the served model has no tokenizer.json: send token ids")
        return tok

    async def tokenize(self, request: HTTPRequest) -> Response:
        """vLLM's `/tokenize`: a text (or chat) -> its token ids, as a completion (or chat
        completion) would encode it."""
        prompt, special, name = protocol.parse_tokenize(await self._body(request))
        self._check_model(name)
        tok = self._tokenizer()

        def encode():
            if isinstance(prompt, str):
                return tok.encode(prompt, add_special_tokens=special)
            return requests.encode(tok, prompt, None, "/tokenize")

        try:
            ids = await anyio.to_thread.run_sync(encode)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        body = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                "token_strs": None}  # fmt: skip
        return JSONResponse(body)

    async def detokenize(self, request: HTTPRequest) -> Response:
        """vLLM's `/detokenize`: token ids -> their text."""
        ids, name = protocol.parse_detokenize(await self._body(request), self.engine.limits.vocab)
        self._check_model(name)
        tok = self._tokenizer()
        return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        """The tokenizer's special tokens and chat template (what a client needs to tokenize
        and template as the server does, without a copy of the tokenizer)."""
        tok = self._tokenizer()
        info = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k: tok.special_tokens.get(k) for k in ("bos_token", "eos_token", "pad_token",
                                                        "unk_token")},
            "chat_template": tok.chat_template_source,
            "model_max_length": self.config.max_model_len,
        }  # fmt: skip
        return JSONResponse(info)

    async def models(self, request: HTTPRequest) -> Response:
        self._check_key(request)
        cfg = self.config
        card = {
            "id": cfg.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "rkvjax",
            "max_model_len": cfg.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.worker is None or not self.worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not self.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


_NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _idle(engine):
    from rkvjax.entrypoints.serve.worker import Snapshot

    return Snapshot(slots=engine.slots)


def _engine_error(ev: BaseException) -> APIError:
    if isinstance(ev, ShutDown):
        return APIError(503, str(ev), kind="server_error", code="shutdown")
    if isinstance(ev, ValueError):
        return APIError(400, str(ev))
    return APIError(500, f"the engine failed: {ev!r}", kind="server_error", retry=False)


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client disconnects (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine, config: ServeConfig, scorer=None) -> Starlette:
    """The ASGI app serving `engine` (see the module docstring). The engine thread starts
    with the app's lifespan and stops with it; nothing else may drive the engine meanwhile.
    `scorer` (`scoring.scoring_engine`) scores echoed prompts; without one, `echo` with
    `logprobs` is refused."""
    server = _Server(engine, config, scorer)

    def counted(endpoint, name):
        async def route(request: HTTPRequest) -> Response:
            try:
                response = await endpoint(request)
            except APIError as e:
                server.metrics.requests.labels(endpoint=name, status=str(e.status)).inc()
                raise
            server.metrics.requests.labels(endpoint=name, status=str(response.status_code)).inc()
            return response

        return route

    routes = [
        Route("/v1/chat/completions", counted(server.chat, "chat"), methods=["POST"]),
        Route("/v1/completions", counted(server.completions, "completions"), methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        # At the root, as vLLM serves them (and without the API key, as vLLM's are).
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
    ]
    handlers = {
        APIError: _api_error,
        HTTPException: _http_error,
        Exception: _server_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=server.lifespan)
    app.state.server = server
    return app


async def _api_error(request: HTTPRequest, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = {404: f"no route {request.url.path}", 405: f"{request.method} not allowed"}.get(
        exc.status_code, str(exc.detail)
    )
    return JSONResponse(
        protocol.error_body(message, kind=kind), status_code=exc.status_code, headers=exc.headers
    )


async def _server_error(request: HTTPRequest, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    return JSONResponse(
        protocol.error_body(f"internal error: {exc!r}", kind="server_error"), status_code=500
    )
