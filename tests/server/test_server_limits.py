"""Bounded inputs: every number within what the engine stores (the bound in the error), text
that is valid Unicode, bodies under --max-request-bytes (413 unread), and no request stalling
the event loop; each while another request streams on and completes normally."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest
from server_harness import CHAT, COMPLETIONS, MODEL, USER, bystander

from zipage_jax.server.middleware import DEFAULT_MAX_REQUEST_BYTES

VOCAB = 320  # the tiny model's


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "x", "max_tokens": 4, **fields}


OUT_OF_BOUNDS = [  # (path, body, param, text the message must hold)
    (COMPLETIONS, completion(n=2**70), "n", "less than or equal to 128"),
    (COMPLETIONS, completion(n=129), "n", "less than or equal to 128"),
    (COMPLETIONS, completion(n=9), "n", "max_num_seqs=8"),  # the engine runs 8 sequences at once
    (COMPLETIONS, completion(temperature=1.0, top_k=2**31), "top_k", "less than or equal to 2147483647"),
    (COMPLETIONS, completion(top_k=-2), "top_k", "greater than or equal to -1"),
    (COMPLETIONS, completion(stop_token_ids=[2**40], min_tokens=2), "stop_token_ids", "2147483647"),
    (COMPLETIONS, completion(stop_token_ids=[VOCAB]), "stop_token_ids", f"[0, {VOCAB})"),
    (COMPLETIONS, completion(stop_token_ids=[1] * 65), "stop_token_ids", "at most 64 items"),
    (COMPLETIONS, completion(seed=2**63), "seed", "less than or equal to 9223372036854775807"),
    (COMPLETIONS, completion(seed=-(2**63) - 1), "seed", "greater than or equal to -9223372036854775808"),
    (COMPLETIONS, completion(temperature=1e39), "temperature", "less than or equal to 3402823466385288"),
    (COMPLETIONS, completion(repetition_penalty=1e39), "repetition_penalty", "less than or equal to 3402823466385288"),
    (COMPLETIONS, completion(max_tokens=2**31), "max_tokens", "less than or equal to 2147483647"),
    (COMPLETIONS, completion(min_tokens=2**31), "min_tokens", "less than or equal to 2147483647"),
    (COMPLETIONS, completion(kv_budget=2**31), "kv_budget", "less than or equal to 2147483647"),
    (COMPLETIONS, completion(logprobs=21), "logprobs", "less than or equal to 20"),
    (COMPLETIONS, completion(prompt=[1, 2**31]), "prompt", "less than or equal to 2147483647"),
    (COMPLETIONS, completion(prompt=[1, VOCAB]), "prompt", f"[0, {VOCAB})"),
    (CHAT, {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": 2**31}, "max_completion_tokens",
     "2147483647"),
]


def test_out_of_bounds_values_are_400s_that_give_the_bound(server):
    with bystander(server):
        for path, body, param, bound in OUT_OF_BOUNDS:
            r = server.http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and bound in error["message"], (body, error)


def test_top_k_beyond_the_vocabulary_keeps_every_token(server):
    sampled = dict(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    with bystander(server):
        beyond = server.http.post(COMPLETIONS, json=completion(top_k=10**6, **sampled))
        off = server.http.post(COMPLETIONS, json=completion(top_k=0, **sampled))
    assert beyond.status_code == off.status_code == 200
    assert beyond.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]


LONE_SURROGATES = [  # (path, JSON body with a "\ud800" escape, param)
    (COMPLETIONS, '{"model": "tiny", "prompt": "\\ud800", "max_tokens": 4}', "prompt"),
    (COMPLETIONS, '{"model": "tiny", "prompt": ["ok", "a\\udfffb"], "max_tokens": 4}', "prompt"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "stop"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "user": "\\ud800"}', "user"),
    (COMPLETIONS, '{"model": "\\ud800", "prompt": "x"}', "model"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "\\ud800": 1}', None),  # a field name
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\\udc00"}]}', "messages"),
]


def test_text_that_is_not_unicode_is_a_400_naming_the_field(server):
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    with bystander(server):
        for path, body, param in LONE_SURROGATES:
            connection.request("POST", path, body.encode(), {"Content-Type": "application/json"})
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 400 and error["param"] == param, (body, error)
            assert "not valid Unicode (a lone surrogate" in error["message"], error
        sock = connection.sock
        pair = '{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'  # a surrogate pair is an emoji
        connection.request("POST", COMPLETIONS, pair.encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2
        assert connection.sock is sock  # one keep-alive connection throughout


def test_bodies_over_the_limit_are_413_before_parsing(server, monkeypatch):
    parsed = []
    parse = server.app.state.preprocessor.parse
    limit = DEFAULT_MAX_REQUEST_BYTES
    body = json.dumps(completion(prompt="x" * limit)).encode()

    def chunks():
        for start in range(0, len(body), 2**16):
            yield body[start:start + 2**16]

    with bystander(server):
        monkeypatch.setattr(server.app.state.preprocessor, "parse", lambda *args: parsed.append(1) or parse(*args))
        declared = server.http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
        chunked = server.http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    for r in (declared, chunked):
        assert r.status_code == 413 and str(limit) in r.json()["error"]["message"], r.text
        assert r.headers["x-request-id"]
    assert parsed == []
    assert "transfer-encoding" in chunked.request.headers and "content-length" not in chunked.request.headers
    at_limit = json.dumps(completion(prompt="x" * (limit - 100))).encode()
    at_limit += b" " * (limit - len(at_limit))  # exactly the limit: parsed (then refused as too long)
    r = server.http.post(COMPLETIONS, content=at_limit, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and parsed == [1]


class _Slow:
    """A tokenizer that takes `seconds` (releasing the GIL) to tokenize or render a template."""

    def __init__(self, tokenizer, seconds: float, busy: threading.Event):
        self._tokenizer, self._seconds, self.busy = tokenizer, seconds, busy

    def _slowly(self, fn, *args, **kwargs):
        self.busy.set()
        time.sleep(self._seconds)
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy.clear()

    def __call__(self, *args, **kwargs):
        return self._slowly(self._tokenizer, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._slowly(self._tokenizer.apply_chat_template, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def health_latencies(server, until: threading.Event, busy: threading.Event | None = None) -> list[float]:
    """/health response times, polled until `until` (only those while `busy`, if given)."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while not until.is_set():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            if busy is None or busy.is_set():
                latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    return latencies


