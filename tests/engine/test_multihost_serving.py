"""`zipage-jax serve` over two processes (tensor parallelism across them, gloo collectives on
CPU): process 0 serves and schedules, process 1 replays its runner's device calls
(engine/runner/step_relay.py).

The relay's framing, follower loop and fault handling run in this process on fake runners; the
served pair runs as real subprocesses, one CPU device each, and its greedy tokens must equal one
process's (full KV, and compressed under a small kv_budget), streamed or not. A follower killed
mid-request makes process 0 fail the requests in flight and exit with status 1; a killed
process 0 ends its follower.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest

from zipage_jax.engine.runner.step_relay import (
    EXIT_STATUS,
    Follower,
    LeaderRelay,
    PeerLost,
    encode,
    recv_message,
    relay_address,
    runner_signature,
    send_message,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37,
           [200, 201]]
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
               dtype="float32", compilation_cache_dir="")
FULL_TOKENS, COMPRESSED_TOKENS, KV_BUDGET = 24, 60, 32
STARTUP_S = 600  # two processes loading and (with a warm-up) compiling on a small CI machine
EXIT_BOUND_S = 60  # how soon a broken group must have exited


# -- the relay in this process, on fake runners -------------------------------------------------


@dataclass
class FakeConfig:
    tensor_parallel_size: int = 2
    max_num_seqs: int = 8


class Step(NamedTuple):
    tokens: np.ndarray
    slots: np.ndarray


class FakeRunner:
    """What the relay reads of a runner (config, pool, model config), recording the calls it gets."""

    def __init__(self, config: FakeConfig | None = None, fail: str | None = None):
        self.config, self.pool, self.model_config = config or FakeConfig(), "pool(64 blocks)", "model(2 layers)"
        self.relay = None
        self.calls: list[tuple] = []
        self._fail = fail

    def _record(self, name, *args):
        if name == self._fail:
            raise RuntimeError("boom")
        self.calls.append((name, *args))

    def run_forward(self, key, step, prompt_targets):
        self._record("run_forward", key, step, prompt_targets)

    def run_compaction(self, key, tables):
        self._record("run_compaction", key, tables)

    def reset_state(self):
        self._record("reset_state")


class Lost:
    """on_lost and hard_exit of a LeaderRelay under test."""

    def __init__(self):
        self.reasons: list[str] = []
        self.exits: list[int] = []
        self.exited = threading.Event()

    def on_lost(self, reason: str) -> None:
        self.reasons.append(reason)

    def hard_exit(self, status: int) -> None:
        self.exits.append(status)
        self.exited.set()


def _leader(lost: Lost, num_followers: int = 1) -> LeaderRelay:
    return LeaderRelay("127.0.0.1", 0, num_followers, lost.on_lost, exit_grace_s=0.05, hard_exit=lost.hard_exit)


def _follow_in_thread(runner: FakeRunner, relay: LeaderRelay, process_id: int = 1) -> dict:
    result: dict = {}

    def run() -> None:
        follower = Follower(runner, relay.address, process_id)
        result["status"] = follower.run(follower.connect(timeout_s=10))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def test_messages_round_trip_and_a_closed_connection_is_eof():
    a, b = socket.socketpair()
    with a, b:
        step = Step(np.arange(6, dtype=np.int32).reshape(2, 3), np.full(2, -1, np.int32))
        send_message(a, ("run_forward", (("decode rows", 2), step, np.zeros((2, 1), np.int32))))
        method, (key, got, targets) = recv_message(b)
        assert (method, key, type(got)) == ("run_forward", ("decode rows", 2), Step)
        np.testing.assert_array_equal(got.tokens, step.tokens)
        assert got.tokens.dtype == np.int32 and targets.shape == (2, 1)
        frame = encode("a message cut short")
        a.sendall(frame[:len(frame) - 3])
        a.close()
        with pytest.raises(EOFError):
            recv_message(b)


def test_relay_address_is_the_coordinators_host_and_next_port_unless_given():
    assert relay_address("10.1.2.3:1234") == ("10.1.2.3", 1235)
    assert relay_address("[::1]:1234", 4000) == ("::1", 4000)
    assert relay_address("node-0:8476") == ("node-0", 8477)
    for bad in ("1234", "host:", ":1234"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            relay_address(bad)
    with pytest.raises(ValueError, match="--coordinator-address"):
        relay_address(None)
    with pytest.raises(ValueError, match="relay port"):
        relay_address("host:65535")


def test_follower_replays_every_call_in_order_then_stops_cleanly():
    lost = Lost()
    relay, leader, follower = _leader(lost), FakeRunner(), FakeRunner()
    followed = _follow_in_thread(follower, relay)
    relay.attach(leader, timeout_s=10)
    assert leader.relay is relay
    step = Step(np.array([[1, 2, 3]], np.int32), np.array([7], np.int32))
    relay.publish("run_forward", (("prefill rows", 1), step, np.full((1, 3), -1, np.int32)))
    relay.publish("run_compaction", (("batch", 1, "blocks", 2), {"tables": np.ones((1, 2), np.int32)}))
    relay.publish("reset_state", ())
    relay.close()
    followed["thread"].join(10)
    assert followed["status"] == 0 and not lost.reasons and not lost.exits
    assert [c[0] for c in follower.calls] == ["run_forward", "run_compaction", "reset_state"]
    np.testing.assert_array_equal(follower.calls[0][2].tokens, step.tokens)
    np.testing.assert_array_equal(follower.calls[1][2]["tables"], np.ones((1, 2), np.int32))


def test_a_lost_follower_fails_publish_calls_on_lost_and_exits_after_the_grace():
    lost = Lost()
    relay = _leader(lost)
    sock = socket.create_connection(relay.address)
    send_message(sock, (1, runner_signature(FakeRunner())))
    relay.attach(FakeRunner(), timeout_s=10)
    sock.close()  # the follower dies
    assert lost.exited.wait(10)
    assert lost.exits == [EXIT_STATUS] == [1]
    assert len(lost.reasons) == 1 and "process 1" in lost.reasons[0] and "closed" in lost.reasons[0]
    with pytest.raises(PeerLost, match="process 1"):
        relay.publish("reset_state", ())


def test_a_follower_whose_call_fails_says_why_and_exits_non_zero():
    lost = Lost()
    relay = _leader(lost)
    followed = _follow_in_thread(FakeRunner(fail="reset_state"), relay)
    relay.attach(FakeRunner(), timeout_s=10)
    relay.publish("reset_state", ())
    followed["thread"].join(10)
    assert followed["status"] == EXIT_STATUS
    assert lost.exited.wait(10)
    assert lost.reasons == ["process 1 failed: reset_state: RuntimeError: boom"]


def test_a_follower_refuses_a_call_that_is_not_relayed():
    lost = Lost()
    relay = _leader(lost)
    followed = _follow_in_thread(FakeRunner(), relay)
    relay.attach(FakeRunner(), timeout_s=10)
    relay.publish("__init__", ())
    followed["thread"].join(10)
    assert followed["status"] == EXIT_STATUS
    assert lost.exited.wait(10)
    assert "'__init__' is not a relayed runner call" in lost.reasons[0]


def test_a_follower_with_other_options_is_refused_by_name():
    lost = Lost()
    relay = _leader(lost)
    followed = _follow_in_thread(FakeRunner(FakeConfig(max_num_seqs=16)), relay)
    with pytest.raises(ValueError, match=r"process 1 built a different engine than process 0 \(max_num_seqs differ\)"):
        relay.attach(FakeRunner(), timeout_s=10)
    followed["thread"].join(10)
    assert followed["status"] == EXIT_STATUS  # its connection closed


def test_a_process_id_that_is_not_awaited_is_refused():
    relay = _leader(Lost())
    sock = socket.create_connection(relay.address)
    send_message(sock, (3, runner_signature(FakeRunner())))
    with pytest.raises(ValueError, match=r"process 3 connected to the relay, which waits for process\(es\) 1"):
        relay.attach(FakeRunner(), timeout_s=10)
    sock.close()


def test_process_0_waits_for_its_followers_a_bounded_time():
    relay = _leader(Lost(), num_followers=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"process\(es\) 1, 2 did not connect to the relay at 127\.0\.0\.1:\d+"):
        relay.attach(FakeRunner(), timeout_s=0.3)
    assert time.monotonic() - started < 5


class RecordingRelay:
    """Process 0's relay as a follower would receive it: every published call, pickled."""

    def __init__(self):
        self.frames: list[bytes] = []

    def publish(self, method: str, args: tuple) -> None:
        self.frames.append(encode((method, args)))


