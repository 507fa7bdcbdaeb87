"""Config fields as command-line flags (shared by the CLI, the server and the benchmarks): a
flag's help is its field's documentation (`compress.config.option`) and its default."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from zipage_jax.compress.config import doc_of
from zipage_jax.config import option_fields

_NOT_ARGPARSE = ("doc", "flag")  # field metadata that add_field_argument reads itself


def add_engine_arguments(parser: argparse.ArgumentParser, help: dict[str, str] | None = None) -> None:
    """One --flag per engine option (--max-cache-blocks-per-seq, --kvcache-block-size, ...), None
    unless given (the config's default then holds); `help`: text that replaces the help of
    some, by option name."""
    help = help or {}
    for f, kind in option_fields():
        add_field_argument(parser, f, kind, default=None, help=help.get(f.name))


def add_field_argument(parser: argparse.ArgumentParser, f: dataclasses.Field, kind: object,
                       default: object = dataclasses.MISSING, help: str | None = None) -> None:
    """The flag of config field `f` of type `kind`: --name (or its metadata's "flag"), a bool as
    --name / --no-name; `default`: the field's unless given; help: `help`, else the field's
    documentation and default. The field's other metadata (metavar, nargs, choices) go to argparse."""
    flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    text = help or doc_of(f) + _default_note(f.default)
    options = {key: value for key, value in f.metadata.items() if key not in _NOT_ARGPARSE}
    options.update(dest=f.name, default=f.default if default is dataclasses.MISSING else default,
                   help=text.replace("%", "%%"))
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
    else:
        if "choices" not in options:
            options.setdefault("metavar", f.name.upper())
        parser.add_argument(flag, type=_parser_for(kind), **options)


def add_distributed_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--coordinator-address, --num-processes, --process-id: this process's place in a jax.distributed
    run; returns their group (a command adds its own multi-process flags to it)."""
    group = parser.add_argument_group("multi-process (jax.distributed; every process runs the same command, with its "
                                      "own --process-id)")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address, the same in all")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index: 0 .. N-1")
    return group


def start_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize from the flags (nothing without --coordinator-address)."""
    from zipage_jax.engine.distributed import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)


def engine_options(args: argparse.Namespace) -> dict:
    """The flags that were given, as `EngineConfig.from_options` keyword arguments."""
    return {f.name: getattr(args, f.name) for f, _ in option_fields() if getattr(args, f.name, None) is not None}


def _default_note(default: object) -> str:
    """A field's default as its help states it; none for None (the documentation says what that means)."""
    if default is None or default is dataclasses.MISSING:
        return ""
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f" (default: {shown})"


def _parser_for(kind):
    """What argparse converts a value with: the type itself, its member (optional, a list's
    element), str for a Literal."""
    if typing.get_origin(kind) is typing.Literal:
        return str
    members = [a for a in typing.get_args(kind) if a is not type(None)]
    if members:
        return _parser_for(members[0])
    return kind
