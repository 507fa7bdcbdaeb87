"""zipage_jax/harness.py: the run record, timing and medians, the JSON output; and the "run"
object of every JSON result kept in docs/."""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

import pytest

from zipage_jax import harness

ROOT = Path(__file__).resolve().parents[1]

DOCS_JSON = sorted((ROOT / "docs").glob("**/*.json"))


def test_run_record_keys_and_types():
    info = harness.run_record()
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


def test_run_record_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(harness.subprocess, "run", no_git)
    assert harness.run_record()["commit"] == "unknown"


@pytest.mark.parametrize("path", DOCS_JSON, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_docs_json_has_run_metadata(path):
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, "one JSON object on one line (`zipage-jax bench plot` reads the last line)"
    run = json.loads(lines[0]).get("run")
    assert isinstance(run, dict), f"{path.name}: no top-level 'run' object"
    assert isinstance(run.get("commit"), str) and re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", run["commit"])
    datetime.datetime.fromisoformat(run["date"])
    assert "load_average" in run
    if run["load_average"] is None:
        assert run.get("load_note", "").startswith("not recorded")


def test_docs_has_json_results():
    assert DOCS_JSON


class FakeClock:
    """time.perf_counter for the harness: a call advances it by the next of `durations` (the fn's own time)."""

    def __init__(self, durations: list[float]):
        self.now, self.durations, self.calls = 0.0, iter(durations), []

    def __call__(self) -> float:
        return self.now

    def work(self, name: str):
        def fn() -> str:
            self.calls.append(name)
            self.now += next(self.durations)
            return name

        return fn


def test_timed_and_median_seconds(monkeypatch):
    clock = FakeClock([0.5, 3.0, 1.0, 2.0, 10.0, 1.5])
    monkeypatch.setattr(harness.time, "perf_counter", clock)
    assert harness.timed(clock.work("once")) == ("once", 0.5)
    assert harness.median_seconds(clock.work("f"), runs=3) == 2.0  # 3, 1, 2
    assert harness.median_seconds(clock.work("g"), runs=2) == pytest.approx(5.75)  # the mean of the middle two
    assert clock.calls == ["once"] + ["f"] * 3 + ["g"] * 2
    with pytest.raises(ValueError, match="at least 1"):
        harness.median_seconds(clock.work("never"), runs=0)


def test_interleaved_medians_alternate_the_calls(monkeypatch):
    clock = FakeClock([1.0, 10.0, 5.0, 20.0, 3.0, 30.0])
    monkeypatch.setattr(harness.time, "perf_counter", clock)
    medians = harness.interleaved_medians({"a": clock.work("a"), "b": clock.work("b")}, runs=3)
    assert clock.calls == ["a", "b", "a", "b", "a", "b"]
    assert medians == {"a": 3.0, "b": 20.0} and list(medians) == ["a", "b"]


def _output_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def test_emit_json_line_and_out_file(tmp_path, capsys):
    out = tmp_path / "results" / "bench.json"
    assert harness.emit({"tokens": 3}, _output_args("--json", "--out", str(out)), status=1) == 1
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1
    result = json.loads(printed[0])
    assert result["tokens"] == 3 and set(result["run"]) >= {"commit", "date", "load_average"}
    assert out.read_text() == printed[0] + "\n"  # the folder made, the same line written


def test_emit_without_json_prints_indented_and_keeps_a_run_it_has(capsys):
    kept = {"commit": "abc1234", "date": "2026-01-01T00:00:00+00:00"}
    assert harness.emit({"tokens": 3, "run": kept}, _output_args()) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == {"tokens": 3, "run": kept} and printed.count("\n") > 1


def test_usage_error_exits_2_with_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        harness.usage_error("bench throughput", "--a and --b do not go together")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "zipage-jax bench throughput: error: --a and --b do not go together\n"
