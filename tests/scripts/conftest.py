"""Fixtures the script tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory, model_cache_dir) -> str:
    """The tiny llama model's directory, its converted parameters in the session's private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield str(tiny_model_factory("llama"))
    mp.undo()
