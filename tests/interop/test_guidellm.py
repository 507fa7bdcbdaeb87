"""guidellm (the vLLM project's load tester) against a live server: a short streaming profile,
run by the real `guidellm` command with its defaults for the OpenAI HTTP backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import MODEL, LiveServer, server_errors

pytestmark = pytest.mark.interop


def test_a_streaming_profile_has_no_errors_and_real_latencies(live_server: LiveServer, tmp_path: Path):
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("guidellm")), "run",
         "--backend", f"kind=openai_http,target={live_server.url},model={MODEL}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
         "--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=12",
         "--tokenizer", f"kind=huggingface_auto,model={live_server.model_dir}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": 16, "errored": 0, "incomplete": 0, "total": 16}
    assert server_errors(live_server) == []
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == 16 and ttft["median"] > 0
    assert itl["median"] > 0
    assert metrics["output_token_count"]["successful"]["mean"] == 12  # usage came back with every request
