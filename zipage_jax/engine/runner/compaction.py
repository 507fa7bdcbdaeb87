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
        tables[i, :len(plan.source_table)] = plan.source_table
        targets[i, :len(plan.target_table)] = plan.target_table
        num_blocks[i] = len(plan.source_table)
    n = len(plans)
    # the sequences' counts, from their rows of the running batch in one gather each
    seqs = [plan.seq for plan in plans]
    batch = seqs[0].batch if seqs else None
    if batch is not None and all(seq.batch is batch for seq in seqs):
        at = np.array([seq.row for seq in seqs])
        query_ids[:n] = batch.query_slot[at]
        compressed[:n] = batch.compressed[at]
        computed, kv, prefill = batch.num_computed_tokens[at], batch.num_kv_slots[at], batch.num_prefill_tokens[at]
    else:
        query_ids[:n] = [seq.query_slot for seq in seqs]
        compressed[:n] = [seq.compressed for seq in seqs]
        computed, kv, prefill = (np.array([getattr(seq, name) for seq in seqs], np.int64)
                                 for name in ("num_computed_tokens", "num_kv_slots", "num_prefill_tokens"))
    rows = compress_rows([seq.budget for seq in seqs], b, [
        RowSequence(seq.num_prompt_tokens, int(c - k), seq.quote_end, in_prompt=bool(c <= p))
        for seq, c, k, p in zip(seqs, computed, kv, prefill)])
    return CompactionTables(tables, num_blocks, query_ids, compressed, targets, rows)
