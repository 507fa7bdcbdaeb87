"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory, model_cache_dir):
    """The tiny llama model, its converted parameters cached in the session's private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield tiny_model_factory("llama")
    mp.undo()
