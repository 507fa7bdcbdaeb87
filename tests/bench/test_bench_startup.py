"""`zipage-jax bench startup`: its pure helpers, the server probe against canned responses, and
--quick runs on the tiny llama model (this tree only; the baseline in a slow test)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from zipage_jax.bench import startup
from zipage_jax.bench.startup_goals import GOALS, evaluate_goal, evaluate_goals
from zipage_jax.bench.startup_metrics import (
    SERVER_METRICS,
    grid_done,
    median_fields,
    metric,
    parse_metrics,
    percentile,
    server_metric_snapshot,
    stream_summary,
)
from zipage_jax.bench.startup_server import ServerProbe
from zipage_jax.bench.startup_worker import KINDS, extrapolate, program_summary, select_subset, summarize_records

ROOT = Path(__file__).resolve().parents[2]


# -- pure helpers -------------------------------------------------------------------------------------


def test_percentile_interpolates_and_ignores_none():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None and percentile([None, 5], 50) == 5


METRICS = """# HELP zipage:programs_ready Programs built.
# TYPE zipage:programs_ready gauge
zipage:programs_ready{model_name="bench"} 11.0
# TYPE zipage:compile_seconds counter
zipage:compile_seconds_total{model_name="bench"} 29.5
zipage:compile_seconds_created{model_name="bench"} 1.7e9
zipage:programs_loaded_total{model_name="bench"} 0.0
zipage:warmup_programs_total{model_name="bench"} 6.0
zipage:warmup_programs_ready{model_name="bench"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="bench"} 3.0
zipage:requests_refused_total{model_name="bench",reason="queue_full"} 1.0
zipage:requests_refused_total{model_name="bench",reason="other"} 2.0
not a metric line
"""


def test_parse_metrics_sums_labels_and_finds_counters_by_either_name():
    m = parse_metrics(METRICS)
    assert m["zipage:programs_ready"] == 11.0 and m["zipage:requests_refused_total"] == 3.0
    assert m['vllm:time_to_first_token_seconds_bucket'] == 3.0
    assert metric(m, "zipage:compile_seconds") == 29.5 == metric(m, "zipage:compile_seconds_total")
    assert metric(m, "zipage:programs_loaded_total") == 0.0
    assert metric(m, "zipage:no_such_metric") is None and metric(None, "zipage:programs_ready") is None
    snapshot = server_metric_snapshot(m)
    assert snapshot["zipage:compile_seconds_total"] == 29.5 and snapshot["zipage:warmup_done"] is None
    assert set(snapshot) == set(SERVER_METRICS)


def test_grid_done_prefers_warmup_done_then_counts_and_is_none_without_a_grid():
    m = parse_metrics(METRICS)
    assert grid_done(m) is False  # 4 of 6 grid programs (programs_ready 11 counts stages: not used)
    assert grid_done({**m, "zipage:warmup_programs_ready": 6.0}) is True
    assert grid_done({**m, "zipage:warmup_done": 0.0, "zipage:warmup_programs_ready": 6.0}) is False
    assert grid_done({**m, "zipage:warmup_done": 1.0}) is True
    older = {"zipage:programs_ready": 6.0, "zipage:warmup_programs_total": 6.0}  # the brief's metrics only
    assert grid_done(older) is True and grid_done({**older, "zipage:programs_ready": 5.0}) is False
    assert grid_done({**m, "zipage:warmup_programs_total": 0.0}) is None  # --no-warmup
    assert grid_done(parse_metrics('vllm:num_requests_running{model_name="x"} 0.0')) is None
    assert grid_done(None) is None


def test_goals_value_limit_and_met_per_tree():
    assert evaluate_goal(None, 5.0) == {"value": None, "goal": 5.0, "met": None}
    assert evaluate_goal(4.0, 5.0)["met"] is True and evaluate_goal(6.0, 5.0)["met"] is False
    assert evaluate_goal(1.0, 2.0, ok=False)["met"] is False
    results = {
        "warmup": {"current": {"cold": {"ok": True, "ready_at_s": 40.0},
                               "warm": {"runs": [{"ok": True}], "median": {"ready_at_s": 4.0}}},
                   "baseline": {"cold": {"ok": True, "ready_at_s": 300.0},
                                "warm": {"runs": [{"ok": True}], "median": {"ready_at_s": 60.0}}}},
        "first_token": {"current": {"cold": {"ok": False}, "warm": {"runs": [], "median": {}}}},
        "server": {"current": {"cold": {"ok": True, "grid_done_s": 80.0, "ttft_p50_s": 1.0, "all_succeeded": False}},
                   "baseline": {"cold": {"ok": True, "grid_done_s": 200.0, "ttft_p50_s": 0.5,
                                         "all_succeeded": True}}},
    }
    goals = evaluate_goals(results, {"current": None, "baseline": None})
    assert list(goals) == [g.name for g in GOALS]
    for goal in goals.values():
        assert {"goal", "unit", "what", "from", "current", "baseline"} <= set(goal)
        assert set(goal["current"]) == {"value", "goal", "met"}
    assert goals["cold_start_to_warmed_engine_s"]["current"] == {"value": 40.0, "goal": 90.0, "met": True}
    assert goals["cold_start_to_warmed_engine_s"]["baseline"]["met"] is False
    assert goals["restart_to_warmed_engine_s"]["current"]["met"] is True
    assert goals["restart_to_warmed_engine_s"]["baseline"] == {"value": 60.0, "goal": 10.0, "met": False}
    assert goals["restart_to_first_token_s"]["current"]["met"] is None  # no successful run
    assert goals["restart_to_first_token_s"]["baseline"]["met"] is None  # section not run for it
    assert goals["cold_start_to_warmed_server_s"]["current"]["met"] is True
    assert goals["new_server_ttft_p50_s"]["current"]["met"] is False  # a stream failed
    assert goals["new_server_ttft_p50_s"]["baseline"]["met"] is True
    assert evaluate_goals(results, {"current": None})["new_server_ttft_p50_s"]["baseline"] is None


def test_median_fields_over_successful_runs_numbers_only():
    runs = [{"ok": True, "a": 1.0, "b": 10, "flag": True, "text": "x"}, {"ok": True, "a": 3.0, "b": None},
            {"ok": True, "a": 2.0}, {"ok": False, "a": 100.0}]
    assert median_fields(runs) == {"a": 2.0, "b": 10}
    assert median_fields([{"ok": False, "a": 1.0}]) == {}


def _record(name, key, origin, trace=0.0, lower=0.0, compile_=0.0, load=0.0):
    return SimpleNamespace(name=name, key=key, origin=origin, trace_seconds=trace, lower_seconds=lower,
                           compile_seconds=compile_, load_seconds=load)


def test_summarize_records_by_kind_and_origin():
    records = [_record("embed", ("decode rows", 1), "compiled", 0.1, 0.2, 1.0),
               _record("layers", ("decode rows", 1), "compiled", 0.3, 0.1, 2.0),
               _record("forward", ("prefill rows", 4), "loaded", load=0.05),
               _record("compression", ("batch", 8, "blocks", 64), "compiled", 0.5, 0.5, 3.0),
               _record("history", ("tokens", 64), "loaded", load=0.01)]
    s = summarize_records(records)
    assert (s["total"], s["compiled"], s["loaded"]) == (5, 3, 2)
    assert set(s["by_kind"]) == set(KINDS)
    decode = s["by_kind"]["forward_decode"]
    assert decode["programs"] == 2 and decode["compiled"] == 2 and decode["loaded"] == 0
    assert decode["trace_s"] == pytest.approx(0.4) and decode["compile_s"] == pytest.approx(3.0)
    assert decode["total_s"] == pytest.approx(3.7)
    assert s["by_kind"]["forward_prefill"]["load_s"] == pytest.approx(0.05)
    assert s["seconds"] == pytest.approx(3.7 + 0.05 + 4.0 + 0.01)
    assert summarize_records([])["total"] == 0


def test_program_summary_of_a_runner_without_records_counts_compile_seconds():
    runner = SimpleNamespace(num_compiles=3,
                             forward=SimpleNamespace(name="forward", compile_seconds={("decode rows", 1): 2.0,
                                                                                      ("prefill rows", 2): 3.0}),
                             compressor=SimpleNamespace(name="compression", compile_seconds={}),
                             seeder=SimpleNamespace(name="history", compile_seconds={("tokens", 64): 0.5}))
    s = program_summary(runner)
    assert s["total"] == 3 and s["compiled"] is None and s["loaded"] is None and s["seconds"] == 5.5
    assert s["by_kind"]["forward_prefill"]["total_s"] == 3.0 and s["by_kind"]["history"]["programs"] == 1
    assert s["by_kind"]["forward_decode"]["compile_s"] is None  # no per-stage timing
    assert program_summary(SimpleNamespace(records=[_record("history", ("tokens", 64), "loaded")]))["loaded"] == 1


def test_select_subset_and_extrapolate():
    keys = ([("decode rows", r) for r in (1, 2, 4, 8)] + [("prefill rows", r) for r in (1, 2)]
            + [("batch", b, "blocks", w) for b in (1, 2) for w in (2, 4, 8)] + [("tokens", n) for n in (64, 128)])
    assert select_subset(keys) == [("decode rows", 1), ("decode rows", 8), ("prefill rows", 2),
                                      ("batch", 2, "blocks", 8), ("tokens", 128)]
    assert select_subset([("decode rows", 1)]) == [("decode rows", 1)]
    programs = [{"kind": "forward_decode", "build_s": 2.0}, {"kind": "forward_decode", "build_s": 4.0},
                {"kind": "compression", "build_s": 1.0}]
    e = extrapolate(keys, programs)
    assert e["per_kind"]["forward_decode"] == {"grid_programs": 4, "measured": 2, "mean_s": 3.0, "estimated_s": 12.0}
    assert e["per_kind"]["compression"]["estimated_s"] == 6.0
    assert e["per_kind"]["history"]["estimated_s"] is None and e["estimated_grid_s"] is None
    assert extrapolate(keys[:4], programs)["estimated_grid_s"] == 12.0


def test_options_flags_and_arguments(bench_args):
    assert startup.parse_option("max_num_seqs=8") == ("max_num_seqs", 8)
    assert startup.parse_option("kv-cache-dtype=int8") == ("kv_cache_dtype", "int8")
    assert startup.parse_option("enable_prefix_caching=false") == ("enable_prefix_caching", False)
    assert startup.server_flags({"kvcache_block_size": 32, "enable_prefix_caching": False, "warmup": True,
                                 "max_model_len": None}) == ["--kvcache-block-size", "32",
                                                             "--no-enable-prefix-caching", "--warmup"]
    args = startup.with_defaults(bench_args("startup"))
    assert (args.runs, args.streams, args.stream_tokens, args.baseline) == (3, 64, 16, "09dcce3")
    assert args.engine_options == {} and args.skip == set() and args.timeout == 1800
    args = startup.with_defaults(bench_args("startup", "--quick", "--baseline", "none", "--skip", "server,qwen3_8b",
                                            "--skip", "warmup", "--option", "max_num_seqs=3"))
    assert (args.runs, args.streams, args.stream_tokens, args.baseline) == (1, 8, 4, None)
    assert args.skip == {"server", "qwen3_8b", "warmup"}
    assert args.engine_options == {**startup.QUICK_OPTIONS, "max_num_seqs": 3}
    for bad in (["--skip", "nope"], ["--option", "novalue"], ["--runs", "0"]):
        with pytest.raises(SystemExit):
            startup.with_defaults(bench_args("startup", *bad))


def test_serve_command_of_a_tree_with_and_without_the_console_script(tmp_path):
    assert startup.serve_command(startup.Tree("current", ROOT, "test"))[1:] == ["-m", "zipage_jax", "serve"]
    older = startup.Tree("baseline", tmp_path, "test")  # a commit before zipage_jax/cli.py
    assert startup.serve_command(older)[1:] == [str(tmp_path / "scripts" / "serve_jax.py")]


def test_stop_process_terminates_then_kills():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert startup.stop_process(proc, grace=10) == {"returncode": -15, "killed": False}
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    assert startup.stop_process(stubborn, grace=0.5) == {"returncode": -9, "killed": True}


# -- the server probe against canned responses --------------------------------------------------------


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


PROBE = ServerProbe(streams=8, stream_tokens=4, timeout=300.0)  # --quick's


def test_stream_ttft_success_and_failures():
    bodies = {
        "0": (200, _sse({"choices": [{"text": ""}]}, {"choices": [{"text": " Paris"}]}, {"choices": [{"text": "."}]},
                        "[DONE]")),
        "1": (503, b'{"error": {"message": "warming up"}}'),
        "2": (200, _sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine step failed"}}, "[DONE]")),
        "3": (200, _sse({"choices": [{"text": "a"}]})),  # no [DONE]
    }
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        number = body["prompt"].split(":")[0].split()[-1]
        status, content = bodies[number]
        return httpx.Response(status, content=content)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return [await PROBE.stream(client, "http://test", i) for i in range(4)]

    ok, refused, failed, cut = asyncio.run(run())
    assert ok["ok"] and ok["chunks"] == 3 and ok["error"] is None and 0 <= ok["ttft_s"] <= ok["seconds"]
    assert not refused["ok"] and refused["error"].startswith("HTTP 503")
    assert not failed["ok"] and "engine step failed" in failed["error"]
    assert not cut["ok"] and "[DONE]" in cut["error"]
    assert all(b["stream"] is True and b["temperature"] == 0 and b["max_tokens"] == 4 for b in seen)
    assert len({b["prompt"] for b in seen}) == 4
    summary = stream_summary([ok, refused, failed, cut])
    assert summary["streams"] == 4 and summary["succeeded"] == 1 and summary["all_succeeded"] is False
    assert summary["ttft_p50_s"] == ok["ttft_s"] and len(summary["errors"]) == 3
    assert stream_summary([ok])["all_succeeded"] is True and stream_summary([])["all_succeeded"] is False

    async def never_answers(request):
        await asyncio.sleep(30)

    async def bounded():
        async with httpx.AsyncClient(transport=httpx.MockTransport(never_answers)) as client:
            return await PROBE.bounded_stream(client, "http://test", 0, time.monotonic() + 0.1)

    late = asyncio.run(bounded())
    assert not late["ok"] and "not finished" in late["error"]


def test_a_worker_past_its_timeout_is_stopped_and_reported(tmp_path, bench_args):
    args = startup.with_defaults(bench_args("startup", "--quick", "--baseline", "none", "--timeout", "0.3"))
    bench = startup.Bench(args, tmp_path, {})
    cache = tmp_path / "cache"
    cache.mkdir()
    result = bench.worker("convert", startup.Tree("current", ROOT, "test"), cache, "once")
    assert not result["ok"] and result["error"] == "timed out after 0.3 s" and result["returncode"] is not None
    assert bench.errors == ["convert current once: timed out after 0.3 s"]


def test_poll_grid_until_done_or_no_grid():
    scrapes = iter(['zipage:warmup_programs_total{model_name="b"} 6\nzipage:warmup_programs_ready{model_name="b"} 2',
                    'zipage:warmup_programs_total{model_name="b"} 6\nzipage:warmup_programs_ready{model_name="b"} 6\n'
                    'zipage:programs_loaded_total{model_name="b"} 6'])

    def growing(request):
        return httpx.Response(200, text=next(scrapes))

    async def poll(handler, timeout):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await PROBE.poll_grid(client, "http://test", 0.0, time.monotonic() + timeout, give_up_s=0.5)

    done = asyncio.run(poll(growing, 30))
    assert done["grid_done_from"] == "metrics" and done["grid_done_s"] > 0
    assert done["metrics"]["zipage:programs_loaded_total"] == 6 and done["metrics"]["zipage:warmup_done"] is None
    absent = asyncio.run(poll(lambda r: httpx.Response(200, text='vllm:num_requests_running{model_name="b"} 0'), 30))
    assert absent["grid_done_s"] is None and "no warm-up grid" in absent["grid_note"]
    stuck = asyncio.run(poll(lambda r: httpx.Response(200, text='zipage:warmup_programs_total 6\n'
                                                                   'zipage:warmup_programs_ready 1'), 0.6))
    assert stuck["grid_done_s"] is None and "not built" in stuck["grid_note"]


# -- --quick runs on the tiny model -------------------------------------------------------------------


def _check_common(out: dict, sections: set[str]):
    assert {"model", "quick", "runs", "engine_options", "skipped", "trees", "conversion", "goals", "errors",
            "run"} <= set(out)
    assert out["errors"] == [] and out["quick"] is True and out["runs"] == 1
    assert {"commit", "date", "load_average", "cpu_count", "platform", "python", "jax"} <= set(out["run"])
    assert set(out["trees"]) == {"current"} and out["trees"]["current"]["commit"]
    conversion = out["conversion"]["current"]
    assert conversion["ok"] and conversion["seconds"] > 0 and not conversion["from_cache"]
    assert len(conversion["entries"]) == 1
    assert list(out["goals"]) == [g.name for g in GOALS]
    for goal in out["goals"].values():
        assert goal["baseline"] is None and set(goal["current"]) == {"value", "goal", "met"}
    for section in ("first_token", "warmup", "server", "qwen3_8b"):
        assert (section in out) == (section in sections)


def _check_runs(section: dict, key: str):
    cold, warm = section["current"]["cold"], section["current"]["warm"]
    assert cold["ok"] and cold[key] > 0 and cold["interpreter_s"] > 0 and cold["import_s"] > 0
    assert cold["programs_compiled"] > 0 and cold["programs_loaded"] == 0  # an empty program store
    assert len(warm["runs"]) == 1 and warm["runs"][0]["ok"]
    run = warm["runs"][0]
    assert run["programs_loaded"] > 0 and run["programs_compiled"] == 0  # all from the store
    assert warm["median"][key] == run[key] > 0 and run["exit_at_s"] >= run[key]
    assert cold["zipage_jax"].endswith("zipage_jax/__init__.py") and "current-tree" in cold["zipage_jax"]
    return cold, run


def test_quick_first_token_cold_compiles_and_warm_loads(llama_dir, bench_args, last_json):
    argv = ["--quick", "--model", llama_dir, "--baseline", "none", "--skip", "warmup,server,qwen3_8b", "--json"]
    assert startup.run(bench_args("startup", *argv)) == 0
    out = last_json()
    _check_common(out, {"first_token"})
    section = out["first_token"]
    assert section["prompt"] == startup.PROMPT and section["max_tokens"] == 8
    cold, warm = _check_runs(section, "first_token_at_s")
    for run in (cold, warm):
        assert run["tokens"] == 8 and run["engine_construction_s"] > 0
        assert run["first_token_at_s"] == pytest.approx(run["engine_ready_at_s"] + run["first_token_after_engine_s"])
        assert run["programs_at_first_token"]["total"] >= 2  # a prefill and a decode program at least
        assert set(run["programs"]["by_kind"]) >= {"forward_prefill", "forward_decode"}
    goal = out["goals"]["restart_to_first_token_s"]["current"]
    assert goal["value"] == warm["first_token_at_s"] and goal["met"] == (warm["first_token_at_s"] <= 5.0)
    assert out["goals"]["new_server_ttft_p50_s"]["current"] == {"value": None, "goal": 2.0, "met": None}


@pytest.mark.slow
def test_quick_all_sections(llama_dir, bench_args, last_json):
    assert startup.run(bench_args("startup", "--quick", "--model", llama_dir, "--baseline", "none", "--json")) == 0
    out = last_json()
    _check_common(out, {"first_token", "warmup", "server", "qwen3_8b"})
    cold, warm = _check_runs(out["warmup"], "ready_at_s")
    assert cold["grid_programs"] == warm["grid_programs"] > 0
    assert cold["programs_total"] >= cold["grid_programs"] and cold["warmup_status"]["done"]
    for kind in KINDS:
        row = cold["by_kind"][kind]
        assert row["compiled"] == row["programs"] > 0 and row["compile_s"] > 0 and row["load_s"] == 0
        assert warm["by_kind"][kind]["loaded"] == warm["by_kind"][kind]["programs"] > 0
    assert out["goals"]["cold_start_to_warmed_engine_s"]["current"]["value"] == cold["ready_at_s"]

    server = out["server"]
    assert server["streams"] == 8 and server["max_tokens"] == 4 and set(server["modes"]) == {"current"}
    assert "--kvcache-block-size" in server["modes"]["current"]["flags"]
    for run in (server["current"]["cold"], *server["current"]["warm"]["runs"]):
        assert run["ok"] and run["all_succeeded"] and run["succeeded"] == 8 and run["health_s"] > 0, run.get("errors")
        assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"] <= run["ttft_max_s"]
        assert run["exit"]["returncode"] is not None
        if run["metrics"]["zipage:warmup_programs_total"]:  # a server with a background warm-up
            assert run["grid_done_from"] == "metrics" and run["grid_done_s"] >= run["health_s"]
    loaded = server["current"]["warm"]["runs"][0]["metrics"]["zipage:programs_loaded_total"]
    assert loaded is None or loaded > 0  # a warm server loads its programs (when its /metrics says)
    assert out["goals"]["new_server_ttft_p50_s"]["current"]["value"] == server["current"]["cold"]["ttft_p50_s"]

    qwen3 = out["qwen3_8b"]
    assert qwen3["scaled_down"] and qwen3["model_config"]["qk_norm"] and "extrapolation" in qwen3
    current = qwen3["current"]
    assert current["ok"] and current["backend"] == "cpu" and current["grid"]["size"] > len(current["programs"])
    assert [p["kind"] for p in current["programs"]].count("forward_decode") == 2
    assert {p["kind"] for p in current["programs"]} == set(KINDS)
    for p in current["programs"]:
        assert p["build_s"] > 0 and p["compile_s"] > 0 and p["origins"] == ["compiled"]
    assert current["extrapolated"]["estimated_grid_s"] > 0
    assert current["memory"]["weights_stayed_abstract"] and current["memory"]["params_abstract"] > 0


def _has_commit(commit: str) -> bool:
    return subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_commit(startup.DEFAULT_BASELINE), reason="the baseline commit is not in this clone")
def test_quick_against_the_baseline_worktree(llama_dir, bench_args, last_json):
    argv = ["--quick", "--model", llama_dir, "--skip", "warmup,server,baseline_no_warmup", "--json"]
    assert startup.run(bench_args("startup", *argv)) == 0
    out = last_json()
    assert out["errors"] == [] and set(out["trees"]) == {"current", "baseline"}
    assert out["trees"]["baseline"]["requested"] == startup.DEFAULT_BASELINE
    base = out["first_token"]["baseline"]
    assert base["cold"]["ok"] and "baseline-tree" in base["cold"]["zipage_jax"]
    assert base["cold"]["programs"]["source"].startswith("compile_seconds") and base["cold"]["programs_total"] > 0
    assert base["warm"]["runs"][0]["ok"]
    assert out["qwen3_8b"]["baseline"]["ok"] and out["qwen3_8b"]["baseline"]["memory"]["weights_stayed_abstract"]
    for goal in out["goals"].values():
        assert set(goal["baseline"]) == {"value", "goal", "met"}
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "baseline-tree" not in worktrees  # removed at the end
