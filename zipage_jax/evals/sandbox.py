"""Runs untrusted Python (generated code and its tests) in a separate, limited process.

Each program runs in its own interpreter (`python -I`, an empty temporary working directory, no
stdin, a minimal environment, its own process group) under resource limits: CPU seconds, address
space, file size and process count, and a wall-clock timeout after which the whole group is
killed. Whatever the program does (raise, loop, allocate, fork, exit), the caller gets a
`RunResult`; only a failure to start the interpreter itself raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall-clock seconds before the process group is killed
    cpu_s: int = 5  # RLIMIT_CPU
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the program may write
    processes: int = 64  # RLIMIT_NPROC (per user, so generous; stops a fork bomb)


@dataclass(frozen=True)
class RunResult:
    status: str  # "passed" (exit 0), "failed" (non-zero exit), "timeout" (killed at wall_s)
    returncode: int | None
    stderr_tail: str  # the last lines the program wrote to stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, limits: Limits = Limits()) -> RunResult:
    """Runs `source` as a script in a fresh, limited interpreter; exit status 0 is a pass."""
    with tempfile.TemporaryDirectory(prefix="zipage-sandbox-") as work:
        path = os.path.join(work, "program.py")
        with open(path, "w") as f:
            f.write(source)
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "HOME": work, "TMPDIR": work}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _LAUNCHER, path, *map(str, _rlimits(limits))],
                                cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            _, err = proc.communicate()
            return RunResult("timeout", None, _tail(err))
        finally:
            _kill_group(proc)  # children it left behind
        return RunResult("passed" if proc.returncode == 0 else "failed", proc.returncode, _tail(err))


# Sets the limits (soft = hard, so the program cannot raise them), then becomes the program's
# interpreter: limits survive exec, and no code runs between fork and exec in the (threaded) caller.
_LAUNCHER = """
import os, resource, sys
path, *values = sys.argv[1:]
for name, value in zip(("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_CORE"), values):
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
os.execv(sys.executable, [sys.executable, "-I", path])
"""


def _rlimits(limits: Limits) -> tuple[int, ...]:
    return limits.cpu_s, limits.memory_bytes, limits.file_bytes, limits.processes, 0


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(stderr: bytes, lines: int = 5) -> str:
    return "\n".join(stderr.decode(errors="replace").splitlines()[-lines:])
