"""The server the test modules share: one per module (server_harness.running_server)."""

from __future__ import annotations

import pytest
from server_harness import running_server


@pytest.fixture(scope="module")
def server(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir) as srv:
        yield srv