@pytest.mark.slow
def test_a_replayed_runner_ends_in_process_0s_device_state(model, cache_dir):
    """The relayed calls are all a runner needs: a second runner replaying a single-process
    engine's calls through the follower loop (a reset, full KV, compressed, a penalised
    prefix-cache hit that seeds its history) ends with a bit-identical KV pool and sampler state."""
    import jax

    from zipage_jax import LLM, SamplingParams
    from zipage_jax.engine.runner.model_runner import ModelRunner

    llm = LLM(str(model), **{**OPTIONS, "compilation_cache_dir": None})
    engine, relay = llm.engine, RecordingRelay()
    engine.core.runner.relay = relay
    engine.core.runner.reset_state()
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=COMPRESSED_TOKENS, kv_budget=KV_BUDGET, **greedy),
                               SamplingParams(max_tokens=12, **greedy)], use_tqdm=False)
    penalised = SamplingParams(max_tokens=4, repetition_penalty=1.3, **greedy)
    for _ in range(2):  # the second time a prefix-cache hit: its history is seeded
        llm.generate([PROMPTS[0] * 2], penalised, use_tqdm=False)
    methods = [recv_message(_frame_reader(frame))[0] for frame in relay.frames]
    assert {"run_forward", "run_compaction", "run_seed", "reset_state", "prefetch_decode"} <= set(methods)
    assert engine.stats.num_compressions > 0

    twin = ModelRunner(engine.core.loaded, engine.config, engine.core.pool, eos_token_ids=engine.core.eos_token_ids)
    leader_end, follower_end = socket.socketpair()
    with leader_end, follower_end:
        sender = threading.Thread(target=lambda: leader_end.sendall(b"".join(relay.frames) + encode(("stop", ()))))
        sender.start()
        assert Follower(twin, ("unused", 0), 1).run(follower_end) == 0
        sender.join()
    for mine, replayed in zip(jax.tree.leaves(jax.device_get(engine.core.runner.state)),
                              jax.tree.leaves(jax.device_get(twin.state)), strict=True):
        np.testing.assert_array_equal(mine, replayed)


