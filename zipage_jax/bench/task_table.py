"""The paper's table on task requests (`bench throughput --humaneval SPLIT` / `--gsm8k SPLIT`):
full KV and the default policy at a budget (tokens, or "auto") on one pool of equal memory, timed
side by side on the problems' chat prompts (greedy, ending at EOS); both runs' answers graded, so
the pass ratio comes from the very outputs that were timed.

The pool holds every request at `pool_budget` tokens (the fixed budget itself, unless the budget
is automatic), so full KV holds only some of them at once and preempts or queues the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from zipage_jax.bench.workload import Workload, engine_config, size_pools
from zipage_jax.config import EngineConfig

TASKS = ("humaneval", "gsm8k")


@dataclass(frozen=True)
class TaskProblems:
    ids: list[str]
    conversations: list[list[dict]]
    grade: Callable[[dict], dict]  # {(run, id): output} -> {(run, id): passed}


def task_problems(task: str, split: str, limit: int | None) -> TaskProblems:
    if task == "humaneval":
        from zipage_jax.evals import code
        from zipage_jax.evals.datasets import humaneval_problems

        problems = humaneval_problems((split,), limit)
        return TaskProblems([p.task_id for p in problems], [code.messages(p) for p in problems],
                            lambda answers: {k: s == "passed" for k, s in code.grade(problems, answers).items()})
    from zipage_jax.evals import math as math_eval
    from zipage_jax.evals.math_data import load

    problems = load(task, (split,), limit)
    _, grade = math_eval.make_grader()
    return TaskProblems([p.problem_id for p in problems], [math_eval.messages(p) for p in problems],
                        lambda answers: math_eval.grade_answers(problems, answers, grade))


def run_task_table(task: str, split: str, budget: int | str, model: str, options: dict | None = None,
                   limit: int | None = None, max_tokens: int = 512, block_size: int = 16, interleave: bool = True,
                   log=None, warmup: bool = True, pool_budget: int = 128) -> dict:
    """Full KV against the default policy at `budget` (see the module docstring)."""
    from zipage_jax.bench.throughput import bench_modes, pair_summary
    from zipage_jax.chat import chat_prompt_ids
    from zipage_jax.models.loading import load_model

    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    options = {k: v for k, v in (options or {}).items() if k not in ("eviction_policy", "kvcache_memory_gb")}
    loaded = load_model(model, dtype=options.get("dtype"), revision=options.get("revision"),
                        download_dir=options.get("download_dir"))
    problems = task_problems(task, split, limit)
    prompts = [chat_prompt_ids(loaded.tokenizer, c) for c in problems.conversations]
    lengths = [len(p) for p in prompts]
    sized = pool_budget if budget == "auto" else budget
    workload = Workload(requests=len(prompts), prompt_len_min=min(lengths), prompt_len_max=max(lengths),
                        max_tokens=max_tokens, block_size=block_size, budget_blocks=-(-sized // block_size))
    workload.check()
    pool = size_pools(workload, loaded, ["auto"], options.get("tensor_parallel_size", 1))["auto"]
    compressed = f"default@{budget if budget == 'auto' else workload.budget_blocks * block_size}"
    if budget == "auto":  # the engine's ceiling, not the pool's budget
        options = {"auto_budget": True, "auto_budget_max": EngineConfig.auto_budget_max, **options}
    configs = {"full": engine_config(model, workload, False, options, pool),
               compressed: engine_config(model, workload, True, options, pool, scoring={})}
    outputs: dict[str, list[dict]] = {}
    rows = bench_modes(loaded, configs, prompts, max_tokens, interleave, log, warmup, ignore_eos=False,
                       answers=outputs)
    answers = {(name, i): out for name, outs in outputs.items() for i, out in zip(problems.ids, outs, strict=True)}
    passed = problems.grade(answers)
    for name, row in rows.items():
        row["passed"] = sum(passed[name, i] for i in problems.ids)
        row["pass_at_1"] = row["passed"] / len(prompts)
        row["mean_generated_tokens"] = row["output_tokens"] / len(prompts)
        row["mean_peak_kv_tokens"] = block_size * float(np.mean([o["metrics"]["kv_blocks_peak"]
                                                                 for o in outputs[name]]))
    full, zipage_row = rows["full"], rows[compressed]
    return {
        **pair_summary(full, zipage_row, pool, float(np.mean(lengths)) + full["mean_generated_tokens"]),
        "pass_at_1_full": full["pass_at_1"],
        "pass_at_1_compressed": zipage_row["pass_at_1"],
        "pass_ratio": zipage_row["passed"] / full["passed"] if full["passed"] else None,
        "tokens_ratio": zipage_row["mean_generated_tokens"] / full["mean_generated_tokens"],
        "peak_kv_ratio": zipage_row["mean_peak_kv_tokens"] / full["mean_peak_kv_tokens"],
        "task": task,
        "split": split,
        "problems": len(prompts),
        "budget": budget,
        "budget_tokens": None if budget == "auto" else workload.budget_blocks * block_size,
        "pool_budget_tokens": workload.budget_blocks * block_size,
        "model": str(loaded.source),
        "options": options,
        "interleaved": interleave,
        "warmup": warmup,
        "workload": asdict(workload),
        "runs": rows,
    }
