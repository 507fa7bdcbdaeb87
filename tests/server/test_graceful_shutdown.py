"""The server's graceful shutdown (server/shutdown.py): on SIGTERM or SIGINT it stops admitting at
once (new requests and /health answer 503 "the server is shutting down", the listener still
open), lets the requests in flight finish, aborts those left after --shutdown-timeout (a 503, or
an error event then [DONE] ending a stream), a second signal aborting at once, and exits 0 with
nothing it started left running.

The drain's logic runs on a stub app; the serving side on the scripted engine behind the real app
(a signal there is `handle_exit` called as the handler would be: uvicorn listens for signals on the
main thread only); `zipage-jax serve` itself, as users run it, in subprocesses (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
import uvicorn
from scripted_engine import ScriptedEngine
from server_harness import COMPLETIONS, ENGINE_OPTIONS, MODEL, serve, sse_events, wait_for
from test_engine_process import Served

from zipage_jax.server import create_app
from zipage_jax.server.config import ServerConfig
from zipage_jax.server.engine_client import InProcessEngineClient
from zipage_jax.server.shutdown import SHUTTING_DOWN, GracefulServer, defer_signals_to_process_0

EXIT_GRACE_S = 5  # how soon after its shutdown timeout the process must have exited
STREAMS = 16


class Running:
    """A GracefulServer serving `app` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app, shutdown_timeout: float, stop_admitting, abort):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = GracefulServer(uvicorn.Config(app, log_level="warning"), shutdown_timeout, stop_admitting,
                                     abort)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn did not start")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.server.handle_exit(sig, None)

    def wait_stopped(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"


# -- the drain, on a stub app --------------------------------------------------------------------


class StubApp:
    """GET / answers at once; GET /slow once `release` is set (or the stub's abort sets it)."""

    def __init__(self):
        self.release = threading.Event()
        self.admitting, self.aborts = True, 0

    def stop_admitting(self) -> None:
        self.admitting = False

    def abort(self) -> None:
        self.aborts += 1
        self.release.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/slow":
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        body = b"aborted" if self.aborts else (b"ok" if self.admitting else b"draining")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def stub_server(shutdown_timeout: float) -> Iterator[tuple[Running, StubApp, list]]:
    """The running stub, and what its slow request got (filled in once it ends)."""
    app = StubApp()
    running = Running(app, shutdown_timeout, app.stop_admitting, app.abort)
    answers: list = []
    slow = threading.Thread(target=lambda: answers.append(httpx.get(f"{running.url}/slow", timeout=60).text),
                            daemon=True)
    slow.start()
    wait_for(lambda: len(running.server.server_state.tasks) == 1, 30, "the slow request did not arrive")
    try:
        yield running, app, answers
    finally:
        app.release.set()
        running.wait_stopped()
        slow.join(30)


def test_the_drain_lets_the_request_in_flight_finish_and_keeps_listening_meanwhile():
    with stub_server(shutdown_timeout=600) as (running, app, answers):
        assert httpx.get(running.url).text == "ok"  # positive control
        running.signal()
        assert not app.admitting
        assert httpx.get(running.url).text == "draining"  # the listener is open during the drain
        assert running.thread.is_alive() and not answers
        app.release.set()
        running.wait_stopped()
        assert answers == ["draining"] and app.aborts == 0


@pytest.mark.parametrize("signals, timeout", [(1, 0.3), (1, 0), (2, 600)])
def test_what_still_runs_is_aborted_after_the_timeout_or_a_second_signal(signals, timeout):
    with stub_server(shutdown_timeout=timeout) as (running, app, answers):
        for sig in [signal.SIGTERM, signal.SIGINT][:signals]:
            running.signal(sig)
        running.wait_stopped()
        assert answers == ["aborted"] and app.aborts >= 1


def test_without_a_request_in_flight_the_server_stops_at_once():
    app = StubApp()
    running = Running(app, 600, app.stop_admitting, app.abort)
    running.signal()
    running.wait_stopped()
    assert app.aborts == 0


def test_a_negative_timeout_is_refused_and_zero_accepted(capsys):
    app = StubApp()
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="shutdown_timeout must be >= 0 seconds"):
            GracefulServer(uvicorn.Config(app), bad, app.stop_admitting, app.abort)
        with pytest.raises(ValueError, match="--shutdown-timeout must be >= 0 seconds"):
            ServerConfig(shutdown_timeout=bad)
    assert ServerConfig(shutdown_timeout=0).shutdown_timeout == 0
    with pytest.raises(SystemExit) as exc:
        serve("--model", "default", "--shutdown-timeout", "-1")
    assert exc.value.code == 2
    assert "zipage-jax serve: error: --shutdown-timeout must be >= 0 seconds, got -1" in capsys.readouterr().err


def test_a_signalled_follower_goes_on_until_process_0_stops_it_unless_signalled_twice():
    forced: list[bool] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        defer_signals_to_process_0(force_exit=lambda: forced.append(True))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode: this process lives on
        assert forced == []
        os.kill(os.getpid(), signal.SIGINT)
        assert forced == [True]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# -- the serving side: the real app on the scripted engine --------------------------------------------