def test_health_answers_within_100ms_while_prompts_are_tokenized(server, monkeypatch):
    preprocessor = server.app.state.preprocessor
    busy, done = threading.Event(), threading.Event()
    own = preprocessor._tokenizer

    def slow_tokenizer():
        tokenizer, bytes_per_token = own()
        return _Slow(tokenizer, 0.5, busy), bytes_per_token

    monkeypatch.setattr(preprocessor, "_tokenizer", slow_tokenizer)
    results = {}

    def send():
        try:
            results["completion"] = server.http.post(COMPLETIONS, json=completion(prompt="ab" * 8, max_tokens=2))
            results["chat"] = server.http.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2})
        finally:
            done.set()

    with bystander(server):
        sender = threading.Thread(target=send)
        sender.start()
        latencies = health_latencies(server, done, busy)
        sender.join()
    assert results["completion"].status_code == 200 and results["chat"].status_code == 200
    assert len(latencies) >= 10 and max(latencies) < 0.1, latencies


def test_a_maximal_prompt_is_refused_unread_by_the_tokenizer_while_health_answers(server):
    body = json.dumps(completion(prompt="The quick brown fox. " * ((DEFAULT_MAX_REQUEST_BYTES - 200) // 21)))
    done, results = threading.Event(), {}

    def send():
        start = time.perf_counter()
        results["response"] = server.http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
        results["seconds"] = time.perf_counter() - start
        done.set()

    with bystander(server):
        sender = threading.Thread(target=send)
        sender.start()
        latencies = health_latencies(server, done)
        sender.join()
    error = results["response"].json()["error"]
    assert results["response"].status_code == 400 and error["param"] == "prompt"
    assert "prompt has at least" in error["message"] and "maximum context length is 256" in error["message"]
    assert results["seconds"] < 2 and max(latencies, default=0) < 0.1, (results["seconds"], latencies)


@pytest.mark.parametrize("field, items", [("prompt", [-1] * 700_000), ("messages", [1] * 900_000)])
def test_a_body_of_many_bad_items_is_refused_at_the_first(server, field, items):
    body = {"model": MODEL, field: items}
    path = COMPLETIONS if field == "prompt" else CHAT
    start = time.monotonic()
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field)
    assert elapsed < 2.0  # one error, not one per item (seconds of a preprocessing thread)
