"""`bench soak`'s server: `zipage-jax serve` in a process of its own on a free loopback port, and
what the bench reads of it from outside: /metrics sums, the process tree's RSS, its replicas'
processes (to kill one), and a SIGTERM stop that lets the server drain.

With --data-parallel-size the replicas are Ray actors in worker processes under the server's
local Ray (raylet, a child of the server); their process title starts with REPLICA_TITLE. (The
replicas of a cluster RAY_ADDRESS names run elsewhere: the kill then fails, saying so.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from zipage_jax.harness import log

HEALTH_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0  # beyond the server's own --shutdown-timeout
REPLICA_TITLE = "ray::EngineReplica"


def server_flags(options: dict) -> list[str]:
    """Options as `zipage-jax serve` flags (a bool as --name / --no-name)."""
    flags = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def summed_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition summed by name (over replicas and other labels)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


class SoakServer:
    """The server with `options` (engine and server options by name); started by __enter__ (once
    /health is 200), stopped by __exit__ with SIGTERM, then SIGKILL after `shutdown_timeout_s` +
    STOP_GRACE_S."""

    def __init__(self, options: dict, shutdown_timeout_s: float):
        self.options, self.shutdown_timeout_s = options, shutdown_timeout_s
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.exit_status: int | None = None
        self._log = tempfile.TemporaryFile("w+")

    def __enter__(self) -> SoakServer:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "zipage_jax", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning", *server_flags(self.options)]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        self.url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while not self._healthy():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not healthy in {HEALTH_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        log(f"server ready on {self.url} (pid {self.proc.pid})")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        return False

    def stop(self) -> None:
        """SIGTERM (the server drains what is in flight), SIGKILL if it outlasts its timeout."""
        proc = self.proc
        if proc is None or self.exit_status is not None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.shutdown_timeout_s + STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log("the server outlasted its shutdown timeout: SIGKILL")
                proc.kill()
                proc.wait()
        self.exit_status = proc.returncode

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def metrics(self) -> dict[str, float]:
        return summed_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def wait_idle(self, replicas: int, timeout_s: float = 120.0) -> dict[str, float]:
        """/metrics once no request runs or waits and `replicas` replicas serve (each one's
        figures present); TimeoutError if that does not come within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            serving = m.get("zipage:replica_serving", 1.0 if replicas == 1 else 0.0)
            busy = m.get("vllm:num_requests_running", 1.0) + m.get("vllm:num_requests_waiting", 0.0)
            if busy == 0 and serving == replicas:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not idle with {replicas} replicas serving in {timeout_s:.0f} s "
                                   f"(running + waiting {busy:g}, serving {serving:g})")
            time.sleep(0.5)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss_bytes(self) -> int:
        """The resident memory of the server's process tree (Ray's processes included)."""
        total = 0
        for proc in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_info().rss
        return total

    def replica_pids(self) -> list[int]:
        """The processes of the replica actors, by pid."""
        pids = []
        for proc in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if any(part.startswith(REPLICA_TITLE) for part in proc.cmdline()[:1]):
                    pids.append(proc.pid)
        return sorted(pids)

    def kill_replica(self) -> int:
        """SIGKILLs the first replica's process; its pid (RuntimeError when none is found)."""
        pids = self.replica_pids()
        if not pids:
            raise RuntimeError(f"no process titled {REPLICA_TITLE} under the server")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]
