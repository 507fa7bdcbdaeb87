"""The host tables of one compaction step, padded to its bucket (b sequences, tables w blocks
wide), gathered from the running batch's rows: each sequence's source and target blocks, its
block count, query slot, whether it was compressed before, and its policy row
(compress/policies.py). Padding rows keep nothing. Two arrays, so that the program (called once
per layer) copies two to the device, not fourteen."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zipage_jax.compress.policies import CompressRows, set_compress_rows, unfillable_reserve_to_recent
from zipage_jax.engine.block_manager import DUMMY_BLOCK, CompressionPlan
from zipage_jax.engine.running_batch import RunningBatch

PER_ROW_HEAD = 3  # per_row's rows before the policy rows: block count, query slot, compressed before


class CompactionTables(NamedTuple):
    """The arguments of the compaction program after the layer's KV (runner/steps.py compaction_program)."""

    blocks: np.ndarray  # [2, b, w] i32 the blocks read, then the blocks written
    per_row: np.ndarray  # [3 + len(CompressRows), b] i32 block count, query slot, compressed before (0/1), policy rows

    @property
    def num_blocks(self) -> np.ndarray:
        return self.per_row[0]

    @property
    def query_ids(self) -> np.ndarray:
        return self.per_row[1]

    @property
    def compressed(self) -> np.ndarray:
        return self.per_row[2]

    @property
    def rows(self) -> CompressRows:
        return CompressRows(*self.per_row[PER_ROW_HEAD:])


def padding_tables(b: int, w: int, num_query_slots: int) -> CompactionTables:
    """b padding rows (they read and keep nothing): the shapes of the program's bucket."""
    per_row = np.zeros((PER_ROW_HEAD + len(CompressRows._fields), b), np.int32)
    per_row[1] = num_query_slots
    return CompactionTables(np.full((2, b, w), DUMMY_BLOCK, np.int32), per_row)


def compaction_tables(batch: RunningBatch, rows: np.ndarray, plans: list[CompressionPlan], b: int, w: int,
                      num_query_slots: int) -> CompactionTables:
    """The tables of compacting the running `rows` (a step's compaction rows: its plans' first,
    then the rows compacting in place). A row reads its blocks and writes its first M + 1, or
    its plan's targets."""
    t = padding_tables(b, w, num_query_slots)
    n = len(rows)
    read, written = t.blocks[0], t.blocks[1]
    t.num_blocks[:n] = batch.num_blocks[rows]
    table = batch.block_table[rows, :w]  # the bucket may be wider than the batch's tables
    cols = np.arange(table.shape[1])
    read[:n, :len(cols)] = np.where(cols < t.num_blocks[:n, None], table, DUMMY_BLOCK)
    written[:n, :len(cols)] = np.where(cols <= batch.budget_blocks[rows, None], table, DUMMY_BLOCK)
    for i, plan in enumerate(plans):  # blocks shared with other sequences are replaced
        written[i, :len(plan.target_table)] = plan.target_table
    t.query_ids[:n] = batch.query_slot[rows]
    t.compressed[:n] = batch.compressed[rows]
    computed, kv, prefill = batch.num_computed_tokens[rows], batch.num_kv_slots[rows], batch.num_prefill_tokens[rows]
    set_compress_rows(
        t.rows, slice(0, n), budget=batch.budget_tokens[rows], sinks=batch.budget_sinks[rows],
        recent=batch.budget_recent[rows], score=batch.budget_score[rows], prompt_reserve=batch.budget_reserve[rows],
        prompt_len=batch.num_prompt[rows], position_offset=computed - kv, quote_end=batch.quote_end[rows],
        in_prompt=computed <= prefill, history=batch.history_blocks[rows])
    unfillable_reserve_to_recent(t.rows, slice(0, n))
    return t


def measurement_tables(batch: RunningBatch, rows: np.ndarray, b: int, w: int, num_query_slots: int) -> CompactionTables:
    """The tables of measuring `rows` (automatic budgets at their compaction point): scored as
    their compaction would score them, each keeping every token in its own blocks, so nothing
    moves and the program reports what each budget would evict."""
    t = compaction_tables(batch, rows, [], b, w, num_query_slots)
    n = len(rows)
    t.blocks[1, :n] = t.blocks[0, :n]
    t.rows.budget[:n] = batch.num_kv_slots[rows]
    return t
