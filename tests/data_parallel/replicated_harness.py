"""The HTTP server over a ReplicatedEngine (replicas on Ray, the tiny qwen3 model), as
`zipage-jax serve --data-parallel-size N` builds it: an InProcessEngineClient whose core is the
ReplicatedEngine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from server_harness import ENGINE_OPTIONS, MODEL, ServerThread, wait_for

from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient


@contextlib.contextmanager
def replicated_server(tiny_model_factory, model_cache_dir, **engine_options) -> Iterator[ServerThread]:
    """A ServerThread over a ReplicatedEngine(model=tiny qwen3, ENGINE_OPTIONS | engine_options),
    loaded, with .client (the InProcessEngineClient), .engine (its ReplicatedEngine) and .http
    (httpx); the replicas are shut down afterwards."""
    from zipage_jax.data_parallel.replicated_engine import ReplicatedEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))  # the replicas inherit it
        model_dir = str(tiny_model_factory("qwen3"))
        options = {**ENGINE_OPTIONS, **engine_options}
        client = InProcessEngineClient(lambda: ReplicatedEngine(model=model_dir, **options))
        srv = ServerThread(create_app(client, [MODEL, "alias"]))
        try:
            wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200 or client.load_error is not None,
                     180, "the replicas did not load")
            assert client.load_error is None, client.load_error
            srv.client, srv.engine = client, client.core
            srv.http = httpx.Client(base_url=srv.url, timeout=60)
            yield srv
        finally:
            srv.close()
            if client.core is not None:
                client.core.shutdown()
