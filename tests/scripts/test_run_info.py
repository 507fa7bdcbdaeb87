"""zipage_jax/run_info.py's metadata, and the "run" object of every JSON result in docs/."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from zipage_jax import run_info

ROOT = Path(__file__).resolve().parents[2]

DOCS_JSON = sorted((ROOT / "docs").glob("*.json"))


def test_run_info_keys_and_types():
    info = run_info.run_info()
    assert set(info) == {"commit", "date", "load_average", "cpu_count", "platform", "python", "jax"}
    assert info["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?", info["commit"])
    date = datetime.datetime.fromisoformat(info["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - date) < datetime.timedelta(minutes=5)
    load = info["load_average"]
    assert load is None or (len(load) == 3 and all(isinstance(x, float) and x >= 0 for x in load))
    assert isinstance(info["cpu_count"], int) and info["cpu_count"] >= 1
    assert isinstance(info["platform"], str) and info["platform"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", info["python"])
    assert info["jax"] is None or isinstance(info["jax"], str)
    json.dumps(info)  # it goes into a JSON result as it is


def test_run_info_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(run_info.subprocess, "run", no_git)
    assert run_info.run_info()["commit"] == "unknown"


@pytest.mark.parametrize("path", DOCS_JSON, ids=lambda p: p.name)
def test_docs_json_has_run_metadata(path):
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, "one JSON object on one line (scripts/plot_results.py reads the last line)"
    run = json.loads(lines[0]).get("run")
    assert isinstance(run, dict), f"{path.name}: no top-level 'run' object"
    assert isinstance(run.get("commit"), str) and re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", run["commit"])
    datetime.datetime.fromisoformat(run["date"])
    assert "load_average" in run
    if run["load_average"] is None:
        assert run.get("load_note", "").startswith("not recorded")


def test_docs_has_json_results():
    assert DOCS_JSON
