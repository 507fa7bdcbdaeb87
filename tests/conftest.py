"""Session-wide fixtures: tiny saved models (built once per session), a private cache of
parameters and compiled programs; after each module, its compiled programs released; and the
namespaces `zipage-jax bench|eval NAME ARGV` parse to, with the JSON a subcommand printed last."""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import jax
import pytest
from tiny_models import ARCHS, save_tiny_model

from zipage_jax.cli import build_parser


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch, sharded=False, **config_overrides) -> a saved tiny model directory (made once per args)."""
    made: dict[tuple, Path] = {}

    def make(arch: str, *, sharded: bool = False, **overrides) -> Path:
        key = (arch, sharded, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"), sharded=sharded, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir(request, tiny_model_factory) -> Path:
    """One tiny model per family: qwen3 (tied, head_dim 32, q/k norm), qwen2 (qkv biases, sharded
    safetensors), llama (llama3 RoPE scaling). Parametrise with indirect=True to pick one."""
    return tiny_model_factory(request.param, sharded=request.param == "qwen2")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    """A converted-parameter cache for this session only (never ~/.cache)."""
    return tmp_path_factory.mktemp("zipage_jax_cache")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """$ZIPAGE_JAX_CACHE for this session only (tests that convert models point it at
    `model_cache_dir`): engines of different tests share stored programs through it, and the
    suite never loads a program or parameters that another process (an older checkout, a
    benchmark) wrote."""
    directory = tmp_path_factory.mktemp("zipage_jax_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(directory))
    yield directory
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def xla_flags_unchanged():
    """No test module leaves XLA_FLAGS changed: every process a later test starts inherits it (a
    device count meant for one worker would give every later server several devices)."""
    before = os.environ.get("XLA_FLAGS")
    yield
    assert os.environ.get("XLA_FLAGS") == before, f"XLA_FLAGS changed to {os.environ.get('XLA_FLAGS')!r}"


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """After each module, drop what it compiled (its engines are gone by then): every executable
    holds memory mappings of its machine code, and a process with more than vm.max_map_count
    (65,530 by default) mappings dies inside XLA's next compile."""
    yield
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory, model_cache_dir) -> str:
    """The tiny llama model's directory, its converted parameters in the session's private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield str(tiny_model_factory("llama"))
    mp.undo()


def _cli_namespace(*words: str) -> argparse.Namespace:
    """The namespace `zipage-jax WORDS...` parses to: what the CLI hands a subcommand's run()."""
    return build_parser(list(words))[0].parse_args(list(words))


@pytest.fixture(scope="session")
def bench_args():
    """bench_args(name, *argv): the namespace of `zipage-jax bench NAME ARGV`."""
    return lambda name, *argv: _cli_namespace("bench", name, *argv)


@pytest.fixture(scope="session")
def eval_args():
    """eval_args(name, *argv): the namespace of `zipage-jax eval NAME ARGV`."""
    return lambda name, *argv: _cli_namespace("eval", name, *argv)


@pytest.fixture
def last_json(capsys):
    """last_json(): the JSON object on the last line printed to stdout so far."""
    return lambda: json.loads(capsys.readouterr().out.strip().splitlines()[-1])
