"""BlockManager: ref counts, free list, chained prefix cache, compression targets."""

from __future__ import annotations

import numpy as np
import pytest
from budgets import zipage_budget
from fake_device import FakeDevice, check_block_manager
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zipage_jax.engine import block_manager as bm_module
from zipage_jax.engine.block_manager import DUMMY_BLOCK, BlockManager, chain_hash
from zipage_jax.engine.sequence import Sequence

BS = 4


def make_seq(tokens, budget=None) -> Sequence:
    return Sequence(list(tokens), BS, budget=zipage_budget(budget, BS))


def extend(seq: Sequence, tokens) -> None:
    """New tokens reach a standalone sequence as the engine's do: sampled (pending), then known."""
    for token in tokens:
        seq.append_pending()
        seq.resolve(token)


def compute(bm: BlockManager, seq: Sequence, n: int, device: FakeDevice | None = None) -> None:
    """What the scheduler and runner do for a chunk of n tokens."""
    assert bm.allocate_slots(seq, n)
    if device is not None:
        device.write(seq, seq.num_computed_tokens, n)
    seq.num_computed_tokens += n
    seq.num_kv_slots += n
    bm.commit_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence, device: FakeDevice | None = None) -> int:
    cached = bm.match_prefix(seq)
    compute(bm, seq, len(seq) - cached, device)
    bm.count_prefix_lookup(seq, cached)
    return cached


def compress_seq(bm: BlockManager, seq: Sequence, device: FakeDevice | None = None):
    assert seq.num_kv_slots == len(seq.block_table) * BS, "compression needs full blocks"
    plan = bm.plan_compression(seq)
    assert plan is not None
    if device is not None:
        device.compact(plan)
    bm.finish_compression(plan)
    seq.num_kv_slots = seq.budget_blocks * BS
    seq.compressed = True
    return plan


# -- allocation ---------------------------------------------------------------------------------


def test_needs_a_real_block_besides_the_dummy():
    with pytest.raises(ValueError, match="at least 2"):
        BlockManager(1, BS)


def test_allocate_grows_by_whole_blocks_and_never_hands_out_the_dummy():
    bm = BlockManager(4, BS)
    seq = make_seq(range(10))
    assert bm.allocate_slots(seq, 5)
    assert len(seq.block_table) == 2 and DUMMY_BLOCK not in seq.block_table
    seq.num_kv_slots = 5
    assert bm.blocks_needed(seq, 3) == 0 and bm.blocks_needed(seq, 4) == 1
    assert not bm.allocate_slots(seq, 3 + 2 * BS)  # would need 2 more, 1 is free
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1  # nothing taken on failure
    assert bm.allocate_slots(seq, 7)
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    bm.free(seq)
    assert bm.num_free_blocks == 3 and seq.block_table == []
    check_block_manager(bm, [seq])


# -- prefix cache -------------------------------------------------------------------------------


def test_same_prompt_shares_full_blocks_and_leaves_a_token_to_compute():
    bm, device = BlockManager(16, BS), FakeDevice(16, BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, b = make_seq(prompt), make_seq(prompt)
    assert admit(bm, a, device) == 0
    assert admit(bm, b, device) == 2 * BS
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert b.num_computed_tokens == len(prompt) and b.num_hashed_blocks == 2
    device.check_view(b)
    check_block_manager(bm, [a, b], device)
    assert bm.prefix_hit_rate() == pytest.approx(2 / 4)  # a: 0 of 2 blocks, b: 2 of 2


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    bm = BlockManager(16, BS)
    prompt = list(range(2 * BS))
    a, b = make_seq(prompt), make_seq(prompt)
    admit(bm, a)
    assert bm.match_prefix(b) == BS  # the last token must be computed to get logits
    assert b.num_computed_tokens == b.num_kv_slots == BS


def test_hashes_are_chained():
    bm = BlockManager(16, BS)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_first = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first
    assert bm.match_prefix(other_first) == 0
    same_first = make_seq([1, 2, 3, 4, 0, 6, 7, 8, 9])
    assert bm.match_prefix(same_first) == BS


class _Colliding:
    """xxhash whose every digest is 42: every block's chained hash collides."""

    class xxh64:
        def update(self, data: bytes) -> None:
            pass

        def intdigest(self) -> int:
            return 42

    @staticmethod
    def xxh64_intdigest(data: bytes) -> int:
        return 42


def test_a_hit_is_verified_against_the_stored_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "xxhash", _Colliding)  # everything collides
    bm = BlockManager(16, BS)
    admit(bm, make_seq([1, 2, 3, 4, 5]))
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 5])) == 0
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 7])) == BS