@pytest.fixture(scope="module")
def scripted_factory(tiny_model_factory, model_cache_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        model_dir = str(tiny_model_factory("qwen3"))
        ScriptedEngine(model=model_dir, **ENGINE_OPTIONS)  # the model's parameters cached once
        yield lambda: ScriptedEngine(model=model_dir, **ENGINE_OPTIONS)


@contextlib.contextmanager
def scripted_server(factory, shutdown_timeout: float) -> Iterator[Running]:
    client = InProcessEngineClient(factory)
    app = create_app(client, [MODEL])
    serving = app.state.serving
    running = Running(app, shutdown_timeout, serving.stop_admitting, serving.abort_in_flight)
    try:
        wait_for(lambda: httpx.get(f"{running.url}/health").status_code == 200, 120, "the model did not load")
        client.core.step_delay = 0.02  # 200 tokens: 4 s, so the requests surely outlast the test's checks
        yield running
    finally:
        running.signal(signal.SIGINT)
        running.wait_stopped()


def start_streams(url: str, count: int, max_tokens: int) -> tuple[list[threading.Thread], dict[int, list[str]]]:
    """`count` streaming completions, once each has been answered 200; their SSE events by index."""
    events: dict[int, list[str]] = {}
    started = threading.Semaphore(0)

    def read(i: int) -> None:
        body = dict(model=MODEL, prompt=f"stream {i}", max_tokens=max_tokens, temperature=0, ignore_eos=True,
                    stream=True)
        try:
            with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=120) as r:
                events[i] = [f"status {r.status_code}"]
                started.release()
                events[i] += sse_events(r.iter_lines())
        except httpx.HTTPError as exc:
            events[i] = [f"failed {exc!r}"]
            started.release()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=120), "a stream did not start"
    return threads, events


def assert_refused_while_draining(url: str) -> None:
    health = httpx.get(f"{url}/health", timeout=30)
    late = httpx.post(f"{url}{COMPLETIONS}", json=dict(model=MODEL, prompt="late", max_tokens=4), timeout=30)
    for r in (health, late):
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": SHUTTING_DOWN, "type": "service_unavailable", "param": None,
                                     "code": None}


def outcome(events: list[str]) -> str:
    """"finished" (every chunk clean, the last "length"), "aborted" (a shutdown error event then
    [DONE]), else what went wrong."""
    assert events[0] == "status 200" and events[-1] == "[DONE]", events[:2] + events[-2:]
    *chunks, last = [json.loads(e) for e in events[1:-1]]
    assert all("error" not in c for c in chunks), chunks
    if "error" in last:
        error = last["error"]
        assert error["type"] == "service_unavailable" and error["message"].startswith(SHUTTING_DOWN), error
        return "aborted"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "finished"


def test_draining_refuses_new_requests_and_in_flight_streams_finish(scripted_factory):
    with scripted_server(scripted_factory, shutdown_timeout=600) as running:
        threads, events = start_streams(running.url, 4, max_tokens=40)
        running.signal()
        assert_refused_while_draining(running.url)
        for thread in threads:
            thread.join(60)
        assert [outcome(events[i]) for i in range(4)] == ["finished"] * 4
        running.wait_stopped()


def test_after_the_timeout_streams_end_with_an_error_event_and_whole_responses_get_503(scripted_factory):
    with scripted_server(scripted_factory, shutdown_timeout=0.5) as running:
        threads, events = start_streams(running.url, 3, max_tokens=200)
        whole: list[httpx.Response] = []
        body = dict(model=MODEL, prompt="whole", max_tokens=200, temperature=0, ignore_eos=True)
        asking = threading.Thread(target=lambda: whole.append(httpx.post(f"{running.url}{COMPLETIONS}", json=body,
                                                                         timeout=120)), daemon=True)
        asking.start()
        wait_for(lambda: running.server.server_state.tasks and len(running.server.server_state.tasks) == 4, 30,
                 "the whole request did not arrive")
        running.signal()
        for thread in [*threads, asking]:
            thread.join(60)
        assert [outcome(events[i]) for i in range(3)] == ["aborted"] * 3
        assert whole[0].status_code == 503 and whole[0].json()["error"]["message"].startswith(SHUTTING_DOWN)
        running.wait_stopped()


# -- zipage-jax serve, as users run it --------------------------------------------------------------


def _signalled(srv: Served, sig: int = signal.SIGTERM) -> list[psutil.Process]:
    """Sends `sig` to the server; its process tree as it was just before."""
    tree = psutil.Process(srv.proc.pid).children(recursive=True)
    assert tree, "the server started no process"
    srv.proc.send_signal(sig)
    return tree


def _assert_all_gone(tree: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(tree, timeout=EXIT_GRACE_S)
    alive = [p for p in alive if _running(p)]
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.status() != psutil.STATUS_ZOMBIE
    return False


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.mark.slow
@pytest.mark.parametrize("timeout, flags", [(120, []), (0, []), (120, ["--data-parallel-size", "2"])],
                         ids=["drained", "aborted", "data-parallel"])
def test_serve_drains_on_sigterm_exits_0_and_leaves_no_process(model_dir, model_cache_dir, timeout, flags):
    """The engine core process, or the data-parallel replicas and the local Ray, stop with the server."""
    srv = Served(model_dir, model_cache_dir, "--shutdown-timeout", str(timeout), *flags)
    try:
        threads, events = start_streams(srv.url, STREAMS, max_tokens=200)
        tree = _signalled(srv)
        if timeout:  # with no timeout the server may be gone before a request reaches it
            assert_refused_while_draining(srv.url)
        assert srv.proc.wait(timeout + EXIT_GRACE_S) == 0, srv.proc.stderr.read()[-3000:]
        _assert_all_gone(tree)
        for thread in threads:
            thread.join(30)
        outcomes = [outcome(events[i]) for i in range(STREAMS)]
        if timeout == 120:
            assert outcomes == ["finished"] * STREAMS
        else:  # aborted at the first tick after the signal: the 8 queued behind the running 8 cannot have finished
            assert "aborted" in outcomes, outcomes
    finally:
        srv.stop()
