"""Failure stays with its request: a request the engine fails alone gets a bare 500 (or an
error event) with its request id while the others go on; a device failure inside a step is
recovered (/health 503 meanwhile) and the requests in flight finish as without it; a step that
raises anyway fails every request in flight and serving goes on; an engine that cannot rebuild
fails what is in flight, answers 503 and stops the server; a 500 never carries exception text,
which the log line under the same request id does."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading

import httpx
import pytest
from device_failures import FailingCalls
from server_harness import (
    COMPLETIONS,
    MODEL,
    POISON_SEED,
    ROW_FAILURE,
    ROW_FAILURE_SEED,
    FaultyEngine,
    bystander,
    running_server,
    serve,
    slow_steps,
    sse_events,
    wait_for,
    wait_idle,
)

from zipage_jax.commands import serve as serve_command
from zipage_jax.engine.core import EngineFailed
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.server.engine_client import InProcessEngineClient


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


LONG = dict(model=MODEL, prompt="survivor", max_tokens=40, temperature=0, ignore_eos=True)


def test_a_device_failure_mid_stream_is_recovered_and_the_stream_ends_as_without_it(server, monkeypatch):
    start = wait_idle(server)
    reference = server.http.post(COMPLETIONS, json=LONG).json()["choices"][0]["text"]
    runner = server.engine.runner
    rebuilding, release = threading.Event(), threading.Event()
    reset_state = runner.reset_state

    def held_rebuild():
        rebuilding.set()
        release.wait(30)
        reset_state()

    monkeypatch.setattr(runner, "reset_state", held_rebuild)
    health = []

    def inject() -> None:
        failure = FailingCalls(monkeypatch, runner.forward, {2})
        assert rebuilding.wait(30), "the injected failure did not happen"
        try:  # /health follows the core through its events (the client's output thread): at once, or nearly
            wait_for(lambda: server.http.get("/health").status_code != 200, 10, "/health missed the rebuild")
            r = server.http.get("/health")
            health.append((r.status_code, r.json()))
        finally:
            release.set()
        wait_for(lambda: server.http.get("/health").status_code == 200, 30, "/health did not recover")
        health.append(failure.donated)

    chunks = []
    with slow_steps(server), httpx.stream("POST", f"{server.url}{COMPLETIONS}", json={**LONG, "stream": True},
                                          timeout=60) as r:
        injector = None
        for line in r.iter_lines():
            chunks += sse_events([line])
            if chunks and injector is None:
                injector = threading.Thread(target=inject, daemon=True)
                injector.start()
    injector.join(60)
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(e) for e in chunks[:-1]]
    assert all("error" not in c for c in parsed), parsed
    assert "".join(c["choices"][0]["text"] for c in parsed) == reference  # the same greedy text, nothing twice
    assert health[0] == (503, {"error": {
        "message": "the engine is rebuilding its device state after a failed step", "type": "service_unavailable",
        "param": None, "code": None}})
    assert health[1] == [True]  # the failure came after the call consumed the device state
    end = wait_idle(server, start["zipage:kv_free_blocks"])
    assert end["zipage:engine_recoveries_total"] == start["zipage:engine_recoveries_total"] + 1


def test_a_step_that_raises_without_recovering_fails_everything_in_flight_and_serving_goes_on(server, log):
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


@pytest.mark.slow  # a server of its own (its engine ends unusable): its compiles
def test_an_engine_that_cannot_rebuild_fails_its_requests_and_answers_503(tiny_model_factory, model_cache_dir,
                                                                         monkeypatch, log):
    failures = []
    with running_server(tiny_model_factory, model_cache_dir, on_engine_error=failures.append) as srv:
        runner = srv.engine.runner

        def broken_rebuild():
            raise MemoryError("injected: no room for a fresh KV pool")

        monkeypatch.setattr(runner, "_fresh_state", broken_rebuild)
        FailingCalls(monkeypatch, runner.forward, {3})
        body = dict(LONG, stream=True)
        with httpx.stream("POST", f"{srv.url}{COMPLETIONS}", json=body, timeout=60) as r:
            request_id = r.headers["x-request-id"]
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == (
            f"the server failed to process the request (request id {request_id})")
        wait_for(lambda: failures, 10, "on_engine_error was not called")
        # the client learns of it as the driver's Fatal event (plain text: the core may be in another process)
        assert str(failures[0]) == ("the engine failed: EngineFailed: rebuilding the device state after a failed "
                                    "step failed")
        assert isinstance(srv.engine.failed, MemoryError)  # the core's own record of why
        assert srv.app.state.engine_client.engine_error is failures[0]
        unavailable = {"message": "the engine failed and cannot serve (the server's log says why)",
                       "type": "service_unavailable", "param": None, "code": None}
        r = srv.http.get("/health")
        assert r.status_code == 503 and r.json() == {"error": unavailable}
        r = srv.http.post(COMPLETIONS, json=dict(model=MODEL, prompt="x", max_tokens=2))
        assert r.status_code == 503 and r.json() == {"error": unavailable}
    assert any("cannot serve" in rec.getMessage() and request_id in rec.getMessage() for rec in log.records)


class _FailedEngine(FaultyEngine):
    """A real engine core whose first step finds it failed for good."""

    def __init__(self, **options):
        super().__init__(**options)
        self.add_request([1, 2, 3], SamplingParams(max_tokens=4))

    def step(self):
        self.failed = MemoryError("injected: no room for a fresh KV pool")
        raise EngineFailed("rebuilding the device state after a failed step failed") from self.failed


def test_serve_exits_1_once_the_engine_has_failed(tiny_model_factory, model_cache_dir, monkeypatch, caplog):
    """`serve` runs its engine core in a process of its own: here the failing core is driven in
    this process instead, behind the same client front (the output stage, the engine's events)."""
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    monkeypatch.setattr(serve_command, "MultiProcessEngineClient",
                        lambda config, log_level: InProcessEngineClient(lambda: _FailedEngine(config=config)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(tiny_model_factory("qwen3"))
    assert serve("--model", model, "--port", str(port), "--kvcache-block-size", "16") == 1
    assert "the engine failed and cannot serve" in caplog.text
