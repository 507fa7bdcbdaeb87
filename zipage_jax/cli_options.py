"""Engine options as command-line flags (shared by the CLI, the server and the scripts)."""

from __future__ import annotations

import argparse
import typing

from zipage_jax.config import option_fields


def add_engine_arguments(parser: argparse.ArgumentParser, help: dict[str, str] | None = None) -> None:
    """One --flag per engine option (--max-cache-blocks-per-seq, --kvcache-block-size, ...);
    `help`: text for some of them, by option name."""
    help = help or {}
    for name, kind in option_fields():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help.get(name))
        else:
            parser.add_argument(flag, type=_parser_for(kind), default=None, metavar=name.upper(), help=help.get(name))


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """--coordinator-address, --num-processes, --process-id: this process's place in a jax.distributed run."""
    group = parser.add_argument_group("multi-process (jax.distributed; every process runs the same command)")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address, the same in all")
    group.add_argument("--num-processes", type=int, metavar="N")
    group.add_argument("--process-id", type=int, metavar="I", help="0 .. N-1")


def start_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize from the flags (nothing without --coordinator-address)."""
    from zipage_jax.engine.sharding import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)


def engine_options(args: argparse.Namespace) -> dict:
    """The flags that were given, as `EngineConfig.from_options` keyword arguments."""
    return {name: getattr(args, name) for name, _ in option_fields() if getattr(args, name, None) is not None}


def _parser_for(kind):
    if typing.get_origin(kind) is not typing.Literal:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if args else kind
    return str if typing.get_origin(kind) is typing.Literal else kind
