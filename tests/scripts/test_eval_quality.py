"""scripts/eval_quality.py and scripts/plot_results.py plumbing, on a tiny random model."""

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import eval_quality as eq  # noqa: E402
import plot_results  # noqa: E402
from zipage_jax import SamplingParams  # noqa: E402
from zipage_jax.models.loading import load_model  # noqa: E402

LENGTH = 160  # prompt + forced tokens per job: 10 blocks of 16


@pytest.fixture(scope="module")
def loaded(tiny_model_factory, model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield load_model(str(tiny_model_factory("llama")))
    mp.undo()


@pytest.fixture(scope="module")
def args():
    return eq.parse_args(["--length", str(LENGTH), "--block-size", "16", "--query-cache-len", "4"])


def _jobs(free: int = 0) -> list[eq.Job]:
    rng = np.random.default_rng(0)
    return [eq.Job("text:t", rng.integers(3, 320, 16).tolist(), rng.integers(3, 320, LENGTH - 16).tolist(), free=free)
            for _ in range(2)]


def test_forced_logprobs_are_the_engines_own(loaded, args):
    """Forcing the tokens greedy decoding chose gives back greedy decoding's log-probabilities."""
    llm = eq.make_llm(loaded, args, 64, 4)
    prompt = _jobs()[0].prompt
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0,
                                                  kv_budget=0), use_tqdm=False)[0]
    job = eq.Job("text:t", prompt, plain["token_ids"][:30], free=10)
    (res,) = eq.teacher_force(llm, [job], [0], ["full"])
    expected = [d["logprob"] for d in plain["logprobs"]]
    np.testing.assert_allclose(res.logprobs, expected[:30], rtol=0, atol=1e-5)
    assert res.generated == plain["token_ids"][30:40]


def test_compression_changes_only_tokens_after_the_first_compaction(loaded, args):
    jobs = _jobs(free=8)
    budget = 64  # 4 blocks: the first compaction comes when the 6th block is needed (token 80)
    llm = eq.make_llm(loaded, args, eq.pool_blocks(jobs * 3, [0, 0, budget, budget, budget, budget], 16), 6)
    results = eq.teacher_force(llm, jobs * 3, [0, 0, budget, budget, budget, budget],
                               ["full", "full", "zipage-attn", "zipage-attn", "streaming", "streaming"])
    full, attn, streaming = results[:2], results[2:4], results[4:]
    before = 5 * 16 - 16  # forced tokens decoded before any compaction (the prompt is 16 tokens)
    for ref, mine in zip(full * 2, attn + streaming):
        assert np.all(np.isfinite(mine.logprobs)) and np.all(mine.logprobs <= 0)
        np.testing.assert_allclose(mine.logprobs[:before], ref.logprobs[:before], rtol=0, atol=1e-5)
        assert np.abs(mine.logprobs[before:] - ref.logprobs[before:]).max() > 1e-4
    assert any(not np.allclose(a.logprobs, s.logprobs) for a, s in zip(attn, streaming))
    row = eq.summarise("streaming", 0.4, jobs, streaming, full)
    assert 0 < row["ppl_ratio"] != 1.0 and 0 <= row["agreement"] <= 1 and row["passkey_accuracy"] is None


def test_each_policy_runs_with_its_own_engine_options(loaded, args):
    """Mixed in one batch, every policy gives what an engine built for it alone gives."""
    jobs = _jobs()
    budget = 64
    names = ["zipage-attn", "zipage", "window-attn", "window"]
    mixed, _ = eq.run_batch(loaded, args, jobs * 4, [budget] * 8, [n for n in names for _ in jobs])
    for k, name in enumerate(names):
        options = dict(eq.VARIANTS[name])
        llm = eq.make_llm(loaded, args, eq.pool_blocks(jobs, [budget] * 2, 16), 2,
                          tuple(sorted(options.items())))  # eviction_policy as an engine option
        alone = eq.teacher_force(llm, jobs, [budget] * 2, ["full"] * 2)  # "full" sets no per-request policy
        for a, b in zip(mixed[2 * k:2 * k + 2], alone):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)  # batch-size rounding
    assert np.abs(mixed[0].logprobs - mixed[2].logprobs).max() > 1e-2  # zipage-attn != zipage
    assert np.abs(mixed[4].logprobs - mixed[6].logprobs).max() > 1e-2  # window-attn != window (global score)


