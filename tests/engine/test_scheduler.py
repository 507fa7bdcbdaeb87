"""Scheduler, driven by a fake engine loop over a fake device (no model, no jax)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from budgets import zipage_budget
from fake_device import FakeDevice, check_block_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage_jax.compress.quotes import advance_quote_end
from zipage_jax.engine.block_manager import BlockManager, CompressionPlan
from zipage_jax.engine.core_outputs import EngineCoreOutputs
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.runner.results import FetchedStep, PromptLogprobsResult, RowFailure, RunnerOutput
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.scheduler import Chunk, Scheduler, SchedulerOutput
from zipage_jax.engine.sequence import PENDING, Sequence, SequenceStatus
from zipage_jax.sampling_params import SamplingParams


def make_scheduler(bm: BlockManager, *, max_num_batched_tokens: int, prefill_row_size: int = 1,
                   prompt_window: int = 0, **options) -> Scheduler:
    """A scheduler with the prompt compaction rule the engine core would give it."""
    prompt = PromptCompaction.of(bm.block_size, max_num_batched_tokens, prompt_window, prefill_row_size)
    return Scheduler(bm, max_num_batched_tokens=max_num_batched_tokens, prefill_row_size=prefill_row_size,
                     prompt=prompt, **options)


def sampled_rows(out: SchedulerOutput) -> np.ndarray:
    """The batch rows whose token a dispatched step samples: its decode rows, then the rows of
    the chunks that end at their sequence's last token."""
    rows = [c.seq.row for c in out.chunks if c.samples]
    return np.concatenate([out.decode_rows, np.asarray(rows, np.int64)]).astype(np.int64)


def kept_in_place(sched: Scheduler, out: SchedulerOutput) -> dict[Sequence, int]:
    """The sequences the step compacts in place, each with the tokens it keeps: one that decodes
    in the step writes its token past them."""
    batch = sched.batch
    return {batch.seqs[row]: int(batch.budget_tokens[row]) for row in out.compact_rows}


def fetched(sched: Scheduler, rows, tokens, epochs: np.ndarray | None = None,
            prompt_logprobs: list[PromptLogprobsResult] = ()) -> FetchedStep:
    """A step's results as the runner reads them back: row `rows[i]` sampled `tokens[i]`; `epochs`:
    the rows' epochs when the step was dispatched (default: now)."""
    rows = np.asarray(rows, np.int64)
    n = len(rows)
    return FetchedStep(rows, sched.batch.epoch[rows].copy() if epochs is None else epochs,
                       np.asarray(tokens, np.int32).reshape(n), np.zeros(n, np.float32), np.zeros((n, 1), np.int32),
                       np.zeros((n, 1), np.float32), prompt_logprobs=list(prompt_logprobs))


@dataclasses.dataclass
class Stepped:
    """One step of the fake loop: what the scheduler planned, every chunk it computed (decode rows
    as one-token chunks, as they stood when it was scheduled), and what the update handed back."""

    out: SchedulerOutput
    chunks: list[Chunk]
    compressions: list[CompressionPlan]  # every compaction, in-place rows as plans
    result: EngineCoreOutputs

    @property
    def preempted(self):
        return self.out.preempted


