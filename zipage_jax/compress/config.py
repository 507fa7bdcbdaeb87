"""The engine-wide scoring options (docs/ALGORITHM.md sections 4-5), validated at construction.

A static argument of the jitted compression step: changing one compiles a new step. A
sequence's budget and policy are per-row values (`policies.KVBudget`), not part of it, and the
block size is the pools' own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Redundancy = Literal["none", "lightning", "raw"]


@dataclass(frozen=True)
class CompressionConfig:
    use_global_score: bool = True  # accumulated attention with decay (the reference's global score)
    decay_factor: float = 0.8
    max_norm: bool = False
    enable_pooling: bool = False
    continues_pooling: bool = False
    pooling_size: int = 5
    # max-pool kernel over the scores of a compaction inside a prompt (SnapKV's pooling): a token
    # the prompt's end attends to keeps its neighbours, so a span survives whole; 1: off
    prompt_pooling_size: int = 15
    redundancy: Redundancy = "none"
    redundancy_lambda: float = 0.2
    redundancy_temperature: float = 0.4
    redundancy_threshold: float = 0.5

    def __post_init__(self) -> None:
        for name in ("use_global_score", "max_norm", "enable_pooling", "continues_pooling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.pooling_size, int) or self.pooling_size < 1 or self.pooling_size % 2 == 0:
            raise ValueError(f"pooling_size must be a positive odd number, got {self.pooling_size!r}")
        if not isinstance(self.prompt_pooling_size, int) or self.prompt_pooling_size < 1 \
                or self.prompt_pooling_size % 2 == 0:
            raise ValueError(f"prompt_pooling_size must be a positive odd number, got {self.prompt_pooling_size!r}")
        if self.redundancy not in ("none", "lightning", "raw"):
            raise ValueError(f"redundancy must be none, lightning or raw, got {self.redundancy!r}")
        if not 0.0 <= self.redundancy_lambda <= 1.0:
            raise ValueError(f"redundancy_lambda must be in [0, 1], got {self.redundancy_lambda}")
        if self.redundancy_temperature <= 0:
            raise ValueError(f"redundancy_temperature must be > 0, got {self.redundancy_temperature}")
        if not 0.0 < self.decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in (0, 1], got {self.decay_factor}")
        if not 0.0 <= self.redundancy_threshold <= 1.0:
            raise ValueError(f"redundancy_threshold must be in [0, 1], got {self.redundancy_threshold}")
