"""The server of the chaos test, in its own process: create_app on the tiny model with the real
engine core (driven on a thread of this process), whose forward call `fail_at` runs on the donated
state and then raises (device_failures).

    python tests/server/chaos_server.py MODEL_DIR PORT FAIL_AT
"""

from __future__ import annotations

import sys

import pytest
import uvicorn
from device_failures import FailingCalls
from server_harness import ENGINE_OPTIONS, MODEL

from zipage_jax.engine.core import EngineCore
from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient


def main(model_dir: str, port: int, fail_at: int) -> None:
    def core() -> EngineCore:
        built = EngineCore(model=model_dir, **ENGINE_OPTIONS)
        FailingCalls(pytest.MonkeyPatch(), built.runner.forward, at={fail_at})
        return built

    uvicorn.run(create_app(InProcessEngineClient(core), [MODEL]), host="127.0.0.1", port=port, log_level="info")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
