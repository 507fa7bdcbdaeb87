"""The automatic budget (`kv_budget="auto"`): a sequence's budget follows what compacting would cost.

Where a fixed budget would compact (every block full at the budget, and the next token needs a
block), an automatic one first measures: the compaction program runs once keeping every token
(nothing moves) and reports, for every number of blocks j the sequence could keep, the share of
the cached queries' attention that the tokens it would evict receive (scoring.py `evicted_mass`: per layer
and kv head, the tokens ranked by the policy's own final score, the attention outside the best
j * block_size; averaged over heads and layers). The host then picks (`choose`):

- the fewest blocks j, from the floor up to what the sequence holds, whose loss is at most the
  threshold: it compacts to j next step (its budget may shrink as well as stay);
- none: it grows by `grow_blocks` (at most to its ceiling) and measures again once those fill;
- none, but it is at its ceiling or the pool has no block that no one is owed (the running
  sequences on their way to their first compaction: engine/block_reserve.py): it compacts to
  what it holds (the fixed budget's behaviour at that size).

So memory per sequence stays within its ceiling, a growing sequence never takes a block another
one needs (it compacts instead), and a step that does not measure pays nothing: the measurement
is read back only in the step that runs it, once that step's forward is on its way. DBudgetKV
(arXiv 2502.16886) stops when the kept attention reaches a share of the full; Ada-KV (arXiv
2407.11550) bounds the output's loss by the evicted attention mass: the same quantity, used here
to size the budget rather than split it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

AUTO = "auto"
Budget = int | str  # a kv_budget: tokens (0: full KV), or AUTO


@dataclass(frozen=True)
class AutoBudget:
    """A sequence's automatic budget bounds, in blocks, and its loss threshold."""

    floor: int  # the fewest blocks it keeps when it compacts
    ceiling: int  # the most blocks it keeps (it holds one more while it fills the next)
    grow: int  # blocks added when no budget it could keep loses little enough
    threshold: float  # the largest share of attention a compaction may evict


def parse_budget(text: str) -> int | str:
    """A command line's kv_budget: "auto" or a token count (0: full KV)."""
    if text == AUTO:
        return AUTO
    if not text.isdigit():
        raise ValueError(f"a kv_budget is a token count or {AUTO!r}, got {text!r}")
    return int(text)


parse_budget.__name__ = "kv_budget"  # argparse's "invalid kv_budget value: ..."


def choose(losses: np.ndarray, num_blocks: np.ndarray, budget_blocks: np.ndarray, floor: np.ndarray,
           ceiling: np.ndarray, grow: np.ndarray, threshold: np.ndarray,
           spare_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The next budget in blocks of each measured row, and whether it compacts to it now.

    losses: [R, W] `evicted_mass` averaged over layers; the others [R]; spare_blocks: the free
    blocks growth may take. Returns (blocks [R], compacts [R] bool): a row that does not compact
    grows to `blocks` (> what it keeps now)."""
    width = losses.shape[1]
    j = np.arange(width)[None]
    holds = num_blocks - 1  # the most it can keep and still write its next token
    fits = ((j >= floor[:, None]) & (j <= np.minimum(holds, ceiling)[:, None])
            & (losses <= threshold[:, None]))
    best = np.where(fits.any(axis=1), fits.argmax(axis=1), -1)
    grown = np.minimum(ceiling, budget_blocks + grow)
    wants = (best < 0) & (grown > holds)
    can_grow = wants & (np.cumsum(wants) <= spare_blocks)  # each takes its next block now
    compacts = ~can_grow
    blocks = np.where(best >= 0, best, np.where(can_grow, grown, np.minimum(holds, ceiling)))
    return blocks, compacts


def bounds(floor_tokens: int, ceiling_tokens: int, grow_tokens: int, threshold: float, block_size: int,
           holds_protected: Callable[[int], bool]) -> AutoBudget:
    """Bounds in blocks: the floor rounded up to blocks and to what the policy protects
    (`holds_protected(blocks)`), the ceiling rounded down and at least the floor."""
    floor = max(1, -(-floor_tokens // block_size))
    while not holds_protected(floor):
        floor += 1
    return AutoBudget(floor, max(floor, ceiling_tokens // block_size), max(1, -(-grow_tokens // block_size)),
                      threshold)
