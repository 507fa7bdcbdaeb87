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
from dataclasses import dataclass

from zipage_jax.bench.common import build_llm, run_record
from zipage_jax.compress.policies import POLICIES
from zipage_jax.evals.datasets import SPLITS, HumanEvalProblem, humaneval_problems
from zipage_jax.evals.sandbox import Limits, run_program

DEFAULT_BUDGETS = (64, 96, 128, 192, 256)
INSTRUCTION = "Complete the following Python function:"
FULL_KV = "full"
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class EvalConfig:
    policy: str  # FULL_KV or an eviction policy
    budget: int  # kv_budget in tokens; 0 with FULL_KV

    @property
    def name(self) -> str:
        return FULL_KV if self.policy == FULL_KV else f"{self.policy}@{self.budget}"


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


def configs(policies: Sequence[str], budgets: Sequence[int]) -> list[EvalConfig]:
    """Full KV, then every policy at every budget."""
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    for budget in budgets:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budgets must be positive token counts, got {budget!r}")
    return [EvalConfig(FULL_KV, 0)] + [EvalConfig(p, b) for p in policies for b in budgets]


def parse_configs(pairs: Sequence[str]) -> list[EvalConfig]:
    """Full KV, then each "policy@budget" pair, validated as `configs` validates."""
    out = [EvalConfig(FULL_KV, 0)]
    for pair in pairs:
        policy, _, budget = pair.partition("@")
        if not budget.isdigit():
            raise ValueError(f"a config is POLICY@BUDGET (e.g. streaming@128), got {pair!r}")
        out += configs([policy], [int(budget)])[1:]
    return out


def generate_answers(llm, problems: Sequence[HumanEvalProblem], eval_configs: Sequence[EvalConfig], max_tokens: int,
                     use_tqdm: bool = True, keep_prompt: bool = False) -> dict[tuple[str, str], dict]:
    """(config name, task id) -> the engine's output dict, every pair in one generate call;
    `keep_prompt` gives every budgeted request its whole prompt on top of its budget."""
    from zipage_jax import SamplingParams

    prompts = {p.task_id: llm.apply_chat_template(messages(p)) for p in problems}
    pairs = [(c, p) for p in problems for c in eval_configs]  # a problem's configs together: its prefix is shared
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_budget=c.budget,
                             eviction_policy=None if c.policy == FULL_KV else c.policy,
                             keep_prompt=keep_prompt and c.policy != FULL_KV) for c, _ in pairs]
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


def summarize(problems: Sequence[HumanEvalProblem], eval_configs: Sequence[EvalConfig], answers: dict, statuses: dict,
              max_tokens: int) -> dict[str, list[dict]]:
    """Per split, one row per config: pass@1, ratios to full KV, mean generated tokens, answers cut."""
    table = {}
    for split in SPLITS:
        ids = [p.task_id for p in problems if p.split == split]
        if not ids:
            continue
        rows = []
        for c in eval_configs:
            lengths = [len(answers[c.name, t]["token_ids"]) for t in ids]
            rows.append({
                "config": c.name, "policy": c.policy, "budget": c.budget, "problems": len(ids),
                "passed": sum(statuses[c.name, t] == "passed" for t in ids),
                "mean_generated_tokens": sum(lengths) / len(ids),
                "cut_at_max_tokens": sum(answers[c.name, t]["finish_reason"] == "length" for t in ids),
                "timeouts": sum(statuses[c.name, t] == "timeout" for t in ids),
                "passed_ids": [t for t in ids if statuses[c.name, t] == "passed"],
            })
        full = rows[0]
        for row in rows:
            row["pass_at_1"] = row["passed"] / row["problems"]
            row["pass_ratio"] = row["passed"] / full["passed"] if full["passed"] else None
            row["tokens_ratio"] = row["mean_generated_tokens"] / full["mean_generated_tokens"]
        table[split] = rows
    return table


def format_table(table: dict[str, list[dict]], max_tokens: int) -> str:
    lines = []
    for split, rows in table.items():
        lines.append(f"{split} ({rows[0]['problems']} problems)")
        lines.append(f"{'config':<22} {'pass@1':>7} {'vs full':>8} {'gen tok':>8} {'vs full':>8} "
                     f"{'cut@' + str(max_tokens):>8}")
        for r in rows:
            ratio = "-" if r["pass_ratio"] is None else f"{r['pass_ratio']:.2f}"
            lines.append(f"{r['config']:<22} {r['passed']:>3}/{r['problems']:<3} {ratio:>8} "
                         f"{r['mean_generated_tokens']:>8.1f} {r['tokens_ratio']:>8.2f} {r['cut_at_max_tokens']:>8}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--split", choices=(*SPLITS, "both"), default="both")
    parser.add_argument("--policies", nargs="+", default=["all"], help="eviction policies, or 'all'")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS), help="kv_budget tokens")
    parser.add_argument("--configs", nargs="+", default=None, metavar="POLICY@BUDGET",
                        help="these pairs instead of every policy at every budget (full KV always runs)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many problems per split")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--kvcache-block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kvcache-memory-gb", type=float, default=4.0)
    parser.add_argument("--sink-len", type=int, default=None, help="override every policy's sinks")
    parser.add_argument("--recent-fraction", type=float, default=None, help="override the policies' recent share")
    parser.add_argument("--prompt-fraction", type=float, default=None, help="override the policies' prompt reserve")
    parser.add_argument("--keep-prompt", action="store_true", help="keep each prompt whole, beside its budget")
    parser.add_argument("--task-ids", nargs="+", default=None, help="only these problems (e.g. HumanEval/0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the summary and every answer to this file")


def run(args: argparse.Namespace) -> int:
    policies = list(POLICIES) if args.policies == ["all"] else args.policies
    eval_configs = configs(policies, args.budgets) if args.configs is None else parse_configs(args.configs)
    problems = humaneval_problems(SPLITS if args.split == "both" else (args.split,), args.limit)
    if args.task_ids is not None:
        unknown = set(args.task_ids) - {p.task_id for p in problems}
        if unknown:
            raise SystemExit(f"--task-ids not among the chosen problems: {', '.join(sorted(unknown))}")
        problems = [p for p in problems if p.task_id in set(args.task_ids)]
    overrides = {k: v for k in ("sink_len", "recent_fraction", "prompt_fraction")
                 if (v := getattr(args, k)) is not None}
    llm = build_llm(args.model, kvcache_block_size=args.kvcache_block_size, max_num_seqs=args.max_num_seqs,
                    kvcache_memory_gb=args.kvcache_memory_gb, **overrides)
    answers = generate_answers(llm, problems, eval_configs, args.max_tokens, keep_prompt=args.keep_prompt)
    statuses = grade(problems, answers)
    table = summarize(problems, eval_configs, answers, statuses, args.max_tokens)
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
