"""Scheduler, driven by a fake engine loop over a fake device (no model, no jax)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from budgets import zipage_budget
from fake_device import FakeDevice, check_block_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.runner.results import PromptLogprobsResult, RowFailure, RunnerOutput, StepResult
from zipage_jax.engine.scheduler import Chunk, Scheduler, SchedulerOutput
from zipage_jax.engine.sequence import Sequence, SequenceStatus


class LengthChecker:
    """A stop checker that only counts (the scheduler asks it whether a token ends its sequence)."""

    def __init__(self, max_tokens: int, stop_at: int | None = None):
        self.max_tokens, self.stop_at = max_tokens, stop_at
        self.num_tokens = 0
        self.stop_reason: int | None = None

    def append(self, token_id: int, final: bool = False) -> tuple[str, str | None]:
        self.num_tokens += 1
        if token_id == self.stop_at:
            self.stop_reason = token_id
            return "", "stop"
        return f"<{token_id}>", "length" if self.num_tokens >= self.max_tokens else None


class Loop:
    """The engine loop of llm_engine.step with the model replaced by FakeDevice; checks the
    scheduler's promises around every step."""

    def __init__(self, num_blocks: int, bs: int = 4, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                 num_query_slots: int = 8, max_compress_seqs: int = 8, prefix_caching: bool = True,
                 query_cache_len: int = 2, seed: int = 0, prompt_window: int = 0):
        self.bs, self.ql = bs, query_cache_len
        self.bm = BlockManager(num_blocks, bs, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               num_query_slots=num_query_slots, max_compress_seqs=max_compress_seqs,
                               prompt_window=prompt_window)
        self.device = FakeDevice(num_blocks, bs, num_query_slots, query_cache_len, seed)
        self.rng = random.Random(seed)
        self.max_tokens: dict[Sequence, int] = {}
        self.seqs: list[Sequence] = []
        self.admitted: list[Sequence] = []  # in order of first admission
        self.history: list[SchedulerOutput] = []
        self.compactions: list[tuple[Sequence, int]] = []  # (sequence, its computed tokens then)
        self.slots_in_use = 0  # most query slots ever held at once
        self.tails: list[tuple[Sequence, int, int]] = []  # (sequence, chunk end, tail tokens)
        self.observed: dict[Sequence, list[int]] = {}  # positions whose queries a tail chunk cached

    def add(self, token_ids: list[int], max_tokens: int, budget: int | None = None,
            parent: Sequence | None = None, deferred: bool = False) -> Sequence:
        kv_budget = zipage_budget(budget, self.bs, self.ql)
        if deferred:
            kv_budget = dataclasses.replace(kv_budget, deferred=True)
        seq = Sequence(list(token_ids), self.bs, budget=kv_budget, parent=parent, query_cache_len=self.ql,
                       stop_checker=LengthChecker(max_tokens))
        self.max_tokens[seq] = max_tokens
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        before = {s: _state(s, self.bs, self.sched) for s in self.seqs}
        running, waiting = list(self.sched.running), list(self.sched.waiting)
        out = self.sched.schedule()
        self._check_output(out, before, running, waiting)
        for plan in out.compressions:
            self.device.check_query_tail(plan.seq, self.observed.pop(plan.seq, None))
            self.device.compact(plan)
            self.compactions.append((plan.seq, plan.seq.num_computed_tokens))
        evicted = self.sched.finish_compressions(out)
        assert evicted == sum(before[p.seq]["kv"] - p.seq.budget_blocks * self.bs for p in out.compressions)
        for chunk in out.chunks:
            seq = chunk.seq
            self.device.write(seq, chunk.start, chunk.num_tokens, chunk.tail, chunk.tail_start, chunk.tail_blocks)
            self.observed.pop(seq, None)
            if chunk.tail:
                first = chunk.tail_start
                assert first >= chunk.start + chunk.num_tokens and first + chunk.tail == seq.num_prefill_tokens
                self.observed[seq] = (list(range(chunk.start, chunk.start + chunk.num_tokens))
                                      + list(range(first, first + chunk.tail)))
                self.tails.append((seq, chunk.start + chunk.num_tokens, chunk.tail))
            self.sched.release_tail(chunk)
        sampled = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq not in self.admitted:
                self.admitted.append(seq)
            samples = chunk.samples
            self.sched.commit(chunk)
            if samples:  # the sampled token arrives at once (synchronous scheduling)
                sampled.append(StepResult(chunk, self.rng.randrange(3), 0.0, None, None))
        self.sched.update_from_output(RunnerOutput(sampled))
        self.check_state()
        self.history.append(out)
        return out

    def run(self, max_steps: int = 2000) -> int:
        for steps in range(max_steps):
            if not self.sched.has_unfinished():
                return steps
            out = self.step()
            assert out.chunks or out.compressions, f"stalled at step {steps}"
        raise AssertionError(f"not finished after {max_steps} steps")

    # -- checks ---------------------------------------------------------------------------------

    def _check_output(self, out, before, running, waiting) -> None:
        sched, bs = self.sched, self.bs
        assert sum(c.num_tokens + c.tail for c in out.chunks) <= sched.max_num_batched_tokens
        rows = sum(-(-c.num_tokens // sched.prefill_row_size) + -(-c.tail // sched.prefill_row_size)
                   for c in out.chunks if c.num_tokens > 1 or c.tail)
        assert rows <= sched.max_num_batched_tokens // sched.prefill_row_size
        for c in out.chunks:  # a tail's scratch blocks: its own, outside every table
            assert len(c.tail_blocks) == -(-c.tail // bs)
            assert all(self.bm.blocks[b].ref_count == 1 for b in c.tail_blocks)
            assert not set(c.tail_blocks) & {b for s in self.seqs for b in s.block_table}
        assert len(sched.running) <= sched.max_num_seqs
        assert len({c.seq for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            seq = c.seq
            assert seq.status == SequenceStatus.RUNNING and not seq.compressing
            assert c.start == seq.num_computed_tokens and 1 <= c.num_tokens <= len(seq) - c.start
            assert len(seq.block_table) * bs >= seq.num_kv_slots + c.num_tokens
            m = seq.budget_blocks
            for phys in range(seq.num_kv_slots, seq.num_kv_slots + c.num_tokens):
                if m is not None and phys // bs >= m and phys % bs >= bs - self.ql:
                    assert seq.query_slot is not None, "computes a query tail without a query slot"
        holders = [s.query_slot for s in self.seqs if s.query_slot is not None]
        assert len(holders) == len(set(holders)) <= sched.query_slots.num_slots
        assert all(0 <= q < sched.query_slots.num_slots for q in holders)
        self.slots_in_use = max(self.slots_in_use, len(holders))
        # preemption: the victim is the most recently admitted sequence that may be preempted
        remaining = list(running)
        for victim in out.preempted:
            assert not before[victim]["compressed"] and not victim.compressing
            later = remaining[remaining.index(victim) + 1:]
            assert all(s.compressed or s.compressing for s in later), "not the most recent preemptible"
            remaining.remove(victim)
        # FCFS: admitted sequences are a prefix of the queue (preempted ones went to its front)
        admitted = [s for s in sched.running if s not in remaining]
        queue = list(reversed(out.preempted)) + waiting
        assert admitted == queue[:len(admitted)], "admission is not FCFS"
        # compression exactly when all blocks are full and the next token needs a new one
        planned = [p.seq for p in out.compressions]
        assert len(planned) == len(set(planned)) <= sched.max_compress_seqs
        for s in remaining:
            if before[s]["full"] and not before[s]["compressing"]:
                assert s not in [c.seq for c in out.chunks], "grows past its budget"
        for plan in out.compressions:
            seq, m = plan.seq, plan.seq.budget_blocks
            assert before[seq]["full"] and not before[seq]["compressing"] and seq.compressing
            assert plan.source_table == seq.block_table and len(plan.target_table) == m + 1
            assert len(set(plan.target_table)) == m + 1 and 0 not in plan.target_table
            for i, b in enumerate(plan.target_table):
                assert b not in plan.source_table[i + 1:], "a write could overtake a read"
                assert self.bm.blocks[b].ref_count == 1
            kept = [b for b in plan.source_table if b in plan.target_table]
            assert sorted(plan.release) == sorted(b for b in plan.source_table if b not in kept)

    def check_state(self) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        assert set(live) == set(self.sched.running) | set(self.sched.waiting)
        assert len(self.sched.running) == len(set(self.sched.running))
        check_block_manager(self.bm, live, self.device)
        for s in self.seqs:
            if s.status != SequenceStatus.RUNNING:
                assert s.block_table == [] and s.query_slot is None
                assert s.is_finished or s.num_kv_slots == s.num_computed_tokens == 0
                continue
            self.device.check_view(s)
            assert not s.compressing
            if s.compressed:  # its budget and the next block, or the blocks of a prefill chunk since
                assert len(s.block_table) == max(s.budget_blocks + 1, -(-s.num_kv_slots // self.bs)), \
                    "a compressed sequence grew"
            else:
                assert len(s.block_table) == -(-s.num_kv_slots // self.bs)
            if s.budget is not None and not s.budget.deferred:
                assert len(s.block_table) <= s.budget_blocks + max(1, self.sched.chunk_blocks), \
                    "past budget + one chunk"

    def check_all_freed(self) -> None:
        assert all(s.is_finished for s in self.seqs)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks, "blocks leaked"
        assert self.sched.query_slots.in_use == 0, "query slots leaked"


def _state(seq: Sequence, bs: int, sched: Scheduler) -> dict:
    # full: at its compaction point while computing its prompt, at its budget and the next block after it
    m = seq.budget_blocks
    in_prompt = seq.num_computed_tokens < seq.num_prefill_tokens
    peak = None if m is None else (sched.prompt.point(seq) if in_prompt else m + 1)
    full = (m is not None and peak is not None and seq.status == SequenceStatus.RUNNING
            and len(seq.block_table) >= peak and seq.num_kv_slots == len(seq.block_table) * bs)
    return dict(full=full, kv=seq.num_kv_slots, compressed=seq.compressed, compressing=seq.compressing)


def prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(100, 200) for _ in range(n)]


# -- admission and batching ---------------------------------------------------------------------


def test_fcfs_admission_and_everything_finishes():
    loop = Loop(64, max_num_seqs=2)
    seqs = [loop.add(prompt(5 + i, i), max_tokens=3 + i) for i in range(6)]
    loop.run()
    assert loop.admitted == seqs
    assert [s.num_output_tokens for s in seqs] == [3 + i for i in range(6)]
    loop.check_all_freed()


def test_chunked_prefill_respects_the_token_budget():
    loop = Loop(64, max_num_batched_tokens=5)
    long = loop.add(prompt(23, 0), max_tokens=4)
    short = loop.add(prompt(3, 1), max_tokens=4)
    out = loop.step()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(long, 0, 5)]
    steps = [loop.step() for _ in range(4)]
    assert [c.num_tokens for c in steps[-1].chunks] == [3, 2]  # the prompt ends, the next one starts
    assert long.num_output_tokens == 1 and short.num_output_tokens == 0
    loop.run()
    assert all(sum(c.num_tokens for c in o.chunks) <= 5 for o in loop.history)
    loop.check_all_freed()


# -- preemption ---------------------------------------------------------------------------------


def test_preemption_picks_the_latest_and_every_request_finishes():
    loop = Loop(9, prefix_caching=False)  # 8 usable blocks of 4: room for about 2 of these
    seqs = [loop.add(prompt(6, i), max_tokens=10) for i in range(4)]
    loop.run()
    preempted = [s for o in loop.history for s in o.preempted]
    assert preempted, "the pool was never full"
    assert seqs[0] not in preempted  # the oldest always keeps its blocks
    assert all(s.num_output_tokens == 10 for s in seqs)
    loop.check_all_freed()


def test_a_compressed_sequence_is_never_preempted():
    loop = Loop(10)
    full = [loop.add(prompt(6, i), max_tokens=16) for i in range(1, 3)]
    budgeted = loop.add(prompt(6, 0), max_tokens=40, budget=1)  # the latest; compressed from 8 tokens on
    loop.run()
    preempted = [s for o in loop.history for s in o.preempted]
    assert preempted and budgeted not in preempted and budgeted.metrics.num_compressions > 0
    assert all(s.is_finished for s in full)
    loop.check_all_freed()


def test_a_preempted_sequence_recomputes_from_the_prefix_cache():
    loop = Loop(7)  # 6 blocks: the first sequence ends with 4, the other 2 stay cached meanwhile
    first, victim = [loop.add(prompt(6, i), max_tokens=10) for i in range(2)]
    loop.run()
    assert victim.metrics.num_preemptions == 1 and first.metrics.num_preemptions == 0
    assert victim.metrics.num_cached_prompt_tokens == 8
    # 1 + 1 blocks looked up at first admission, 3 at readmission (2 hits); failed attempts don't count
    assert (loop.bm.prefix_queries, loop.bm.prefix_hits) == (5, 2)
    loop.check_all_freed()


def test_preempt_releases_blocks_and_query_slot():
    loop = Loop(16, num_query_slots=1)
    seq = loop.add(prompt(9, 0), max_tokens=6, budget=1)
    loop.step()
    assert seq.query_slot is not None
    out = SchedulerOutput()
    loop.sched.preempt(seq, out)
    assert out.preempted == [seq] and list(loop.sched.waiting) == [seq]
    assert seq.query_slot is None and seq.num_computed_tokens == 0 and seq.metrics.num_preemptions == 1
    loop.check_state()
    assert loop.sched.query_slots.in_use == 0
    loop.run()
    assert seq.num_output_tokens == 6
    loop.check_all_freed()


# -- compression --------------------------------------------------------------------------------


def test_compression_happens_exactly_when_the_budget_is_full():
    bs, m = 4, 2
    loop = Loop(16, bs, query_cache_len=2)
    seq = loop.add(prompt(5, 0), max_tokens=10 * (m + 1) * bs, budget=m)
    compressed_at = []
    while loop.sched.has_unfinished():
        out = loop.step()
        if out.compressions:
            assert [p.seq for p in out.compressions] == [seq] and not out.chunks
            compressed_at.append(seq.num_computed_tokens)
            assert seq.num_kv_slots == m * bs and len(seq.block_table) == m + 1
        assert len(seq.block_table) <= m + 1
    last = 5 + 10 * (m + 1) * bs - 2  # position of the last computed token
    expected = list(range((m + 1) * bs, last + 1, bs))
    assert compressed_at == expected
    assert seq.metrics.num_compressions == len(expected)
    assert seq.metrics.kv_tokens_evicted == len(expected) * bs
    loop.check_all_freed()


def test_a_long_prompt_is_compressed_between_prefill_chunks():
    bs, m, chunk = 4, 2, 8
    loop = Loop(64, bs, max_num_batched_tokens=chunk)
    seq = loop.add(prompt(8 * m * bs, 0), max_tokens=6, budget=m)  # 8x the budget
    peak = 0
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        loop.step()
        peak = max(peak, len(seq.block_table))
    positions = [n for s, n in loop.compactions if s is seq]
    # a compaction each time the sequence holds its budget and one chunk: positions 16, 24, ..., 56
    assert positions == list(range((m + chunk // bs) * bs, 8 * m * bs, chunk))
    assert peak == m + chunk // bs  # the budget and one chunk, not the 16 blocks of the prompt
    loop.run()
    loop.check_all_freed()


def test_compactions_in_a_prompt_do_not_depend_on_its_chunks():
    # the same prompt alone (whole chunks) and beside a decode that takes a token of every step
    def positions(with_neighbour: bool) -> list[int]:
        loop = Loop(64, 4, max_num_batched_tokens=8)
        if with_neighbour:
            loop.add(prompt(3, 1), max_tokens=40)
            loop.step()
        seq = loop.add(prompt(50, 0), max_tokens=4, budget=2)
        loop.run()
        return [n for s, n in loop.compactions if s is seq]

    assert positions(False) == positions(True) != []


def test_a_prompt_that_ends_inside_a_block_compresses_when_its_decode_fills_it():
    bs, m = 4, 1
    loop = Loop(16, bs, max_num_batched_tokens=6)
    seq = loop.add(prompt(5 * bs - 1, 0), max_tokens=6, budget=m)
    while seq.in_prefill or seq.num_output_tokens == 0:
        loop.step()
    assert seq.compressed and len(seq.block_table) <= m + 1 + -(-6 // bs)
    loop.run()
    assert seq.num_output_tokens == 6
    loop.check_all_freed()


def test_a_compression_that_needs_blocks_for_shared_ones_preempts():
    loop = Loop(8, 4, max_num_seqs=3, max_num_batched_tokens=16, num_query_slots=1, query_cache_len=1)
    p = prompt(14, 0)  # one chunk: prefilled whole, compressed once its decodes fill block 4
    parent = loop.add(p, max_tokens=4, budget=1)
    loop.add(p, max_tokens=4, budget=1, parent=parent)  # shares the parent's first 3 blocks
    loop.add(prompt(1, 1), max_tokens=8, budget=1)  # holds the last free blocks
    loop.run()
    plan, out = next((p, o) for o in loop.history for p in o.compressions if p.seq is parent)
    assert set(plan.target_table).isdisjoint(plan.source_table)  # both kept blocks were shared
    assert out.preempted, "the blocks for the shared ones came from a preemption"
    loop.check_all_freed()


def test_a_failed_compaction_gives_back_its_replacement_blocks(monkeypatch):
    loop = Loop(32, 4, max_num_batched_tokens=16, num_query_slots=2, query_cache_len=1)
    p = prompt(14, 0)
    parent = loop.add(p, max_tokens=12, budget=1)
    loop.add(p, max_tokens=12, budget=1, parent=parent)  # shares the parent's first 3 blocks
    outs = []
    schedule = loop.sched.schedule
    monkeypatch.setattr(loop.sched, "schedule", lambda: outs.append(schedule()) or outs[-1])

    def failing_compaction(plan):
        raise RuntimeError("injected compaction failure")

    monkeypatch.setattr(loop.device, "compact", failing_compaction)
    with pytest.raises(RuntimeError, match="injected"):
        loop.run()
    plans = outs[-1].compressions
    fresh = [t for plan in plans for t, s in zip(plan.target_table, plan.source_table) if t != s]
    assert fresh, "no replacement block was allocated: the test shows nothing"
    live = [s for s in loop.seqs if not s.is_finished]
    check_block_manager(loop.bm, live, pending=fresh)
    loop.sched.abort_compressions(outs[-1])
    check_block_manager(loop.bm, live)  # the replacements are free again, every ref count as before
    assert all(loop.bm.blocks[b].ref_count == 0 and b in loop.bm.free_block_ids for b in fresh)
    assert all(plan.seq.block_table == plan.source_table and not plan.seq.compressing for plan in plans)


def test_requeue_all_recomputes_every_sequence_from_its_tokens_on_a_fresh_device():
    loop = Loop(24, 4, max_num_batched_tokens=8, query_cache_len=1)
    seqs = [loop.add(prompt(6, i), max_tokens=20, budget=1 if i % 2 else None) for i in range(4)]
    for _ in range(12):
        loop.step()
    assert any(s.compressed for s in loop.sched.running), "no compressed sequence was running"
    running, waiting = list(loop.sched.running), list(loop.sched.waiting)
    running[0].append_pending()  # a token still on the (lost) device
    known = {s: s.token_ids[:s.num_known_tokens] for s in seqs}
    loop.sched.requeue_all()
    assert list(loop.sched.waiting) == running + waiting and loop.sched.running == []
    assert {s: s.token_ids for s in seqs} == known  # what the host knew stays, the pending token goes
    assert loop.bm.num_free_blocks == loop.bm.num_usable_blocks and loop.bm.hash_to_block_id == {}
    assert loop.sched.query_slots.in_use == loop.sched.state_slots.in_use == 0
    assert all(s.num_computed_tokens == s.num_kv_slots == 0 and not s.compressed for s in seqs)
    loop.device = FakeDevice(24, 4, 8, 1)  # nothing of the old pool may be read again
    loop.run()
    assert all(s.num_output_tokens == 20 and s.token_ids[:len(known[s])] == known[s] for s in seqs)
    loop.check_all_freed()


def test_max_compress_seqs_bounds_one_step():
    loop = Loop(64)
    seqs = [loop.add(prompt(8, 0), max_tokens=12, budget=1) for _ in range(5)]
    loop.sched.max_compress_seqs = 2
    loop.run()
    assert max(len(o.compressions) for o in loop.history) == 2
    assert all(s.metrics.num_compressions >= 1 for s in seqs)
    loop.check_all_freed()


# -- query slots --------------------------------------------------------------------------------


def test_query_slots_are_shared_by_more_sequences_than_slots():
    bs, m, ql = 4, 1, 2
    loop = Loop(64, bs, num_query_slots=2, query_cache_len=ql)
    seqs = [loop.add(prompt(3, i), max_tokens=20, budget=m) for i in range(5)]
    waited = set()
    while loop.sched.has_unfinished():
        out = loop.step()
        scheduled = {c.seq for c in out.chunks} | {p.seq for p in out.compressions}
        for s in loop.sched.running:
            if s not in scheduled and s.query_slot is None:
                assert s.num_kv_slots == m * bs + bs - ql  # stopped right before its query tail
                waited.add(s)
    assert loop.slots_in_use == 2 and waited
    assert all(s.num_output_tokens == 20 for s in seqs)
    loop.check_all_freed()


def test_a_sequence_without_a_slot_decodes_below_its_budget():
    loop = Loop(64, num_query_slots=1)
    holder = loop.add(prompt(3, 0), max_tokens=30, budget=1)
    small = loop.add(prompt(2, 1), max_tokens=5, budget=1)  # never reaches block M's tail
    while not small.is_finished:
        out = loop.step()
        assert small in [c.seq for c in out.chunks] and small.query_slot is None
    assert small.num_output_tokens == 5 and holder.query_slot is not None
    loop.run()
    loop.check_all_freed()


# -- n > 1 --------------------------------------------------------------------------------------


def test_siblings_wait_for_the_parent_prompt_then_hit_the_prefix_cache():
    bs = 4
    loop = Loop(64, bs, max_num_batched_tokens=8)
    p = prompt(3 * bs + 2, 0)
    parent = loop.add(p, max_tokens=4)
    siblings = [loop.add(p, max_tokens=4, parent=parent) for _ in range(2)]
    while parent.num_computed_tokens < len(p):
        assert all(s.status == SequenceStatus.WAITING for s in siblings)
        loop.step()
    loop.step()
    assert all(s.status == SequenceStatus.RUNNING for s in siblings)
    for s in siblings:
        assert s.metrics.num_cached_prompt_tokens == 3 * bs
        assert s.block_table[:3] == parent.block_table[:3]
    assert [loop.bm.blocks[b].ref_count for b in parent.block_table[:3]] == [3, 3, 3]
    loop.run()
    loop.check_all_freed()


# -- abort --------------------------------------------------------------------------------------


def test_abort_frees_waiting_and_running_sequences():
    loop = Loop(10, max_num_seqs=2, num_query_slots=1)
    running = [loop.add(prompt(9, i), max_tokens=50, budget=1) for i in range(2)]
    waiting = [loop.add(prompt(5, i), max_tokens=50) for i in range(2, 4)]
    for _ in range(12):
        loop.step()
    assert any(s.compressed for s in running) and all(s.status == SequenceStatus.WAITING for s in waiting)
    for s in running + waiting:
        loop.sched.finish(s)
        loop.check_state()
    assert not loop.sched.has_unfinished()
    loop.check_all_freed()


# -- random workloads ---------------------------------------------------------------------------


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    ql = draw(st.integers(1, bs))
    max_num_batched_tokens = draw(st.integers(1, 12))
    window = draw(st.integers(0, min(3, max_num_batched_tokens - 1)))  # the prompt tail's tokens
    requests, need = [], 0
    for _ in range(draw(st.integers(1, 6))):
        family = draw(st.integers(0, 2))  # prompts of one family share a prefix
        p = prompt(5 * bs, family)[:draw(st.integers(1, 5 * bs))] + draw(st.lists(st.integers(0, 2), max_size=bs))
        k = draw(st.integers(1, 8 * bs))
        m = draw(st.sampled_from([None, 1, 1, 2, 3]))
        if m is None:
            blocks = -(-(len(p) + k) // bs)
        else:  # prefilled in full (+1 block of output before it compresses), then fresh blocks for shared ones
            blocks = -(-max(len(p), (m + 1) * bs) // bs) + 1 + m + 1 + -(-window // bs)  # and a tail's
        need = max(need, blocks)
        requests.append(dict(prompt=p, max_tokens=k, budget=m, n=draw(st.integers(1, 3)),
                             arrival=draw(st.integers(0, 12)), deferred=m is not None and draw(st.booleans())))
    return dict(
        bs=bs, ql=ql, requests=requests, prompt_window=window,
        num_blocks=need + 1 + draw(st.integers(0, 4)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=max_num_batched_tokens,
        num_query_slots=draw(st.integers(1, 4)),
        max_compress_seqs=draw(st.integers(1, 3)),
        prefix_caching=draw(st.booleans()),
        abort=draw(st.one_of(st.none(), st.integers(0, 30))),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_on_tiny_pools_always_finish(w):
    loop = Loop(w["num_blocks"], w["bs"], max_num_seqs=w["max_num_seqs"],
                max_num_batched_tokens=w["max_num_batched_tokens"], num_query_slots=w["num_query_slots"],
                max_compress_seqs=w["max_compress_seqs"], prefix_caching=w["prefix_caching"],
                query_cache_len=w["ql"], prompt_window=w["prompt_window"])
    pending = sorted(w["requests"], key=lambda r: r["arrival"])
    aborted = None
    for step in range(3000):
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            parent = loop.add(r["prompt"], r["max_tokens"], r["budget"], deferred=r["deferred"])
            for _ in range(r["n"] - 1):
                loop.add(r["prompt"], r["max_tokens"], r["budget"], parent=parent, deferred=r["deferred"])
        if step == w["abort"] and loop.seqs:
            aborted = loop.seqs[-1]
            loop.sched.finish(aborted)
            loop.check_state()
        if not loop.sched.has_unfinished():
            if not pending:
                break
            continue
        out = loop.step()
        assert out.chunks or out.compressions, f"stalled at step {step}"
    else:
        raise AssertionError("not finished after 3000 steps")
    loop.check_all_freed()
    assert all(s.num_output_tokens == loop.max_tokens[s] for s in loop.seqs if s is not aborted)


def test_prefill_rows_stay_within_the_grid_and_a_full_row_beside_a_decode():
    # rows of 8 tokens, 16 tokens a step: at most 2 prefill rows; a decode costs a token, not a row
    bm = BlockManager(64, 4, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, num_query_slots=8, max_compress_seqs=8,
                      prefill_row_size=8)
    decoding = Sequence([1, 2, 3], 4)
    sched.add(decoding)
    for chunk in sched.schedule().chunks:  # its prompt
        sched.commit(chunk)
    decoding.resolve(9)  # sampled: it decodes from now on
    for prompt_len in (3, 9, 30):
        sched.add(Sequence(list(range(1, prompt_len + 1)), 4))
    for _ in range(6):
        out = sched.schedule()
        prefill = [c for c in out.chunks if c.num_tokens > 1]
        assert sum(-(-c.num_tokens // 8) for c in prefill) <= 2  # rows
        assert sum(c.num_tokens for c in out.chunks) <= 16  # tokens
        for chunk in out.chunks:
            samples = chunk.samples
            sched.commit(chunk)
            if samples:
                chunk.seq.resolve(9)
    assert all(not s.in_prefill for s in sched.running)


def test_a_step_of_one_row_still_admits_a_prefill_beside_a_decode():
    bm = BlockManager(64, 4, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, num_query_slots=8, max_compress_seqs=8,
                      prefill_row_size=8)
    first = Sequence([1, 2], 4)
    sched.add(first)
    for chunk in sched.schedule().chunks:
        sched.commit(chunk)
    first.resolve(5)
    sched.add(Sequence([3, 4, 5, 6, 7], 4))
    out = sched.schedule()
    assert sorted(c.num_tokens for c in out.chunks) == [1, 5]  # the decode and the whole 5-token prompt


# -- prompt tails and deferred prompts -----------------------------------------------------------


def test_each_compaction_in_a_prompt_is_scored_by_the_prompt_tail_within_budget_and_one_chunk():
    bs, m, chunk, window = 4, 2, 12, 3  # one tail block: two blocks of room between compactions
    loop = Loop(64, bs, max_num_batched_tokens=chunk, query_cache_len=2, prompt_window=window)
    seq = loop.add(prompt(64, 0), max_tokens=3, budget=m)
    loop.run()
    compacted = [n for s, n in loop.compactions if s is seq]
    in_prompt = [n for n in compacted if n < 64]
    assert in_prompt == list(range((m + 2) * bs, 64, 2 * bs))  # 16, 24, ..., 56
    # the chunk reaching each point carries the prompt's last 3 tokens (positions 61..63)
    assert [(end, t) for s, end, t in loop.tails if s is seq] == [(n, window) for n in in_prompt]
    assert seq.metrics.kv_blocks_peak == m + chunk // bs  # the tail's block inside the budget and one chunk
    loop.check_all_freed()


def test_a_prompt_tail_is_only_what_the_prompt_has_left():
    bs, m = 4, 1
    loop = Loop(64, bs, max_num_batched_tokens=8, query_cache_len=2, prompt_window=3)
    seq = loop.add(prompt(4 * bs + 2, 0), max_tokens=2, budget=m)  # points at 8 and 12, two tokens after 16
    loop.run()
    assert [(end, t) for s, end, t in loop.tails if s is seq] == [(8, 3), (12, 3), (16, 2)]
    loop.check_all_freed()


@pytest.mark.parametrize("window", [0, 3])
def test_compactions_and_tails_do_not_depend_on_how_the_prompt_was_cut(window):
    def run(with_neighbour: bool):
        loop = Loop(64, 4, max_num_batched_tokens=8, prompt_window=window)
        if with_neighbour:  # a decode takes a token of every step: the prompt's chunks are cut otherwise
            loop.add(prompt(3, 1), max_tokens=40)
            loop.step()
        seq = loop.add(prompt(50, 0), max_tokens=4, budget=2)
        loop.run()
        return [n for s, n in loop.compactions if s is seq], [(e, t) for s, e, t in loop.tails if s is seq]

    alone, beside = run(False), run(True)
    assert alone == beside and alone[0] != []
    assert bool(alone[1]) == bool(window)


def test_a_deferred_prompt_compacts_once_at_its_last_full_block():
    bs, m = 4, 2
    loop = Loop(64, bs, max_num_batched_tokens=8, query_cache_len=2, prompt_window=3)
    seq = loop.add(prompt(50, 0), max_tokens=6, budget=m, deferred=True)
    loop.run()
    compacted = [n for s, n in loop.compactions if s is seq]
    assert compacted[0] == 48  # the prompt's last full block; its two last tokens follow
    assert [(end, t) for s, end, t in loop.tails if s is seq] == [(48, 2)]
    assert all(n > 50 for n in compacted[1:])  # then in decode only
    assert seq.metrics.kv_blocks_peak == 13  # the whole prompt (12 full blocks and the tail's)
    loop.check_all_freed()



def test_a_tail_always_fits_a_step_beside_its_chunks_row():
    # one prefill row a step: no room for the tail's own rows, so none (the chunk's own queries)
    one_row = Scheduler(BlockManager(64, 16, True), max_num_seqs=4, max_num_batched_tokens=32, num_query_slots=4,
                        max_compress_seqs=4, prefill_row_size=32, prompt_window=16)
    assert one_row.prompt.window == 0
    two_rows = Scheduler(BlockManager(64, 16, True), max_num_seqs=4, max_num_batched_tokens=64, num_query_slots=4,
                         max_compress_seqs=4, prefill_row_size=32, prompt_window=48)
    assert two_rows.prompt.window == 32  # half a step, a row beside the chunk's
    seq = Sequence(prompt(200, 0), 16, budget=zipage_budget(2, 16, 8), query_cache_len=8)
    two_rows.add(seq)
    steps, tails = 0, []
    while seq.num_computed_tokens < 200 and steps < 100:
        out = two_rows.schedule()
        for plan in out.compressions:
            two_rows.finish_compressions(SchedulerOutput(compressions=[plan]))
        for chunk in out.chunks:
            tails.append(chunk.tail)
            two_rows.release_tail(chunk)
            two_rows.commit(chunk)
            if chunk.samples:
                seq.resolve(1)
        steps += 1
    assert seq.num_computed_tokens == 200 and 32 in tails  # every point reached, each with its tail


# -- a step's output ----------------------------------------------------------------------------


def dispatched(sched: Scheduler) -> list[Chunk]:
    """One step scheduled and dispatched: its chunks (their tokens PENDING until they arrive)."""
    out = sched.schedule()
    for chunk in out.chunks:
        sched.release_tail(chunk)
        sched.commit(chunk)
    return out.chunks


def token(chunk: Chunk, token_id: int) -> StepResult:
    return StepResult(chunk, token_id, 0.0, None, None)


def test_a_token_joins_its_sequence_commits_its_blocks_and_stops_it():
    loop = Loop(16)
    seq = loop.add(prompt(7, 0), max_tokens=10)
    seq.stop_checker.stop_at = 9
    [first] = dispatched(loop.sched)
    [second] = dispatched(loop.sched)  # asynchronous scheduling: before the first token arrives
    assert seq.num_pending == 2 and seq.num_hashed_blocks == 1  # block 1 holds a PENDING token
    update = loop.sched.update_from_output(RunnerOutput([token(first, 5)]))
    assert seq.token_ids[7] == 5 and seq.num_pending == 1 and seq.num_hashed_blocks == 2
    assert update.tokens == [(seq, token(first, 5), "<5>")] and update.finished == []
    assert seq.metrics.first_token_time is not None and not seq.is_finished
    [third] = dispatched(loop.sched)
    update = loop.sched.update_from_output(RunnerOutput([token(second, 9), token(third, 1)]))
    assert update.finished == [seq] and [t for _, t, _ in update.tokens] == [token(second, 9)]  # the third dropped
    assert (seq.finish_reason, seq.stop_reason, seq.token_ids[-1]) == ("stop", 9, 9) and seq.num_pending == 0
    assert seq.is_finished and seq.metrics.finish_time is not None
    loop.check_all_freed()


def test_a_sequence_at_its_length_limit_finishes():
    loop = Loop(16)
    seq = loop.add(prompt(7, 0), max_tokens=100)
    seq.max_len = 9
    for expected in (None, "length"):
        [chunk] = dispatched(loop.sched)
        loop.sched.update_from_output(RunnerOutput([token(chunk, 1)]))
        assert seq.finish_reason == expected
    assert len(seq) == 9 and not loop.sched.has_unfinished()


def test_a_failure_finishes_every_sequence_of_its_request():
    loop = Loop(32)
    other = loop.add(prompt(5, 1), max_tokens=10)
    parent = loop.add(prompt(7, 0), max_tokens=10)
    sibling = loop.add(prompt(7, 0), max_tokens=10, parent=parent)
    for seq, request_id, index in [(other, "b", 0), (parent, "a", 0), (sibling, "a", 1)]:
        seq.request_id, seq.index = request_id, index
    ours, theirs = dispatched(loop.sched)  # the sibling waits for its parent's prompt
    assert ours.seq is other and theirs.seq is parent and sibling in loop.sched.waiting
    error = ValueError("no room for this row")
    update = loop.sched.update_from_output(RunnerOutput([token(ours, 1)], [RowFailure(theirs, error)]))
    assert update.failures == [(parent, error)] and update.finished == [parent, sibling]
    assert parent.finish_reason == sibling.finish_reason == "error" and parent.stop_reason is None
    assert loop.sched.running == [other] and not loop.sched.waiting and other.num_pending == 0


def test_prompt_logprobs_mark_how_far_the_prompt_has_arrived():
    loop = Loop(32, max_num_batched_tokens=4)
    seq = loop.add(prompt(7, 0), max_tokens=10)
    seq.computes_prompt_logprobs = True
    results = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        [chunk] = dispatched(loop.sched)
        n = min(chunk.num_tokens, seq.num_prompt_tokens - 1 - chunk.start)
        results.append(PromptLogprobsResult(chunk, chunk.start + 1, [0.0] * n, None, None))
    first = loop.sched.update_from_output(RunnerOutput(results[:1]))
    assert first.prompt_logprobs == results[:1] and seq.num_prompt_logprobs == 5 and seq.computes_prompt_logprobs
    rest = loop.sched.update_from_output(RunnerOutput(results[1:] + results[:1]))  # one arrives again: dropped
    assert rest.prompt_logprobs == results[1:] and seq.num_prompt_logprobs == 7 and not seq.computes_prompt_logprobs