def test_the_batched_hashes_are_the_chained_hash_of_each_block():
    # hash_blocks (a sequence's blocks in a run) and hash_next_blocks (one block per row, by array)
    # register what match_prefix looks up: chain_hash over each block, chained on the one before
    tokens = [[7, 1, 3, 9, 2, 2, 0, 5, 4, 4, 4, 1], [5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 1, 1]]
    expected = []
    for row in tokens:
        h, chain = None, []
        for i in range(0, len(row), BS):
            h = chain_hash(row[i:i + BS], h)
            chain.append(h)
        expected.append(chain)
    bm = BlockManager(16, BS)
    seqs = [make_seq(row) for row in tokens]
    for seq in seqs:
        seq.block_table = bm.take_free_blocks(3)
    tables = np.array([seq.block_table for seq in seqs], np.int32)
    bm.hash_blocks(tables[0], tokens[0][:2 * BS], 0, 2)  # blocks 0 and 1 of the first row
    bm.hash_blocks(tables[1], tokens[1][:BS], 0, 1)  # block 0 of the second
    assert [bm.blocks[b].hash for b in tables[0, :2]] == expected[0][:2]
    bm.hash_next_blocks(tables, np.array([2, 1]), np.array([tokens[0][2 * BS:], tokens[1][BS:2 * BS]], np.int64))
    assert [bm.blocks[b].hash for b in tables[0]] == expected[0]
    assert [bm.blocks[b].hash for b in tables[1, :2]] == expected[1][:2]
    assert bm.blocks[tables[1, 1]].token_ids == tuple(tokens[1][BS:2 * BS])
    assert bm.hash_to_block_id[expected[1][1]] == tables[1, 1]
    for seq in seqs:
        bm.free(seq)
    assert bm.match_prefix(make_seq(tokens[0] + [3])) == 3 * BS
    assert bm.match_prefix(make_seq(tokens[1][:2 * BS] + [3])) == 2 * BS


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = make_seq(range(9))
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 3
    b = make_seq(range(9))
    assert bm.match_prefix(b) == 2 * BS  # taken back from the free list
    assert bm.num_free_blocks == 1
    bm.free(b)
    c = make_seq([7] * 12)  # takes every block, evicting the cached ones
    admit(bm, c)
    bm.free(c)
    assert bm.match_prefix(make_seq(range(9))) == 0
    check_block_manager(bm, [])


def test_prefix_caching_disabled_shares_nothing():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    admit(bm, make_seq(range(9)))
    assert bm.match_prefix(make_seq(range(9))) == 0
    assert bm.hash_to_block_id == {}


# -- compression --------------------------------------------------------------------------------


def test_compression_in_place_releases_blocks_beyond_the_budget():
    bm, device = BlockManager(16, BS), FakeDevice(16, BS)
    seq = make_seq(range(100, 100 + 5 * BS), budget=2)  # a prompt longer than the budget
    admit(bm, seq, device)
    table = list(seq.block_table)
    plan = compress_seq(bm, seq, device)
    assert plan.source_table == table
    assert plan.target_table == table[:3]  # nothing shared: compacts in place
    assert sorted(plan.release) == sorted(table[3:])
    assert seq.block_table == table[:3] and seq.num_hashed_blocks == 0
    assert all(bm.blocks[b].hash is None for b in seq.block_table)  # contents changed
    assert bm.num_free_blocks == 15 - 3
    device.check_view(seq)
    check_block_manager(bm, [seq], device)
    # compressed blocks never enter the prefix cache
    extend(seq, [1] * BS)
    compute(bm, seq, BS, device)
    assert all(bm.blocks[b].hash is None for b in seq.block_table)
    assert bm.match_prefix(make_seq(range(100, 100 + 5 * BS))) == 0


def test_compression_replaces_shared_prefix_blocks():
    bm, device = BlockManager(16, BS), FakeDevice(16, BS)
    prompt = list(range(100, 100 + 2 * BS + 1))
    owner = make_seq(prompt)
    admit(bm, owner, device)
    seq = make_seq(prompt + [7] * (2 * BS - 1), budget=2)  # shares 2 blocks, 4 blocks in all
    assert admit(bm, seq, device) == 2 * BS
    table = list(seq.block_table)
    shared, own = table[:2], table[2:]
    plan = compress_seq(bm, seq, device)
    target = plan.target_table
    assert len(target) == 3 and not set(target[:2]) & set(table)  # fresh blocks for the shared ones
    assert target[2] == own[0]
    assert sorted(plan.release) == sorted(shared + own[1:])
    assert [bm.blocks[b].ref_count for b in shared] == [1, 1]  # only the owner holds them now
    assert all(bm.blocks[b].ref_count == 1 and bm.blocks[b].hash is None for b in target)
    assert bm.blocks[own[1]].ref_count == 0
    assert len(seq.block_table) == 3 and seq.block_table == target
    device.check_view(seq)
    device.check_view(owner)  # the shared blocks were not overwritten
    check_block_manager(bm, [owner, seq], device)
    assert bm.match_prefix(make_seq(prompt)) == 2 * BS  # the owner's prefix is still cached


