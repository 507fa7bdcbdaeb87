"""The server protects itself from its clients: an API key on the /v1 and tokenizer routes,
JSON bodies only (415), chat messages bounded before the template renders them, a bounded
queue (503 with Retry-After), and no per-token work on the event loop (/health answers within
100 ms while responses with 20 log-probability alternatives per token are formatted)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_harness import CHAT, COMPLETIONS, MODEL, USER, metrics, running_server, slow_steps, sse_events, wait_for

import zipage_jax.server.preprocess as preprocess
from zipage_jax.server import create_app
from zipage_jax.server.auth import api_key_from
from zipage_jax.server.engine_client import InProcessEngineClient
from zipage_jax.server.limits import DEFAULT_MAX_CHAT_BYTES, chat_bytes
from zipage_jax.server.protocol import ChatMessage

KEY = "sk-test-0123456789"
MAX_QUEUED = 8  # the engine's max_num_seqs: one full batch may wait
REFUSED = "zipage:requests_refused_total"


@pytest.fixture(scope="module")
def server(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir, api_key=KEY, max_queued_requests=MAX_QUEUED) as srv:
        yield srv


@pytest.fixture
def queue_empties(server):
    """After the test, nothing holds a place in the admission queue."""
    yield
    wait_for(lambda: server.app.state.queue.queued == 0, 30, "the queue was not released")


def anonymous(server, **headers) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers=headers)


# -- API key -----------------------------------------------------------------------------------

PROTECTED = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
             ("POST", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 1}),
             ("POST", CHAT, {"model": MODEL, "messages": USER, "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]})]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY])
def test_a_missing_or_wrong_key_is_a_401_on_every_protected_route(server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    with anonymous(server, **headers) as http:
        for method, path, body in PROTECTED:
            r = http.request(method, path, json=body)
            assert r.status_code == 401, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", error
            assert KEY not in r.text and r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]


def test_the_right_key_opens_every_protected_route(server):
    for scheme in ("Bearer", "bearer"):
        with anonymous(server, Authorization=f"{scheme} {KEY}") as http:
            for method, path, body in PROTECTED:
                assert http.request(method, path, json=body).status_code == 200, path


def test_open_routes_need_no_key(server):
    with anonymous(server) as http:
        for path in ("/health", "/metrics", "/version", "/openapi.json", "/docs"):
            assert http.get(path).status_code == 200, path
        assert http.get("/nothing").status_code == 404


def test_the_openai_client_needs_the_key(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as raised:
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert right.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert [m.id for m in right.models.list()] == [MODEL, "alias"]


def test_an_unauthenticated_body_is_refused_unread(server):
    huge = b"x" * (8 * 2**20)  # over --max-request-bytes: read, it would be a 413
    with anonymous(server) as http:
        r = http.post(COMPLETIONS, content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 401


def test_the_document_states_the_key(server):
    document = server.http.get("/openapi.json").json()
    assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in document["paths"].items():
        for op in item.values():
            protected = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
            assert ("401" in op["responses"]) == protected and (op.get("security") == [{"bearer": []}]) == protected


def test_the_key_comes_from_the_flag_then_the_environment():
    both = {"ZIPAGE_API_KEY": "zipage", "VLLM_API_KEY": "vllm"}
    assert api_key_from("flag", both) == "flag"
    assert api_key_from(None, both) == "zipage"
    assert api_key_from(None, {"ZIPAGE_API_KEY": "", "VLLM_API_KEY": "vllm"}) == "vllm"
    assert api_key_from(None, {}) is None


@pytest.mark.parametrize("key", ["", "has space", "tab\t", "é"])
def test_a_key_that_cannot_be_sent_is_a_value_error(key):
    with pytest.raises(ValueError, match="api_key"):
        create_app(InProcessEngineClient(lambda: None), [MODEL], api_key=key)


# -- Content-Type ------------------------------------------------------------------------------

POSTS = [(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 1}),
         (CHAT, {"model": MODEL, "messages": USER, "max_tokens": 1}),
         ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "json"])
def test_a_body_not_declared_json_is_a_415(server, content_type, queue_empties):
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path, body in POSTS:
        r = server.http.post(path, content=json.dumps(body).encode(), headers=headers)
        assert r.status_code == 415, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert "Content-Type: application/json" in error["message"], error


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_a_json_body_is_served(server, content_type):
    for path, body in POSTS:
        r = server.http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": content_type})
        assert r.status_code == 200, (path, r.text)


# -- chat bounds -------------------------------------------------------------------------------

def test_chat_bytes_count_every_string_of_every_message():
    raw = [{"role": "user", "content": "héllo", "name": "ann"},
           {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                 "function": {"name": "f", "arguments": "{\"a\": \"ü\"}"}}]},
           {"role": "tool", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "€"}],
            "tool_call_id": "c1"}]

    def strings(value, key=None):  # every string value but the role and type tags
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in strings(v, k)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) and key not in ("role", "type") else []

    expected = sum(len(s.encode()) for s in strings(raw)) + 32 * len(raw)
    assert chat_bytes([ChatMessage.model_validate(m) for m in raw]) == expected == 30 + 3 * 32


def test_a_hundred_thousand_messages_are_refused_at_once(server, queue_empties):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 100_000})
    for path in (CHAT, "/tokenize"):
        start = time.perf_counter()
        r = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
        seconds = time.perf_counter() - start
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "--max-chat-messages of 10000" in r.json()["error"]["message"]
        assert seconds < 2.0, seconds  # templating them first took 3.8 s; a loaded 2-core CI took 0.50 s here
    r = server.http.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_chat_text_over_the_bound_is_refused_before_the_template(server, monkeypatch, queue_empties):
    rendered = []
    for name in ("chat_prompt_ids", "chat_prompt_text"):
        real = getattr(preprocess, name)
        monkeypatch.setattr(preprocess, name, lambda *a, real=real, **k: rendered.append(1) or real(*a, **k))
    text = "x" * (DEFAULT_MAX_CHAT_BYTES - 80)  # with the name and two messages' overhead, 4 bytes over
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "", "name": "é" * 10}]
    for path in (CHAT, "/tokenize"):
        r = server.http.post(path, json={"model": MODEL, "messages": messages})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages", r.text
        assert f"--max-chat-bytes of {DEFAULT_MAX_CHAT_BYTES}" in error["message"]
        assert f"holds {DEFAULT_MAX_CHAT_BYTES + 4} bytes" in error["message"], error
    assert rendered == []


# -- admission ---------------------------------------------------------------------------------

def test_a_full_queue_is_a_503_with_retry_after(server, queue_empties):
    refused = metrics(server)[REFUSED]
    waiting = dict(model=MODEL, prompt="x", n=MAX_QUEUED, max_tokens=2, temperature=0, ignore_eos=True, stream=True)
    with slow_steps(server, 1.0), server.http.stream("POST", COMPLETIONS, json=waiting) as first:
        assert first.status_code == 200  # added; no output until its first step ends
        for body in ({"model": MODEL, "prompt": "y", "max_tokens": 1},
                     {"model": MODEL, "messages": USER, "max_tokens": 1}):
            r = server.http.post(CHAT if "messages" in body else COMPLETIONS, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            error = r.json()["error"]
            assert error["type"] == "service_unavailable" and "--max-queued-requests 8" in error["message"], error
        events = sse_events(first.iter_lines())
    assert events[-1] == "[DONE]" and len(events) == 1 + MAX_QUEUED * 2
    assert metrics(server)[REFUSED] == refused + 2
    r = server.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "y", "max_tokens": 1})
    assert r.status_code == 200


def test_more_sequences_than_the_queue_holds_are_a_400(server, queue_empties):
    r = server.http.post(COMPLETIONS, json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and "9 sequences" in r.json()["error"]["message"], r.text
    assert "--max-queued-requests of 8" in r.json()["error"]["message"]


def test_a_request_that_fails_or_goes_away_gives_its_place_back(server, queue_empties):
    too_long = server.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "x " * 300, "max_tokens": 1})
    assert too_long.status_code == 400  # refused after it was admitted
    assert server.app.state.queue.queued == 0
    body = dict(model=MODEL, prompt="x", n=MAX_QUEUED, max_tokens=50, ignore_eos=True, stream=True)
    with slow_steps(server, 0.5):
        with server.http.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200 and server.app.state.queue.queued == MAX_QUEUED
        # the client went away before the first output


# -- no per-token work on the event loop -------------------------------------------------------

HEAVY = [(COMPLETIONS, dict(prompt="the", logprobs=20, stream=True)),
         (CHAT, dict(messages=USER, logprobs=True, top_logprobs=20, stream=True)),
         (COMPLETIONS, dict(prompt="the", logprobs=20)),
         (CHAT, dict(messages=USER, logprobs=True, top_logprobs=20, prompt_logprobs=20))]


DECODE_S = 50e-6  # a large vocabulary's tokenizer decodes a token in tens of microseconds, holding the GIL


def spinning(decode, seconds: float):
    """`decode`, taking `seconds` more of CPU (and the GIL) per call."""
    def slow(*args, **kwargs):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return decode(*args, **kwargs)
    return slow


@pytest.mark.parametrize("path, fields", HEAVY, ids=["completions-stream", "chat-stream", "completions", "chat"])
def test_health_answers_within_100ms_while_logprobs_are_formatted(server, path, fields, monkeypatch, queue_empties):
    tokenizer = server.app.state.engine_client.tokenizer  # the response builders'
    monkeypatch.setattr(tokenizer, "decode", spinning(tokenizer.decode, DECODE_S))
    body = dict(model=MODEL, n=4, max_tokens=160, temperature=0, ignore_eos=True, **fields)
    done, result = threading.Event(), {}

    def send():
        try:
            with server.http.stream("POST", path, json=body) as r:
                result["status"] = r.status_code
                result["body"] = r.read().decode()
        finally:
            done.set()

    latencies = []
    sender = threading.Thread(target=send)
    with slow_steps(server, 0.01), httpx.Client(base_url=server.url, timeout=10) as health:
        sender.start()
        while not done.is_set():
            start = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    sender.join()
    assert result["status"] == 200, result
    if body.get("stream"):
        chunks = [json.loads(e) for e in sse_events(result["body"].splitlines())[:-1]]
        choices = [c for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
    else:
        choices = json.loads(result["body"])["choices"]
    if path == COMPLETIONS:  # alternatives by text: those that decode alike are one
        alternatives = [len(top) for c in choices for top in c["logprobs"]["top_logprobs"]]
        assert len(alternatives) == 4 * 160 and min(alternatives) >= 1, alternatives
    else:
        alternatives = [len(t["top_logprobs"]) for c in choices for t in c["logprobs"]["content"]]
        assert alternatives == [20] * (4 * 160)
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    assert len(latencies) >= 40 and p99 < 0.1, (len(latencies), p99, max(latencies))
