"""`zipage-jax eval math`: its graders, problem sets and report (tiny models)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zipage_jax.evals import math as bench_math


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


def test_arithmetic_set_round_trips_and_bad_files_raise(tmp_path, eval_args):
    rows = bench_math.make_arithmetic(20, seed=3)
    assert rows == bench_math.make_arithmetic(20, seed=3) and rows != bench_math.make_arithmetic(20, seed=4)
    for r in rows:  # every answer is the value of the expression in the problem
        expr = r["problem"].removeprefix("What is ").removeprefix("Compute ").rstrip("?.")
        if "apples" not in expr:
            assert eval(expr) == int(r["answer"])  # noqa: S307 - generated digits and operators only
    path = tmp_path / "a.jsonl"
    assert bench_math.run(eval_args("math", "--make-arithmetic", "5", str(path))) == 0
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
                                      core=SimpleNamespace(runner=SimpleNamespace(compile_seconds=0.0)))
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
def test_bench_math_end_to_end_tiny_model(llama_dir, tmp_path, eval_args, last_json):
    data = tmp_path / "arith.jsonl"
    bench_math.run(eval_args("math", "--make-arithmetic", "3", str(data)))
    assert bench_math.run(eval_args("math", *_math_argv(data, llama_dir))) == 0
    _check_math_report(last_json(), 3, 2, 24)


@pytest.mark.slow
def test_bench_math_end_to_end_default_model(tmp_path, eval_args, last_json):
    data = tmp_path / "arith.jsonl"
    bench_math.run(eval_args("math", "--make-arithmetic", "2", str(data)))
    assert bench_math.run(eval_args("math", *_math_argv(data, "default", max_cache_blocks_per_seq=2))) == 0
    report = last_json()
    _check_math_report(report, 2, 2, 24)
    assert report["model"].endswith(".gguf") and report["budget_tokens"] == 32

