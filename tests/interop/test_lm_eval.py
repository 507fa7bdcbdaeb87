"""lm-eval's `local-completions` model against a live server: a tiny local task of each output
type (generate_until, loglikelihood, multiple_choice), run by the real `lm-eval` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import MODEL, LiveServer, server_errors

pytestmark = pytest.mark.interop

DOCS = {
    "generate": [{"question": f"Count: {' '.join(map(str, range(i, i + 4)))}", "answer": str(i + 4)} for i in range(4)],
    "loglikelihood": [{"context": f"The number after {i} is", "continuation": f" {i + 1}"} for i in range(4)],
    "multiple_choice": [{"question": f"Which is larger than {i}?", "choices": [str(i - 1), str(i + 1), str(i)],
                         "label": 1} for i in range(1, 5)],
}
TASKS = {
    "generate": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                 "metric_list": [{"metric": "exact_match"}]},
    "loglikelihood": {"output_type": "loglikelihood", "doc_to_text": "{{context}}",
                      "doc_to_target": "{{continuation}}",
                      "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]},
    "multiple_choice": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                        "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                        "metric_list": [{"metric": "acc"}]},
}


def write_tasks(root: Path) -> list[str]:
    names = []
    for kind, task in TASKS.items():
        data = root / f"{kind}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[kind]))
        name = f"zipage_tiny_{kind}"
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **task}
        (root / f"{name}.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
        names.append(name)
    return names


def test_every_output_type_runs_without_errors(live_server: LiveServer, tmp_path):
    tasks = write_tasks(tmp_path)
    out = tmp_path / "out"
    model_args = ",".join([f"model={MODEL}", f"base_url={live_server.url}/v1/completions",
                           f"tokenizer={live_server.model_dir}", "tokenizer_backend=huggingface",
                           "tokenized_requests=True", "num_concurrent=4", "max_retries=1", "max_length=512"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                          "--model_args", model_args, "--tasks", ",".join(tasks), "--include_path", str(tmp_path),
                          "--output_path", str(out), "--batch_size", "4"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert server_errors(live_server) == []
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert set(results) == set(tasks)
    assert 0 <= results["zipage_tiny_generate"]["exact_match,none"] <= 1
    assert 0 <= results["zipage_tiny_multiple_choice"]["acc,none"] <= 1
    assert results["zipage_tiny_loglikelihood"]["perplexity,none"] > 1