class Loop:
    """The engine loop of EngineCore.step with the model replaced by FakeDevice, and synchronous
    scheduling (a step's tokens are read back in its own update); checks the scheduler's promises
    around every step."""

    def __init__(self, num_blocks: int, bs: int = 4, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                 num_query_slots: int = 8, max_compress_seqs: int = 8, prefix_caching: bool = True,
                 query_cache_len: int = 2, seed: int = 0, prompt_window: int = 0):
        self.bs, self.ql = bs, query_cache_len
        self.bm = BlockManager(num_blocks, bs, prefix_caching)
        self.sched = make_scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    num_query_slots=num_query_slots, max_compress_seqs=max_compress_seqs,
                                    prompt_window=prompt_window)
        self.device = FakeDevice(num_blocks, bs, num_query_slots, query_cache_len, seed)
        self.rng = random.Random(seed)
        self.max_tokens: dict[Sequence, int] = {}
        self.seqs: list[Sequence] = []
        self.admitted: list[Sequence] = []  # in order of first admission
        self.history: list[Stepped] = []
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
                       max_len=len(token_ids) + max_tokens)
        self.max_tokens[seq] = max_tokens
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> Stepped:
        before = {s: _state(s, self.bs, self.sched) for s in self.seqs}
        running, waiting = list(self.sched.running), list(self.sched.waiting)
        out = self.sched.schedule()
        chunks = out.all_chunks(self.sched.batch)
        plans = out.all_compressions(self.sched.batch)
        self._check_output(out, chunks, plans, before, running, waiting)
        for plan in plans:
            self.device.check_query_tail(plan.seq, self.observed.pop(plan.seq, None))
            self.device.compact(plan)
            self.compactions.append((plan.seq, plan.seq.num_computed_tokens))
        kept = kept_in_place(self.sched, out)
        for chunk in chunks:
            seq = chunk.seq
            if seq not in self.admitted:
                self.admitted.append(seq)
            self.device.write(seq, chunk.start, chunk.num_tokens, chunk.tail, chunk.tail_start, chunk.tail_blocks,
                              kv_start=kept.get(seq))
            self.observed.pop(seq, None)
            if chunk.tail:
                first = chunk.tail_start
                assert first >= chunk.start + chunk.num_tokens and first + chunk.tail == seq.num_prefill_tokens
                self.observed[seq] = (list(range(chunk.start, chunk.start + chunk.num_tokens))
                                      + list(range(first, first + chunk.tail)))
                self.tails.append((seq, chunk.start + chunk.num_tokens, chunk.tail))
        rows = sampled_rows(out)
        sampled = [self.sched.batch.seqs[row] for row in rows]
        assert sorted(s.seq_id for s in sampled) == sorted(c.seq.seq_id for c in chunks if c.samples)
        tokens = [self.rng.randrange(3) for _ in sampled]  # they arrive at once (synchronous scheduling)
        result = self.sched.update_from_output(out, RunnerOutput(fetched=[fetched(self.sched, rows, tokens)]))
        self._check_result(plans, result, before, sampled, tokens)
        self.check_state()
        stepped = Stepped(out, chunks, plans, result)
        self.history.append(stepped)
        return stepped

    def run(self, max_steps: int = 2000) -> int:
        for steps in range(max_steps):
            if not self.sched.has_unfinished():
                return steps
            out = self.step()
            assert not out.out.empty, f"stalled at step {steps}"
        raise AssertionError(f"not finished after {max_steps} steps")

    # -- checks ---------------------------------------------------------------------------------

    def _check_output(self, out, chunks, plans, before, running, waiting) -> None:
        sched, bs = self.sched, self.bs
        assert sum(c.num_tokens + c.tail for c in chunks) <= sched.max_num_batched_tokens
        rows = sum(-(-c.num_tokens // sched.prefill_row_size) + -(-c.tail // sched.prefill_row_size)
                   for c in chunks if c.num_tokens > 1 or c.tail)
        assert rows <= sched.max_num_batched_tokens // sched.prefill_row_size
        compacting = kept_in_place(sched, out)
        # a decode row: a running sequence past its prompt, its last token (the only one left) to compute
        assert len(set(out.decode_rows.tolist())) == len(out.decode_rows)
        for row in out.decode_rows:
            seq = sched.batch.seqs[row]
            assert seq is not None and seq.row == row and sched.batch.running[row]
            assert seq.num_computed_tokens == len(seq) - 1 >= seq.num_prefill_tokens
            assert not seq.compressing or row in out.compact_rows, "decodes while a plan compacts it"
        for c in chunks:  # a tail's scratch blocks: its own, outside every table
            assert len(c.tail_blocks) == -(-c.tail // bs)
            assert all(self.bm.blocks[b].ref_count == 1 for b in c.tail_blocks)
            assert not set(c.tail_blocks) & {b for s in self.seqs for b in s.block_table}
        assert len(sched.running) <= sched.max_num_seqs
        assert len({c.seq for c in chunks}) == len(chunks)
        for c in chunks:
            seq = c.seq
            assert seq.status == SequenceStatus.RUNNING and (not seq.compressing or seq in compacting)
            assert c.start == seq.num_computed_tokens and 1 <= c.num_tokens <= len(seq) - c.start
            kv = compacting.get(seq, seq.num_kv_slots)
            assert len(seq.block_table) * bs >= kv + c.num_tokens
            m = seq.budget_blocks
            for phys in range(kv, kv + c.num_tokens):
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
        planned = [p.seq for p in plans]
        assert len(planned) == len(set(planned)) <= sched.max_compress_seqs
        for s in remaining:
            if before[s]["full"] and not before[s]["compressing"] and s not in compacting:
                assert s not in [c.seq for c in chunks], "grows past its budget"
        for plan in plans:
            seq, m = plan.seq, plan.seq.budget_blocks
            assert before[seq]["full"] and not before[seq]["compressing"] and seq.compressing
            assert plan.source_table == seq.block_table and len(plan.target_table) == m + 1
            assert len(set(plan.target_table)) == m + 1 and 0 not in plan.target_table
            for i, b in enumerate(plan.target_table):
                assert b not in plan.source_table[i + 1:], "a write could overtake a read"
                assert self.bm.blocks[b].ref_count == 1
            kept = [b for b in plan.source_table if b in plan.target_table]
            assert sorted(plan.release) == sorted(b for b in plan.source_table if b not in kept)

    def _check_result(self, plans, result, before, sampled, tokens) -> None:
        """What the update handed back: every token sampled (none left pending: they arrived at
        once), the sequences that reached their length, the compactions and what they evicted."""
        assert result.seq_ids.tolist() == [s.seq_id for s in sampled] and result.token_ids.tolist() == tokens
        assert all(s.num_pending == 0 and s.token_ids[-1] == t for s, t in zip(sampled, tokens))
        done = [s for s in sampled if s.num_output_tokens == self.max_tokens[s]]
        assert [(f.seq_id, f.reason, f.stop_reason) for f in result.finished] == \
            [(s.seq_id, "length", None) for s in done]
        assert all(s.is_finished and s.finish_reason == "length" for s in done)
        assert result.compressed == [p.seq.seq_id for p in plans]
        assert result.kv_tokens_evicted == sum(before[p.seq]["kv"] - p.seq.budget_blocks * self.bs for p in plans)
        assert not result.failures

    def check_state(self) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        assert set(live) == set(self.sched.running) | set(self.sched.waiting)
        assert len(self.sched.running) == len(set(self.sched.running))
        batch = self.sched.batch  # a row per running sequence, and only those
        assert batch.num_running == len(self.sched.running) <= self.sched.max_num_seqs
        assert all(batch.seqs[s.row] is s and batch.running[s.row] for s in self.sched.running)
        assert sorted(batch.free_rows) == [r for r in range(batch.num_rows) if batch.seqs[r] is None]
        assert all(s.row is None for s in self.seqs if s.status != SequenceStatus.RUNNING)
        assert PENDING not in [t for s in self.seqs for t in s.token_ids]
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
        assert len(self.sched.batch.free_rows) == self.sched.batch.num_rows, "rows leaked"


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


@pytest.mark.parametrize("budget", [1, None])
def test_a_budgeted_sequence_waits_for_room_to_its_first_compaction(budget):
    """Admitted only when its way to its first compaction point (budget and the next block) fits
    beside what the running budgeted ones are still owed, no budgeted sequence is preempted on
    its way, and none later (compressed, it holds its own); full KV on the same pool preempts."""
    loop = Loop(12, prefix_caching=False)  # 11 usable blocks of 4; a prompt of 10 takes 3
    seqs = [loop.add(prompt(10, i), max_tokens=24, budget=budget) for i in range(6)]
    loop.run()
    preempted = [s for o in loop.history for s in o.preempted]
    assert all(s.num_output_tokens == 24 for s in seqs)
    if budget is None:
        assert preempted, "the pool was never short"
    else:
        assert not preempted and all(s.metrics.num_compressions > 0 for s in seqs)
        assert max(len(o.out.decode_rows) for o in loop.history) >= 3  # not one at a time
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
    max_tokens = 10 * (m + 1) * bs
    seq = loop.add(prompt(5, 0), max_tokens=max_tokens, budget=m)
    compressed_at, kinds = [], []
    while loop.sched.has_unfinished():
        out = loop.step()
        if out.compressions:
            assert [p.seq for p in out.compressions] == [seq]
            in_place = not out.out.compressions
            # a plan sits the step out; compacting in place, the sequence decodes in the same step
            assert [c.seq for c in out.chunks] == ([seq] if in_place else [])
            compressed_at.append(seq.num_computed_tokens - in_place)
            kinds.append("in place" if in_place else "plan")
            assert seq.num_kv_slots == m * bs + in_place and len(seq.block_table) == m + 1
            assert seq.history_blocks == m  # the next compaction's history: what this one kept
        assert len(seq.block_table) <= m + 1
    last = 5 + 10 * (m + 1) * bs - 2  # position of the last computed token
    expected = list(range((m + 1) * bs, last + 1, bs))
    assert compressed_at == expected
    # once compressed, every block is its own and unhashed: it compacts in place, with no plan
    assert kinds == ["plan"] + ["in place"] * (len(expected) - 1)
    assert len(loop.history) == 1 + (max_tokens - 1) + 1  # the prompt, the decodes, the plan's step
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
    loop = Loop(9, 4, max_num_seqs=3, max_num_batched_tokens=16, num_query_slots=1, query_cache_len=1)
    p = prompt(14, 0)  # one chunk: prefilled whole, compressed once its decodes fill block 4
    parent = loop.add(p, max_tokens=4, budget=1)
    loop.add(p, max_tokens=4, budget=1, parent=parent)  # shares the parent's first 3 blocks
    loop.add(prompt(8, 1), max_tokens=8)  # full KV: holds the last free blocks
    loop.run()
    plan, out = next((p, o) for o in loop.history for p in o.compressions if p.seq is parent)
    assert set(plan.target_table).isdisjoint(plan.source_table)  # both kept blocks were shared
    assert out.preempted, "the blocks for the shared ones came from a preemption"
    loop.check_all_freed()


def test_a_failed_compaction_is_recovered_on_a_fresh_pool(monkeypatch):
    # a compaction fails on the device: the engine requeues every sequence (Scheduler.requeue_all)
    # and the block manager starts over; the replacement blocks the plan took are free again
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
    check_block_manager(loop.bm, live, pending=fresh)  # held by the plan alone
    known = {s: s.token_ids for s in loop.seqs}
    loop.sched.requeue_all()
    assert loop.bm.num_free_blocks == loop.bm.num_usable_blocks and loop.bm.hash_to_block_id == {}
    assert all(loop.bm.blocks[b].ref_count == 0 and b in loop.bm.free_block_ids for b in fresh)
    assert loop.sched.query_slots.in_use == loop.sched.batch.num_running == 0
    assert all(s.status == SequenceStatus.WAITING and s.block_table == [] and not s.compressing
               and s.num_computed_tokens == s.num_kv_slots == 0 for s in loop.seqs)
    assert list(loop.sched.waiting) == loop.seqs  # in admission order
    loop.check_state()
    loop.device = FakeDevice(32, 4, 2, 1)  # nothing of the old pool may be read again
    loop.run()
    assert all(s.num_output_tokens == 12 and s.token_ids[:len(known[s])] == known[s] for s in loop.seqs)
    assert parent.metrics.num_compressions > 0
    loop.check_all_freed()


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
    assert loop.sched.query_slots.in_use == loop.sched.batch.num_running == 0
    assert len(loop.sched.batch.free_rows) == loop.sched.batch.num_rows
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
        assert not out.out.empty, f"stalled at step {step}"
    else:
        raise AssertionError("not finished after 3000 steps")
    loop.check_all_freed()
    assert all(s.num_output_tokens == loop.max_tokens[s] for s in loop.seqs if s is not aborted)


def run_step(sched: Scheduler, token_id: int = 9) -> tuple[SchedulerOutput, list[Chunk]]:
    """One step scheduled, dispatched and read back at once, every sampled row getting `token_id`:
    what it scheduled and all its chunks."""
    out = sched.schedule()
    chunks = out.all_chunks(sched.batch)
    rows = sampled_rows(out)
    sched.update_from_output(out, RunnerOutput(fetched=[fetched(sched, rows, [token_id] * len(rows))]))
    return out, chunks


def test_prefill_rows_stay_within_the_grid_and_a_full_row_beside_a_decode():
    # rows of 8 tokens, 16 tokens a step: at most 2 prefill rows; a decode costs a token, not a row
    bm = BlockManager(64, 4, True)
    sched = make_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, num_query_slots=8, max_compress_seqs=8,
                           prefill_row_size=8)
    decoding = Sequence([1, 2, 3], 4, max_len=100)
    sched.add(decoding)
    run_step(sched)  # its prompt, and its first token: it decodes from now on
    assert decoding.token_ids == [1, 2, 3, 9]
    for prompt_len in (3, 9, 30):
        sched.add(Sequence(list(range(1, prompt_len + 1)), 4, max_len=100))
    decoded = 0
    for _ in range(6):
        out, chunks = run_step(sched)
        prefill = [c for c in chunks if c.num_tokens > 1]
        assert sum(-(-c.num_tokens // 8) for c in prefill) <= 2  # rows
        assert sum(c.num_tokens for c in chunks) <= 16  # tokens
        decoded += decoding.row in out.decode_rows
    assert decoded == 6  # the decode never waited for a row
    assert all(not s.in_prefill for s in sched.running)


def test_a_step_of_one_row_still_admits_a_prefill_beside_a_decode():
    bm = BlockManager(64, 4, True)
    sched = make_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, num_query_slots=8, max_compress_seqs=8,
                           prefill_row_size=8)
    first = Sequence([1, 2], 4, max_len=100)
    sched.add(first)
    run_step(sched, 5)
    sched.add(Sequence([3, 4, 5, 6, 7], 4, max_len=100))
    out = sched.schedule()
    assert out.decode_rows.tolist() == [first.row]
    assert sorted(c.num_tokens for c in out.all_chunks(sched.batch)) == [1, 5]  # the decode, the whole prompt


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
    one_row = make_scheduler(BlockManager(64, 16, True), max_num_seqs=4, max_num_batched_tokens=32, num_query_slots=4,
                             max_compress_seqs=4, prefill_row_size=32, prompt_window=16)
    assert one_row.prompt.window == 0
    two_rows = make_scheduler(BlockManager(64, 16, True), max_num_seqs=4, max_num_batched_tokens=64,
                              num_query_slots=4, max_compress_seqs=4, prefill_row_size=32, prompt_window=48)
    assert two_rows.prompt.window == 32  # half a step, a row beside the chunk's
    seq = Sequence(prompt(200, 0), 16, budget=zipage_budget(2, 16, 8), query_cache_len=8, max_len=210)
    two_rows.add(seq)
    steps, tails = 0, []
    while seq.num_computed_tokens < 200 and steps < 100:
        out, _ = run_step(two_rows, 1)
        tails += [chunk.tail for chunk in out.chunks]
        steps += 1
    assert seq.num_computed_tokens == 200 and 32 in tails  # every point reached, each with its tail


# -- a step's output ----------------------------------------------------------------------------


@dataclasses.dataclass
class Dispatched:
    """A step scheduled and dispatched (committed: its sampled tokens PENDING until they arrive)."""

    out: SchedulerOutput
    rows: np.ndarray  # the rows it samples
    epochs: np.ndarray  # theirs when it was dispatched

    @property
    def chunks(self) -> list[Chunk]:
        return self.out.chunks


def dispatched(sched: Scheduler, device: FakeDevice | None = None) -> Dispatched:
    """`device`: the step's chunks are written there (for a loop that runs on afterwards)."""
    out = sched.schedule()
    if device is not None:
        for c in out.all_chunks(sched.batch):
            device.write(c.seq, c.start, c.num_tokens, c.tail, c.tail_start, c.tail_blocks)
    rows = sampled_rows(out)
    epochs = sched.batch.epoch[rows].copy()
    sched.update_from_output(out, RunnerOutput())
    return Dispatched(out, rows, epochs)


def arrive(sched: Scheduler, *steps: tuple[Dispatched, list[int]]) -> EngineCoreOutputs:
    """The tokens of earlier steps reach the host (in an update of a step that scheduled nothing)."""
    return sched.update_from_output(SchedulerOutput(), RunnerOutput(
        fetched=[fetched(sched, d.rows, tokens, d.epochs) for d, tokens in steps]))


def with_params(loop: Loop, token_ids: list[int], params: SamplingParams, max_len: int | None = None) -> Sequence:
    seq = Sequence(list(token_ids), loop.bs, params=params, max_len=max_len or len(token_ids) + params.max_tokens)
    loop.max_tokens[seq] = params.max_tokens
    loop.seqs.append(seq)
    loop.sched.add(seq)
    return seq


def test_a_token_joins_its_sequence_commits_its_blocks_and_stops_it():
    loop = Loop(16)
    seq = with_params(loop, prompt(7, 0), SamplingParams(max_tokens=10, stop_token_ids=[9]))
    first = dispatched(loop.sched)
    second = dispatched(loop.sched)  # asynchronous scheduling: before the first token arrives
    assert len(second.out.decode_rows) == 1 and not second.chunks  # it decodes the PENDING token
    assert seq.num_pending == 2 and seq.num_hashed_blocks == 1  # block 1 holds a PENDING token
    update = arrive(loop.sched, (first, [5]))
    assert seq.token_ids[7] == 5 and seq.num_pending == 1 and seq.num_hashed_blocks == 2
    assert (update.seq_ids.tolist(), update.token_ids.tolist(), update.finished) == ([seq.seq_id], [5], [])
    assert not seq.is_finished
    third = dispatched(loop.sched)
    update = arrive(loop.sched, (second, [9]), (third, [1]))
    assert (update.seq_ids.tolist(), update.token_ids.tolist()) == ([seq.seq_id], [9])  # the third dropped
    assert [(f.seq_id, f.reason, f.stop_reason, f.stop_token) for f in update.finished] == [(seq.seq_id, "stop", 9,
                                                                                              True)]
    assert (seq.finish_reason, seq.stop_reason, seq.token_ids[-1]) == ("stop", 9, 9) and seq.num_pending == 0
    assert seq.is_finished and seq.token_ids == prompt(7, 0) + [5, 9]
    loop.check_all_freed()


def test_a_sequence_at_its_length_limit_finishes():
    loop = Loop(16)
    seq = with_params(loop, prompt(7, 0), SamplingParams(max_tokens=100, ignore_eos=True), max_len=9)
    for expected in (None, "length"):
        update = arrive(loop.sched, (dispatched(loop.sched), [1]))
        assert seq.finish_reason == expected
    assert [(f.seq_id, f.reason, f.stop_reason, f.stop_token) for f in update.finished] == \
        [(seq.seq_id, "length", None, False)]
    assert len(seq) == 9 and not loop.sched.has_unfinished()
    loop.check_all_freed()


def test_eos_stop_ids_min_tokens_and_max_tokens_finish_rows_in_one_step():
    # four rows decode together; each token is checked against its own row's request
    bm = BlockManager(64, 4, True)
    batch = RunningBatch(8, 63, 4, (2,))  # EOS: token 2
    sched = make_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, num_query_slots=8, max_compress_seqs=8,
                           batch=batch)
    params = {"eos": SamplingParams(max_tokens=10),
              "ignore_eos": SamplingParams(max_tokens=10, ignore_eos=True),
              "min_tokens": SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]),
              "max_tokens": SamplingParams(max_tokens=2)}
    seqs = {name: Sequence([10 + i, 11, 12], 4, params=p, max_len=3 + p.max_tokens)
            for i, (name, p) in enumerate(params.items())}
    for seq in seqs.values():
        sched.add(seq)
    order = list(seqs.values())

    def step(tokens: dict[str, int]) -> EngineCoreOutputs:
        out = sched.schedule()
        rows = sampled_rows(out)
        by_row = {s.row: tokens[name] for name, s in seqs.items() if not s.is_finished}
        return sched.update_from_output(out, RunnerOutput(
            fetched=[fetched(sched, rows, [by_row[r] for r in rows.tolist()])]))

    first = step({"eos": 5, "ignore_eos": 2, "min_tokens": 7, "max_tokens": 5})
    assert first.finished == [] and all(s.num_output_tokens == 1 for s in order)  # the stop id within min_tokens
    second = step({"eos": 2, "ignore_eos": 2, "min_tokens": 2, "max_tokens": 5})
    assert [(f.seq_id, f.reason, f.stop_reason, f.stop_token) for f in second.finished] == [
        (seqs["eos"].seq_id, "stop", None, True), (seqs["max_tokens"].seq_id, "length", None, False)]
    third = step({"ignore_eos": 2, "min_tokens": 7})  # past min_tokens: the stop id stops it
    assert [(f.seq_id, f.reason, f.stop_reason, f.stop_token) for f in third.finished] == [
        (seqs["min_tokens"].seq_id, "stop", 7, True)]
    assert seqs["min_tokens"].token_ids[3:] == [7, 2, 7]  # EOS is no stop token of its own (min_tokens: 2)
    assert seqs["ignore_eos"].token_ids[3:] == [2, 2, 2] and not seqs["ignore_eos"].is_finished
    assert seqs["eos"].token_ids[3:] == [5, 2] and seqs["max_tokens"].token_ids[3:] == [5, 5]


