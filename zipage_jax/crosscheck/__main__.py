"""python -m zipage_jax.crosscheck {logits,generate,golden,tp} ...

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "logits": "this model's logits vs transformers' on the same weights",
    "generate": "batched greedy generation vs transformers' generate",
    "golden": "scoring and compaction vs the reference's golden vectors",
    "tp": "greedy outputs with tensor parallelism vs one device",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.crosscheck")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"zipage_jax.crosscheck.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"zipage_jax.crosscheck.{name}":
                raise
            continue
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
