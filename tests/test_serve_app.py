"""`rkvjax.entrypoints.serve`'s HTTP side without a model: the app and its engine thread in front
of a fake engine, on a real loopback socket.

`FakeEngine` implements what `serve.app` and `serve.worker` call on an `Engine`, and makes
tokens by a rule of its own (one token per step and running sample), so every answer can be
checked against the results it recorded. The app runs under uvicorn on a thread of this
process: disconnects, a `Content-Length` the server must refuse without reading, and chunked
bodies then go over a real connection, as they would in production. `tests/test_serve.py`
covers the same server end to end with a real model.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from types import SimpleNamespace
from typing import ClassVar

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from rkvjax.entrypoints.serve import ServeConfig, build_app
from rkvjax.runtime import requests
from rkvjax.runtime.results import GenerationResult, GenerationStats, RunStats, StreamDelta
from rkvjax.sampling.params import SamplingParams
from tests.limits import HANG_S

NAME = "fake-served"
KEY = "sk-test-0123456789"
EOS = 0
VOCAB = 0x110000  # every code point is a token
CONTEXT = 1 << 16
CAPACITY = 64
# A wait, or a client's read, that takes longer is a hang: guards only, never speed limits.
WAIT_S = CLIENT_TIMEOUT_S = HANG_S
USER = [{"role": "user", "content": "Hello there"}]


# -- a model-free engine ---------------------------------------------------------------------


class CharTokenizer:
    """One token per character (its code point); EOS (0) is special."""

    name = "chars"
    has_chat_template = True
    chat_template_source = "<{{ role }}>{{ content }}"  # names no "tool" role

    special_tokens: ClassVar = {"eos_token": "</s>"}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def chat_ids(self, messages) -> list[int]:
        return self.encode(
            "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        )

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        eos = "" if skip_special_tokens else "</s>"
        return "".join(eos if t == EOS else chr(t) for t in ids)


@dataclasses.dataclass(eq=False)
class _Sample:
    request: requests.Request
    index: int
    stream: bool
    submitted: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token: float | None = None

    def next_token(self) -> tuple[int, str | None]:
        """The token this sample makes next, and its finish reason if it is its last: sample
        j > 0 stops (EOS) after max_tokens - j tokens, so the samples of one request differ
        in text, length and finish reason."""
        k, j, limit = len(self.tokens), self.index, self.request.sampling.max_tokens
        if j > 0 and k + 1 >= max(1, limit - j):
            return EOS, "stop"
        token = ord("a") + (3 * j + k) % 26
        return token, ("length" if k + 1 >= limit else None)


class FakeEngine:
    """What the server drives of an `Engine`, with no model behind it.

    Samples take free rows in submission order and make one token per `step`; while `progress`
    is clear, steps admit but make nothing (a request then stays running for as long as a test
    needs). It records what it was asked (`submitted`, `aborted`), what it made (`results`), and
    which threads drove it (the worker promises one).
    """

    def __init__(self, *, slots: int = 4, step_s: float = 0.0):
        self.slots = slots
        self.step_s = step_s
        self.model = SimpleNamespace(tokenizer=CharTokenizer(), eos_token_ids=(EOS,))
        self.limits = requests.Limits(
            vocab=VOCAB,
            max_positions=CONTEXT,
            eos=(EOS,),
            capacity=None,
            logprobs=None,
            penalties=True,
            stop_width=8,
        )
        self.scheduler = SimpleNamespace(queue=collections.deque(), owner=[None] * slots)
        self.progress = threading.Event()
        self.progress.set()
        # While `stepping` is clear a step blocks (a long prefill, say); `in_step` says one has.
        self.stepping = threading.Event()
        self.stepping.set()
        self.in_step = threading.Event()
        self.fail: BaseException | None = None  # step raises it
        self.submitted: list[tuple[requests.Request, bool]] = []
        self.aborted: list = []
        self.results: list[GenerationResult] = []
        self.threads: set[threading.Thread] = set()
        self._live: dict = {}
        self._deltas: list[StreamDelta] = []
        self._prefilled: set = set()
        self._counters = collections.Counter()
        self._t0 = time.perf_counter()

    def _driven(self) -> None:
        self.threads.add(threading.current_thread())

    def prepare(self, prompt, sampling, *, request_id, where=None) -> requests.Request:
        return requests.prepare(
            prompt,
            sampling,
            request_id,
            tokenizer=self.model.tokenizer,
            limits=self.limits,
            where=where,
        )

    def submit_many(self, prepared, *, stream: bool = False) -> list:
        self._driven()
        for r in prepared:
            if r.id in self._live:
                raise ValueError(f"request id {r.id!r} is already queued or running")
        now = time.perf_counter()
        for r in prepared:
            self.submitted.append((r, stream))
            self._live[r.id] = r.sampling.n
            self.scheduler.queue.extend(_Sample(r, j, stream, now) for j in range(r.sampling.n))
            self._counters["requests"] += 1
            self._counters["samples"] += r.sampling.n
        return [r.id for r in prepared]

    @property
    def has_work(self) -> bool:
        self._driven()
        return bool(self.scheduler.queue) or self.busy_slots > 0

    @property
    def busy_slots(self) -> int:
        return sum(s is not None for s in self.scheduler.owner)

    def _admit(self) -> None:
        owner, queue = self.scheduler.owner, self.scheduler.queue
        for row, s in enumerate(owner):
            if s is None and queue:
                owner[row] = s = queue.popleft()
                if s.request.id not in self._prefilled:
                    self._prefilled.add(s.request.id)
                    self._counters["prompt_tokens"] += len(s.request.prompt_token_ids)

    def step(self) -> list[GenerationResult]:
        self._driven()
        if self.fail is not None:
            raise self.fail
        if not self.stepping.is_set():
            self.in_step.set()
            assert self.stepping.wait(WAIT_S), "the test never let the step end"
        time.sleep(self.step_s)
        self._admit()
        if not self.progress.is_set():
            time.sleep(0.002)
            return []
        owner, finished = self.scheduler.owner, []
        self._counters["decode_steps"] += 1
        for row, s in enumerate(owner):
            if s is None:
                continue
            token, reason = s.next_token()
            s.tokens.append(token)
            if s.first_token is None:
                s.first_token = time.perf_counter()
            self._counters["decoded"] += 1
            result = None
            if reason is not None:
                result = self._result(s, reason)
                finished.append(result)
                owner[row] = None
                self._live[s.request.id] -= 1
                if not self._live[s.request.id]:
                    del self._live[s.request.id]
            if s.stream:
                text = self.model.tokenizer.decode([token])
                self._deltas.append(
                    StreamDelta(s.request.id, s.index, text, [token], result=result)
                )
        # Later samples first: the order of a response's choices is then the server's doing.
        finished.sort(key=lambda r: -r.sample_index)
        self.results.extend(finished)
        return finished

    def _result(self, s: _Sample, reason: str) -> GenerationResult:
        prompt = list(s.request.prompt_token_ids)
        wall = time.perf_counter() - self._t0
        stats = GenerationStats(
            prompt_tokens=len(prompt),
            generated_tokens=len(s.tokens),
            method="fake",
            budget=None,
            compressions=s.index + 1,
            cache_capacity=CAPACITY,
            peak_cache_slots=min(CAPACITY, len(prompt) + len(s.tokens)),
            stalled_steps=s.index,
            batch_size=self.slots,
            time_to_first_token_s=s.first_token - s.submitted,
            decode_s=wall,
            tokens_per_s=self._counters["generated"] / max(wall, 1e-9),
            compile_s=0.0,
        )
        self._counters["generated"] += len(s.tokens)
        self._counters["compressions"] += stats.compressions
        self._counters["stalled"] += stats.stalled_steps
        return GenerationResult(
            text=self.model.tokenizer.decode(s.tokens),
            token_ids=list(s.tokens),
            finish_reason=reason,
            stats=stats,
            prompt_token_ids=prompt,
            request_id=s.request.id,
            sample_index=s.index,
        )

    def take_deltas(self) -> list[StreamDelta]:
        self._driven()
        out, self._deltas = self._deltas, []
        return out

    def abort(self, request_id) -> int:
        self._driven()
        if request_id not in self._live:
            return 0
        sched = self.scheduler
        mine = [s for s in sched.queue if s.request.id == request_id]
        for s in mine:
            sched.queue.remove(s)
        for row, s in enumerate(sched.owner):
            if s is not None and s.request.id == request_id:
                mine.append(s)
                sched.owner[row] = None
        del self._live[request_id]
        self.aborted.append(request_id)
        self._counters["aborted"] += 1
        return len(mine)

    @property
    def stats(self) -> RunStats:
        c = self._counters
        wall = time.perf_counter() - self._t0
        return RunStats(
            slots=self.slots,
            lanes=1,
            requests=c["requests"],
            samples=c["samples"],
            prefills=len(self._prefilled),
            prefill_rows=len(self._prefilled),
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated"],
            decode_steps=c["decode_steps"],
            slot_occupancy=0.0,
            decoded_row_steps=c["decoded"],
            narrowings=0,
            widenings=0,
            compressions=c["compressions"],
            rows_compressed_per_step=0.0,
            stalled_row_steps=c["stalled"],
            wall_s=wall,
            compile_s=0.0,
            tokens_per_s=c["generated"] / max(wall, 1e-9),
            aborted=c["aborted"],
            decoded_tokens=c["decoded"],
        )

    # -- for the tests ---------------------------------------------------------------------

    def request(self, i: int = -1) -> requests.Request:
        return self.submitted[i][0]

    def results_of(self, request_id) -> list[GenerationResult]:
        return sorted(
            (r for r in self.results if r.request_id == request_id), key=lambda r: r.sample_index
        )


class GatedEngine(FakeEngine):
    """Holds each `prepare` (the server runs it on a worker thread) while `gate` is clear, so
    a test can change the engine's state between a request's admission and its submission."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.preparing = threading.Event()

    def prepare(self, *args, **kwargs):
        self.preparing.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().prepare(*args, **kwargs)