def test_compression_waits_for_free_blocks_to_replace_shared_ones():
    bm = BlockManager(7, BS)
    prompt = list(range(2 * BS + 1))
    owner = make_seq(prompt)
    admit(bm, owner)
    seq = make_seq(prompt[:2 * BS] + [5] * BS, budget=2)
    admit(bm, seq)
    filler = make_seq([9] * (BS + 1))
    assert bm.allocate_slots(filler, BS + 1) and bm.num_free_blocks == 0
    before = ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_block_ids), list(seq.block_table))
    assert bm.plan_compression(seq) is None
    assert ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_block_ids), list(seq.block_table)) == before
    bm.free(filler)
    assert bm.plan_compression(seq) is not None


def test_a_compressed_sequence_compacts_in_place():
    bm, device = BlockManager(8, BS), FakeDevice(8, BS)
    seq = make_seq(range(3 * BS), budget=2)
    admit(bm, seq, device)
    for _ in range(3):
        extend(seq, [len(seq)])
        compress_seq(bm, seq, device)
        assert len(seq.block_table) == 3 and bm.num_free_blocks == 7 - 3
        compute(bm, seq, 1, device)  # the new token lands in slot 0 of block M
        assert seq.num_kv_slots == 2 * BS + 1
        extend(seq, range(BS - 1))
        compute(bm, seq, BS - 1, device)
        device.check_view(seq)
    check_block_manager(bm, [seq], device)


# -- random operation sequences -----------------------------------------------------------------

PREFIXES = [[1] * 12, [1] * 4 + [2] * 8, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come and go, share prefixes, grow and compress over a small pool."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(8, BS)
        self.device = FakeDevice(8, BS)
        self.seqs: list[Sequence] = []

    def _compressible(self) -> list[Sequence]:
        return [s for s in self.seqs if s.budget_blocks is not None and len(s.block_table) >= s.budget_blocks + 1
                and s.num_kv_slots == len(s.block_table) * BS]

    @rule(family=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 12),
          suffix=st.lists(st.integers(0, 3), max_size=6), budget=st.sampled_from([None, 1, 2]))
    def add(self, family, cut, suffix, budget):
        seq = make_seq(PREFIXES[family][:cut] + suffix, budget)
        cached = self.bm.match_prefix(seq)
        assert cached <= len(seq) - 1 and cached % BS == 0
        assert all(self.bm.blocks[b].token_ids == tuple(seq.block_tokens(i)) for i, b in enumerate(seq.block_table))
        if self.bm.blocks_needed(seq, len(seq) - cached) <= self.bm.num_free_blocks:
            compute(self.bm, seq, len(seq) - cached, self.device)
            self.seqs.append(seq)
        else:
            self.bm.free(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 5), token=st.integers(0, 3))
    def grow(self, data, n, token):
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.budget_blocks is not None and len(seq.block_table) >= seq.budget_blocks + 1:
            n = min(n, len(seq.block_table) * BS - seq.num_kv_slots)  # at its budget: fill, then compress
        if n and self.bm.blocks_needed(seq, n) <= self.bm.num_free_blocks:
            extend(seq, [token] * n)
            compute(self.bm, seq, n, self.device)

    @precondition(lambda self: self._compressible())
    @rule(data=st.data())
    def compress(self, data):
        seq = data.draw(st.sampled_from(self._compressible()))
        m = seq.budget_blocks
        before = {b: self.bm.blocks[b].ref_count for b in seq.block_table}
        plan = self.bm.plan_compression(seq)
        if plan is None:
            assert sum(before[b] > 1 for b in seq.block_table[:m + 1]) > self.bm.num_free_blocks
            return
        fresh = [b for b in plan.target_table if b not in plan.source_table]
        check_block_manager(self.bm, self.seqs, pending=fresh)
        for i, b in enumerate(plan.target_table):
            assert b != DUMMY_BLOCK and before.get(b, 1) == 1, "a shared block is a compression target"
            assert b not in plan.source_table[i + 1:], "a write could overtake a read"
        self.device.compact(plan)
        self.bm.finish_compression(plan)
        seq.num_kv_slots = m * BS
        seq.compressed = True
        assert len(seq.block_table) == m + 1 and len(set(seq.block_table)) == m + 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq)

    @invariant()
    def consistent(self):
        check_block_manager(self.bm, self.seqs, self.device)
        for seq in self.seqs:
            self.device.check_view(seq)

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq)
        check_block_manager(self.bm, [])
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks, "blocks leaked"


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
