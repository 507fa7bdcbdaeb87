"""The console script zipage-jax (zipage_jax/cli.py): every flag of its serve and generate
subcommands says what it does, and its help runs as `python -m zipage_jax` and as the installed
script."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from zipage_jax.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def subcommand_parser(*path: str) -> argparse.ArgumentParser:
    """The parser of `zipage-jax PATH...`, with its arguments."""
    parser, _ = build_parser(list(path))
    for name in path:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    return parser


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_option_has_help(command):
    parser = subcommand_parser(command)
    options = [action for action in parser._actions if action.option_strings]
    assert len(options) > 40  # the engine's flags are there
    assert [action.option_strings for action in options if not (action.help or "").strip()] == []
    parser.format_help()  # every help string formats


def test_server_flags_keep_their_spelling_and_defaults():
    args = subcommand_parser("serve").parse_args([])
    assert (args.host, args.port, args.served_model_name, args.log_level, args.max_n, args.api_key) == (
        "127.0.0.1", 8000, None, "info", 128, None)
    assert (args.max_request_bytes, args.max_queued_requests) == (4 * 2**20, 1024)
    assert (args.max_prompts, args.max_stop_strings, args.max_stop_chars) == (None, None, None)
    assert (args.max_chat_messages, args.max_chat_bytes) == (10_000, 2 * 2**20)
    assert args.max_num_seqs is None and args.warmup is None  # engine flags: the config's default unless given
    args = subcommand_parser("serve").parse_args(["--max-prompts-per-request", "3", "--served-model-name", "a", "b",
                                                  "--no-enable-prefix-caching", "--decay-factor", "0.5"])
    assert (args.max_prompts, args.served_model_name) == (3, ["a", "b"])
    assert (args.enable_prefix_caching, args.decay_factor) == (False, 0.5)


def test_help_shows_each_engine_options_documentation_and_default():
    text = " ".join(subcommand_parser("generate").format_help().split())
    assert "--max-num-seqs MAX_NUM_SEQS sequences running at once (default: 64)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching share the KV blocks" in text
    assert "(default: on)" in text


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_python_dash_m_help_runs():
    result = run(sys.executable, "-m", "zipage_jax", "--help")
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("generate", "serve", "bench", "eval", "crosscheck"))


def test_the_installed_script_runs_a_crosscheck_help():
    script = Path(sys.executable).with_name("zipage-jax")
    assert script.is_file(), "the package is not installed (pip install -e .)"
    result = run(str(script), "crosscheck", "golden", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: zipage-jax crosscheck golden")
