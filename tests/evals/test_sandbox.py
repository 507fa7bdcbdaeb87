"""The sandbox: generated code runs in its own limited process; whatever it does, the caller gets a result."""

from __future__ import annotations

import os
import time

import pytest

from zipage_jax.evals.sandbox import Limits, run_program

FAST = Limits(wall_s=5.0, cpu_s=2, memory_bytes=512 << 20)


def test_exit_status_decides():
    assert run_program("assert 1 + 1 == 2\n", FAST).status == "passed"
    failed = run_program("def f():\n    raise ValueError('wrong answer')\nf()\n", FAST)
    assert failed.status == "failed" and failed.returncode == 1 and "ValueError: wrong answer" in failed.stderr_tail
    assert run_program("raise SystemExit(3)\n", FAST).returncode == 3
    assert run_program("def broken(:\n", FAST).status == "failed"  # a syntax error is a failed answer


def test_cpu_limit_kills_a_busy_loop():
    start = time.perf_counter()
    result = run_program("while True:\n    pass\n", Limits(wall_s=30.0, cpu_s=1))
    assert result.status == "failed" and result.returncode < 0  # killed by SIGXCPU / SIGKILL, not the wall clock
    assert time.perf_counter() - start < 10


def test_wall_clock_kills_a_sleeper_and_its_children():
    start = time.perf_counter()
    source = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n" \
             "time.sleep(60)\n"
    result = run_program(source, Limits(wall_s=1.5, cpu_s=5))
    assert result.status == "timeout" and result.returncode is None
    assert time.perf_counter() - start < 10


def test_memory_limit():
    result = run_program("x = bytearray(2 << 30)\n", FAST)
    assert result.status == "failed" and "MemoryError" in result.stderr_tail


def test_limits_cannot_be_raised_and_the_environment_is_bare():
    source = ("import os, resource, sys\n"
              "soft, hard = resource.getrlimit(resource.RLIMIT_CPU)\n"
              "assert soft == hard == 2, (soft, hard)\n"
              "assert resource.getrlimit(resource.RLIMIT_AS)[1] == 512 << 20\n"
              "assert 'SECRET_FOR_TEST' not in os.environ\n"
              "assert sys.flags.isolated\n"
              "assert os.listdir('.') == ['program.py'], os.listdir('.')\n")
    os.environ["SECRET_FOR_TEST"] = "1"
    try:
        result = run_program(source, FAST)
    finally:
        del os.environ["SECRET_FOR_TEST"]
    assert result.passed, result.stderr_tail


@pytest.mark.parametrize("source", ["import os\nos._exit(0)\n", "print('x' * 10_000_000)\n"])
def test_odd_but_passing_programs(source):
    assert run_program(source, FAST).passed
