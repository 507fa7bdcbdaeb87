"""Math accuracy (pass@1) and output tok/s with full KV and with Zipage, side by side (the paper's protocol).

    zipage-jax eval math --data FILE.jsonl [--samples 4] [--max-tokens 4096] [--limit N] [--json]
        [--model default] [engine options, e.g. --max-cache-blocks-per-seq 8 --kvcache-block-size 256]
    zipage-jax eval math --make-arithmetic N OUT.jsonl [--sample-seed 0]

FILE.jsonl: one problem a line, {"problem": "...", "answer": "..."} (AIME/AMC/GSM8K style; the
answer a number or a LaTeX expression). Each problem is asked through the model's chat template
with the usual instruction to reason step by step and put the final answer in \\boxed{}; N
samples each at temperature 0.6, top_p 0.95, with the same seeds in both runs. Answers are graded
with the `math-verify` package (pip install 'zipage-jax[math]'); without it a fallback compares
the last \\boxed{} (else the last number) numerically, with a warning. Nothing is downloaded.

The compressed run uses --max-cache-blocks-per-seq (default 8 blocks, the reference's) with the
recommended scoring (global score + pooling + lightning redundancy); every other engine option
is shared. Compile time is measured (the engine's own count) and left out of the tok/s. The last
line of --json is one JSON object: pass_at_1 and throughput for "full" and "zipage", their
ratios, the grader and the settings.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from fractions import Fraction

from zipage_jax.bench.common import add_output_arguments, build_llm, emit, log, timed, usage_error
from zipage_jax.cli_options import add_engine_arguments, engine_options

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_BUDGET_BLOCKS = 8


# -- data ---------------------------------------------------------------------------------------


def load_problems(path: str, limit: int | None = None) -> list[dict]:
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict) or "problem" not in row or "answer" not in row:
                raise ValueError(f"{path}:{lineno}: each line needs 'problem' and 'answer'")
            problems.append({"problem": str(row["problem"]), "answer": str(row["answer"])})
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems[:limit] if limit else problems


def make_arithmetic(n: int, seed: int = 0) -> list[dict]:
    """Small arithmetic word problems with integer answers (a pipeline test set, not a benchmark)."""
    import numpy as np

    if n < 1:
        raise ValueError(f"need at least one problem, got {n}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b, c = (int(x) for x in rng.integers(2, 50, 3))
        kind = int(rng.integers(0, 4))
        if kind == 0:
            rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
        elif kind == 1:
            rows.append({"problem": f"What is {a} * {c % 12 + 2}?", "answer": str(a * (c % 12 + 2))})
        elif kind == 2:
            rows.append({"problem": f"Tom has {a + b} apples and gives away {b}. How many apples are left?",
                         "answer": str(a)})
        else:
            rows.append({"problem": f"Compute ({a} + {b}) * {c % 5 + 2}.", "answer": str((a + b) * (c % 5 + 2))})
    return rows


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


def run_mode(llm, problems: list[dict], params, grade) -> dict:
    conversations = [[{"role": "user", "content": f"{p['problem']}\n{INSTRUCTION}"}] for p in problems]
    compiled = llm.engine.core.runner.compile_seconds
    results, wall = timed(lambda: llm.chat(conversations, params, use_tqdm=False))
    compiled = llm.engine.core.runner.compile_seconds - compiled
    correct, tokens, truncated = [], 0, 0
    for problem, result in zip(problems, results, strict=True):
        outs = result["outputs"]
        correct.append(sum(grade(problem["answer"], o["text"]) for o in outs) / len(outs))
        tokens += sum(len(o["token_ids"]) for o in outs)
        truncated += sum(o["finish_reason"] == "length" for o in outs)
    stats = llm.engine.get_stats()
    net = max(wall - compiled, 1e-9)
    samples = len(problems) * params.n
    return {
        "pass_at_1": sum(correct) / len(correct),
        "throughput": tokens / net,
        "output_tokens": tokens,
        "mean_output_tokens": tokens / samples,
        "truncated_share": truncated / samples,
        "wall_seconds": net,
        "compile_seconds_excluded": compiled,
        "preemptions": stats.num_preemptions,
        "compressions": stats.num_compressions,
        "per_problem": correct,
    }


def compare(problems: list[dict], model: str, options: dict, samples: int, max_tokens: int, seed: int,
            budget_blocks: int) -> dict:
    """Full KV, then Zipage at `budget_blocks` per sequence with the recommended scoring, on one
    loaded model: pass@1, throughput and their ratios."""
    from zipage_jax import SamplingParams
    from zipage_jax.bench.workload import RECOMMENDED_SCORING

    grader, grade = make_grader()
    params = SamplingParams(n=samples, temperature=0.6, top_p=0.95, max_tokens=max_tokens, seed=seed)
    llm = build_llm(model, **options, max_cache_blocks_per_seq=None)
    report = {"grader": grader, "problems": len(problems), "samples": samples, "max_tokens": max_tokens,
              "budget_blocks": budget_blocks, "model": str(llm.engine.core.loaded.source), "options": options}
    report["full"] = run_mode(llm, problems, params, grade)
    log(f"  full: pass@1 {report['full']['pass_at_1']:.3f}, {report['full']['throughput']:.1f} tok/s")
    zipage_options = {**RECOMMENDED_SCORING, **options, "max_cache_blocks_per_seq": budget_blocks}
    llm = build_llm(model, loaded=llm.engine.core.loaded, **zipage_options)
    report["zipage"] = run_mode(llm, problems, params, grade)
    report["budget_tokens"] = budget_blocks * llm.engine.config.kvcache_block_size
    log(f"zipage: pass@1 {report['zipage']['pass_at_1']:.3f}, {report['zipage']['throughput']:.1f} tok/s "
        f"(budget {report['budget_tokens']} tokens, {report['zipage']['compressions']} compressions)")
    full_acc = report["full"]["pass_at_1"]
    report["accuracy_retention"] = report["zipage"]["pass_at_1"] / full_acc if full_acc else None
    report["speedup"] = report["zipage"]["throughput"] / report["full"]["throughput"]
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="JSONL file of {problem, answer}")
    parser.add_argument("--make-arithmetic", nargs=2, metavar=("N", "OUT"), help="write N arithmetic problems")
    parser.add_argument("--samples", type=int, default=4, help="samples per problem (pass@1 is their mean)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--limit", type=int, help="only the first N problems")
    parser.add_argument("--sample-seed", type=int, default=0,
                        help="sampling seed (the same for both runs) and --make-arithmetic's seed")
    add_output_arguments(parser)  # --json: one JSON object as the last line
    add_engine_arguments(parser)  # includes --model and --seed (the engine's)


def run(args: argparse.Namespace) -> int:
    if args.make_arithmetic:
        count, out = args.make_arithmetic
        rows = make_arithmetic(int(count), args.sample_seed)
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        log(f"wrote {len(rows)} problems to {out}")
        return 0
    if not args.data:
        usage_error("eval math", "--data FILE.jsonl (or --make-arithmetic N OUT.jsonl) is required")
    if args.samples < 1 or args.max_tokens < 1:
        usage_error("eval math", "--samples and --max-tokens must be >= 1")
    options = engine_options(args)
    model = options.pop("model", None) or "default"
    budget_blocks = options.pop("max_cache_blocks_per_seq", None) or DEFAULT_BUDGET_BLOCKS
    problems = load_problems(args.data, args.limit)
    log(f"{len(problems)} problems x {args.samples} samples, up to {args.max_tokens} tokens each")
    report = compare(problems, model, options, args.samples, args.max_tokens, args.sample_seed, budget_blocks)
    if not args.json:
        for mode in ("full", "zipage"):
            report[mode].pop("per_problem")
    return emit(report, args)
