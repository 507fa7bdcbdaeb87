"""Switching a fresh engine's attention / compression backend in tests (importable anywhere: it
changes no environment, unlike the workers that set XLA_FLAGS for their own process)."""

from __future__ import annotations

from zipage_jax.backend import Backend


def use_backend(runner, backend: str) -> None:
    """Switches a fresh runner's attention / compression backend (pallas-interpret is not an
    EngineConfig choice: it only exists for tests on CPU)."""
    assert runner.num_compiles == 0, "switch the backend before anything compiles"
    runner.inputs.backend = backend = Backend.parse(backend)
    runner.forward.layers.static["backend"] = runner.compressor.static["backend"] = backend
