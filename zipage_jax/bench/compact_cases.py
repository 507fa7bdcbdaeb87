"""Adversarial compaction inputs: keep patterns and block geometries (tests/compress/test_compact.py and
`zipage-jax bench gpu`, which runs them on the GPU against the reference).

A case: `num_seqs` sequences of `width` full blocks at shuffled blocks, then one padding row
(keeps nothing, tables and targets all the dummy block 0). Targets rotate through: in place,
all fresh blocks (out of place), a fresh first block (replacing a shared prefix block) and the
rest in place.
"""

from __future__ import annotations

import numpy as np

PATTERNS = ("shift_by_one", "alternate", "only_last", "run_across_blocks", "positions_1_and_2",
            "nothing", "too_many", "random")


def num_pool_blocks(num_seqs: int, width: int, budget: int) -> int:
    return 1 + num_seqs * (width + budget) + 2  # dummy, sequences, fresh targets, unused


def kept_positions(name: str, width: int, budget: int, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Kept logical positions of one (seq, head) among width*BS tokens, for budget*BS slots."""
    cap, total = budget * block_size, width * block_size
    if name == "shift_by_one":  # every kept token moves back one slot
        return np.arange(1, cap + 1)
    if name == "alternate":
        return np.arange(1, total, 2)[:cap]
    if name == "only_last":
        return np.arange(total - cap, total)
    if name == "run_across_blocks":  # two early tokens, then a run crossing block boundaries
        return np.r_[0, 3, np.arange(block_size - 2, block_size - 4 + cap)]
    if name == "positions_1_and_2":  # 2 -> 1 while 1 -> 0; the rest of the block stays
        return np.array([1, 2])
    if name == "nothing":
        return np.array([], int)
    if name == "too_many":  # more than the budget: the extra ones are dropped
        return np.sort(rng.choice(total, cap + block_size // 2, replace=False))
    if name == "random":  # mostly exactly the budget
        n = int(rng.choice([cap, cap, rng.integers(1, cap + 1)]))
        return np.sort(rng.choice(total, n, replace=False))
    raise ValueError(f"unknown keep pattern {name!r}; choose from {PATTERNS}")


def compaction_case(pattern: str, seed: int, *, num_seqs: int, num_kv_heads: int, width: int, budget: int,
                    block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block_tables [B, W], target_tables [B, M], keep [B, Hkv, W, BS]) with B = num_seqs + 1,
    every valid (seq, head) keeping `pattern` (drawn anew per head for "random")."""
    if width < budget + 1:
        raise ValueError(f"width {width} must exceed the budget {budget}")
    rng = np.random.default_rng(seed)
    batch = num_seqs + 1
    free = list(rng.permutation(np.arange(1, num_pool_blocks(num_seqs, width, budget))))
    tables = np.zeros((batch, width), np.int32)
    targets = np.zeros((batch, budget), np.int32)
    keep = np.zeros((batch, num_kv_heads, width * block_size), bool)
    for b in range(num_seqs):
        tables[b] = [free.pop() for _ in range(width)]
        targets[b] = tables[b, :budget]
        if b % 3 == 1:
            targets[b] = [free.pop() for _ in range(budget)]
        elif b % 3 == 2:
            targets[b, 0] = free.pop()
        for h in range(num_kv_heads):
            keep[b, h, kept_positions(pattern, width, budget, block_size, rng)] = True
    return tables, targets, keep.reshape(batch, num_kv_heads, width, block_size)
