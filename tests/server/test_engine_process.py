"""`zipage-jax serve` as users run it: the engine core in a process of its own behind the HTTP
server's process. Its outputs equal an offline engine's (streamed, whole, with stop strings);
a client that goes away frees its sequence; a bad request is a 400; and when the core's process
dies, the requests in flight end with an error and the server exits with status 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import COMPLETIONS, ENGINE_OPTIONS, MODEL, parse_metrics, wait_for, wait_healthy

from zipage_jax import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the quick brown fox", "once upon a time", "hello world, this is"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """`python -m zipage_jax serve` of the tiny qwen3 model on a free port, with `extra` flags."""

    def __init__(self, model_dir: Path, cache: Path, *extra: str):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = [arg for name, value in ENGINE_OPTIONS.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
        env = {**os.environ, "ZIPAGE_JAX_CACHE": str(cache)}
        self.proc = subprocess.Popen([sys.executable, "-m", "zipage_jax", "serve", "--model", str(model_dir),
                                      "--served-model-name", MODEL, "--port", str(self.port), "--no-warmup",
                                      "--log-level", "warning", *flags, *extra], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_healthy(self.url, self.proc, lambda: self.proc.stderr.read()[-3000:], 180)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=60, max_retries=0)

    def core_pid(self) -> int:
        """The engine core process: the server process's child running zipage_jax.engine.core_process."""
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and "zipage_jax.engine.core_process" in cmdline:
                return int(entry.name)
        raise AssertionError("no engine core process under the server")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def served(model_dir, model_cache_dir):
    srv = Served(model_dir, model_cache_dir)
    core = srv.core_pid()
    yield srv
    assert srv.stop() == 0  # SIGTERM drains the server, which exits 0
    assert not Path(f"/proc/{core}").exists() or "Z" in Path(f"/proc/{core}/stat").read_text().split()[2], \
        "the engine core outlived its server"


@pytest.fixture(scope="module")
def offline(model_dir, model_cache_dir, monkeypatch_module) -> LLM:
    return LLM(str(model_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def monkeypatch_module(model_cache_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        yield mp


def test_the_core_runs_in_its_own_process_and_serves_what_an_offline_engine_computes(served, offline):
    core = served.core_pid()
    assert core != served.proc.pid and served.proc.poll() is None
    params = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    want = [r["text"] for r in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                                 use_tqdm=False)]
    whole = served.client.completions.create(model=MODEL, prompt=PROMPTS, **params)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
    assert whole.usage.completion_tokens == 3 * 24
    for prompt, text in zip(PROMPTS, want):
        chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, stream=True, **params))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    stop = want[0][5:9]
    cut = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], **params)
    assert cut.choices[0].text == want[0][:want[0].index(stop)] and cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="max_tokens|context length"):
        served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10**6)
    m = served.metrics()
    assert m["vllm:generation_tokens_total"] >= 5 * 24 and m["vllm:num_requests_running"] == 0


def test_a_client_that_goes_away_frees_its_sequence(served):
    body = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{served.url}{COMPLETIONS}", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(3)) if line.startswith("data:")) >= 1
    total = served.metrics()["zipage:kv_total_blocks"]
    wait_for(lambda: (m := served.metrics())["vllm:num_requests_running"] == 0
             and m["zipage:kv_free_blocks"] == total, 30, "the aborted request kept its blocks")


@pytest.mark.slow
def test_when_the_core_process_dies_requests_fail_cleanly_and_the_server_exits_1(model_dir, model_cache_dir):
    srv = Served(model_dir, model_cache_dir)
    try:
        body = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=200, temperature=0, ignore_eos=True, stream=True)
        events = []
        with httpx.stream("POST", f"{srv.url}{COMPLETIONS}", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        os.kill(srv.core_pid(), signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["type"] == "server_error" and "failed to process" in error["error"]["message"]
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
