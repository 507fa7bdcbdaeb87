"""A host model of the device's pool for the block manager and scheduler tests.

`FakeDevice`: every pool slot holds the (token id, position) whose K/V it would hold, and every query-cache
row the (seq id, position) of the queries it would hold, so the tests can check what a real
engine would read: a sequence's view of its blocks, the prefix cache's contents, and the queries
a compression scores with.
"""

from __future__ import annotations

import random
from collections import Counter

from zipage_jax.engine.block_manager import DUMMY_BLOCK, BlockManager, CompressionPlan
from zipage_jax.engine.sequence import Sequence

Entry = tuple[int, int] | None


class FakeDevice:
    def __init__(self, num_blocks: int, block_size: int, num_query_slots: int = 0, query_cache_len: int = 1,
                 seed: int = 0):
        self.bs, self.ql = block_size, query_cache_len
        self.pool: list[list[Entry]] = [[None] * block_size for _ in range(num_blocks)]
        self.queries: list[list[Entry]] = [[None] * query_cache_len for _ in range(num_query_slots)]
        self.rng = random.Random(seed)

    def write(self, seq: Sequence, start: int, num_tokens: int, tail: int = 0, tail_start: int = 0,
              tail_blocks: list[int] = (), kv_start: int | None = None) -> None:
        """A chunk, as the runner writes it: positions start.. go to physical slots num_kv_slots..
        (`kv_start`.. for a row that compacted in place earlier in the step); a prompt tail's
        positions follow in its scratch blocks, and the last QL of both (only those) are the
        cached queries."""
        bs = self.bs
        first = seq.num_kv_slots if kv_start is None else kv_start
        for i in range(num_tokens):
            phys, pos = first + i, start + i
            block = seq.block_table[phys // bs]
            assert block != DUMMY_BLOCK, "a chunk writes into the dummy block"
            self.pool[block][phys % bs] = (seq.token_ids[pos], pos)
            offset = phys % bs - (bs - self.ql)
            if seq.query_slot is not None and offset >= 0 and not tail:
                self.queries[seq.query_slot][offset] = (seq.seq_id, pos)
        if tail:
            first = tail_start
            for j, pos in enumerate(range(first, first + tail)):
                self.pool[tail_blocks[j // bs]][j % bs] = (seq.token_ids[pos], pos)
            observed = list(range(start, start + num_tokens)) + list(range(first, first + tail))
            for row, pos in zip(range(self.ql - 1, -1, -1), reversed(observed)):
                self.queries[seq.query_slot][row] = (seq.seq_id, pos)

    def compact(self, plan: CompressionPlan) -> None:
        """Keep a random, order-preserving M*BS of the source tokens in the first M target blocks."""
        bs, m = self.bs, plan.seq.budget_blocks
        src = [self.pool[b][o] for b in plan.source_table for o in range(bs)]
        keep = sorted(self.rng.sample(range(len(src)), m * bs))
        for q, p in enumerate(keep):
            self.pool[plan.target_table[q // bs]][q % bs] = src[p]

    def view(self, seq: Sequence) -> list[Entry]:
        bs = self.bs
        return [self.pool[seq.block_table[p // bs]][p % bs] for p in range(seq.num_kv_slots)]

    def check_view(self, seq: Sequence) -> None:
        """The slots a sequence attends over hold its own tokens, in order."""
        view = self.view(seq)
        assert None not in view, f"seq {seq.seq_id} reads unwritten slots"
        positions = [p for _, p in view]
        assert [t for t, _ in view] == [seq.token_ids[p] for p in positions], f"seq {seq.seq_id}: wrong tokens"
        if seq.compressed:  # kept tokens, then every token since the last compression
            assert all(a < b for a, b in zip(positions, positions[1:])), f"seq {seq.seq_id}: order lost"
            kept, n = seq.budget_blocks * self.bs, seq.num_computed_tokens
            assert positions[kept:] == list(range(n - len(positions) + kept, n)), f"seq {seq.seq_id}: lost a token"
        else:
            assert positions == list(range(seq.num_computed_tokens)), f"seq {seq.seq_id}: positions {positions}"

    def check_query_tail(self, seq: Sequence, observed: list[int] | None = None) -> None:
        """At compression the query cache holds the queries of the sequence's last QL tokens, or
        (after a prompt tail) the last of `observed`: the chunk's positions, then the tail's."""
        assert seq.query_slot is not None, f"seq {seq.seq_id} compresses without a query slot"
        if observed is None:
            n = seq.num_computed_tokens
            observed = list(range(n - self.ql, n))
        k = min(self.ql, len(observed))
        assert self.queries[seq.query_slot][self.ql - k:] == [(seq.seq_id, p) for p in observed[-k:]]


def check_block_manager(bm: BlockManager, seqs: list[Sequence], device: FakeDevice | None = None,
                        pending: list[int] = ()) -> None:
    """Ref counts, free list and prefix-cache entries agree with the sequences' block tables.

    `pending`: blocks held outside any table (fresh targets of a planned compression)."""
    refs = Counter(b for s in seqs for b in s.block_table) + Counter(pending)
    assert DUMMY_BLOCK not in refs, "the dummy block is in a block table"
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} holds a block twice"
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count"
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "duplicates in the free list"
    assert set(free) == {b.block_id for b in bm.blocks[1:] if b.ref_count == 0}, "free list != blocks with ref 0"
    bs = bm.block_size
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block_id != DUMMY_BLOCK and block.hash == h and len(block.token_ids) == bs
        if device is not None:
            content = device.pool[block_id]
            start = content[0][1] if content[0] else -1
            assert start % bs == 0 and content == [(t, start + o) for o, t in enumerate(block.token_ids)], \
                f"cached block {block_id} does not hold its tokens"
