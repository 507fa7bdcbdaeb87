"""python -m zipage_jax.crosscheck tp --model M --tp N [--json] [--kv-budget T] [engine options]

Greedy generation of the same prompts with tensor parallelism over N devices and on one
device (float32 unless --dtype says otherwise); the token ids must be identical. --kv-budget
compresses every request to T tokens. On CPU with fewer than N devices this command runs
itself again with XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from zipage_jax.cli_options import add_engine_arguments, engine_options

PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of the planets of the solar system, in order from the sun, with one fact about each:",
]
_REEXEC = "ZIPAGE_JAX_TP_REEXEC"  # set in the re-executed child, so it never loops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size to compare with 1")
    parser.add_argument("--prompt", action="append", help="prompt (repeatable); default: 4 built-in prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-budget", type=int, default=None, help="per-request KV budget in tokens (compression)")
    parser.add_argument("--json", action="store_true", help="last line: a JSON report with `identical`")
    add_engine_arguments(parser)


def greedy_tokens(llm, prompts: list, max_tokens: int, kv_budget: int | None = None) -> list[list[int]]:
    from zipage_jax import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_budget=kv_budget)
    return [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if index is None and len(a) != len(b) else index


def run(args: argparse.Namespace) -> int:
    if args.tp < 1:
        print(f"error: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size is not None:
        print("error: use --tp, not --tensor-parallel-size", file=sys.stderr)
        return 2
    error = _ensure_devices(args.tp)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    import jax

    from zipage_jax import LLM

    options = {"dtype": "float32", **engine_options(args)}
    prompts = args.prompt or PROMPTS
    outputs = {}
    try:
        for size in (1, args.tp):
            llm = LLM(tensor_parallel_size=size, **options)
            outputs[size] = greedy_tokens(llm, prompts, args.max_tokens, args.kv_budget)
            del llm
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {"identical": True, "tp": args.tp, "devices": [str(d) for d in jax.devices()[:args.tp]],
              "tokens_compared": 0, "prompts": []}
    for prompt, single, parallel in zip(prompts, outputs[1], outputs[args.tp]):
        difference = first_difference(single, parallel)
        report["tokens_compared"] += min(len(single), len(parallel))
        report["identical"] &= difference is None
        report["prompts"].append({"prompt": prompt, "first_difference": difference,
                                  "tp1": single if difference is not None else None,
                                  f"tp{args.tp}": parallel if difference is not None else None})
        status = "identical" if difference is None else f"differs at new token {difference}"
        print(f"{len(single)} new tokens, TP={args.tp} vs TP=1: {status}")
    if args.json:
        print(json.dumps(report))
    return 0 if report["identical"] else 1


def _ensure_devices(size: int) -> str | None:
    """None if JAX sees `size` devices; on CPU it re-executes this command with enough (never returns)."""
    import jax

    count = len(jax.devices())
    if count >= size:
        return None
    if jax.default_backend() != "cpu" or os.environ.get(_REEXEC):
        return f"--tp {size} needs {size} devices, JAX sees {count} {jax.default_backend()} device(s)"
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, _REEXEC: "1",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={size}".strip()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "zipage_jax.crosscheck", *sys.argv[1:]], env)
