"""What the data-parallel tests share: one Ray instance per module (starting one takes seconds),
and the server tests' harness (tests/server/server_harness.py)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray of 2 CPUs for the module: a replica asks for one."""
    ray = pytest.importorskip("ray")
    with warnings.catch_warnings():  # Ray's processes are forked and exec'd at once: no JAX runs in the child
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