def test_a_preempted_sequence_keeps_its_row_until_its_token_in_flight_arrives():
    loop = Loop(16)
    seq = loop.add(prompt(7, 0), max_tokens=4)
    step = dispatched(loop.sched, loop.device)
    row = seq.row
    loop.sched.preempt(seq, SchedulerOutput())
    assert seq.row == row and loop.sched.batch.occupied[row] and not loop.sched.batch.running[row]
    assert list(loop.sched.waiting) == [seq] and loop.sched.running == [] and seq.num_pending == 1
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    update = arrive(loop.sched, (step, [2]))
    assert update.seq_ids.tolist() == [seq.seq_id] and seq.token_ids == prompt(7, 0) + [2]
    assert seq.row is None and len(loop.sched.batch.free_rows) == loop.sched.batch.num_rows  # the row is free
    loop.check_state()
    loop.run()
    assert seq.num_output_tokens == 4 and seq.token_ids[:8] == prompt(7, 0) + [2]
    assert seq.num_prefill_tokens == 8  # it computed its token again as a prompt
    loop.check_all_freed()


def test_a_token_for_a_row_that_changed_hands_is_dropped():
    loop = Loop(16, max_num_seqs=1)
    gone = loop.add(prompt(5, 0), max_tokens=8)
    step = dispatched(loop.sched, loop.device)
    loop.sched.finish(gone)  # aborted while its token is in flight
    new = loop.add(prompt(6, 1), max_tokens=3)
    dispatched_new = dispatched(loop.sched, loop.device)
    assert new.row == step.rows[0]  # the only row, again
    update = arrive(loop.sched, (step, [1]), (dispatched_new, [2]))
    assert (update.seq_ids.tolist(), update.token_ids.tolist()) == ([new.seq_id], [2])
    assert gone.token_ids == prompt(5, 0) and new.token_ids == prompt(6, 1) + [2]
    loop.run()
    loop.sched.finish(gone)
    assert new.num_output_tokens == 3
    loop.check_all_freed()


