"""The live server the third-party clients' tests share (one per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import LiveServer, serve


@pytest.fixture(scope="session")
def live_server(tiny_model_factory, tmp_path_factory) -> Iterator[LiveServer]:
    with serve(tiny_model_factory("qwen3"), tmp_path_factory.mktemp("live_server")) as server:
        yield server
