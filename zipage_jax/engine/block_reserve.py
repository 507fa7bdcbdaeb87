"""What a full pool owes before it lends a block to an automatic budget's growth.

A budgeted sequence holds its own once it reaches its first compaction point: from there it
compacts rather than take another block, and it is never preempted. On its way there it takes
blocks as any sequence does. If the pool admits it without room for that way, or lends the room
to an automatic budget that grows, a full pool preempts it and it computes its prompt again: the
costliest thing a full pool does. So a budgeted sequence is admitted only when its peak fits
beside what the running ones are still owed, and an automatic budget grows only into blocks they
are not owed. Waiting requests hold no claim: an automatic budget that needs to grow does so
before another request is admitted, so its answer does not depend on how many requests wait.
"""

from __future__ import annotations

import numpy as np

from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.sequence import Sequence


def owed_blocks(batch: RunningBatch, rows: np.ndarray) -> int:
    """Blocks the budgeted `rows` not yet compressed still take to reach their first compaction
    point: their budget and the block after it (an automatic budget past its prompt: its floor)."""
    m, floor = batch.budget_blocks[rows], batch.auto_floor[rows]
    in_prompt = batch.num_computed_tokens[rows] < batch.num_prefill_tokens[rows]
    target = np.where(in_prompt | (floor < 0), m, floor) + 1
    owed = np.where((m >= 0) & ~batch.compressed[rows], target - batch.num_blocks[rows], 0)
    return int(np.maximum(owed, 0).sum())


def beyond_floor(batch: RunningBatch, rows: np.ndarray) -> np.ndarray:
    """Which of `rows` have an automatic budget and hold more than its floor: another block
    for them is growth, lent only from what no one is owed."""
    floor = batch.auto_floor[rows]
    return (floor >= 0) & (batch.num_blocks[rows] > floor)


def admission_blocks(seq: Sequence, prompt: PromptCompaction) -> int:
    """The most blocks `seq` holds before it holds its own: a budgeted one its peak up to its
    first compaction point (engine/prompt_compaction.py), one with full KV its tokens so far and
    the block its next token starts."""
    if seq.budget is None:
        return len(seq) // seq.block_size + 1
    return prompt.peak_blocks(seq.budget.blocks, len(seq), seq.budget.deferred)