def test_a_failure_finishes_every_sequence_of_its_request():
    loop = Loop(32)
    other = loop.add(prompt(5, 1), max_tokens=10)
    parent = loop.add(prompt(7, 0), max_tokens=10)
    sibling = loop.add(prompt(7, 0), max_tokens=10, parent=parent)
    for seq, request_id, index in [(other, "b", 0), (parent, "a", 0), (sibling, "a", 1)]:
        seq.request_id, seq.index = request_id, index
    out = loop.sched.schedule()
    ours, theirs = out.chunks  # the sibling waits for its parent's prompt
    assert ours.seq is other and theirs.seq is parent and sibling in loop.sched.waiting
    loop.device.write(other, ours.start, ours.num_tokens)  # the step runs without the failed chunk
    error = ValueError("no room for this row")
    update = loop.sched.update_from_output(out, RunnerOutput(fetched=[fetched(loop.sched, [other.row], [1])],
                                                             failures=[RowFailure(theirs, error)]))
    assert update.failures == [("a", "ValueError: no room for this row", error)]
    assert [(f.seq_id, f.reason) for f in update.finished] == [(parent.seq_id, "error"), (sibling.seq_id, "error")]
    assert parent.finish_reason == sibling.finish_reason == "error" and parent.stop_reason is None
    assert parent.num_computed_tokens == 0 and parent.token_ids == prompt(7, 0)  # never committed
    assert update.seq_ids.tolist() == [other.seq_id] and update.token_ids.tolist() == [1]
    assert loop.sched.running == [other] and not loop.sched.waiting and other.num_pending == 0
    loop.run()
    loop.check_all_freed()