# -- a served app and a client ------------------------------------------------------------------


def wait_for(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    data: bytes

    def json(self):
        return json.loads(self.data)

    def events(self) -> list:
        """The server-sent events' payloads: JSON objects, or the string "[DONE]"."""
        out = []
        for block in self.data.decode("utf-8").split("\n\n"):
            if not block:
                continue
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out


class Served:
    def __init__(self, app, port: int, engine: FakeEngine):
        self.app, self.port, self.engine = app, port, engine
        self.base = f"http://127.0.0.1:{port}"

    def request(
        self, method: str, path: str, body=None, headers=None, timeout=CLIENT_TIMEOUT_S
    ) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, dict):
                body = json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json"} if body is not None else {}
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def chat(self, headers=None, timeout=CLIENT_TIMEOUT_S, **fields) -> Reply:
        body = {"model": NAME, "messages": USER, **fields}
        return self.request("POST", "/v1/chat/completions", body, headers, timeout)

    def complete(self, prompt: str = "Once upon", headers=None, **fields) -> Reply:
        body = {"model": NAME, "prompt": prompt, **fields}
        return self.request("POST", "/v1/completions", body, headers)

    def metrics(self) -> dict[tuple, float]:
        """Every sample of /metrics: (name, sorted label pairs) -> value."""
        reply = self.request("GET", "/metrics")
        assert reply.status == 200
        out = {}
        for family in text_string_to_metric_families(reply.data.decode()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def client(self, key: str = "unused"):
        import openai

        return openai.OpenAI(
            base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=CLIENT_TIMEOUT_S)


def metric(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@contextlib.contextmanager
def serving(engine: FakeEngine | None = None, **config):
    """The app around `engine`, served on a free loopback port until the block ends."""
    engine = engine or FakeEngine()
    config.setdefault("max_model_len", CONTEXT)
    app = build_app(engine, ServeConfig(model_name=NAME, **config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
        assert server.started, "uvicorn did not start"
        yield Served(app, sock.getsockname()[1], engine)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"
    # The worker's promise: one thread, not the event loop's nor this one, drives the engine.
    assert len(engine.threads) <= 1
    assert threading.current_thread() not in engine.threads


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def assert_error_shape(reply_or_body, status: int | None = None, **expected) -> dict:
    """OpenAI's error body, `{"error": {message, type, param, code}}`; returns the error."""
    if isinstance(reply_or_body, Reply):
        assert reply_or_body.status == status, reply_or_body
        assert reply_or_body.headers["content-type"].startswith("application/json")
        reply_or_body = reply_or_body.json()
    assert set(reply_or_body) == {"error"}
    err = reply_or_body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for k, v in expected.items():
        assert err[k] == v, (k, err)
    return err


def usage_of(results: list[GenerationResult]) -> dict[str, int]:
    prompt = results[0].stats.prompt_tokens
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def rkvjax_field(r: GenerationResult) -> dict[str, int]:
    st = r.stats
    return {
        "compressions": st.compressions,
        "peak_cache_slots": st.peak_cache_slots,
        "stalled_steps": st.stalled_steps,
        "cache_capacity": st.cache_capacity,
    }


# -- tests ---------------------------------------------------------------------------------------


def test_non_streamed_bodies():
    with serving() as s:
        tok = s.engine.model.tokenizer
        t0 = int(time.time())
        reply = s.chat(n=3, max_tokens=4)
        t1 = int(time.time())
        assert reply.status == 200, reply
        body = reply.json()
        rid = s.engine.request().id
        results = s.engine.results_of(rid)
        assert len(results) == 3
        # The fake gives the samples different endings; a mix-up between choices would show.
        assert len({(r.text, r.finish_reason) for r in results}) == 3
        assert body["id"] == rid and rid.startswith("chatcmpl-")
        assert body["object"] == "chat.completion"
        assert t0 <= body["created"] <= t1
        assert body["model"] == NAME
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        for c, r in zip(body["choices"], results, strict=True):
            assert c["message"] == {"role": "assistant", "content": r.text}
            assert c["logprobs"] is None
            assert c["finish_reason"] == r.finish_reason
            assert c["rkvjax"] == rkvjax_field(r)
        # A chat prompt goes through the template.
        assert s.engine.request().prompt_token_ids == tuple(tok.chat_ids(USER))
        assert body["usage"] == usage_of(results)

        prompt = "The answer is"
        reply = s.complete(prompt, n=2, max_tokens=3)
        assert reply.status == 200, reply
        body = reply.json()
        rid = s.engine.request().id
        results = s.engine.results_of(rid)
        assert body["id"] == rid and rid.startswith("cmpl-")
        assert body["object"] == "text_completion" and body["model"] == NAME
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for c, r in zip(body["choices"], results, strict=True):
            assert c["text"] == r.text
            assert c["logprobs"] is None and c["finish_reason"] == r.finish_reason
            assert c["rkvjax"] == rkvjax_field(r)
        # OpenAI's completions take raw text: no chat template.
        assert s.engine.request().prompt_token_ids == tuple(tok.encode(prompt))
        assert body["usage"] == usage_of(results)
        assert all(not stream for _, stream in s.engine.submitted)


def test_openai_client():
    """OpenAI's own client reads the bodies, the extra `rkvjax` field and the stream."""
    openai = pytest.importorskip("openai")  # a test extra; the other tests run without it
    with serving(api_key=KEY) as s:
        client = s.client(KEY)
        out = client.chat.completions.create(model=NAME, messages=USER, n=2, max_tokens=3)
        results = s.engine.results_of(out.id)
        assert [c.message.content for c in out.choices] == [r.text for r in results]
        assert [c.finish_reason for c in out.choices] == [r.finish_reason for r in results]
        assert [c.model_extra["rkvjax"] for c in out.choices] == list(map(rkvjax_field, results))
        assert out.usage.completion_tokens == usage_of(results)["completion_tokens"]

        out = client.completions.create(model=NAME, prompt="Hi", max_tokens=5)
        (r,) = s.engine.results_of(out.id)
        assert out.choices[0].text == r.text

        chunks = list(
            client.chat.completions.create(
                model=NAME,
                messages=USER,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        (r,) = s.engine.results_of(chunks[0].id)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.text
        assert chunks[-1].usage.completion_tokens == len(r.token_ids)

        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert [m.id for m in client.models.list()] == [NAME]


def test_streamed_chunks():
    with serving() as s:
        n = 2
        reply = s.chat(n=n, max_tokens=5, stream=True, stream_options={"include_usage": True})
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        (req, streamed), results = (
            s.engine.submitted[-1],
            s.engine.results_of(s.engine.request().id),
        )
        assert streamed and len(results) == n
        events = reply.events()
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        chunks = events[:-1]
        for c in chunks:
            assert c["id"] == req.id and c["object"] == "chat.completion.chunk"
            assert c["model"] == NAME and isinstance(c["created"], int)
        # The role first, for every choice.
        assert chunks[0]["choices"] == [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
            for i in range(n)
        ]  # fmt: skip
        # With include_usage: `usage: null` everywhere, then one chunk with the usage alone.
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage_of(results)
        for r in results:
            mine = [
                c["choices"][0] for c in chunks[1:-1] if c["choices"][0]["index"] == r.sample_index
            ]
            assert all(len(c["choices"]) == 1 for c in chunks[1:-1])
            assert "".join(ch["delta"].get("content", "") for ch in mine) == r.text
            assert [ch["finish_reason"] for ch in mine[:-1]] == [None] * (len(mine) - 1)
            assert mine[-1]["finish_reason"] == r.finish_reason
            assert mine[-1]["rkvjax"] == rkvjax_field(r)
            assert all("rkvjax" not in ch for ch in mine[:-1])

        # Completions: no role chunk; without include_usage, no `usage` key at all.
        reply = s.complete("Go", max_tokens=4, stream=True)
        (r,) = s.engine.results_of(s.engine.request().id)
        events = reply.events()
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == r.text
        assert chunks[-1]["choices"][0]["finish_reason"] == r.finish_reason
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_request_timeout_aborts():
    engine = FakeEngine()
    engine.progress.clear()  # nothing ever finishes
    timeout = 0.3
    with serving(engine, request_timeout=timeout) as s:
        t0 = time.monotonic()
        reply = s.chat(max_tokens=100)
        assert time.monotonic() - t0 >= timeout
        assert_error_shape(reply, 408, code="timeout", type="invalid_request_error")
        rid = engine.request().id
        wait_for(lambda: rid in engine.aborted, "the timed-out request's abort")

        # A stream that already sent tokens ends with an error event and [DONE].
        engine.progress.set()
        engine.step_s = 0.01
        reply = s.chat(max_tokens=10_000, stream=True)
        assert reply.status == 200
        events = reply.events()
        rid = engine.request().id
        assert events[-1] == "[DONE]"
        assert_error_shape(events[-2], code="timeout")
        assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[1:-2])
        wait_for(lambda: rid in engine.aborted, "the timed-out stream's abort")


def test_shutdown_drains_then_aborts():
    engine = FakeEngine(step_s=0.005)
    grace = 0.6
    with serving(engine) as s:
        stream = in_background(s.chat, max_tokens=10_000, stream=True)
        plain = in_background(s.complete, max_tokens=10_000)
        wait_for(lambda: engine.busy_slots == 2, "two running requests")
        short = in_background(s.chat, max_tokens=3)
        wait_for(lambda: len(engine.submitted) == 3, "the short request")
        t0 = time.monotonic()
        s.app.state.server.shut_down(grace)

        def draining():
            return s.request("GET", "/health").status == 503

        wait_for(draining, "/health to say it is shutting down")
        assert s.request("GET", "/health").json() == {"status": "shutting down"}
        assert_error_shape(s.chat(max_tokens=2), 503, type="server_error")
        assert_error_shape(s.complete(max_tokens=2), 503, type="server_error")
        assert len(engine.submitted) == 3  # refused before reaching the engine

        # A request that finishes within the grace period is answered in full.
        reply = short.result(CLIENT_TIMEOUT_S)
        assert reply.status == 200
        assert (
            reply.json()["choices"][0]["message"]["content"]
            == engine.results_of(engine.request(2).id)[0].text
        )

        reply = stream.result(CLIENT_TIMEOUT_S)
        assert time.monotonic() - t0 >= grace
        events = reply.events()
        assert events[-1] == "[DONE]"
        assert_error_shape(events[-2], code="shutdown", type="server_error")
        assert_error_shape(plain.result(CLIENT_TIMEOUT_S), 503, code="shutdown")
        ids = {engine.request(0).id, engine.request(1).id}
        wait_for(lambda: ids <= set(engine.aborted), "both long requests' aborts")
        assert engine.request(2).id not in engine.aborted


def test_engine_failure():
    engine = FakeEngine()
    engine.progress.clear()
    with serving(engine) as s:
        assert s.request("GET", "/health").json() == {"status": "ok"}
        stream = in_background(s.chat, max_tokens=50, stream=True)
        plain = in_background(s.chat, max_tokens=50)
        wait_for(lambda: engine.busy_slots == 2, "two running requests")
        engine.fail = RuntimeError("device lost")

        # Both waiting handlers hear of it (a hang would end in the client's timeout).
        err = assert_error_shape(plain.result(CLIENT_TIMEOUT_S), 500, type="server_error")
        assert "device lost" in err["message"]
        events = stream.result(CLIENT_TIMEOUT_S).events()
        assert events[-1] == "[DONE]"
        assert "device lost" in assert_error_shape(events[-2], type="server_error")["message"]

        health = s.request("GET", "/health")
        assert (health.status, health.json()) == (503, {"status": "engine stopped"})
        err = assert_error_shape(s.complete(max_tokens=2), 500, type="server_error")
        assert "device lost" in err["message"]
        assert len(engine.submitted) == 2


def test_api_key():
    with serving(api_key=KEY) as s:
        refused = {
            "no header": None,
            "wrong key": f"Bearer {KEY}x",
            "a prefix of the key": f"Bearer {KEY[:-1]}",
            "another scheme": f"Basic {KEY}",
            "the key alone": KEY,
            "an empty token": "Bearer ",
            # compare_digest refuses non-ASCII str: the comparison must be of bytes.
            "a non-ASCII key": "Bearer cl\u00e9",
        }
        for why, header in refused.items():
            headers = {"Authorization": header} if header is not None else {}
            for reply in (
                s.chat(headers=headers, max_tokens=2),
                s.complete(headers=headers, max_tokens=2),
                s.request("GET", "/v1/models", headers=headers),
            ):
                assert reply.status == 401, why
                assert_error_shape(reply, 401, code="invalid_api_key")
        assert s.engine.submitted == []

        ok = {"Authorization": f"Bearer {KEY}"}
        assert s.chat(headers=ok, max_tokens=2).status == 200
        assert s.chat(headers={"Authorization": f"bearer {KEY}"}, max_tokens=2).status == 200
        models = s.request("GET", "/v1/models", headers=ok)
        assert models.status == 200
        (card,) = models.json()["data"]
        assert (card["id"], card["object"], card["max_model_len"]) == (NAME, "model", CONTEXT)
        # Probes need no key.
        assert s.request("GET", "/health").status == 200
        assert s.request("GET", "/metrics").status == 200


def test_body_limit():
    limit = 2_000
    with serving(max_body_bytes=limit) as s:
        body = json.dumps({"model": NAME, "messages": USER, "max_tokens": 2}).encode()
        padded = body + b" " * (limit - len(body))  # JSON allows trailing whitespace

        # Exactly the limit passes, announced or chunked.
        assert s.request("POST", "/v1/chat/completions", padded).status == 200
        chunked = s.request("POST", "/v1/chat/completions", iter([padded[:1000], padded[1000:]]))
        assert chunked.status == 200

        # One byte over, chunked: refused once the stream passes the limit.
        over = iter([padded[:1000], padded[1000:], b" "])
        assert_error_shape(
            s.request("POST", "/v1/chat/completions", over), 413, code="body_too_large"
        )

        # An announced length over the limit is refused from the headers: no body is sent, and
        # a server that waited for it would never answer.
        with s.connect() as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nContent-Length: {limit + 1}\r\n\r\n".encode()
            )
            sock.settimeout(HANG_S)
            r = http.client.HTTPResponse(sock)
            r.begin()
            assert r.status == 413
            assert_error_shape(json.loads(r.read()), code="body_too_large")
        assert len(s.engine.submitted) == 2


def test_metrics():
    engine = FakeEngine(slots=2)
    engine.progress.clear()
    with serving(engine) as s, serving() as other:
        m = s.metrics()
        assert metric(m, "rkvjax_slots") == engine.slots
        assert metric(m, "rkvjax_requests_running") == 0

        wide = in_background(s.chat, n=engine.slots, max_tokens=4)
        wait_for(lambda: engine.busy_slots == engine.slots, "the wide request's rows")
        queued = in_background(s.complete, max_tokens=3)

        def gauges():
            m = s.metrics()
            names = ("requests_waiting", "requests_running", "slots_busy")
            return tuple(metric(m, f"rkvjax_{k}") for k in names)

        # One request holds every slot, the other waits for one.
        wait_for(lambda: gauges() == (1, 1, engine.slots), "the gauges to show a full engine")

        engine.progress.set()
        assert wide.result(CLIENT_TIMEOUT_S).status == 200
        assert queued.result(CLIENT_TIMEOUT_S).status == 200
        assert s.chat(messages=[]).status == 400
        assert s.complete(max_tokens=2, headers={}).status == 200
        wait_for(lambda: gauges() == (0, 0, 0), "the gauges to show an idle engine")

        m, st = s.metrics(), engine.stats
        counters = {
            "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generated_tokens,
            "stalled_row_steps": st.stalled_row_steps,
            "decode_steps": st.decode_steps,
            "decoded_tokens": st.decoded_tokens,
            "requests_aborted": st.aborted,
        }
        assert {k: metric(m, f"rkvjax_{k}_total") for k in counters} == counters
        assert metric(m, "rkvjax_compressions_total", kind="decode") == st.compressions
        assert metric(m, "rkvjax_compressions_total", kind="prefill") == st.prompt_compressions
        assert st.generated_tokens > 0 and st.compressions > 0 and st.stalled_row_steps > 0
        assert metric(m, "rkvjax_generation_tokens_per_second") > 0
        reasons = collections.Counter(r.finish_reason for r in engine.results)
        for reason, count in reasons.items():
            assert metric(m, "rkvjax_samples_finished_total", finish_reason=reason) == count
        assert metric(m, "rkvjax_time_to_first_token_seconds_count") == len(engine.results)
        answered = {("chat", "200"): 1, ("chat", "400"): 1, ("completions", "200"): 2}
        for (endpoint, status), count in answered.items():
            labels = {"endpoint": endpoint, "status": status}
            assert metric(m, "rkvjax_requests_total", **labels) == count

        # Another app of the same process counts its own.
        assert other.chat(max_tokens=2).status == 200
        mo = other.metrics()
        assert metric(mo, "rkvjax_requests_total", endpoint="chat", status="200") == 1
        assert metric(mo, "rkvjax_requests_total", endpoint="completions", status="200") is None
        assert metric(mo, "rkvjax_prompt_tokens_total") == other.engine.stats.prompt_tokens
        assert metric(s.metrics(), "rkvjax_requests_total", endpoint="chat", status="200") == 1


def test_requests_count_as_waiting_from_their_arrival():
    """Requests that arrive while the engine is busy with a long round (a prefill) are waiting
    on /metrics at once, not only after that round ends."""
    engine = FakeEngine(slots=2)
    engine.progress.clear()
    with serving(engine) as s:
        first = in_background(s.chat, max_tokens=3)
        wait_for(lambda: engine.busy_slots == 1, "the first request to run")
        engine.stepping.clear()
        assert engine.in_step.wait(WAIT_S)  # the engine thread is inside a step now
        later = [in_background(s.complete, max_tokens=2) for _ in range(3)]

        def waiting():
            return metric(s.metrics(), "rkvjax_requests_waiting")

        wait_for(lambda: waiting() == 3, "three arrivals to count as waiting")
        assert len(engine.submitted) == 1  # they are still in the inbox
        engine.stepping.set()
        engine.progress.set()
        for r in (first, *later):
            assert r.result(CLIENT_TIMEOUT_S).status == 200
        wait_for(lambda: waiting() == 0, "nothing to wait")


def test_metrics_after_an_abort():
    engine = FakeEngine()
    engine.progress.clear()
    with serving(engine, request_timeout=0.1) as s:
        assert s.chat(max_tokens=5).status == 408
        wait_for(lambda: engine.aborted, "the abort")
        names = ("requests_running", "slots_busy", "requests_aborted_total")
        wait_for(
            lambda: tuple(metric(s.metrics(), f"rkvjax_{k}") for k in names) == (0, 0, 1),
            "/metrics to show the abort",
        )


def test_null_means_not_given():
    defaults = {"seed": 7, "temperature": 0.5}
    context = 64
    with serving(defaults=defaults, max_model_len=context) as s:
        nulls = dict.fromkeys(
            ("model", "stop", "seed", "n", "temperature", "logprobs", "top_logprobs",
             "stream", "stream_options", "max_completion_tokens", "stop_token_ids"),
        )  # fmt: skip
        reply = s.chat(**nulls, max_tokens=2)
        assert reply.status == 200, reply
        assert reply.headers["content-type"].startswith("application/json")  # not a stream
        sp = s.engine.request().sampling
        # The server's defaults fill what a null leaves out; the rest are SamplingParams'.
        assert (sp.seed, sp.temperature) == (defaults["seed"], defaults["temperature"])
        base = SamplingParams()
        assert (sp.stop, sp.n, sp.logprobs, sp.stop_token_ids) == (
            base.stop,
            base.n,
            base.logprobs,
            base.stop_token_ids,
        )
        nulls = dict.fromkeys(("model", "stop", "seed", "n", "logprobs", "max_tokens"))
        reply = s.complete(**nulls)
        assert reply.status == 200, reply
        # No max_tokens: what the context leaves after the prompt.
        req = s.engine.request()
        assert req.sampling.max_tokens == context - len(req.prompt_token_ids)
        assert s.engine.results_of(req.id)[0].finish_reason == "length"


def test_refusals_never_reach_the_engine():
    engine = FakeEngine(slots=2)
    with serving(engine, max_model_len=32) as s:
        too_long = "x" * 40
        cases = [
            (s.chat(model="another"), 404, {"code": "model_not_found", "param": "model"}),
            (s.chat(n=engine.slots + 1), 400, {}),
            (s.complete(too_long), 400, {}),
            (s.complete(max_tokens=32), 400, {}),
            (s.chat(tools=[]), 400, {}),
            (s.chat(stream_options={"include_usage": True}), 400, {}),
            (s.request("POST", "/v1/chat/completions", b"{not json"), 400, {}),
            (s.request("POST", "/v1/completions", b"[1, 2]"), 400, {}),
            (s.request("GET", "/v1/chat/completions"), 405, {}),
            (s.request("GET", "/v1/nothing"), 404, {}),
        ]
        for reply, status, expected in cases:
            assert_error_shape(reply, status, **expected)
        assert engine.submitted == []


def test_deep_or_huge_bodies_get_a_short_400():
    """A body nested past what any request needs, or past what the JSON parser can nest, is a
    400 naming the depth (it once was a 500 with two tracebacks); no 400 repeats kilobytes of
    what the client sent."""
    engine = FakeEngine()
    with serving(engine) as s:
        for depth in (40, 5000):
            deep = b'{"model": "x", "messages": ' + b"[" * depth + b"]" * depth + b"}"
            reply = s.request("POST", "/v1/chat/completions", deep)
            assert_error_shape(reply, 400)
            assert "nested more than 32 levels deep" in reply.json()["error"]["message"]
        many = {"messages": USER, **{f"field{i:05d}": 1 for i in range(5000)}}
        reply = s.request("POST", "/v1/chat/completions", json.dumps(many).encode())
        assert_error_shape(reply, 400)
        assert len(reply.json()["error"]["message"]) < 600
        assert engine.submitted == []


def test_disconnect_aborts():
    engine = FakeEngine()
    engine.progress.clear()
    with serving(engine) as s:
        for stream in (False, True):
            body = json.dumps({"messages": USER, "max_tokens": 50, "stream": stream}).encode()
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            before = len(engine.submitted)
            with s.connect() as sock:
                sock.sendall(head.encode() + body)
                wait_for(lambda b=before: len(engine.submitted) > b, "the request to be queued")
                wait_for(lambda: engine.busy_slots == 1, "the request to run")
            rid = engine.request().id
            wait_for(lambda r=rid: r in engine.aborted, f"the abort (stream={stream})")
            assert engine.busy_slots == 0


# The engine thread dies, or the grace period ends, while a request admitted before is still
# being prepared: it must still be answered (once it hung until the client gave up).
RACE_TIMEOUT_S = HANG_S


def test_engine_failure_during_prepare():
    engine = GatedEngine()
    engine.progress.clear()
    with serving(engine) as s:
        running = in_background(s.chat, max_tokens=5)
        wait_for(lambda: engine.busy_slots == 1, "a running request")
        engine.gate.clear()
        late = in_background(s.chat, max_tokens=5, timeout=RACE_TIMEOUT_S)
        assert engine.preparing.wait(WAIT_S)
        engine.fail = RuntimeError("device lost")
        assert running.result(CLIENT_TIMEOUT_S).status == 500  # the engine thread is gone
        engine.gate.set()
        assert_error_shape(late.result(CLIENT_TIMEOUT_S), 500, type="server_error")


def test_shutdown_during_prepare():
    engine = GatedEngine()
    engine.progress.clear()
    grace = 0.1
    with serving(engine) as s:
        engine.gate.clear()
        late = in_background(s.chat, max_tokens=5, timeout=RACE_TIMEOUT_S)
        assert engine.preparing.wait(WAIT_S)
        s.app.state.server.shut_down(grace)
        wait_for(lambda: s.request("GET", "/health").status == 503, "the shutdown")
        time.sleep(2 * grace)  # the grace period's abort_all has run
        engine.gate.set()
        assert_error_shape(late.result(CLIENT_TIMEOUT_S), 503, type="server_error")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--api-key", "a b"], "API key"),
        (["--api-key", ""], "--api-key is empty"),
        (["--port", "70000"], "--port"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--method", "full", "--budget", "64"], "--budget"),
        (["--temperature", "5"], "temperature"),
        (["--logprobs", "30"], "--max-logprobs"),
    ],
)
def test_bad_serve_flags_fail_in_one_line_before_the_model_loads(argv, names, capsys, monkeypatch):
    from rkvjax.entrypoints import cli
    from rkvjax.entrypoints.cli import flags

    monkeypatch.setattr(flags, "load", lambda args: pytest.fail("the model loaded"))
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rkvjax: error:") and names in err and err.count("\n") == 1, err


def test_an_empty_api_key_in_the_environment_is_refused(capsys, monkeypatch):
    """`RKVJAX_API_KEY=` (set but empty) would start an open server its user thinks locked."""
    from rkvjax.entrypoints import cli
    from rkvjax.entrypoints.cli import flags

    monkeypatch.setattr(flags, "load", lambda args: pytest.fail("the model loaded"))
    monkeypatch.setenv("RKVJAX_API_KEY", "")
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rkvjax: error: $RKVJAX_API_KEY is empty") and err.count("\n") == 1


def test_a_port_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    from rkvjax.entrypoints import cli
    from rkvjax.entrypoints.cli import flags

    monkeypatch.setattr(flags, "load", lambda args: pytest.fail("the model loaded"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rkvjax: error: cannot listen on 127.0.0.1:{port}")
    assert err.count("\n") == 1


def test_too_many_logprobs_names_the_server_flag(tiny_checkpoint):
    """A client cannot raise `Engine(logprobs=...)`: the refusal names --max-logprobs."""
    import rkvjax
    from rkvjax.entrypoints import serve

    model = rkvjax.load(tiny_checkpoint("llama")[0])
    engine, _ = serve.serving_engine(model, cache={"method": "rkv", "budget": 16}, slots=1)
    with pytest.raises(ValueError, match=r"logprobs=21 exceeds .*=20 \(the server's --max-logp"):
        engine.prepare([5, 6, 7], SamplingParams(logprobs=21), request_id="r")


def test_an_int8_server_sizes_its_rows_from_the_8_bit_bytes(tiny_checkpoint, monkeypatch):
    """A server's default rows count the cache's kv_dtype: where the memory holds 16 int8
    rows at the server's peak, a bfloat16 cache (the model's dtype) gets 8, an int8 one 16."""
    import rkvjax
    from rkvjax import api
    from rkvjax.entrypoints import serve
    from rkvjax.entrypoints.serve import server
    from rkvjax.runtime import sizing

    model = rkvjax.load(tiny_checkpoint("llama")[0], dtype="bfloat16")
    caches = {d: {"method": "rkv", "budget": 16, "kv_dtype": d} for d in (None, "int8")}
    cc8 = api.cache_config(model, prompt_len=64, max_new=0, **caches["int8"])
    share = 16 * sizing.slot_bytes(model, cc8, cc8.capacity, penalties=True) * server.PEAK_ROWS
    monkeypatch.setattr(sizing, "device_memory", lambda m: int(share / sizing.MEMORY_SHARE) + 1)
    slots = {d: serve.serving_engine(model, cache=c)[0].slots for d, c in caches.items()}
    assert slots == {None: 8, "int8": 16}


def _tree_nbytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_a_warm_up_stays_within_the_peak_its_slots_were_sized_for(tiny_checkpoint, monkeypatch):
    """A server's default slots keep PEAK_ROWS x its state within the memory share, and its
    warm-up (every width compiled, the state allocated, the warm-up prompt prefilled beside
    it) never holds more: the arrays alive after each program, donated ones gone, measured
    against it, a prefilled group's logits and flags (a few bytes per row) allowed besides. (A
    warm-up once held two full states at a time, and a default server was killed for
    memory.)"""
    import jax

    import rkvjax
    from rkvjax import api
    from rkvjax.entrypoints import serve
    from rkvjax.entrypoints.serve import server
    from rkvjax.runtime import programs, sizing

    model = rkvjax.load(tiny_checkpoint("llama")[0])
    cache = {"method": "rkv", "budget": 16, "kv_dtype": "int8"}
    cc = api.cache_config(model, prompt_len=64, max_new=0, **cache)
    per_slot = sizing.slot_bytes(model, cc, cc.capacity, penalties=True)
    share = 2 * per_slot * server.PEAK_ROWS  # room for the peak of 2 slots, not of 4
    monkeypatch.setattr(sizing, "device_memory", lambda m: int(share / sizing.MEMORY_SHARE) + 1)
    engine, _ = serve.serving_engine(model, cache=cache)
    assert engine.slots == 2
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.state_shapes()))
    # What was sized is what the state holds (less each row's few counters and settings).
    assert state == pytest.approx(2 * per_slot, rel=0.01)

    def live() -> int:
        return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())

    peak, outputs = [0], [0]

    def measured(program):
        def run(*args, **kwargs):
            out = program(*args, **kwargs)
            jax.block_until_ready(out)
            peak[0] = max(peak[0], live())  # its inputs still held, the outputs made
            if isinstance(out, tuple):  # (state, Tokens): a chunk's or an insert's outputs
                tokens = sum(x.nbytes for x in jax.tree.leaves(out[1]))
                outputs[0] = max(outputs[0], tokens)
            if isinstance(out, programs.Prefilled):  # a waiting group's logits and flags
                rest = sum(x.nbytes for x in jax.tree.leaves(out)) - _tree_nbytes(out.cache)
                outputs[0] = max(outputs[0], rest)
            return out

        run.lower = program.lower  # the warm-up compiles ahead of time
        return run

    for name in ("init_state", "prefill", "insert", "decode", "release", "take_rows", "put_rows"):
        monkeypatch.setattr(programs, name, measured(getattr(programs, name)))
    before = live()
    serve.warm_up(engine, background=False)
    with engine.executor.running():
        engine.executor.ensure_state()  # made on another thread: the first round takes it
    jax.block_until_ready(engine.executor.state)
    assert engine.stats.narrowings == 0 and engine.executor.compile.programs > 0
    assert state <= max(peak[0], live()) - before <= server.PEAK_ROWS * state + outputs[0]


def test_a_list_of_prompts_answers_each_in_order_and_echo_leads_with_the_prompt():
    with serving() as s:
        prompts = ["The answer is", [ord(c) for c in "Once"], "Why"]
        reply = s.complete(prompts, n=2, max_tokens=3)
        assert reply.status == 200, reply
        body = reply.json()
        asked = [r for r, _ in s.engine.submitted]
        assert [r.prompt_token_ids for r in asked] == [
            tuple(ord(c) for c in "The answer is"),
            tuple(ord(c) for c in "Once"),
            (ord("W"), 104, 121),
        ]
        # OpenAI's order: prompt p's samples are choices 2p and 2p + 1.
        assert [c["index"] for c in body["choices"]] == list(range(6))
        want = [
            r
            for q in asked
            for r in sorted(s.engine.results_of(q.id), key=lambda r: r.sample_index)
        ]
        assert [c["text"] for c in body["choices"]] == [r.text for r in want]
        assert body["usage"]["prompt_tokens"] == 13 + 4 + 3
        assert body["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in want)

        reply = s.complete(["Once", [ord("O"), ord("K")]], max_tokens=2, echo=True)
        assert reply.status == 200, reply
        asked = [r for r, _ in s.engine.submitted[-2:]]
        texts = [s.engine.results_of(q.id)[0].text for q in asked]
        assert [c["text"] for c in reply.json()["choices"]] == ["Once" + texts[0], "OK" + texts[1]]
        # An echo alone (max_tokens 0, as vLLM allows) reaches no engine.
        before = len(s.engine.submitted)
        reply = s.complete("Hi", max_tokens=0, echo=True)
        assert reply.status == 200, reply
        (choice,) = reply.json()["choices"]
        assert choice["text"] == "Hi" and choice["finish_reason"] == "length"
        assert len(s.engine.submitted) == before and reply.json()["usage"]["completion_tokens"] == 0


def test_chat_content_as_text_parts_is_joined_as_vllm_joins_it():
    with serving() as s:
        parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
        reply = s.chat(messages=[{"role": "user", "content": parts}], max_tokens=2)
        assert reply.status == 200, reply
        tok = s.engine.model.tokenizer
        want = tok.chat_ids([{"role": "user", "content": "Hello\nthere"}])
        assert s.engine.request().prompt_token_ids == tuple(want)


@pytest.mark.parametrize(
    "path, body, names",
    [
        ("/v1/completions", {"prompt": ["ok", ""]}, "prompt[1]"),
        ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, "prompt[2]"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, "echo"),
        ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, "list of prompts"),
        ("/v1/completions", {"prompt": "xy", "echo": True, "logprobs": 1, "max_tokens": 1}, "echo"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "echo": True}, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_prompt_lists_echo_and_content_parts_are_one_400_naming_the_field(path, body, names):
    """Each a 400 in OpenAI's shape naming what is wrong; the server answers the next request
    (this server has no scorer: an echo with logprobs is refused, not answered without them)."""
    engine = FakeEngine()
    engine.limits = dataclasses.replace(engine.limits, logprobs=5)
    with serving(engine) as s:
        reply = s.request("POST", path, body)
        err = assert_error_shape(reply, 400)
        assert names in err["message"], err
        assert not s.engine.submitted
        assert s.complete("ok", max_tokens=1).status == 200


def test_tokenizer_routes_in_vllms_shapes():
    with serving(api_key=KEY) as s:  # at the root, open as vLLM's are
        reply = s.request("POST", "/tokenize", {"prompt": "Hi!", "add_special_tokens": False})
        assert reply.status == 200, reply
        assert reply.json() == {"count": 3, "max_model_len": CONTEXT, "tokens": [72, 105, 33],
                                "token_strs": None}  # fmt: skip
        reply = s.request("POST", "/tokenize", {"messages": USER})
        assert reply.json()["tokens"] == s.engine.model.tokenizer.chat_ids(USER)
        reply = s.request("POST", "/detokenize", {"tokens": [72, 105, EOS]})
        assert reply.status == 200 and reply.json() == {"prompt": "Hi</s>"}
        info = s.request("GET", "/tokenizer_info").json()
        assert info["eos_token"] == "</s>" and info["bos_token"] is None
        assert info["chat_template"] == CharTokenizer.chat_template_source
        assert info["model_max_length"] == CONTEXT
        for path, body, names in [
            ("/tokenize", {"prompt": 3}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": USER}, "one of"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
            ("/tokenize", {"text": "a"}, "text"),
            ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, "gpt-4o"),
            ("/detokenize", {"tokens": [1, -2]}, "-2"),
            ("/detokenize", {"tokens": "12"}, "tokens"),
            ("/detokenize", b"[1, 2]", "object"),
        ]:
            reply = s.request("POST", path, body)
            err = assert_error_shape(reply, 404 if "gpt-4o" in names else 400)
            assert names in err["message"], (path, body, err)
        assert s.request("POST", "/tokenize", {"prompt": "ok"}).status == 200
