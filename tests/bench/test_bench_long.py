"""`zipage-jax bench long`: step time per window of generated tokens, compressed against full KV
(a tiny model and a tiny random Qwen3), the goals, presets and flags, and the plot of its JSON."""

from __future__ import annotations

import json

import pytest

from zipage_jax.bench import long, plot


@pytest.mark.slow
def test_bench_long_smoke_tiny_model(llama_dir, tmp_path, bench_args, last_json):
    # 2 requests of 64 tokens, block 16, budget 32 tokens (2 blocks): a pool of 2 * 3 + 1 blocks, where full
    # KV holds one request and a bit; windows of 16 tokens. Small batch limits keep the warm-up grid small.
    argv = ["--model", llama_dir, "--json", "--requests", "2", "--prompt-len", "8", "16", "--max-tokens", "64",
            "--window", "16", "--budget", "32", "--kvcache-block-size", "16", "--max-num-batched-tokens", "64",
            "--max-compress-seqs", "1"]
    assert long.run(bench_args("long", *argv)) == 0
    out = last_json()
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
    assert plot.run(bench_args("plot", str(src), "--out", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_long_random_model_repeats_and_goals(tmp_path, bench_args, last_json):
    # the attention preset's plumbing on tiny settings: a tiny random Qwen3 (byte tokenizer), 2 requests of
    # 80 tokens, windows of 16, budget 32 tokens, block 16, a pool that holds full KV, 2 interleaved repeats
    argv = ["--preset", "attention", "--model", "random-qwen3-tiny", "--json", "--requests", "2", "--prompt-len",
            "8", "16", "--max-tokens", "80", "--window", "16", "--budget", "32", "--repeats", "2",
            "--max-num-batched-tokens", "64", "--max-compress-seqs", "1"]
    assert long.run(bench_args("long", *argv)) == 0
    out = last_json()
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
            assert len(med) == 5 and all(0 <= a <= b <= c for a, b, c in zip(lo, med, hi, strict=True)), kind
            reps = [rep[f"{kind}_ms_by_window"] for rep in run["repeats"]]
            by_window = list(zip(*reps, strict=True))
            assert lo == [min(x) for x in by_window] and hi == [max(x) for x in by_window], kind
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
    assert long.run(bench_args("long", "--resummarize", str(src), "--json")) == 0
    again = last_json()
    assert again["goals"] == goals and again["compressed"] == compressed and again["run"] == out["run"]
    assert "commit" in again["resummarized"]


def test_bench_long_goals_discriminate_beyond_the_spread():
    def row(steps_by_repeat, host, device, first=1):
        repeats = [{"step_ms_by_window": s} for s in steps_by_repeat]
        ratios = [s[-1] / s[first] for s in steps_by_repeat]
        med = [sorted(x)[len(x) // 2] for x in zip(*steps_by_repeat, strict=True)]
        low = [min(x) for x in zip(*steps_by_repeat, strict=True)]
        return {"first_full_window": first, "step_ms_by_window": med, "last_vs_first_full_window": med[-1] / med[first],
                "last_vs_first_full_by_repeat": ratios, "last_vs_first_full_spread": max(ratios) - min(ratios),
                "last_vs_first_full_window_of_min": low[-1] / low[first], "host_ms_by_window": host,
                "device_ms_by_window": device, "repeats": repeats, "compiles_after_warmup": 0, "host_share": 0.05}

    flat = row([[9, 10, 10, 10.2], [9, 10, 10, 10.4], [9, 10, 10, 10.0]], [1, 1, 1, 1], [8, 9, 9, 9.2])
    growing = row([[9, 10, 15, 20], [9, 10, 16, 21], [9, 10, 14, 19]], [1, 1, 1, 1], [8, 9, 14, 19])
    g = long.goals(flat, growing)
    assert g["flat_step_time"] and g["discriminated"] and g["flat_and_discriminated"]
    assert g["compressed_last_vs_first_full"] == pytest.approx(1.02) and g["full_last_vs_first_full"] == 2.0
    assert g["compressed_growth"]["beyond_spread"] is False and g["compressed_growth"]["grows_in"] is None
    assert g["margin_over_both_spreads"] == pytest.approx(2.0 - 1.02 - (0.04 + 0.2))
    assert g["compressed_spread_within_tolerance"] and g["full_last_vs_first_full_of_min"] == 1.9
    assert g["full_over_compressed_by_window"][:2] == [1, 1]
    assert g["full_over_compressed_last_vs_first_full"] == pytest.approx(20 / 10.2)
    noisy = row([[9, 10, 10, 10.2], [9, 10, 10, 30], [9, 5, 10, 10]], [1, 1, 1, 1], [8, 9, 9, 9.2])
    assert not long.goals(flat, noisy)["discriminated"]  # a full KV repeat (1.02) below a compressed one
    # every full KV repeat above every compressed one, though one outlier makes the whole spreads overlap
    outlier = row([[9, 10, 15, 19], [9, 10, 16, 20], [9, 10, 14, 40]], [1, 1, 1, 1], [8, 9, 14, 19])
    g = long.goals(flat, outlier)
    assert g["discriminated"] and g["margin_over_both_spreads"] < 0
    host_grows = row([[9, 10, 12, 13], [9, 10, 12, 13.1], [9, 10, 12, 13.2]], [1, 1, 2, 4], [8, 9, 10, 9.1])
    g = long.goals(host_grows, growing)
    assert not g["flat_step_time"] and g["compressed_growth"]["beyond_spread"]
    assert g["compressed_growth"]["grows_in"] == "host" and g["compressed_growth"]["host_ms_change"] == 3


def test_bench_long_presets_and_bad_arguments(bench_args):
    quick, options = long.settings(bench_args("long", "--quick", "--kv-cache-dtype", "int8"))
    model = quick.model
    assert quick.max_tokens >= 2048 and quick.budget_tokens == 256 and quick.block_size == 64
    assert options == {"kv_cache_dtype": "int8"} and model == "default" and quick.repeats == 1
    quick.pool_workload().check()  # full KV holds the longest request
    default = long.PRESETS["default"]
    assert (default.requests, default.max_tokens, default.window) == (32, 4096, 512)
    assert default.pool_workload().num_pool_blocks == 32 * (256 // 64 + 1) + 1
    attention, _ = long.settings(bench_args("long", "--preset", "attention"))
    assert attention.model == "random-qwen3" and attention.repeats == 3 and attention.requests >= 8
    assert (attention.max_tokens, attention.block_size, attention.budget_tokens) == (8192, 16, 256)
    assert attention.pool_workload().num_pool_blocks == 8 * -(-(64 + 8192) // 16) + 1
    shape = long.RANDOM_MODELS["random-qwen3"]
    assert (shape["num_layers"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (4, 8, 2, 64)
    k4, _ = long.settings(bench_args("long", "--preset", "default-4k", "--repeats", "2", "--model", "x"))
    assert k4.max_tokens >= 4096 and k4.repeats == 2 and k4.model == "x" and k4.pool_holds_full_kv
    with pytest.raises(ValueError, match="multiple of the block size"):
        long.LongWorkload(4, 8, 8, 64, 16, budget_tokens=40).pool_workload()
    for bad in (["--max-cache-blocks-per-seq", "4"], ["--quick", "--preset", "attention"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            long.settings(bench_args("long", *bad))
