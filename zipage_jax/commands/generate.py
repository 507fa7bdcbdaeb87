"""zipage-jax generate "PROMPT" [--model M] [--max-tokens N] [--temperature T] [engine options]"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from zipage_jax.cli_options import add_distributed_arguments, add_engine_arguments, engine_options, start_distributed
from zipage_jax.compress.auto_budget import parse_budget


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--kv-budget", type=parse_budget, default=None,
                        help="per-request KV budget in tokens (0 = full KV), or auto (sized at each compaction)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser)
    add_distributed_arguments(parser)


def run(args: argparse.Namespace) -> int:
    log_progress_to_stderr()
    # transformers only builds the tokenizer here: its "PyTorch was not found" advice does not apply
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

    from zipage_jax import LLM, SamplingParams

    try:
        start_distributed(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, kv_budget=args.kv_budget)
        llm = LLM(**engine_options(args))
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            results = llm.generate(args.prompts, params)
    except (ValueError, FileNotFoundError) as exc:  # a bad option, or a model that is neither here nor fetchable
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, result in zip(args.prompts, results):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": result["text"], "finish_reason": result["finish_reason"],
                              "metrics": result["metrics"]}))
        else:
            print(f"{prompt}{result['text']}")
            print(f"[{result['finish_reason']}; {result['metrics']['completion_tokens']} tokens]", file=sys.stderr)
    return 0


def log_progress_to_stderr() -> None:
    """Show the engine's INFO lines (model conversion and loading stages, with seconds) on stderr."""
    log = logging.getLogger("zipage_jax")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # a library may have given the root logger a handler too
