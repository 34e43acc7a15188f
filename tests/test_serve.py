"""`rkvjax serve` as a client sees it: a real server process on a loopback port, driven with
OpenAI's own Python client (and raw HTTP where a client would refuse to send the request).

Greedy answers are checked token for token against `rkvjax.generate` of the same input with the
same cache policy; the server's engine is compressing (R-KV, budget 48) so compressions fire.
The server starts once for the file (loading and compiling take most of its time); the last
test stops it with SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

import rkvjax
from tests.limits import HANG_S

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

NAME = "smol-served"
KEY = "test-key-123"
SLOTS = 8
CACHE = {"method": "rkv", "budget": 48, "buffer": 16}
MAX_BODY = 200_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=HANG_S)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=HANG_S) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict[str, float]:
        """The samples of /metrics, by name (with its labels, if any, as written there)."""
        status, body = self.get("/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            m = re.fullmatch(r"(rkvjax_[a-z_]+(?:\{[^}]*\})?) (\S+)", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def post(self, path: str, body: bytes, headers: dict | None = None):
        """A raw POST -> (status, decoded JSON body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_S)
        try:
            hdrs = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            hdrs.update(headers or {})
            hdrs = {k: v for k, v in hdrs.items() if v is not None}
            conn.request("POST", path, body=body, headers=hdrs)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server(smol_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "rkvjax", "serve", "--model", str(smol_dir)]
    cmd += ["--dtype", "float32", "--method", CACHE["method"], "--budget", str(CACHE["budget"])]
    cmd += ["--buffer", str(CACHE["buffer"]), "--slots", str(SLOTS), "--port", str(port)]
    cmd += ["--api-key", KEY, "--served-model-name", NAME, "--max-body-bytes", str(MAX_BODY)]
    cmd += ["--shutdown-timeout", "5"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    srv = Server(proc, port, log_path)
    deadline = time.monotonic() + HANG_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(OSError):
            if srv.get("/health")[0] == 200:
                break
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start in {HANG_S} s:\n{log_path.read_text()}")
        time.sleep(0.5)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(HANG_S)


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _alone(smol, prompts, max_tokens, *, chat: bool, stop=None):
    """Each greedy request run alone (one slot) with the server's cache policy."""
    stop = stop or []
    params = [rkvjax.SamplingParams(temperature=0.0, max_tokens=m, stop=stop) for m in max_tokens]
    return rkvjax.generate(
        smol, prompts, sampling=params, slots=1, chat=None if chat else False, **CACHE
    )


def _token_texts(smol, ids) -> list[str]:
    return [smol.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_models_health_and_metrics_routes(server):
    assert server.get("/health") == (200, b'{"status":"ok"}')
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    names = server.metrics()
    for name in ("requests_waiting", "requests_running", "slots_busy", "slots",
                 "generation_tokens_total", "generation_tokens_per_second",
                 'compressions_total{kind="prefill"}', 'compressions_total{kind="decode"}',
                 "stalled_row_steps_total", "time_to_first_token_seconds_count"):  # fmt: skip
        assert f"rkvjax_{name}" in names
    assert names["rkvjax_slots"] == SLOTS


def test_greedy_chat_and_completion_equal_generate(server, smol):
    client = server.client()
    question = "Name three primary colors."
    chat = client.chat.completions.create(
        model=NAME, messages=_chat(question), max_tokens=40, temperature=0, logprobs=True
    )
    text = "The three primary colors of light are red, green and blue, and of paint they are"
    completion = client.completions.create(
        model=NAME, prompt=text, max_tokens=70, temperature=0, logprobs=1
    )
    want_chat, want_text = _alone(smol, [_chat(question)], [40], chat=True)[0], None
    want_text = _alone(smol, [text], [70], chat=False)[0]

    got = chat.choices[0]
    assert got.message.content == want_chat.text
    assert [e.token for e in got.logprobs.content] == _token_texts(smol, want_chat.token_ids)
    assert chat.usage.completion_tokens == len(want_chat.token_ids)
    assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    assert got.finish_reason == want_chat.finish_reason
    assert got.model_extra["rkvjax"]["compressions"] == want_chat.stats.compressions

    got = completion.choices[0]
    assert got.text == want_text.text
    assert got.logprobs.tokens == _token_texts(smol, want_text.token_ids)
    assert completion.usage.completion_tokens == len(want_text.token_ids)
    assert want_text.stats.compressions > 0  # the cache compressed while it decoded
    assert got.model_extra["rkvjax"]["compressions"] == want_text.stats.compressions


def test_stream_concatenates_to_the_same_text_and_starts_early(server):
    client = server.client()
    kw = dict(model=NAME, messages=_chat("Tell me a long story about a lighthouse keeper."),
              max_tokens=160, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**kw)
    pieces, running_at_first, usage, finish = [], None, None, None
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta.content
        if delta and running_at_first is None:
            # The request is still in a slot when its first text arrives.
            running_at_first = server.metrics()["rkvjax_requests_running"]
        pieces.append(delta or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert len([p for p in pieces if p]) > 2
    assert running_at_first == 1
    assert finish == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 160


def test_stream_n_samples_and_stop_strings(server, smol):
    client = server.client()
    text = "Count from one to twenty in words, separated by commas: one, two, three,"
    alone = _alone(smol, [text], [60], chat=False)[0]
    cut = alone.text.find(",", len(alone.text) // 2)
    stop = alone.text[cut - 3 : cut + 1]  # a stop string the greedy answer reaches
    want = _alone(smol, [text], [60], chat=False, stop=[stop])[0]
    texts = {0: "", 1: ""}
    finish = {}
    stream = client.completions.create(
        model=NAME, prompt=text, max_tokens=60, temperature=0, n=2, stop=[stop], stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            assert stop not in texts[c.index]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: want.text, 1: want.text}
    assert finish == {0: "stop", 1: "stop"}


def test_32_concurrent_clients_each_equal_alone(server, smol):
    questions = [f"Write a short paragraph about the number {i}." for i in range(32)]
    budgets = [(8, 24, 48, 16, 64, 32)[i % 6] for i in range(32)]
    before = server.metrics()
    seen = {"busy": 0.0, "waiting": 0.0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            m = server.metrics()
            seen["busy"] = max(seen["busy"], m["rkvjax_slots_busy"])
            seen["waiting"] = max(seen["waiting"], m["rkvjax_requests_waiting"])
            time.sleep(0.05)

    def ask(i):
        return server.client().chat.completions.create(
            model=NAME, messages=_chat(questions[i]), max_tokens=budgets[i], temperature=0
        )

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, range(32)))
    finally:
        done.set()
        watcher.join()
    after = server.metrics()
    alone = _alone(smol, [_chat(q) for q in questions], budgets, chat=True)
    for got, want in zip(answers, alone, strict=True):
        assert got.choices[0].message.content == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
    assert seen["busy"] == SLOTS and seen["waiting"] > 0

    def grew(name):
        return after[f"rkvjax_{name}"] - before[f"rkvjax_{name}"]

    assert grew("generation_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    assert grew("time_to_first_token_seconds_count") == 32
    compressed = sum(a.choices[0].model_extra["rkvjax"]["compressions"] for a in answers)
    assert compressed == sum(w.stats.compressions for w in alone) > 0
    # Both kinds: a prompt longer than the budget once, at prefill, and every compression
    # while decoding. The decode counter is the device's work, which can exceed what the
    # responses count: a row cut by a stop string (an earlier test's) decodes, and may
    # compress, until the chunk after its cut, which the engine may parse during this test.
    long = sum(w.stats.prompt_tokens > CACHE["budget"] for w in alone)
    assert grew('compressions_total{kind="prefill"}') == long
    assert grew('compressions_total{kind="decode"}') >= compressed - long > 0


def _wait_for(cond, timeout: float = HANG_S):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_client_that_disconnects_mid_stream_is_aborted(server):
    before = server.metrics()
    body = json.dumps({"model": NAME, "messages": _chat("Write an endless poem."), "stream": True,
                       "max_tokens": 4000, "ignore_eos": True, "temperature": 0})  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S)
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    sock.sendall(request.encode())
    received = b""
    while received.count(b"data: ") < 4:  # the role, then content: the sample runs
        received += sock.recv(65536)
    assert server.metrics()["rkvjax_slots_busy"] == 1
    sock.close()
    aborted = _wait_for(
        lambda: (
            server.metrics()["rkvjax_requests_aborted_total"]
            == before["rkvjax_requests_aborted_total"] + 1
        )
    )
    assert aborted, server.metrics()
    assert server.metrics()["rkvjax_slots_busy"] == 0
    decoded = server.metrics()["rkvjax_decoded_tokens_total"]
    time.sleep(1.0)
    assert server.metrics()["rkvjax_decoded_tokens_total"] == decoded  # nothing runs on
    answer = server.client().chat.completions.create(
        model=NAME, messages=_chat("Say hi."), max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content


_LONG = (
    "Question: A farmer has 17 sheep and buys 5 more, then sells 8 of them at the market on "
    "Tuesday. How many sheep does the farmer have now? Answer: The farmer starts with 17 sheep. "
    "Buying 5 more gives 22 sheep. Selling 8 leaves 14 sheep, so the answer is 14. Question: "
    "A train leaves at 3 pm and travels for 2 hours and 45 minutes. When does it arrive?"
)


def test_echo_scores_the_prompt_under_the_served_cache(server, smol):
    """lm-eval's loglikelihood request, as it sends it (token ids in a list of lists): the
    echoed prompt's log-probabilities are `rkvjax.score`'s with the served R-KV cache, for
    every token past a prefix of the budget's length (a prefix that short is never
    compressed), and the one generated token is the greedy one."""
    ids = smol.tokenizer.encode(_LONG)[:100]
    assert len(ids) == 100
    body = {"model": NAME, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "prompt_logprobs": 2}  # fmt: skip
    status, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    (choice,) = reply["choices"]
    lp = choice["logprobs"]
    alone = _alone(smol, [ids], [1], chat=False)[0]
    assert choice["text"] == smol.tokenizer.decode(ids) + alone.text
    assert lp["tokens"] == _token_texts(smol, ids + alone.token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    budget = CACHE["budget"]
    want = rkvjax.score(smol, ids, prompt_len=budget, **CACHE)
    assert want.compressions > 0  # the scored tokens ran past the budget: the cache compressed
    np.testing.assert_allclose(lp["token_logprobs"][budget:100], want.logprobs, atol=1e-4)
    assert [next(iter(t)) for t in lp["top_logprobs"][budget:100]] == _token_texts(smol, want.top1)
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len("".join(lp["tokens"][:2]))]
    assert reply["usage"] == {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}
    # vLLM's prompt_logprobs: the same numbers keyed by token id, with ranks.
    plp = choice["prompt_logprobs"]
    assert len(plp) == 100 and plp[0] is None
    for t in range(1, 100):
        mine = plp[t][str(ids[t])]
        assert mine["logprob"] == lp["token_logprobs"][t] and mine["rank"] >= 1
        assert {1, 2} <= {v["rank"] for v in plp[t].values()}  # the two most likely


def test_an_echo_under_fullkv_is_the_forward_pass(smol):
    """Under FullKV an echoed prompt's log-probabilities, and its most likely tokens, are the
    log-softmax of one forward pass (`rkvjax.logits`)."""
    import jax

    from rkvjax.entrypoints.serve import scoring, serving_engine

    engine, length = serving_engine(smol, cache={"method": "full"}, slots=1, max_model_len=96)
    scorer = scoring.scoring_engine(engine, length)
    ids = smol.tokenizer.encode(_LONG)[:80]
    scorer.submit_many([scoring.prompt_request(scorer, ids, 2, "echo")])
    (got,) = scorer.run()
    logp = np.asarray(jax.nn.log_softmax(rkvjax.logits(smol, ids)[0], axis=-1))[:-1]  # [79, V]
    np.testing.assert_allclose(got.logprobs, logp[np.arange(79), ids[1:]], atol=1e-4)
    np.testing.assert_array_equal(got.top_ids, np.argsort(-logp, axis=-1)[:, :2])
    np.testing.assert_allclose(got.top_logprobs, np.sort(logp, axis=-1)[:, ::-1][:, :2], atol=1e-4)
    mine = logp[np.arange(79), ids[1:]]
    np.testing.assert_array_equal(got.ranks, 1 + (logp > mine[:, None]).sum(-1))


def test_a_list_of_prompts_and_chat_text_parts_equal_each_alone(server, smol):
    texts = ["The capital of France is", "One plus one equals"]
    reply = server.client().completions.create(
        model=NAME, prompt=texts, max_tokens=12, temperature=0
    )
    want = _alone(smol, texts, [12, 12], chat=False)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [w.text for w in want]
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "primary colors."}]
    chat = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0
    )
    (joined,) = _alone(smol, [_chat("Name three\nprimary colors.")], [10], chat=True)
    assert chat.choices[0].message.content == joined.text


def test_tokenize_and_detokenize_agree_with_the_model(server, smol):
    body = json.dumps({"prompt": _LONG, "add_special_tokens": False}).encode()
    status, got = server.post("/tokenize", body)
    assert status == 200, got
    ids = smol.tokenizer.encode(_LONG, add_special_tokens=False)
    assert got["tokens"] == ids and got["count"] == len(ids)
    status, text = server.post("/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and text == {"prompt": _LONG}
    status, info = server.get("/tokenizer_info")
    info = json.loads(info)
    assert info["eos_token"] == smol.tokenizer.special_tokens["eos_token"]
    assert "{%" in info["chat_template"]


def _lm_eval(server, tmp_path, model: str, route: str, tasks: str, *extra: str) -> dict:
    """lm-evaluation-harness run as its users run it, against the server; its results."""
    pytest.importorskip("lm_eval")
    out = tmp_path / model
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--tasks", tasks]
    cmd += ["--model_args", f"model={NAME},base_url={server.base}{route}"]
    cmd += ["--include_path", "tests/lm_eval_tasks", "--output_path", str(out), *extra]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tasks' paths
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


def test_lm_eval_scores_loglikelihood_and_generation_tasks(server, tmp_path):
    """lm-eval's `local-completions` with its defaults (token-id prompts, /tokenizer_info and
    /tokenize for its tokenizer) and batches of 4: a 4-shot generate_until task and a 4-shot
    multiple-choice task, whose choices it scores with `echo` under the served R-KV cache;
    `local-chat-completions` runs the generation task through the chat route."""
    got = _lm_eval(server, tmp_path, "local-completions", "/v1/completions",
                   "rkvjax_qa,rkvjax_mc", "--batch_size", "4")  # fmt: skip
    assert 0.0 <= got["rkvjax_qa"]["exact_match,strip"] <= 1.0
    # Eight questions a child answers: a scoring that ignored the prompt would be at chance.
    assert got["rkvjax_mc"]["acc,none"] >= 0.5
    got = _lm_eval(server, tmp_path, "local-chat-completions", "/v1/chat/completions",
                   "rkvjax_qa", "--apply_chat_template")  # fmt: skip
    assert 0.0 <= got["rkvjax_qa"]["exact_match,strip"] <= 1.0


def _good_request_succeeds(server):
    r = server.client().completions.create(
        model=NAME, prompt="One, two, three, four, five, six, seven,", max_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens == 3


_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = {
    "invalid JSON": ("/v1/chat/completions", b'{"messages": [', {}, 400),
    "not an object": ("/v1/chat/completions", b"[1, 2]", {}, 400),
    "unknown field": ("/v1/chat/completions", {**_CHAT, "temperatur": 0.5}, {}, 400),
    "ill-typed field": ("/v1/chat/completions", {**_CHAT, "temperature": "hot"}, {}, 400),
    "ill-typed messages": ("/v1/chat/completions", {"messages": "hi"}, {}, 400),
    "max_tokens 0": ("/v1/chat/completions", {**_CHAT, "max_tokens": 0}, {}, 400),
    "stream_options alone": (
        "/v1/chat/completions", {**_CHAT, "stream_options": {"include_usage": True}}, {}, 400),
    "prompt past the context": (
        "/v1/completions", {"prompt": [17] * 9000, "max_tokens": 4}, {}, 400),
    "n above the slots": ("/v1/chat/completions", {**_CHAT, "n": SLOTS + 1}, {}, 400),
    "body too large": (
        "/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, {}, 413),
    "no API key": ("/v1/chat/completions", _CHAT, {"Authorization": None}, 401),
    "wrong API key": (
        "/v1/chat/completions", _CHAT, {"Authorization": "Bearer test-key-124"}, 401),
    "another model": ("/v1/chat/completions", {**_CHAT, "model": "gpt-4o"}, {}, 404),
    "no such route": ("/v1/embeddings", _CHAT, {}, 404),
    "echo not a bool": ("/v1/completions", {"prompt": "hi", "echo": 1}, {}, 400),
    "an empty prompt in a list": ("/v1/completions", {"prompt": [[5, 6], []]}, {}, 400),
    "an image part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400),
    "logprobs above the limit with echo": (
        "/v1/completions", {"prompt": "hi there", "echo": True, "logprobs": 99}, {}, 400),
    "tokenize a number": ("/tokenize", {"prompt": 5}, {}, 400),
    "negative prompt_logprobs": (
        "/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, {}, 400),
    "prompt_logprobs above the limit": (
        "/v1/completions", {"prompt": "hi there", "prompt_logprobs": 21}, {}, 400),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_4xx_in_openai_shape_then_serving_goes_on(server, case):
    path, body, headers, status = BAD_REQUESTS[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = server.post(path, raw, headers)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if case == "another model":
        assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    if case == "unknown field":
        assert "temperatur" in error["message"] and "temperature" in error["message"]
    if case == "prompt past the context":
        assert "9000" in error["message"]
    _good_request_succeeds(server)


def test_openai_client_raises_its_own_error_types(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="nope").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4o", messages=_chat("hi"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model=NAME, messages=_chat("hi"), temperature=7.0)


def test_sigterm_stops_admitting_and_exits_cleanly(server):
    """Last: it stops the server. A running stream is cut after --shutdown-timeout (5 s)."""
    events = []

    def long_stream():
        try:
            stream = server.client().chat.completions.create(
                model=NAME, messages=_chat("Write an endless poem."), max_tokens=4000,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                events.append(chunk)
        except Exception as e:  # the server may cut the stream: that is the point
            events.append(e)

    t = threading.Thread(target=long_stream)
    t.start()
    assert _wait_for(lambda: len(events) > 2)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(HANG_S) == 0, server.log.read_text()
    t.join(HANG_S)
    assert not t.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    log = server.log.read_text()
    assert "Traceback" not in log, log
