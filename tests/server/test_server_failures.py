"""Failure stays with its request: a request the engine fails alone gets a bare 500 (or an
error event) with its request id while the others go on; a failing engine step fails every
request in flight and serving goes on; a 500 never carries exception text, which the log line
under the same request id does."""

from __future__ import annotations

import http.client
import json
import logging

import httpx
import pytest

from server_harness import (
    COMPLETIONS, MODEL, POISON_SEED, ROW_FAILURE, ROW_FAILURE_SEED, bystander, slow_steps, sse_events,
    wait_idle)


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="zipage_jax.server")
    return caplog


def assert_bare_500(response: httpx.Response, *secrets: str) -> str:
    """The request id of a 500 that says only that the server failed."""
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    assert response.json() == {"error": {
        "message": f"the server failed to process the request (request id {request_id})",
        "type": "server_error", "param": None, "code": None}}
    assert not any(secret in response.text for secret in secrets)
    return request_id


def logged(log, request_id: str, text: str) -> bool:
    return any(request_id in r.getMessage() and (text in r.getMessage() or text in (r.exc_text or ""))
               for r in log.records)


def test_a_request_that_fails_to_join_fails_alone(server, log):
    with bystander(server):
        r = server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt="x", seed=POISON_SEED))
        request_id = assert_bare_500(r, "poisoned", "RuntimeError")
    assert logged(log, request_id, "poisoned request")
    wait_idle(server)


def test_a_request_the_engine_fails_alone_gets_a_bare_500(server, log):
    start = wait_idle(server)
    with bystander(server):
        r = server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt=["x", "y"], seed=ROW_FAILURE_SEED))
        request_id = assert_bare_500(r, "injected", "step inputs")
    assert logged(log, request_id, ROW_FAILURE)
    end = wait_idle(server, start["zipage:kv_free_blocks"])
    assert (end["vllm:e2e_request_latency_seconds_count"]
            == start["vllm:e2e_request_latency_seconds_count"] + 1)  # the bystander finished, the failed did not


def test_a_stream_the_engine_fails_alone_ends_with_an_error_event(server, log):
    body = dict(model=MODEL, prompt="x", max_tokens=8, seed=ROW_FAILURE_SEED, stream=True)
    with bystander(server), httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) == 2
    assert json.loads(events[0]) == {"error": {
        "message": f"the server failed to process the request (request id {request_id})",
        "type": "server_error", "param": None, "code": None}}
    assert logged(log, request_id, ROW_FAILURE)
    wait_idle(server)


def test_a_failing_step_fails_everything_in_flight_and_serving_goes_on(server, log):
    start = wait_idle(server)
    body = dict(model=MODEL, prompt="doomed", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with slow_steps(server), httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        server.engine.fail_steps = 1
        events = sse_events(lines)
        request_id = r.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == (
        f"the server failed to process the request (request id {request_id})")
    assert any("engine step failed" in rec.getMessage() and request_id in rec.getMessage()
               and "injected step failure" in (rec.exc_text or "") for rec in log.records)
    wait_idle(server, start["zipage:kv_free_blocks"])
    r = server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt="doomed", max_tokens=8, temperature=0,
                                                ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_an_unexpected_exception_is_a_bare_500_and_the_connection_stays_open(server, log, monkeypatch):
    def broken(*args):
        raise RuntimeError("secret internal detail")

    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps(dict(model=MODEL, prompt="x", max_tokens=2))
    with bystander(server):
        monkeypatch.setattr(server.app.state.preprocessor, "completion_prompts", broken)
        connection.request("POST", COMPLETIONS, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        sock = connection.sock
        connection.request("GET", "/health")
        again = connection.getresponse()
        assert again.status == 200 and json.loads(again.read()) == {"status": "ok"}
        assert connection.sock is sock  # the same keep-alive connection
    request_id = response.getheader("x-request-id")
    assert response.status == 500 and "secret" not in text and "RuntimeError" not in text
    assert json.loads(text)["error"]["message"].endswith(f"(request id {request_id})")
    assert logged(log, request_id, "secret internal detail")