def test_summarise_ratio_and_agreement():
    job = eq.Job("text:t", [1], [5, 6, 7], free=2)
    full = eq.JobResult(np.log([0.5, 0.5, 0.5]), [1, 2])
    mine = eq.JobResult(np.log([0.25, 0.5, 0.5]), [1, 3])
    key = eq.Job("passkey", [1], [2], free=3, answer="12345", kind="passkey")
    rows = eq.summarise("p", 0.125, [job, key], [mine, eq.JobResult(np.zeros(1), [], " 12345.")],
                        [full, eq.JobResult(np.zeros(1), [], "")])
    assert rows["ppl_ratio"] == pytest.approx(0.5 ** (1 / 3))  # exp(-(log 2) / 3 tokens)
    assert rows["agreement"] == 0.5 and rows["passkey_accuracy"] == 1.0


def test_passkey_jobs_state_the_key_early_and_ask_at_the_end(loaded):
    tok = loaded.tokenizer
    (job,) = eq.passkey_jobs(tok, 3000, 1)
    text = tok.decode(job.prompt + job.forced)
    assert text.rstrip().endswith("The pass key is") and text.index(job.answer) < len(text) // 4
    assert abs(len(job.prompt) + len(job.forced) - 3000) < 60


def test_budget_tokens_and_bad_arguments():
    assert eq._budget_tokens(1 / 8, 2048, 32, 16) == 256
    assert eq._budget_tokens(1 / 16, 1000, 32, 16) == 64
    with pytest.raises(ValueError, match="too small"):
        eq._budget_tokens(1 / 64, 512, 16, 16)
    with pytest.raises(SystemExit):
        eq.parse_args(["--budgets", "1.5"])
    with pytest.raises(SystemExit):
        eq.parse_args(["--text", "/no/such/file"])


