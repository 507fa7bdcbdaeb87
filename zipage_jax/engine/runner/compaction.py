"""The host tables of one compaction step, padded to its bucket (b sequences, tables w blocks
wide): each planned sequence's source and target blocks, its block count, query slot, whether
it was compressed before, and its policy row (compress/policies.py). Padding rows keep nothing."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zipage_jax.compress.policies import CompressRows, RowSequence, compress_rows
from zipage_jax.engine.block_manager import DUMMY_BLOCK, CompressionPlan


class CompactionTables(NamedTuple):
    """The arguments of the compaction program after the layer's KV, in its order."""

    tables: np.ndarray  # [b, w] i32 the blocks read
    num_blocks: np.ndarray  # [b] i32
    query_ids: np.ndarray  # [b] i32 query slots (num_query_slots: the padding row)
    compressed: np.ndarray  # [b] bool: the sequence was compressed before
    targets: np.ndarray  # [b, w] i32 the blocks written
    rows: CompressRows


def compaction_tables(plans: list[CompressionPlan], b: int, w: int, num_query_slots: int) -> CompactionTables:
    tables = np.full((b, w), DUMMY_BLOCK, np.int32)
    targets = np.full((b, w), DUMMY_BLOCK, np.int32)
    num_blocks = np.zeros(b, np.int32)
    query_ids = np.full(b, num_query_slots, np.int32)
    compressed = np.zeros(b, bool)
    for i, plan in enumerate(plans):
        seq = plan.seq
        tables[i, :len(plan.source_table)] = plan.source_table
        targets[i, :len(plan.target_table)] = plan.target_table
        num_blocks[i] = len(plan.source_table)
        query_ids[i] = seq.query_slot
        compressed[i] = seq.compressed
    rows = compress_rows([plan.seq.budget for plan in plans], b, [
        RowSequence(seq.num_prompt_tokens, seq.num_computed_tokens - seq.num_kv_slots, seq.quote_end,
                    in_prompt=seq.num_computed_tokens <= seq.num_prefill_tokens)
        for seq in (plan.seq for plan in plans)])
    return CompactionTables(tables, num_blocks, query_ids, compressed, targets, rows)
