"""What benchmarks, evaluations and cross-checks read of an engine beyond its stats, through one
call (`LLMEngine.introspect()`), so that none of them reaches into the runner or the block manager."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineIntrospection:
    """A snapshot of plain values, taken at the call. Counters the engine's stats already hold
    (free blocks, programs built, compile seconds) stay there: `LLMEngine.get_stats()`."""

    model_source: str  # where the weights came from: a directory, a .gguf file or a random model's name
    kv_block_bytes: int  # one KV block of every layer: K, V and their scales
    compaction_compile_seconds: float  # of the stats' compile_seconds: building the compaction programs
    compaction_seconds: float  # compactions' own time, measured only with the engine's profile_compaction
