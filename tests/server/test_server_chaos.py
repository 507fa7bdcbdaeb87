"""A bounded chaos run: mixed streaming load with random disconnects against a server process,
one device failure injected inside a real compiled call in the middle, then SIGTERM. Every
request completes exactly (greedy text equal to an offline engine's) or gets a clean OpenAI
error, no KV block leaks, and the server serves correctly after the failure."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import CHAT, COMPLETIONS, ENGINE_OPTIONS, MODEL, USER, parse_metrics, wait_healthy

from zipage_jax import LLM
from zipage_jax.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
DURATION_S = 90
CLIENTS = 6
FAIL_AT = 120  # forward call with the injected failure: about a third into the run
PROMPTS = [[(13 * i + 7 * j) % 300 + 3 for j in range(4 + 5 * i)] for i in range(6)]
LENGTHS = (4, 12, 24)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def expected(tiny_model_factory) -> dict[tuple[int, int], str]:
    """(prompt index, max_tokens) -> the offline engine's greedy text."""
    llm = LLM(str(tiny_model_factory("qwen3")), **ENGINE_OPTIONS)
    out = {}
    for n in LENGTHS:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for i, result in enumerate(llm.generate(PROMPTS, params, use_tqdm=False)):
            out[i, n] = result["text"]
    return out


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


class Client(threading.Thread):
    """Sends random requests until `stop`; records each outcome."""

    def __init__(self, url: str, seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.rng, self.stop = url, random.Random(seed), stop
        self.exact: list[tuple[tuple[int, int], str]] = []  # (key, text) of completed greedy requests
        self.errors: list[dict] = []  # clean OpenAI errors
        self.bad: list[str] = []  # anything else
        self.disconnects = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                try:
                    self.one(http)
                except httpx.HTTPError as exc:
                    self.bad.append(f"transport: {exc!r}")

    def one(self, http: httpx.Client) -> None:
        i, n = self.rng.randrange(len(PROMPTS)), self.rng.choice(LENGTHS)
        kind = self.rng.random()
        if kind < 0.15:  # chat noise: sampled, n = 2, logprobs; checked for a clean finish only
            body = {"model": MODEL, "messages": USER, "max_tokens": n, "n": 2, "logprobs": True, "top_logprobs": 3,
                    "temperature": 1.0, "stream": True}
            self.stream(http, CHAT, body, None)
            return
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if kind < 0.65:
            self.stream(http, COMPLETIONS, {**body, "stream": True}, (i, n))
        else:
            r = http.post(COMPLETIONS, json=body)
            self.record(r.status_code, r.text, (i, n), lambda: r.json()["choices"][0]["text"])

    def stream(self, http: httpx.Client, path: str, body: dict, key: tuple[int, int] | None) -> None:
        cut = self.rng.randrange(1, 6) if self.rng.random() < 0.25 else None  # disconnect after `cut` events
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.record(r.status_code, r.read().decode(), key, None)
                return
            events, texts = 0, []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                    return
                events += 1
                if key is not None:
                    texts.append(event["choices"][0]["text"])
                if cut is not None and events >= cut:
                    self.disconnects += 1
                    return  # closing the stream disconnects
            else:
                self.bad.append(f"stream ended without [DONE]: {body}")
                return
        if key is not None:
            self.exact.append((key, "".join(texts)))

    def record(self, status: int, text: str, key, get_text) -> None:
        if status == 200:
            self.exact.append((key, get_text()))
            return
        try:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"]
        except (ValueError, KeyError, AssertionError, TypeError):
            self.bad.append(f"{status}: {text[:200]}")
            return
        self.errors.append(error)


def test_chaos_then_sigterm(tiny_model_factory, model_cache_dir, expected, tmp_path):
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
           "ZIPAGE_JAX_CACHE": str(model_cache_dir)}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, str(HERE / "chaos_server.py"), str(tiny_model_factory("qwen3")),
                             str(port), str(FAIL_AT)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, proc, lambda: (tmp_path / "server.log").read_text()[-3000:], 300)
        total = _metrics(url)["zipage:kv_total_blocks"]
        stop = threading.Event()
        clients = [Client(url, seed, stop) for seed in range(CLIENTS)]
        for c in clients:
            c.start()
        time.sleep(DURATION_S)
        stop.set()
        for c in clients:
            c.join(180)
        assert not any(c.is_alive() for c in clients)
        bad = [b for c in clients for b in c.bad]
        assert bad == []
        exact = [e for c in clients for e in c.exact]
        wrong = [(key, text) for key, text in exact if text != expected[key]]
        assert wrong == [] and len(exact) > 50
        metrics = _metrics(url)
        assert metrics["zipage:engine_recoveries_total"] == 1  # the failure happened, mid-run
        deadline = time.monotonic() + 60
        while (m := _metrics(url))["zipage:kv_free_blocks"] != total or m["vllm:num_requests_running"]:
            assert time.monotonic() < deadline, f"blocks leaked: {m['zipage:kv_free_blocks']} of {total} free"
            time.sleep(0.2)
        after = httpx.post(f"{url}{COMPLETIONS}", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert after.json()["choices"][0]["text"] == expected[3, 24]
        # SIGTERM with a stream in flight: the stream ends, uvicorn shuts down gracefully and
        # the process ends by the signal it re-raises (uvicorn's exit status for SIGTERM)
        ended = threading.Event()

        def long_stream() -> None:
            try:
                with httpx.stream("POST", f"{url}{COMPLETIONS}", timeout=120, json={
                        "model": MODEL, "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass
            ended.set()

        threading.Thread(target=long_stream, daemon=True).start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert ended.wait(30)
        assert "Finished server process" in (tmp_path / "server.log").read_text()
        print(f"chaos: {len(exact)} exact, {sum(len(c.errors) for c in clients)} clean errors, "
              f"{sum(c.disconnects for c in clients)} disconnects")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