def test_prompt_logprobs_mark_how_far_the_prompt_has_arrived():
    loop = Loop(32, max_num_batched_tokens=4)
    seq = loop.add(prompt(7, 0), max_tokens=10)
    seq.computes_prompt_logprobs = True
    results = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        [chunk] = dispatched(loop.sched).chunks
        n = min(chunk.num_tokens, seq.num_prompt_tokens - 1 - chunk.start)
        results.append(PromptLogprobsResult(chunk, chunk.start + 1, [0.0] * n, None, None))

    def arrived(results: list[PromptLogprobsResult]) -> EngineCoreOutputs:
        step = fetched(loop.sched, [], [], prompt_logprobs=results)
        return loop.sched.update_from_output(SchedulerOutput(), RunnerOutput(fetched=[step]))

    def entries(results: list[PromptLogprobsResult]) -> list[tuple]:
        return [(seq.seq_id, r.first, r.logprobs, r.top_ids, r.top_logprobs) for r in results]

    first = arrived(results[:1])
    assert first.prompt_logprobs == entries(results[:1])
    assert seq.num_prompt_logprobs == 5 and seq.computes_prompt_logprobs
    rest = arrived(results[1:] + results[:1])  # one arrives again: dropped
    assert rest.prompt_logprobs == entries(results[1:])
    assert seq.num_prompt_logprobs == 7 and not seq.computes_prompt_logprobs


def test_each_compaction_first_advances_how_far_the_answer_quoted_its_prompt():
    # an answer that restates its prompt: before each compaction (planned or in place) the
    # sequence's quote end is compress/quotes.py's, over the answer known then
    bs, m = 4, 2
    loop = Loop(32, bs, query_cache_len=2)
    p = list(range(100, 140))  # distinct ids: each 4-gram occurs once
    budget = dataclasses.replace(zipage_budget(m, bs, 2), prompt_reserve=2)
    seq = Sequence(list(p), bs, budget=budget, query_cache_len=2, max_len=len(p) + 30)
    loop.max_tokens[seq] = 30
    loop.seqs.append(seq)
    loop.sched.add(seq)
    answer = iter(p)
    loop.rng = type("Restating", (), {"randrange": lambda self, _: next(answer)})()
    expected, kinds = 0, []
    while loop.sched.has_unfinished():
        known = seq.token_ids
        stepped = loop.step()
        if stepped.compressions:
            expected = advance_quote_end(p, known[len(p):], expected)
            assert seq.quote_end == expected
            kinds.append("plan" if stepped.out.compressions else "in place")
    assert expected > 4 and kinds[:2] == ["plan", "in place"]
