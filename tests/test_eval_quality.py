"""scripts/eval_quality.py and scripts/plot_results.py plumbing, on a tiny random model."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

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
    key = eq.Job("passkey", [1], [2], free=3, answer="12345")
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
