"""The console script: zipage-jax generate | serve | bench NAME | eval NAME | crosscheck NAME
(`python -m zipage_jax ...` is the same).

Every subcommand is a module with `add_arguments(parser)` and `run(args) -> int` (the exit
status). Only the chosen subcommand's module is imported, so `zipage-jax serve` does not load
the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zipage_jax import bench, crosscheck, evals

COMMANDS = {  # name: (module, help)
    "generate": ("zipage_jax.commands.generate", "generate text for one or more prompts"),
    "serve": ("zipage_jax.commands.serve", "serve the OpenAI-compatible HTTP API"),
}
GROUPS = {  # name: (package, its subcommands {NAME: help}, help)
    "bench": ("zipage_jax.bench", bench.SUBCOMMANDS, "benchmarks: speed and memory against a baseline"),
    "eval": ("zipage_jax.evals", evals.SUBCOMMANDS, "evaluations: task accuracy, compressed against full KV"),
    "crosscheck": ("zipage_jax.crosscheck", crosscheck.SUBCOMMANDS,
                   "cross-checks against transformers and the PyTorch reference"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], str]]:
    """The parser, with the arguments of the subcommand `argv` names (if any), and the module of
    every subcommand by its path ("generate",) or ("bench", "throughput")."""
    words = [w for w in argv if not w.startswith("-")]
    parser = argparse.ArgumentParser(prog="zipage-jax", description="zipage-jax: LLM inference with a compressed, "
                                     "paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules: dict[tuple[str, ...], str] = {}
    for name, (module, help_text) in COMMANDS.items():
        _add(sub.add_parser(name, help=help_text, description=help_text), module, words[:1] == [name])
        modules[(name,)] = module
    for group, (package, names, help_text) in GROUPS.items():
        group_parser = sub.add_parser(group, help=help_text, description=help_text)
        group_sub = group_parser.add_subparsers(dest="name", required=True, metavar="NAME")
        for name, name_help in names.items():
            module = f"{package}.{name.replace('-', '_')}"
            _add(group_sub.add_parser(name, help=name_help, description=name_help), module, words[:2] == [group, name])
            modules[(group, name)] = module
    return parser, modules


def _add(parser: argparse.ArgumentParser, module: str, selected: bool) -> None:
    if selected:
        importlib.import_module(module).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, modules = build_parser(argv)
    args = parser.parse_args(argv)
    path = (args.command,) if args.command in COMMANDS else (args.command, args.name)
    status = importlib.import_module(modules[path]).run(args)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
