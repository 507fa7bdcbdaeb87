"""python -m zipage_jax.crosscheck generate --model M [--new-tokens 64] [--json]

Batched greedy generation of prompts of different lengths through this engine and through
transformers' greedy `generate` (one prompt at a time, so no padding enters its numbers) on
the same weights; the token ids must be identical.
"""

from __future__ import annotations

import argparse
import json

PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of the planets of the solar system, in order from the sun, with one fact about each:",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", action="append", help="prompt (repeatable); default: 4 built-in prompts")
    parser.add_argument("--kvcache-block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from zipage_jax import LLM, SamplingParams
    from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy

    prompts = args.prompt or PROMPTS
    llm = LLM(args.model, dtype="float32", kvcache_block_size=args.kvcache_block_size)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ours = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    reference = load_reference_model(llm.engine.introspect().model_source)
    report = {"identical": True, "tokens_compared": 0, "prompts": []}
    for prompt, mine in zip(prompts, ours):
        ids = llm.tokenizer(prompt)["input_ids"]
        theirs = reference_greedy(reference, ids, args.new_tokens)
        divergence = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if divergence is None and len(mine) != len(theirs):
            divergence = min(len(mine), len(theirs))
        report["tokens_compared"] += min(len(mine), len(theirs))
        report["prompts"].append({"prompt": prompt, "first_divergence": divergence,
                                  "ours": mine if divergence is not None else None,
                                  "transformers": theirs if divergence is not None else None})
        report["identical"] &= divergence is None
        status = "identical" if divergence is None else f"diverges at new token {divergence}"
        print(f"{len(ids):3d} prompt tokens, {len(mine)} new: {status}")
    if args.json:
        print(json.dumps(report))
    return 0 if report["identical"] else 1