def _frame_reader(frame: bytes) -> socket.socket:
    a, b = socket.socketpair()
    a.sendall(frame)
    a.close()
    return b


# -- two served processes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir: Path) -> dict:
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(cache_dir), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


class Group:
    """`zipage-jax serve` as processes 0 and 1 of a jax.distributed group, their output in files."""

    def __init__(self, model: Path, cache_dir: Path, logs: Path, *extra: str):
        self.http = f"http://127.0.0.1:{_free_port()}"
        coordinator = f"127.0.0.1:{_free_port()}"
        cli = [sys.executable, "-m", "zipage_jax", "serve", "--model", str(model), "--port", self.http.rsplit(":")[-1],
               "--tensor-parallel-size", "2", "--num-processes", "2", "--coordinator-address", coordinator,
               "--relay-port", str(_free_port()), *_flags(OPTIONS), *extra]
        self.logs = [logs / f"process{i}.log" for i in range(2)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen([*cli, "--process-id", str(i)], env=_env(cache_dir), cwd=ROOT,
                                                   stdout=out, stderr=subprocess.STDOUT))

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.procs):
                assert proc.poll() is None, f"process {i} exited ({proc.returncode}):\n{self.log(i)[-4000:]}"
            try:
                if httpx.get(self.http + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise AssertionError(f"not healthy within {STARTUP_S} s:\n{self.log(0)[-4000:]}")

    def wait_exit(self, i: int, timeout: float) -> int:
        try:
            return self.procs[i].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {i} still runs {timeout} s on:\n{self.log(i)[-4000:]}") from None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _flags(options: dict) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]


@pytest.fixture(scope="module")
def cache_dir(model_cache_dir) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        yield model_cache_dir


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    """6 query / 2 kv heads (head_dim 16) with q/k/v biases: splits over 2 devices."""
    return tiny_model_factory("qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model, cache_dir) -> dict:
    """One process's (one device's) greedy texts and log-probabilities, full KV and compressed.
    It also fills the parameter cache the served processes read (several processes do not write it)."""
    from zipage_jax import LLM, SamplingParams

    llm = LLM(str(model), **OPTIONS)
    full = SamplingParams(temperature=0, max_tokens=FULL_TOKENS, ignore_eos=True, logprobs=1)
    compressed = SamplingParams(temperature=0, max_tokens=COMPRESSED_TOKENS, ignore_eos=True, logprobs=1,
                                kv_budget=KV_BUDGET)
    before = llm.engine.stats.num_compressions
    results = {"full": llm.generate(PROMPTS, full, use_tqdm=False),
               "compressed": llm.generate(PROMPTS[:2], compressed, use_tqdm=False)}
    results["compressions"] = llm.engine.stats.num_compressions - before
    assert results["compressions"] > 0
    return results


def _completion(group: Group, prompts: list[list[int]], max_tokens: int, **extra) -> list[dict]:
    body = {"model": "m", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}
    response = httpx.post(group.http + "/v1/completions", json=body, timeout=STARTUP_S)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda c: c["index"])


def _stream(group: Group, prompt: list[int], max_tokens: int, on_event=None, timeout: float = STARTUP_S) -> list:
    """The SSE events' bodies (dicts), then "[DONE]"."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", group.http + "/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if on_event is not None:
                    on_event(events)
    return events


def _assert_same(choices: list[dict], expected: list[dict]) -> None:
    assert [c["text"] for c in choices] == [r["text"] for r in expected]
    for choice, result in zip(choices, expected):
        served = choice["logprobs"]["token_logprobs"]
        one = [lp["logprob"] for lp in result["logprobs"]]
        assert len(served) == len(one) == len(result["token_ids"])
        np.testing.assert_allclose(served, one, atol=1e-4)  # the same tokens: their log-probabilities agree


def _compressions(group: Group) -> float:
    metrics = httpx.get(group.http + "/metrics", timeout=30).text
    return float(re.search(r"^zipage:compressions_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))


@pytest.fixture
def group_factory(model, cache_dir, reference, tmp_path):
    groups = []

    def start(*extra: str) -> Group:
        group = Group(model, cache_dir, tmp_path, "--served-model-name", "m", *extra)
        groups.append(group)
        group.wait_healthy()
        return group

    yield start
    for group in groups:
        group.stop()


@pytest.mark.slow
def test_two_processes_serve_one_processs_greedy_tokens_full_and_compressed(group_factory, reference):
    group = group_factory()  # warming up in the background, the follower too
    _assert_same(_completion(group, PROMPTS, FULL_TOKENS), reference["full"])
    events = _stream(group, PROMPTS[0], FULL_TOKENS)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == reference["full"][0]["text"]
    _assert_same(_completion(group, PROMPTS[:2], COMPRESSED_TOKENS, kv_budget=KV_BUDGET), reference["compressed"])
    assert _compressions(group) == reference["compressions"]
    group.procs[0].send_signal(signal.SIGTERM)  # a clean stop: the follower is told and exits 0
    assert group.wait_exit(0, EXIT_BOUND_S) == -signal.SIGTERM  # uvicorn ends by raising it again
    assert group.wait_exit(1, EXIT_BOUND_S) == 0


@pytest.mark.slow
def test_a_killed_follower_fails_the_requests_in_flight_and_process_0_exits(group_factory):
    group = group_factory("--no-warmup")
    _completion(group, PROMPTS[:2], 8)  # the prefill and decode programs compile now, not during the kill
    streamed_some = threading.Event()
    stream: dict = {}

    def read_stream() -> None:
        try:
            stream["events"] = _stream(group, PROMPTS[1], 400, lambda events: len(events) > 3 and streamed_some.set(),
                                       timeout=EXIT_BOUND_S)
        except Exception as exc:  # noqa: BLE001 - asserted below
            stream["error"] = exc

    whole: dict = {}

    def post_whole() -> None:
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        try:
            whole["response"] = httpx.post(group.http + "/v1/completions", json=body, timeout=EXIT_BOUND_S)
        except Exception as exc:  # noqa: BLE001 - asserted below
            whole["error"] = exc

    threads = [threading.Thread(target=read_stream), threading.Thread(target=post_whole)]
    for thread in threads:
        thread.start()
    assert streamed_some.wait(EXIT_BOUND_S), group.log(0)[-4000:]
    group.procs[1].kill()
    killed = time.monotonic()
    assert group.wait_exit(0, EXIT_BOUND_S) == 1
    exited_after = time.monotonic() - killed
    for thread in threads:
        thread.join(EXIT_BOUND_S)
    assert "error" not in stream, stream.get("error")
    events = stream["events"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events[-3:]
    assert len(events) < 400  # it ended early
    assert "error" not in whole, whole.get("error")
    assert whole["response"].status_code == 500, whole["response"].text
    assert re.search(r"relay: the connection to process 1 closed .*failing the requests in flight", group.log(0))
    assert exited_after < EXIT_BOUND_S


@pytest.mark.slow
def test_a_killed_process_0_ends_its_follower(group_factory):
    group = group_factory("--no-warmup")
    group.procs[0].kill()
    assert group.wait_exit(1, EXIT_BOUND_S) != 0