def test_plot_writes_png(tmp_path):
    rows = [{"policy": "full", "budget_fraction": 1.0, "ppl_ratio": 1.0, "passkey_accuracy": 1.0, "agreement": 1.0}]
    rows += [{"policy": p, "budget_fraction": f, "ppl_ratio": 0.9 + f / 10, "passkey_accuracy": None,
              "agreement": f} for p in ("streaming", "window") for f in (1 / 8, 1 / 4)]
    src = tmp_path / "q.json"
    src.write_text("log line\n" + json.dumps({"results": rows}) + "\n")
    out = tmp_path / "q.png"
    plot_results.main([str(src), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_results.plot(rows, out) == ["ppl_ratio", "agreement"]
    plot_results.main([str(src), "--out", str(out), "--policies", "window"])
    with pytest.raises(ValueError, match="no compressed policy"):
        plot_results.main([str(src), "--out", str(out), "--policies", "nope"])
    src.write_text("{}\n")
    with pytest.raises(ValueError, match="results"):
        plot_results.load_rows(src)


def test_variants_cover_the_policy_registry():
    from zipage_jax import EngineConfig
    from zipage_jax.compress.policies import POLICIES

    assert set(POLICIES) <= set(eq.VARIANTS)
    for name, options in eq.VARIANTS.items():
        assert options.get("eviction_policy", "zipage") in POLICIES, name
        EngineConfig.from_options(**eq.engine_options(eq.parse_args([]), eq.engine_group(name)))
    assert eq.engine_group("window") == eq.engine_group("vnorm-window") == (("use_global_score", True),)
    assert eq.engine_group("zipage-attn") == ()  # attention only: engine_options turns the global score off


# -- equal memory and the held-out set ---------------------------------------------------------

SMOLLM = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # the default model's KV shape


def test_kv_token_bytes_count_values_and_scales():
    values = 2 * 30 * 3 * 64  # K and V of every layer and kv head
    assert eq.kv_token_bytes(SMOLLM, "auto", jnp.bfloat16) == 2 * values
    assert eq.kv_token_bytes(SMOLLM, "auto", jnp.float32) == 4 * values
    for dtype in ("int8", "fp8"):  # one byte a value plus a float32 scale per token, kv head, K / V, layer
        assert eq.kv_token_bytes(SMOLLM, dtype, jnp.bfloat16) == values + 4 * 2 * 30 * 3


def test_memory_budget_tokens_at_equal_memory():
    bf16, int8 = 2 * 64, 64 + 4  # bytes per value of one token's K (likewise V): the ratio is what counts
    for fraction, tokens_bf16, tokens_int8 in ((1 / 16, 64, 112), (1 / 8, 128, 240), (1 / 4, 256, 480)):
        assert eq.memory_budget_tokens(fraction, 1024, bf16, bf16, 16, 16) == tokens_bf16
        # floor(fraction * 1024 * 128 / 68) tokens, rounded down to blocks of 16: never more memory
        assert eq.memory_budget_tokens(fraction, 1024, int8, bf16, 16, 16) == tokens_int8
        assert tokens_int8 * int8 <= fraction * 1024 * bf16 < (tokens_int8 + 16) * int8
    assert eq.memory_budget_tokens(1 / 8, 1024, int8, bf16, 32, 16) == 224  # 240.9 -> 7 blocks of 32
    with pytest.raises(ValueError, match="too few"):
        eq.memory_budget_tokens(1 / 64, 512, bf16, bf16, 16, 16)


def test_memory_fields_in_bf16_and_f32_terms():
    point = eq.Point("vnorm-window", "int8", 1 / 8, 240)
    row = eq.memory_fields(SMOLLM, point, 1024, jnp.float32)
    assert row["memory_fraction"] == 1 / 8 and row["budget_tokens"] == 240
    assert row["memory_fraction_bf16"] == pytest.approx(240 * 68 / (1024 * 128))
    assert row["memory_fraction_f32"] == pytest.approx(240 * 68 / (1024 * 256))
    auto = eq.memory_fields(SMOLLM, eq.Point("streaming", "auto", 1 / 8, 128), 1024, jnp.float32)
    assert auto["memory_fraction_bf16"] == auto["memory_fraction_f32"] == 1 / 8  # the CPU stores auto in f32
    full = eq.memory_fields(SMOLLM, eq.Point("full", "fp8", 1.0, 0), 1024, jnp.float32)  # quantization alone
    assert full["budget_tokens"] == 1024 and full["memory_fraction"] == full["memory_fraction_bf16"] == 68 / 128


def test_plan_points_loop_over_dtypes_and_fractions():
    args = eq.parse_args(["--memory-fractions", "0.0625", "0.125", "--kv-cache-dtypes", "auto", "int8", "fp8"])
    assert (args.policies, args.block_size, args.split, args.passkey_trials) == (eq.MEMORY_POLICIES, 16, "both", 0)
    points = eq.plan_points(args, SMOLLM, 1024)
    assert [p for p in points if p.policy == "full"] == [eq.Point("full", "int8", 1.0, 0), eq.Point("full", "fp8", 1.0, 0)]
    budgets = {(p.kv_cache_dtype, p.fraction): p.budget for p in points if p.policy != "full"}
    assert budgets == {("auto", 1 / 16): 64, ("auto", 1 / 8): 128, ("int8", 1 / 16): 112, ("int8", 1 / 8): 240,
                       ("fp8", 1 / 16): 112, ("fp8", 1 / 8): 240}
    assert len(points) == 2 + 3 * 2 * len(eq.MEMORY_POLICIES)
    legacy = eq.plan_points(eq.parse_args(["--budgets", "0.125", "--policies", "full", "streaming"]), SMOLLM, 1024)
    assert legacy == [eq.Point("streaming", "auto", 0.125, 128)]
    for bad in (["--budgets", "0.1", "--memory-fractions", "0.1"], ["--kv-cache-dtypes", "int8"],
                ["--memory-fractions", "1.0"], ["--heldout-per-kind", "-1"]):
        with pytest.raises(SystemExit):
            eq.parse_args(bad)


class _WordTokenizer:
    def __call__(self, text):
        return {"input_ids": list(range(len(text.split())))}


def test_heldout_rule_is_the_hash_order_of_long_enough_candidates():
    long, short = "w " * 50, "w " * 10
    candidates = {"prose": [(f"p{i}", lambda t=(long if i % 2 else short): t) for i in range(8)],
                  "docstrings": [(f"m{i}.py (docstrings)", lambda: long) for i in range(6)],
                  "code": [(f"m{i}.py", lambda: long) for i in range(6)]}

    def order(kind, names):
        return sorted(names, key=lambda n: hashlib.sha256(f"{kind}:{n}".encode()).hexdigest())

    picked = eq.heldout_sources(_WordTokenizer(), 2, 40, candidates)
    names = {kind: [s.name for s in picked if s.kind == kind] for kind in ("prose", "docstrings", "code")}
    assert names["prose"] == [n for n in order("prose", [f"p{i}" for i in range(8)]) if int(n[1:]) % 2][:2]
    assert names["docstrings"] == order("docstrings", [f"m{i}.py (docstrings)" for i in range(6)])[:2]
    docs = {n.removesuffix(" (docstrings)") for n in names["docstrings"]}
    assert names["code"] == [n for n in order("code", [f"m{i}.py" for i in range(6)]) if n not in docs][:2]
    assert [s.name for s in eq.heldout_sources(_WordTokenizer(), 2, 40, candidates)] == [s.name for s in picked]


def test_heldout_texts_are_fixed_and_never_dev(loaded):
    first = eq.heldout_sources(loaded.tokenizer, 1)
    assert [s.kind for s in first] == list(eq.HELDOUT_KINDS)  # the stdlib alone has a long text of each kind
    assert [(s.name, s.text) for s in eq.heldout_sources(loaded.tokenizer, 1)] == [(s.name, s.text) for s in first]
    assert not {s.name for s in first} & set(eq.STDLIB_TEXTS)
    assert all(len(loaded.tokenizer(s.text)["input_ids"]) >= eq.HELDOUT_MIN_TOKENS for s in first)
    assert not set(eq.HELDOUT_PROBLEMS) & set(eq.PROBLEMS)


def test_memory_mode_end_to_end(loaded, tiny_model_factory, monkeypatch):
    """int8 full KV (quantization alone) and attention-only zipage at a quarter of the bf16 memory (one
    engine: the same engine options), on one dev and one held-out text: budgets, rows per split, table."""
    monkeypatch.setattr(eq, "HELDOUT_KINDS", ("code",))
    args = eq.parse_args(["--model", str(tiny_model_factory("llama")), "--memory-fractions", "0.25",
                          "--kv-cache-dtypes", "int8", "--policies", "zipage-attn", "--length", str(LENGTH),
                          "--no-reasoning", "--num-texts", "1", "--heldout-per-kind", "1", "--query-cache-len", "4"])
    rows, workloads = eq.evaluate(args)
    assert [(j["kind"], j["split"]) for j in workloads["jobs"]] == [("code", "dev"), ("code", "heldout")]
    got = {(r["policy"], r["kv_cache_dtype"], r["split"]): r for r in rows}
    assert set(got) == {(p, d, s) for p, d in (("full", "auto"), ("full", "int8"), ("zipage-attn", "int8"))
                        for s in ("dev", "heldout")}
    # tiny llama: 2 layers, 2 kv heads, head dim 16: bf16 64 bytes a token per layer and head, int8 16 + 4 + 16 + 4
    tokens = int(0.25 * LENGTH * 64 / 40) // 16 * 16
    for split in ("dev", "heldout"):
        assert got["full", "auto", split]["ppl_ratio"] == 1.0
        quant = got["full", "int8", split]
        assert quant["memory_fraction_bf16"] == pytest.approx(40 / 64) and quant["budget_tokens"] == LENGTH
        assert 0.9 < quant["ppl_ratio"] < 1.1  # int8 rounding only
        compressed = got["zipage-attn", "int8", split]
        assert compressed["budget_tokens"] == tokens and compressed["memory_fraction"] == 0.25
        assert compressed["memory_fraction_bf16"] == pytest.approx(tokens * 40 / (LENGTH * 64))
        assert 0 < compressed["ppl_ratio"] != quant["ppl_ratio"]
        assert compressed["ppl_ratio_by_kind"] == {"code": compressed["ppl_ratio"]}
    table = eq.markdown_table(rows)
    r = got["zipage-attn", "int8", "heldout"]
    assert f"| zipage-attn | int8 | {r['memory_fraction_bf16']:.4f} |" in table
    assert f"{r['ppl_ratio']:.3f} ({got['zipage-attn', 'int8', 'dev']['ppl_ratio']:.3f})" in table


def test_plot_memory_writes_png(tmp_path):
    rows = [{"policy": "full", "kv_cache_dtype": "auto", "memory_fraction": 1.0, "memory_fraction_bf16": 1.0,
             "budget_fraction": 1.0, "split": s, "ppl_ratio": 1.0, "reasoning_ppl_ratio": 1.0}
            for s in ("dev", "heldout")]
    rows += [{"policy": "full", "kv_cache_dtype": "int8", "memory_fraction": 0.53, "memory_fraction_bf16": 0.53,
              "budget_fraction": 1.0, "split": "heldout", "ppl_ratio": 0.999, "reasoning_ppl_ratio": 0.998}]
    rows += [{"policy": p, "kv_cache_dtype": d, "memory_fraction": f, "memory_fraction_bf16": f * 0.99,
              "budget_fraction": f, "split": s, "ppl_ratio": 0.9 + f / 10, "reasoning_ppl_ratio": 0.8 + f / 10}
             for p in ("streaming", "vnorm-window") for d in ("auto", "int8") for f in (1 / 8, 1 / 4)
             for s in ("dev", "heldout")]
    src = tmp_path / "m.json"
    src.write_text(json.dumps({"results": rows}) + "\n")
    out = tmp_path / "m.png"
    plot_results.main([str(src), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_results.plot_memory(rows, out) == ["heldout", "dev"]
    assert len(plot_results.merge([src, src])) == len(rows)  # dtype, fraction and split keep rows apart
