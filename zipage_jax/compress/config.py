"""The engine-wide scoring options (docs/ALGORITHM.md sections 4-5), validated at construction.

A static argument of the jitted compression step: changing one compiles a new step. A
sequence's budget and policy are per-row values (`policies.KVBudget`), not part of it, and the
block size is the pools' own.

`option` documents a config field in the field itself: the command-line flags built from
EngineConfig and CompressionConfig (zipage_jax/cli_options.py) show that text as their help.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field
from typing import Any, Literal

Redundancy = Literal["none", "lightning", "raw"]


def option(default: Any = MISSING, *, doc: str, default_factory: Any = MISSING, **metadata: Any) -> Any:
    """A dataclass field with its documentation (`doc_of`) and any other `metadata`."""
    return field(default=default, default_factory=default_factory, metadata={"doc": doc, **metadata})


def doc_of(f: Field) -> str:
    """The documentation `option` gave field `f`."""
    return f.metadata["doc"]


@dataclass(frozen=True)
class CompressionConfig:
    use_global_score: bool = option(True, doc="score a token compressed before by the larger of its fresh score and "
                                              "its earlier one times decay_factor (the reference's global score)")
    decay_factor: float = option(0.8, doc="what the global score multiplies a token's earlier score by; in (0, 1]")
    max_norm: bool = option(False, doc="divide the scores by their per-(sequence, head) maximum before combining "
                                       "them")
    enable_pooling: bool = option(False, doc="max-pool the scores along the tokens (pooling_size) of a sequence not "
                                             "compressed before")
    continues_pooling: bool = option(False, doc="with enable_pooling, pool the scores of sequences compressed before "
                                                "too")
    pooling_size: int = option(5, doc="the max-pooling kernel of enable_pooling (an odd number)")
    prompt_pooling_size: int = option(15, doc="max-pool kernel over the scores of a compaction inside a prompt "
                                              "(SnapKV's pooling): a token the prompt's end attends to keeps its "
                                              "neighbours, so a span survives whole; 1: off")
    redundancy: Redundancy = option("none", doc="penalise keys similar to others: lightning compares keys within "
                                                "a block, raw across the whole sequence; none: off")
    redundancy_lambda: float = option(0.2, doc="with redundancy, the score becomes score * lambda - redundancy * "
                                               "(1 - lambda); in [0, 1]")
    redundancy_temperature: float = option(0.4, doc="with redundancy, the softmax temperature of the similarities "
                                                    "(> 0)")
    redundancy_threshold: float = option(0.5, doc="with redundancy, the cosine similarity above which two keys "
                                                  "count as near-copies; in [0, 1]")

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
