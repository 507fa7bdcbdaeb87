"""The main path needs no torch: a first load of the default model, generation and the server.

The test environment has torch installed (for the reference checks), so this asserts on what
gets imported: a fresh process converts the default model into an empty cache, generates with
`zipage_jax.generate` (the engine core in this process), answers a chat request through the server
app as `zipage-jax serve` builds it (its engine core in a process of its own, loading the model
again, from the cache; the tokenizer, the output stage and HTTP in this one), and never imports
torch. (`.ci/run` also runs the README's first command in an environment without
torch at all.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, sys, time
import zipage_jax

out = zipage_jax.generate("The capital of France is", max_tokens=4)[0]

from fastapi.testclient import TestClient
from zipage_jax.config import EngineConfig
from zipage_jax.server import create_app
from zipage_jax.server.process_client import MultiProcessEngineClient

with TestClient(create_app(MultiProcessEngineClient(EngineConfig(model="default")), ["default"])) as client:
    deadline = time.monotonic() + 300
    while "still loading" in (health := client.get("/health")).text and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health.status_code == 200, health.text
    reply = client.post("/v1/chat/completions", json={"model": "default", "max_tokens": 3, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                  "text": out["text"], "tokens": len(out["token_ids"]),
                  "status": reply.status_code, "reply": reply.json()}))
"""


@pytest.mark.slow
def test_default_model_generates_and_serves_without_torch(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["torch"] == [], result["torch"]
    assert result["text"].strip() and result["tokens"] == 4
    entries = [d for d in cache.iterdir() if (d / "hf_config.json").is_file()]
    assert len(entries) == 1  # the first load converted the model into the empty cache
    assert result["status"] == 200 and result["reply"]["choices"][0]["message"]["content"]
