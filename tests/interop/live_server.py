"""A live `python -m zipage_jax serve` process on a tiny model, for the third-party clients' tests."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
SERVER_FLAGS = ["--kvcache-block-size", "16", "--num-kvcache-blocks", "512", "--max-num-seqs", "8",
                "--max-model-len", "512", "--max-num-batched-tokens", "256", "--max-cache-blocks-per-seq", "8"]


@dataclass
class LiveServer:
    url: str
    model_dir: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, work: Path) -> Iterator[LiveServer]:
    """`zipage-jax serve` serving `model_dir` as MODEL with a KV budget (compression on), until the block exits."""
    port = _free_port()
    log = work / "server.log"
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(work / "cache")}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "zipage_jax", "serve", "--model", str(model_dir),
                                 "--served-model-name", MODEL, "--port", str(port), "--log-level", "info",
                                 *SERVER_FLAGS], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = LiveServer(f"http://127.0.0.1:{port}", model_dir, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_text()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not become healthy:\n{server.log_text()[-3000:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_errors(server: LiveServer) -> list[str]:
    """uvicorn's access-log lines of API requests answered 4xx or 5xx (/health is 503 while the
    model loads)."""
    return [line for line in server.log_text().splitlines() if re.search(r'"[A-Z]+ /v1/\S* HTTP/1\.1" [45]\d\d', line)]
