"""What the data-parallel tests share: one Ray instance per module (starting one takes seconds).
The server tests' harness they also use is tests/server_harness.py."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray of 2 CPUs for the module: a replica asks for one."""
    ray = pytest.importorskip("ray")
    with warnings.catch_warnings():  # Ray's processes are forked and exec'd at once: no JAX runs in the child
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
