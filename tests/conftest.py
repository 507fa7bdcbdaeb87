"""Session-wide fixtures: tiny saved models (built once per session), a private param cache, and
no persistent compilation cache."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from tiny_models import ARCHS, save_tiny_model


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
def no_persistent_compilation_cache() -> None:
    """The suite never writes or reads JAX's persistent compilation cache: jaxlib 0.11.2's CPU
    executable serialization has aborted the test process in (de)serializing some entries, so
    every engine here compiles in memory (subprocesses, such as README command (1)'s CLI, still
    use their own cache)."""
    jax.config.update("jax_enable_compilation_cache", False)
