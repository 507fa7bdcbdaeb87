"""HumanEval pass@1 through the engine: full KV and every policy at several budgets, in one engine.

    zipage-jax eval code [--model qwen2.5-coder-0.5b-instruct] [--split dev|heldout|both]
        [--policies all|NAME ...] [--budgets 64 96 128 192 256] [--limit N] [--json PATH]

The protocol is the usual one for instruct models: the chat template, the user turn
"Complete the following Python function:" and the problem in a python code block; greedy
decoding up to --max-tokens; the answer's first python code block (else its first code block,
else the whole answer), after the prompt's import lines, is run with the problem's tests
(`check(entry_point)`) in a separate, limited process (`sandbox.py`). A crash, a hang or a memory
hog is a failed problem.

Every (config, problem) pair is one request of a single `llm.generate` call: a config is a
per-request `kv_budget` (0 = full KV) and `eviction_policy`, so every config shares one engine
and its prefix cache. Splits (datasets.py): "dev" is the even task numbers (HumanEval/0, /2, ...),
the only ones anything may be tuned on; "heldout" the odd ones. Per split and config the summary gives
pass@1, its ratio to full KV's, the mean generated tokens and their ratio to full KV's, and the
answers cut at max_tokens.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from zipage_jax.compress.policies import POLICIES
from zipage_jax.evals.configs import (
    EvalConfig,
    add_engine_arguments,
    configs,
    engine_overrides,
    format_table,
    parse_budget,
    parse_configs,
    summarize,
)
from zipage_jax.evals.datasets import SPLITS, HumanEvalProblem, humaneval_problems
from zipage_jax.evals.sandbox import Limits, run_program
from zipage_jax.harness import build_llm, run_record

DEFAULT_BUDGETS = (64, 96, 128, 192, 256)
INSTRUCTION = "Complete the following Python function:"
DEFAULT_LIMITS = Limits()


def messages(problem: HumanEvalProblem) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{INSTRUCTION}\n```python\n{problem.prompt}```"}]


_BLOCK = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(answer: str) -> str:
    """The first python code block of an answer, else its first code block, else the answer (an
    unclosed block runs to the end)."""
    blocks = _BLOCK.findall(answer)
    for lang, body in blocks:
        if lang.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else answer


def program(problem: HumanEvalProblem, code: str) -> str:
    """The script that passes (exit 0) when `code` solves `problem`."""
    imports = [line for line in problem.prompt.splitlines() if line.startswith(("import ", "from "))]
    return "\n".join([*imports, "", code, "", problem.test, "", f"check({problem.entry_point})", ""])


def generate_answers(llm, problems: Sequence[HumanEvalProblem], eval_configs: Sequence[EvalConfig], max_tokens: int,
                     use_tqdm: bool = True) -> dict[tuple[str, str], dict]:
    """(config name, task id) -> the engine's output dict, every pair in one generate call."""
    prompts = {p.task_id: llm.apply_chat_template(messages(p)) for p in problems}
    pairs = [(c, p) for p in problems for c in eval_configs]  # a problem's configs together: its prefix is shared
    params = [c.sampling_params(max_tokens) for c, _ in pairs]
    outputs = llm.generate([prompts[p.task_id] for _, p in pairs], params, use_tqdm=use_tqdm)
    return {(c.name, p.task_id): out for (c, p), out in zip(pairs, outputs, strict=True)}


def grade(problems: Sequence[HumanEvalProblem], answers: dict[tuple[str, str], dict], limits: Limits = DEFAULT_LIMITS,
          workers: int = 2) -> dict[tuple[str, str], str]:
    """(config name, task id) -> the sandbox's status ("passed", "failed" or "timeout")."""
    by_id = {p.task_id: p for p in problems}

    def one(key):
        return run_program(program(by_id[key[1]], extract_code(answers[key]["text"])), limits).status

    keys = list(answers)
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def summary(problems: Sequence[HumanEvalProblem], eval_configs: Sequence[EvalConfig], answers: dict,
            statuses: dict, block_size: int) -> dict[str, list[dict]]:
    """Per split, one row per config (configs.py summarize), with the answers that timed out."""
    ids = {split: [p.task_id for p in problems if p.split == split] for split in SPLITS}
    table = summarize(eval_configs, ids, answers, lambda c, t: statuses[c, t] == "passed", block_size)
    for split, rows in table.items():
        for row in rows:
            row["timeouts"] = sum(statuses[row["config"], t] == "timeout" for t in ids[split])
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--split", choices=(*SPLITS, "both"), default="both")
    parser.add_argument("--policies", nargs="+", default=["all"], help="eviction policies, or 'all'")
    parser.add_argument("--budgets", nargs="+", type=parse_budget, default=list(DEFAULT_BUDGETS),
                        help="kv_budget tokens, or auto")
    parser.add_argument("--configs", nargs="+", default=None, metavar="POLICY@BUDGET",
                        help="these pairs instead of every policy at every budget (full KV always runs); "
                             "POLICY@BUDGET+keep_prompt keeps each prompt whole beside the budget, "
                             "+no_keep_prompt bounds it too (default: the engine's choice)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many problems per split")
    parser.add_argument("--max-tokens", type=int, default=512)
    add_engine_arguments(parser)
    parser.add_argument("--keep-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help="--policies x --budgets with each prompt kept whole beside its budget, or bounded by "
                             "it (default: the engine's choice; with --configs: POLICY@BUDGET+keep_prompt)")
    parser.add_argument("--task-ids", nargs="+", default=None, help="only these problems (e.g. HumanEval/0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the summary and every answer to this file")


def run(args: argparse.Namespace) -> int:
    policies = list(POLICIES) if args.policies == ["all"] else args.policies
    if args.configs is not None and args.keep_prompt is not None:
        raise SystemExit("--keep-prompt goes with --policies and --budgets; with --configs write "
                         "POLICY@BUDGET+keep_prompt")
    eval_configs = (configs(policies, args.budgets, args.keep_prompt) if args.configs is None
                    else parse_configs(args.configs))
    problems = humaneval_problems(SPLITS if args.split == "both" else (args.split,), args.limit)
    if args.task_ids is not None:
        unknown = set(args.task_ids) - {p.task_id for p in problems}
        if unknown:
            raise SystemExit(f"--task-ids not among the chosen problems: {', '.join(sorted(unknown))}")
        problems = [p for p in problems if p.task_id in set(args.task_ids)]
    llm = build_llm(args.model, **engine_overrides(args))
    answers = generate_answers(llm, problems, eval_configs, args.max_tokens)
    statuses = grade(problems, answers)
    table = summary(problems, eval_configs, answers, statuses, llm.engine.config.kvcache_block_size)
    print(format_table(table, args.max_tokens))
    if args.json:
        result = {"run": run_record(), "args": _own_arguments(args), "summary": table,
                  "answers": [{"config": k[0], "task_id": k[1], "text": a["text"],
                               "finish_reason": a["finish_reason"], "generated_tokens": len(a["token_ids"]),
                               "status": statuses[k]} for k, a in answers.items()]}
        with open(args.json, "w") as f:
            json.dump(result, f)  # one line, as every JSON result in docs/results/
            f.write("\n")
    return 0


def _own_arguments(args: argparse.Namespace) -> dict:
    """This evaluation's flags, without the command line's choice of subcommand."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "name")}
