"""The compaction program's host tables, gathered from the running batch's rows: checked against
tables written out by hand for a planned sequence (its shared block replaced) and one that
compacts in place, in a bucket wider than the batch's block tables."""

import dataclasses

import numpy as np
from budgets import zipage_budget

from zipage_jax.engine.block_manager import CompressionPlan
from zipage_jax.engine.runner.compaction import compaction_tables, padding_tables
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.sequence import Sequence

BS, M, NUM_QUERY_SLOTS = 4, 2, 5


def _running(batch: RunningBatch, table: list[int], computed: int, kv: int, compressed: bool, query_slot: int,
             prompt_reserve: int = 0) -> Sequence:
    budget = dataclasses.replace(zipage_budget(M, BS, 2), prompt_reserve=prompt_reserve)
    seq = Sequence(list(range(10, 10 + computed + 1)), BS, budget=budget, query_cache_len=2, num_prompt_tokens=6)
    seq.block_table, seq.num_computed_tokens, seq.num_kv_slots = table, computed, kv
    seq.num_prefill_tokens = 6
    seq.compressed, seq.query_slot, seq.quote_end = compressed, query_slot, 3
    seq.history_blocks = M - 1 if compressed else 0  # kept 1 block at its last compaction, grown to M since
    assert batch.attach(seq)
    return seq


def test_tables_of_a_planned_row_and_an_in_place_row_in_a_wider_bucket():
    batch = RunningBatch(4, 6, 2, (0,))
    batch.attach(Sequence([1, 2], BS))  # row 0: a sequence that does not compact
    planned = _running(batch, [7, 8, 9], computed=12, kv=12, compressed=False, query_slot=1)
    in_place = _running(batch, [4, 3, 6], computed=30, kv=12, compressed=True, query_slot=0, prompt_reserve=3)
    plan = CompressionPlan(planned, [7, 8, 9], [11, 8, 9])  # block 7 was shared: block 11 replaces it
    rows = np.array([planned.row, in_place.row])

    t = compaction_tables(batch, rows, [plan], 3, 8, NUM_QUERY_SLOTS)  # 8 blocks wide: the batch holds 6

    assert t.blocks.shape == (2, 3, 8) and t.per_row.shape[1] == 3
    assert t.blocks[0].tolist() == [[7, 8, 9, 0, 0, 0, 0, 0], [4, 3, 6, 0, 0, 0, 0, 0], [0] * 8]
    assert t.blocks[1].tolist() == [[11, 8, 9, 0, 0, 0, 0, 0], [4, 3, 6, 0, 0, 0, 0, 0], [0] * 8]
    assert t.num_blocks.tolist() == [3, 3, 0]
    assert t.query_ids.tolist() == [1, 0, NUM_QUERY_SLOTS]
    assert t.compressed.tolist() == [0, 1, 0]
    r = t.rows
    assert r.budget.tolist() == [M * BS, M * BS, 0]
    assert r.position_offset.tolist() == [0, 30 - 12, 0]  # position - slot of its newest token
    assert r.prompt_len.tolist() == [6, 6, 0] and r.quote_end.tolist() == [3, 3, 0]
    assert r.in_prompt.tolist() == [0, 0, 0]
    assert r.history.tolist() == [0, M - 1, 0]  # what it kept last, not its budget now
    assert r.prompt_reserve.tolist() == [0, 3, 0]
    # a reserve of 3 with a 6-token prompt is filled by the prompt: the recent window stays
    assert r.recent.tolist() == [2, 2, 0]


def test_padding_tables_read_and_keep_nothing():
    t = padding_tables(2, 4, NUM_QUERY_SLOTS)
    assert (t.blocks == 0).all() and t.num_blocks.tolist() == [0, 0]
    assert t.query_ids.tolist() == [NUM_QUERY_SLOTS] * 2 and (t.rows.budget == 0).all()
