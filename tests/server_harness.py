"""The server under test (uvicorn in a thread, the real engine core on a tiny model driven in
this process, failing on demand) and the helpers the server and data-parallel tests share."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from zipage_jax.cli import main
from zipage_jax.engine.core import AdmittedRequest, EngineCore
from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient

MODEL = "tiny"
POISON_SEED = 4242  # add_requests raises for this seed (FaultyEngine)
ROW_FAILURE_SEED = 4343  # the engine fails this request alone, as if its step inputs could not be built
ROW_FAILURE = "injected: this request's step inputs could not be built"
# Every new batch / chunk / block-table bucket and sampler flag set costs a jit compile, so the
# tests keep to greedy sampling, short prompts and outputs, and at most 8 running sequences.
ENGINE_OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_num_seqs=8, max_model_len=256,
                      max_num_batched_tokens=512)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


class FaultyEngine(EngineCore):
    """The real engine core, failing on demand: add_requests for POISON_SEED; a step that fails a
    ROW_FAILURE_SEED request alone (a `failures` entry and an "error" finish for each of its
    sequences, the request aborted: the core's contract for a request whose step inputs fail to
    build); step() itself while fail_steps > 0 (a device failure). It is slowed down on demand
    (step_delay)."""

    fail_steps = 0
    step_delay = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._doomed: list[AdmittedRequest] = []

    def add_requests(self, requests):
        if any(params is not None and params.seed == POISON_SEED for _, params, _ in requests):
            raise RuntimeError("poisoned request")
        admitted = super().add_requests(requests)
        self._doomed += [r for r in admitted if r.params.seed == ROW_FAILURE_SEED]
        return admitted

    def step(self) -> EngineCoreOutputs:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        time.sleep(self.step_delay)
        failures, finished = [], []
        for request in self._doomed:
            self.abort(request.request_id)
            failures.append((request.request_id, ROW_FAILURE, None))
            finished += [FinishedSequence(seq_id, "error", None, False, SequenceMetrics())
                         for seq_id in request.seq_ids]
        self._doomed.clear()
        outputs = super().step()
        outputs.failures[:0] = failures
        outputs.finished[:0] = finished
        return outputs


class ServerThread:
    """uvicorn serving `app` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def running_server(tiny_model_factory, model_cache_dir, engine_class=FaultyEngine, **app_options) -> Iterator:
    """A ServerThread over `engine_class` (an engine core, driven in this process) on the tiny
    qwen3 model, loaded, with .engine (the core), .client (openai) and .http (httpx), both
    sending the app's api_key if it has one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        model_dir = str(tiny_model_factory("qwen3"))
        client = InProcessEngineClient(lambda: engine_class(model=model_dir, **ENGINE_OPTIONS))
        app = create_app(client, [MODEL, "alias"], **app_options)
        srv = ServerThread(app)
        try:
            wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200, 120, "the model did not load")
            srv.engine = client.core
            key = app_options.get("api_key")
            srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key or "none", timeout=60, max_retries=0)
            srv.http = httpx.Client(base_url=srv.url, timeout=60,
                                    headers={} if key is None else {"Authorization": f"Bearer {key}"})
            yield srv
        finally:
            srv.close()


def serve(*argv: str) -> int:
    """`python -m zipage_jax serve ARGV`, in this process (tests patch zipage_jax.commands.serve)."""
    return main(["serve", *argv])


def wait_for(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(0.05)


def wait_healthy(url: str, proc, log_tail, timeout: float) -> None:
    """Until `url`'s /health answers 200; fails with `log_tail()` if the server process `proc` exits,
    and when `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited: {log_tail()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.2)


def metrics(srv) -> dict[str, float]:
    """The /metrics samples, by name with labels stripped (each is unique here)."""
    return parse_metrics(srv.http.get("/metrics").text)


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line.startswith("#") and "le=" not in line and "finished_reason" not in line:
            name, value = re.fullmatch(r"([a-z0-9_:]+)(?:\{.*\})? (\S+)", line).groups()
            samples[name] = float(value)
    return samples


def wait_idle(srv, free_blocks: float | None = None) -> dict[str, float]:
    """The metrics once nothing runs or waits and `free_blocks` (default: all) are free."""
    if free_blocks is None:
        free_blocks = metrics(srv)["zipage:kv_total_blocks"]
    wait_for(lambda: (m := metrics(srv))["zipage:kv_free_blocks"] == free_blocks
             and m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0, 30,
             "blocks were not freed")
    return metrics(srv)


@contextlib.contextmanager
def slow_steps(srv, seconds: float = 0.05):
    """Each engine step sleeps, so a long request is surely still running when the test acts."""
    srv.engine.step_delay = seconds
    try:
        yield
    finally:
        srv.engine.step_delay = 0.0


def sse_events(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data:")]


@contextlib.contextmanager
def bystander(srv, max_tokens: int = 24) -> Iterator[None]:
    """A streaming request in flight throughout the block (steps slowed); afterwards it must
    have completed normally: all its tokens (its usage), finish_reason "length", [DONE], no error.
    (Its tokens come a chunk each while the server keeps up; a chunk carries several when its
    outputs wait for the handler meanwhile, its event loop busy with a large body say:
    server/output_sink.py.)"""
    body = dict(model=MODEL, prompt="bystander", max_tokens=max_tokens, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})
    arrivals: list[tuple[float, str]] = []
    status: list[int] = []
    first = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", f"{srv.url}{COMPLETIONS}", json=body, timeout=60) as r:
                status.append(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        arrivals.append((time.monotonic(), line.removeprefix("data: ")))
                        first.set()
        finally:
            first.set()

    with slow_steps(srv):
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        first.wait(60)
        assert status == [200] and arrivals, f"the bystander did not start: {status}"
        started = time.monotonic()
        yield
        reader.join(60)
    assert not reader.is_alive()
    events = [event for _, event in arrivals]
    assert arrivals[-1][0] > started, "the bystander was not in flight during the block"
    assert events[-1] == "[DONE]", events[-3:]
    *chunks, usage = [json.loads(event) for event in events[:-1]]
    assert all("error" not in c for c in chunks + [usage]), chunks + [usage]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == max_tokens, usage
    assert 0 < len(chunks) <= max_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
