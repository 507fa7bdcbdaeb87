"""A replica's process killed in the middle of a workload (two replicas on Ray behind the HTTP
server, the tiny qwen3 model): every greedy request completes as without the fault, a stream
that samples without a seed completes or ends with an error event, nothing hangs, /health stays
200, and the replica comes back and serves again. With every replica killed, /health is 503 and
a request fails once it has waited no_replica_timeout_s, until they are back."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import httpx
import pytest
from replicated_harness import replicated_server
from server_harness import COMPLETIONS, MODEL, sse_events, wait_for
from test_replicated_serving import labelled

pytestmark = pytest.mark.slow  # Ray, two replicas and a restart: about a minute

MAX_TOKENS = 400
GREEDY_PROMPTS = [[7 + i, 60 + 5 * i, 33, 101 + i] * (3 + i % 3) for i in range(8)]  # even: streamed
SAMPLED_PROMPTS = [[200 + i, 9, 150] * 4 for i in range(2)]  # streamed, temperature 1, no seed
NO_REPLICA_TIMEOUT_S = 1.0  # shorter than any restart: a process alone takes longer to start


@pytest.fixture(scope="module")
def dp_server(ray_instance, tiny_model_factory, model_cache_dir):
    # the tiny model's whole context: long enough for the kill to land mid-request
    with replicated_server(tiny_model_factory, model_cache_dir, data_parallel_size=2,
                           no_replica_timeout_s=NO_REPLICA_TIMEOUT_S, max_model_len=512) as srv:
        yield srv


class Client(threading.Thread):
    """One completion request; `result`: ("ok", text), ("error", text so far) or ("http", status)."""

    def __init__(self, url: str, prompt: list[int], stream: bool, temperature: float = 0.0):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.body = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=temperature,
                         ignore_eos=True, stream=stream)
        self.result: tuple[str, object] | None = None

    def run(self) -> None:
        if self.stream:
            self.result = self._streamed()
        else:
            r = httpx.post(f"{self.url}{COMPLETIONS}", json=self.body, timeout=120)
            self.result = ("ok", r.json()["choices"][0]["text"]) if r.status_code == 200 else ("http", r.status_code)

    def _streamed(self) -> tuple[str, object]:
        text = []
        with httpx.stream("POST", f"{self.url}{COMPLETIONS}", json=self.body, timeout=120) as r:
            if r.status_code != 200:
                return "http", r.status_code
            events = []
            for event in sse_events(r.iter_lines()):
                events.append(event)
                if event != "[DONE]":
                    body = json.loads(event)
                    if "error" in body:
                        return "error", "".join(text)
                    text.append(body["choices"][0]["text"])
        assert events[-1] == "[DONE]"
        return "ok", "".join(text)


def run_clients(url: str, prompts, stream_every: int = 2) -> list[Client]:
    clients = [Client(url, p, stream=i % stream_every == 0) for i, p in enumerate(prompts)]
    for c in clients:
        c.start()
    return clients


def test_a_killed_replica_costs_no_greedy_request_and_comes_back(dp_server, caplog):
    caplog.set_level(logging.INFO, logger="zipage_jax.data_parallel")
    url = dp_server.url
    reference = run_clients(url, GREEDY_PROMPTS)
    sampled = [Client(url, p, stream=True, temperature=1.0) for p in SAMPLED_PROMPTS]  # their programs compile here
    for c in sampled:
        c.start()
    for c in reference + sampled:
        c.join(120)
    expected = [c.result for c in reference]
    assert all(kind == "ok" for kind, _ in expected), expected

    health: list[int] = []
    done = threading.Event()

    def watch_health() -> None:
        while not done.is_set():
            health.append(httpx.get(f"{url}/health", timeout=10).status_code)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    before = labelled(dp_server.http.get("/metrics").text, "vllm:generation_tokens_total")["0"]
    greedy = run_clients(url, GREEDY_PROMPTS)
    sampled = [Client(url, p, stream=True, temperature=1.0) for p in SAMPLED_PROMPTS]
    for c in sampled:
        c.start()
    victim = 0

    def under_way() -> bool:  # the victim runs several requests, which have produced tokens
        text = dp_server.http.get("/metrics").text
        running = labelled(text, "vllm:num_requests_running")[str(victim)]
        return running >= 3 and labelled(text, "vllm:generation_tokens_total")[str(victim)] >= before + 3 * running

    wait_for(under_way, 60, "the replica did not take its share of the requests")
    old_pid = dp_server.engine.replica_pids()[victim]
    os.kill(old_pid, signal.SIGKILL)

    for c in greedy + sampled:
        c.join(120)
    assert not any(c.is_alive() for c in greedy + sampled), "a request hung"
    assert [c.result for c in greedy] == expected  # streamed or not, as without the fault
    assert all(c.result[0] in ("ok", "error") for c in sampled), [c.result for c in sampled]
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replica ")]
    assert len(lost) >= 1 and lost[0].startswith(f"replica {victim} (pid {old_pid}) was lost"), caplog.text
    assert ", 0 run again on another replica" not in lost[0], lost[0]
    replayed = [r.getMessage() for r in caplog.records if "runs again; what it delivered" in r.getMessage()]
    assert replayed, caplog.text  # some request ran again after its first tokens had reached the server

    wait_for(lambda: labelled(dp_server.http.get("/metrics").text, "zipage:replica_serving")[str(victim)] == 1,
             120, "the replica did not come back")
    done.set()
    watcher.join(10)
    assert health and set(health) == {200}, health
    assert dp_server.engine.replica_pids()[victim] != old_pid
    for c in run_clients(url, GREEDY_PROMPTS[:2], stream_every=3):  # ties go round: one reaches the victim
        c.join(120)
        assert c.result == expected[GREEDY_PROMPTS.index(c.body["prompt"])]
    generated = labelled(dp_server.http.get("/metrics").text, "vllm:generation_tokens_total")
    assert generated[str(victim)] > 0, generated  # its counters started again from 0


def test_with_no_replica_serving_health_is_503_and_requests_fail_after_the_timeout(dp_server):
    for pid in dp_server.engine.replica_pids():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: dp_server.http.get("/health").status_code == 503, 30, "/health did not notice")
    assert "no replica serves" in dp_server.http.get("/health").json()["error"]["message"]
    start = time.monotonic()
    r = dp_server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0))
    assert r.status_code == 500 and "the server failed to process the request" in r.json()["error"]["message"]
    assert time.monotonic() - start < NO_REPLICA_TIMEOUT_S + 10
    wait_for(lambda: dp_server.http.get("/health").status_code == 200, 120, "the replicas did not come back")
    r = dp_server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
