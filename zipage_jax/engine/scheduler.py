"""Continuous batching: which sequences compute which tokens this step.

FCFS; running sequences first, then admission from the waiting queue, all under
`max_num_batched_tokens`. Every running sequence that only decodes (past its prompt, with room
in its blocks and a query slot if it needs one) is a *decode row*: these are picked by one mask
over the running batch's arrays (engine/running_batch.py) and each takes one token. The other
running sequences (computing a prompt, needing a block, a query slot or a compaction) are
handled one by one, in admission order, with what the step has left. Prefill chunks are laid
over rows of `prefill_row_size` tokens, and a step holds at most max_num_batched_tokens /
prefill_row_size prefill rows, so the prefill step's shape stays within the compiled grid.

A sequence at its KV budget is compressed instead of growing, in prefill too: while a sequence
computes its prompt (after a recompute, every token it had) it compacts at the points of
`PromptCompaction` (engine/prompt_compaction.py: bounded, within the budget and one chunk, each
compaction scored by the prompt's tail; or deferred, once at the prompt's end); once past its
prompt, whenever its M + 1 blocks are full. These points depend on the sequence alone, not on
how its prompt was cut into chunks, so a request's output does not depend on the batch it ran
in. A sequence compacting in place decodes in the same step (the device compacts first); one
compacting by a plan decodes the next step. Compressed sequences are never preempted.
Preemption is by recompute, the victim being the most recently admitted sequence that may be
preempted. A budgeted sequence is admitted only when its way to its first compaction point fits
beside what the running ones are still owed, and an automatic budget grows only into blocks no
one is owed (engine/block_reserve.py). A sequence whose last token is sampled (perhaps still on
its way to the host) is not scheduled again. A sequence with stop strings decodes only while the
output stage, which matches them, is at most `MAX_OUTPUT_LAG` steps behind (`output_lag`): it
ends within that many steps, and the tokens of an asynchronous step, past its stop string.

What a step changes (`update_from_output`) happens here too, in one place: compactions land,
the chunks and decode rows dispatched are committed, the tokens read back join their sequences
(by row, as arrays), full blocks are committed to the prefix cache, and sequences that stop,
reach their length or fail are finished and freed. It returns what the engine hands back: token
ids and finish reasons (engine/core_outputs.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from zipage_jax.compress.auto_budget import choose
from zipage_jax.compress.quotes import QUOTE_NGRAM, find_quote_end
from zipage_jax.engine.block_manager import BlockManager, CompressionPlan
from zipage_jax.engine.block_reserve import admission_blocks, beyond_floor, owed_blocks
from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.runner.results import CompactionFailed, FetchedStep, RunnerOutput
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.sequence import PENDING, Sequence, SequenceStatus

MAX_OUTPUT_LAG = 4  # steps the output stage may be behind a decoding sequence with stop strings


@dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of `seq` get their K/V computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    tail: int = 0  # tokens of the prompt's end run after it, their queries scoring the next compaction
    tail_start: int = 0  # the tail's first position
    tail_blocks: list[int] = field(default_factory=list)  # scratch blocks of the tail's K/V, this step only

    @property
    def samples(self) -> bool:
        """The chunk ends at the sequence's last token: its logits give the next token."""
        return self.start + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    compressions: list[CompressionPlan] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)  # prefill chunks, and decodes that are not rows
    decode_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # batch rows: one token each
    # batch rows compacting in place (compressed before: every block their own, none hashed), no plan
    compact_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # batch rows with an automatic budget at their compaction point: measured, nothing moves
    measure_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.compressions or len(self.decode_rows) or len(self.compact_rows)
                    or len(self.measure_rows))

    @property
    def num_compactions(self) -> int:
        """Compaction program rows this step: the plans, the in-place rows and the measured ones."""
        return len(self.compressions) + len(self.compact_rows) + len(self.measure_rows)

    def compaction_rows(self) -> np.ndarray:
        """The rows of every compaction of the step: the plans' first, then the in-place ones."""
        return np.concatenate([np.array([p.seq.row for p in self.compressions], np.int64), self.compact_rows])

    def all_compressions(self, batch: RunningBatch) -> list[CompressionPlan]:
        """Every compaction of the step as a plan, the in-place rows' after the others (for tests
        and tools that look at a step as a whole; the engine reads those rows as arrays). Call it
        before the step's update: the update gives the sequences their targets."""
        plans = list(self.compressions)
        for row in self.compact_rows.tolist():
            table = batch.block_table[row, :batch.num_blocks[row]].tolist()
            keep = int(batch.budget_blocks[row]) + 1
            plans.append(CompressionPlan(seq=batch.seqs[row], source_table=table, target_table=table[:keep],
                                         release=table[keep:]))
        return plans

    def all_chunks(self, batch: RunningBatch) -> list[Chunk]:
        """Every chunk of the step, decode rows as one-token chunks after the others (for tests and
        tools that look at a step as a whole; the engine reads the rows as arrays)."""
        return self.chunks + [Chunk(batch.seqs[row], int(batch.num_computed_tokens[row]), 1)
                              for row in self.decode_rows]


class Slots:
    """Numbered rows of a device array, held by sequences through `seq.<attr>`."""

    def __init__(self, num_slots: int, attr: str):
        self.free = deque(range(num_slots))
        self.num_slots = num_slots
        self.attr = attr

    def acquire(self, seq: Sequence) -> bool:
        if getattr(seq, self.attr) is None:
            if not self.free:
                return False
            setattr(seq, self.attr, self.free.popleft())
        return True

    def release(self, seq: Sequence) -> None:
        slot = getattr(seq, self.attr)
        if slot is not None:
            self.free.append(slot)
            setattr(seq, self.attr, None)

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self.free)


@dataclass
class StepBudget:
    """What one step may still compute: tokens, and rows of the prefill batch."""

    tokens: int
    rows: int
    row_size: int

    def limit(self, num_tokens: int) -> int:
        """The most of `num_tokens` a chunk may take now (a chunk of one token is a decode row)."""
        n = min(num_tokens, self.tokens)
        return n if n <= 1 else min(n, self.rows * self.row_size)

    def take(self, num_tokens: int, tail: int = 0) -> None:
        """A chunk of `num_tokens` and its prompt tail (rows of its own, even one token)."""
        self.tokens -= num_tokens + tail
        self.rows -= self._rows(num_tokens, tail)

    def fits(self, num_tokens: int, tail: int) -> bool:
        return num_tokens + tail <= self.tokens and self._rows(num_tokens, tail) <= self.rows

    def _rows(self, num_tokens: int, tail: int) -> int:
        """Prefill rows of a chunk and its tail; a one-token chunk alone is a decode row (none)."""
        if num_tokens <= 1 and not tail:
            return 0
        return -(-num_tokens // self.row_size) + -(-tail // self.row_size)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_query_slots: int, max_compress_seqs: int, prompt: PromptCompaction, prefill_row_size: int = 1,
                 batch: RunningBatch | None = None):
        """prompt: the rule of compaction inside a prompt, the one admission sizes budgets by;
        batch: the running sequences' rows (default: max_num_seqs rows, tables as wide as the pool)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_compress_seqs = max_compress_seqs
        self.prefill_row_size = prefill_row_size
        self.prompt = prompt
        self.chunk_blocks = self.prompt.chunk_blocks
        self.query_slots = Slots(num_query_slots, "query_slot")
        self.batch = batch or RunningBatch(max_num_seqs, block_manager.num_usable_blocks, 1, ())
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.output_lag = 0  # steps the output stage is behind (held sequences: stop strings)
        self._admitted = np.zeros(self.batch.num_rows, np.int64)  # admission order of each row's sequence
        self._num_admitted = 0
        self._rows: np.ndarray | None = None  # running rows in admission order (None: to be sorted again)

    # -- the running set ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def running_rows(self) -> np.ndarray:
        """Rows of the running sequences, in admission order."""
        if self._rows is None:
            rows = np.flatnonzero(self.batch.running)
            self._rows = rows[np.argsort(self._admitted[rows], kind="stable")]
        return self._rows

    @property
    def running(self) -> list[Sequence]:
        """The running sequences in admission order (a new list)."""
        seqs = self.batch.seqs
        return [seqs[row] for row in self.running_rows]

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.batch.running.any())

    def num_at_budget(self) -> int:
        b, rows = self.batch, self.running_rows
        m = b.budget_blocks[rows]
        return int(np.count_nonzero((m >= 0) & (b.num_blocks[rows] >= m + 1)))

    def _start_running(self, seq: Sequence) -> None:
        attached = self.batch.attach(seq)  # `_admit` checked that a row is free
        assert attached
        self._admitted[seq.row] = self._num_admitted
        self._num_admitted += 1
        self.batch.held[seq.row] = bool(seq.params is not None and seq.params.stop)
        self._rows = None

    def _stop_running(self, seq: Sequence, keep_row: bool = False) -> None:
        """`keep_row`: a preempted sequence keeps its row until its tokens in flight arrive."""
        if seq.row is not None:
            if keep_row and seq.num_pending:
                self.batch.running[seq.row] = False
            else:
                self.batch.detach(seq)
        self._rows = None

    # -- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = StepBudget(self.max_num_batched_tokens, self.max_num_batched_tokens // self.prefill_row_size,
                            self.prefill_row_size)
        self._schedule_running(out, budget)
        if out.preempted and out.empty:
            # a sequence that preempted itself freed what the others waited for (its query slot)
            self._schedule_running(out, budget)
        self._admit(out, budget)
        return out

    def decode_mask(self, rows: np.ndarray, kv: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Which of the running `rows` only decode this step: (those with room for their token in
        their blocks, those that need one more block first). A decoding row is past its prompt,
        has its last token to compute, a query slot if that token's query is cached, and (stop
        strings) an output stage that keeps up; one whose blocks are full at its budget compacts
        instead. `kv`: the rows' KV slots in use, if not what they hold now (after a compaction)."""
        b, bs = self.batch, self.block_manager.block_size
        computed, blocks = b.num_computed_tokens[rows], b.num_blocks[rows]
        kv = b.num_kv_slots[rows] if kv is None else kv
        m = b.budget_blocks[rows]
        ready = ((computed == b.num_tokens[rows] - 1) & (computed >= b.num_prefill_tokens[rows])
                 & (b.num_tokens[rows] < b.max_len[rows]) & b.state_fresh[rows])
        start = np.maximum(kv, b.budget_tokens[rows])  # Sequence.first_query_tail_slot, by row
        tail = np.maximum(start, start // bs * bs + b.query_tail[rows])
        ready &= ~((m >= 0) & (tail == kv) & (b.query_slot[rows] < 0))
        if self.output_lag > MAX_OUTPUT_LAG:
            ready &= ~b.held[rows]
        room = kv < blocks * bs
        return ready & room, ready & ~room & ((m < 0) | (blocks < m + 1))

    def _decodes_as_row(self, seq: Sequence) -> bool:
        """After its blocks and query slot were granted: the sequence's chunk is a decode row."""
        return bool(self.decode_mask(np.array([seq.row]))[0][0])

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """The decode rows first (one mask; rows whose blocks are full get their next block as
        long as blocks are free), then every other running sequence in admission order."""
        rows = self.running_rows
        if not len(rows) or budget.tokens == 0:
            return
        b = self.batch
        decode, grows = self.decode_mask(rows)
        if len(out.decode_rows):  # the second pass: rows taken in the first stay out
            taken = np.isin(rows, out.decode_rows)
            decode &= ~taken
            grows &= ~taken
        picked = np.zeros(len(rows), bool)
        picked[np.flatnonzero(decode | grows)[:budget.tokens]] = True
        growing = np.flatnonzero(picked & grows)
        optional = beyond_floor(b, rows[growing])
        growing, optional = growing[~optional], growing[optional]
        short = len(growing) - self.block_manager.num_free_blocks
        if short > 0:  # these preempt, or wait, below
            picked[growing[len(growing) - short:]] = False
            growing = growing[:len(growing) - short]
        if len(growing):
            self._grow(rows[growing])
        if len(optional):  # automatic budgets grow into what no one is owed; the rest compact below
            lent = max(0, self._unowed_blocks())
            picked[optional[lent:]] = False
            if lent:
                self._grow(rows[optional[:lent]])
        out.decode_rows = np.concatenate([out.decode_rows, rows[picked]])
        budget.tokens -= int(np.count_nonzero(picked))
        held = self.output_lag > MAX_OUTPUT_LAG
        rest = rows[~picked & ~decode & (b.num_tokens[rows] < b.max_len[rows])]  # waiting for its last token
        if held:
            rest = rest[~b.held[rest] | (b.num_computed_tokens[rest] < b.num_prefill_tokens[rest])]
        measure = self._measures(rest)
        self._measure(rest[measure], out)
        rest = rest[~measure]  # those past the step's compactions measure in a later one
        in_place = self._compacts_in_place(rest)
        self._decode_after_compaction(self._compact_in_place(rest[in_place], out), out, budget)
        for row in rest[~in_place]:
            if budget.tokens == 0:
                break
            seq = b.seqs[row]
            if seq is None or seq.status != SequenceStatus.RUNNING or row in out.decode_rows:
                continue  # preempted earlier in this loop
            self._schedule_one(seq, out, budget)

    def _at_point(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` are at their compaction point past their prompt: every block full, at
        their budget and the next block after it."""
        b, bs = self.batch, self.block_manager.block_size
        m, blocks = b.budget_blocks[rows], b.num_blocks[rows]
        return ((m >= 0) & (blocks >= m + 1) & (b.num_kv_slots[rows] == blocks * bs)
                & (b.num_computed_tokens[rows] >= b.num_prefill_tokens[rows]))

    def _measures(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` have an automatic budget to size first (compress/auto_budget.py)."""
        b = self.batch
        return (b.auto_floor[rows] >= 0) & ~b.measured[rows] & ~b.compressing[rows] & self._at_point(rows)

    def _measure(self, rows: np.ndarray, out: SchedulerOutput) -> None:
        """As many of `rows` as the step has compaction rows left for: measured this step, sized
        by `update_from_output`."""
        rows = rows[:max(0, self.max_compress_seqs - out.num_compactions)]
        self.batch.measuring[rows] = True
        out.measure_rows = np.concatenate([out.measure_rows, rows])

    def _compacts_in_place(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` compact now with no plan: past their prompt, compressed before (so
        every block is their own and unhashed: a plan would keep their first M + 1 blocks),
        every block full at their budget and the next block after it (`_needs_compression`)."""
        b = self.batch
        return b.compressed[rows] & ~b.compressing[rows] & ~b.measuring[rows] & self._at_point(rows)

    def _compact_in_place(self, rows: np.ndarray, out: SchedulerOutput) -> np.ndarray:
        """As many of `rows` as the step has compactions left for (returned)."""
        rows = rows[:max(0, self.max_compress_seqs - out.num_compactions)]
        if len(rows):
            self.batch.compressing[rows] = True
            self._advance_quotes(rows)
            out.compact_rows = np.concatenate([out.compact_rows, rows])
        return rows

    def _decode_after_compaction(self, rows: np.ndarray, out: SchedulerOutput, budget: StepBudget) -> None:
        """Rows compacting in place decode in the same step: the device runs the step's compaction
        before its forward, so each row's token goes to the first slot past the tokens it keeps
        (the runner's decode inputs read `budget_tokens` for a compacting row)."""
        if not len(rows) or budget.tokens == 0:
            return
        rows = rows[self.decode_mask(rows, kv=self.batch.budget_tokens[rows])[0]][:budget.tokens]
        out.decode_rows = np.concatenate([out.decode_rows, rows])
        budget.tokens -= len(rows)

    def _advance_quotes(self, rows: np.ndarray) -> None:
        """Before their compaction: how far each answer has quoted its prompt, for budgets with a
        prompt reserve (compress/quotes.py advance_quote_end, the answers' last tokens by row)."""
        b, n = self.batch, QUOTE_NGRAM
        rows = rows[b.budget_reserve[rows] > 0]
        known = b.num_tokens[rows] - b.num_pending[rows]
        searched = (known - b.num_prompt[rows] >= n) & (b.num_prompt[rows] >= n)
        rows, known = rows[searched], known[searched]
        tails = b.tokens[rows[:, None], known[:, None] - n + np.arange(n)].astype(np.int64)  # [R, n]
        for row, tail, end in zip(rows.tolist(), tails, b.quote_end[rows].tolist()):
            b.quote_end[row] = find_quote_end(b.seqs[row].prompt_bytes(), tail.tobytes(), end)

    def _grow(self, rows: np.ndarray) -> None:
        """One more block for each of `rows` (decode rows whose blocks are full)."""
        b = self.batch
        blocks = b.num_blocks[rows]
        b.block_table[rows, blocks] = self.block_manager.take_free_blocks(len(rows))
        b.num_blocks[rows] = blocks + 1
        b.kv_blocks_peak[rows] = np.maximum(b.kv_blocks_peak[rows], blocks + 1)

    def _schedule_one(self, seq: Sequence, out: SchedulerOutput, budget: StepBudget) -> None:
        if self._cannot_grow(seq):  # an automatic budget keeps what it holds rather than take from others
            self._resize_budget(seq.row, seq.num_blocks - 1)
            self.batch.measured[seq.row] = True
        if self._needs_compression(seq):
            if out.num_compactions < self.max_compress_seqs:
                plan = self.block_manager.plan_compression(seq)
                while plan is None and self._preempt_for(seq, out):  # blocks to replace shared ones
                    plan = self.block_manager.plan_compression(seq)
                if plan is not None:
                    seq.compressing = True
                    self._advance_quotes(np.array([seq.row]))
                    out.compressions.append(plan)
            return  # decodes once the compaction has landed (next step)
        n = self._chunk_size(seq, budget)
        if n == 0:
            return  # waits for a query slot
        n = self._allocate_or_preempt(seq, n, out)
        if n == 0:
            return
        if n == 1 and self._decodes_as_row(seq):
            out.decode_rows = np.append(out.decode_rows, seq.row)
            budget.take(1)
            return
        chunk = self._with_tail(Chunk(seq, seq.num_computed_tokens, n), out, may_preempt=True)
        if chunk is None:
            return
        out.chunks.append(chunk)
        budget.take(chunk.num_tokens, chunk.tail)

    def _admit(self, out: SchedulerOutput, budget: StepBudget) -> None:
        # No admission in a step that preempted: the pool is full (vLLM does the same).
        while (self.waiting and budget.tokens > 0 and self.batch.num_running < self.max_num_seqs
               and not out.preempted and (self.waiting[0].row is not None or self.batch.free_rows)):
            seq = self.waiting[0]
            parent = seq.parent
            if parent is not None and not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens:
                break  # a sibling of n > 1 shares the prompt blocks once they are cached
            if seq.budget is not None and self._unowed_blocks() < self._admission_blocks(seq):
                break  # it would be preempted on its way to its first compaction (engine/block_reserve.py)
            cached = self.block_manager.match_prefix(seq, self._max_cached_blocks(seq))
            n = min(self._chunk_size(seq, budget), self._capacity(seq))
            if n == 0 or not self.block_manager.allocate_slots(seq, n):
                self.block_manager.free(seq)
                self.query_slots.release(seq)
                seq.num_computed_tokens = seq.num_kv_slots = 0
                break
            seq.metrics.num_cached_prompt_tokens = max(seq.metrics.num_cached_prompt_tokens, cached)
            self.block_manager.count_prefix_lookup(seq, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._start_running(seq)
            chunk = self._with_tail(Chunk(seq, seq.num_computed_tokens, n), out, may_preempt=False)
            if chunk is None:
                break
            out.chunks.append(chunk)
            budget.take(chunk.num_tokens, chunk.tail)

    def _needs_compression(self, seq: Sequence) -> bool:
        """Every block full, at its compaction point in the prompt (`PromptCompaction`), at the
        budget and the next block after it: the next token needs a block."""
        m = seq.budget_blocks
        if m is None or seq.num_kv_slots != seq.num_blocks * self.block_manager.block_size:
            return False
        if self._in_prompt(seq):
            point = self.prompt.point(seq)
            return point is not None and seq.num_blocks >= point
        return seq.num_blocks >= m + 1

    def _cannot_grow(self, seq: Sequence) -> bool:
        """An automatic budget below its blocks, every block full, no block free, and what it
        holds but the block it fills is at least its floor (a sequence below its floor, such as
        one that holds just its prompt kept whole, takes a block as any sequence does)."""
        budget = seq.budget
        return (budget is not None and budget.auto is not None and not self._in_prompt(seq)
                and seq.num_kv_slots == seq.num_blocks * self.block_manager.block_size
                and budget.auto.floor < seq.num_blocks < budget.blocks + 1
                and self._unowed_blocks() <= 0)

    def _unowed_blocks(self) -> int:
        """Free blocks no one is owed: the running budgeted sequences' way to their first
        compaction point set aside (engine/block_reserve.py)."""
        return self.block_manager.num_free_blocks - owed_blocks(self.batch, self.running_rows)

    def _admission_blocks(self, seq: Sequence) -> int:
        """engine/block_reserve.py admission_blocks, at most the pool (a budget grown near the
        pool's size and then preempted recomputes within the pool, compacting as it goes)."""
        return min(admission_blocks(seq, self.prompt), self.block_manager.num_usable_blocks)

    @staticmethod
    def _in_prompt(seq: Sequence) -> bool:
        return seq.num_computed_tokens < seq.num_prefill_tokens

    def _chunk_size(self, seq: Sequence, budget: StepBudget) -> int:
        """Tokens to compute now, within the step's tokens and prefill rows; a budgeted prompt
        chunk stops where the sequence holds its budget and one chunk (it compacts there);
        stops before a query tail when no query slot is free; a chunk whose prompt tail does not
        fit in the step stops before the compaction point."""
        n = self._within_prompt_peak(seq, budget.limit(seq.num_uncomputed_tokens))
        tail = seq.first_query_tail_slot()
        if tail is not None and tail < seq.num_kv_slots + n and not self.query_slots.acquire(seq):
            n = max(0, tail - seq.num_kv_slots)
        extra = self.prompt.tail(seq, n)[1]
        if extra and not budget.fits(n, extra):
            n = n - 1  # stops a slot before the point: the tail comes with the next step's token
        return n

    def _with_tail(self, chunk: Chunk, out: SchedulerOutput, may_preempt: bool) -> Chunk | None:
        """The chunk with its prompt tail and the tail's scratch blocks (a running sequence may
        preempt for them; without them the chunk stops a slot before the compaction point).
        None: the sequence was preempted, or nothing is left to compute this step."""
        seq = chunk.seq
        chunk.tail_start, chunk.tail = self.prompt.tail(seq, chunk.num_tokens)
        if not chunk.tail:
            return chunk
        need = -(-chunk.tail // self.block_manager.block_size)
        while may_preempt and self.block_manager.num_free_blocks < need and self._preempt_for(seq, out):
            pass
        if seq.status != SequenceStatus.RUNNING:
            return None
        if self.block_manager.num_free_blocks < need:
            chunk.num_tokens, chunk.tail = chunk.num_tokens - 1, 0
            return chunk if chunk.num_tokens else None
        chunk.tail_blocks = self.block_manager.allocate_scratch(need)
        seq.metrics.kv_blocks_peak = max(seq.metrics.kv_blocks_peak, seq.num_blocks + need)
        return chunk

    def _max_cached_blocks(self, seq: Sequence) -> int | None:
        """No block for a sequence computing prompt log-probabilities: it needs the logits of every
        prompt position, and cached ones have none (its blocks are still cached for others). A
        budgeted sequence shares fewer prefix-cache blocks than its prompt peak, so it compacts at
        the same positions as without the cache."""
        if seq.computes_prompt_logprobs:
            return 0
        return self.prompt.max_cached_blocks(seq)

    def _within_prompt_peak(self, seq: Sequence, n: int) -> int:
        point = self.prompt.point(seq) if self._in_prompt(seq) else None
        if point is None:
            return n
        return min(n, point * self.block_manager.block_size - seq.num_kv_slots)

    def _capacity(self, seq: Sequence) -> int:
        """Slots the sequence can still write without preempting anyone."""
        bs = self.block_manager.block_size
        return seq.num_blocks * bs - seq.num_kv_slots + self.block_manager.num_free_blocks * bs

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Blocks for up to n slots (a prefill chunk shrinks to what fits); preempts when
        nothing fits. Returns the number of slots granted (0: none this step)."""
        while (capacity := self._capacity(seq)) == 0:
            if not self._preempt_for(seq, out):
                return 0
        n = min(n, capacity)
        self.block_manager.allocate_slots(seq, n)  # fits: n <= capacity
        return n

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempts the most recently admitted sequence that may be (perhaps `seq` itself) to free
        blocks for `seq`. False when `seq` must wait: it was the victim, or only compressed
        sequences hold memory."""
        seqs = self.batch.seqs
        victim = next((s for s in (seqs[row] for row in self.running_rows[::-1])
                       if not (s.compressed or s.compressing or s.is_complete)), None)
        if victim is None:
            return False
        self.preempt(victim, out)
        return victim is not seq

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            if chunk.seq is seq:
                self.release_tail(chunk)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        out.decode_rows = out.decode_rows[out.decode_rows != seq.row]
        out.measure_rows = out.measure_rows[out.measure_rows != seq.row]
        if seq.row is not None:
            self.batch.measuring[seq.row] = self.batch.measured[seq.row] = False
        self.block_manager.free(seq)
        self.query_slots.release(seq)
        self._stop_running(seq, keep_row=True)
        seq.reset_for_recompute()
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def requeue_all(self) -> None:
        """The device lost every sequence's KV (a failed step): each running sequence goes back
        to the head of the queue, in order, to compute its tokens again, and tokens still on
        the device (PENDING) are dropped, to be sampled again. What the host delivered stays:
        tokens, stop checkers and structured-output matchers saw only those.

        A compressed sequence recomputes its tokens as a prompt under its budget, compacting as
        a fresh request on those tokens would: its KV stays within the budget, though the kept
        subset may differ from the one lost, so its later tokens can differ from an
        uninterrupted run's (as after any change of the tokens kept)."""
        for seq in self.waiting:
            seq.drop_pending()
            self._stop_running(seq)  # a preempted sequence's tokens in flight are lost too
        for seq in reversed(self.running):
            seq.drop_pending()
            self.query_slots.release(seq)
            self._stop_running(seq)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)
        self.block_manager.reset()

    def count_failed_compaction(self, failure: CompactionFailed, limit: int) -> EngineCoreOutputs:
        """After `requeue_all` for a failed compaction: each compacting sequence counts it, and the
        requests of those that have counted more than `limit` finish with "error"."""
        out = EngineCoreOutputs()
        for seq in list(self.waiting):
            if seq.seq_id in failure.seq_ids and seq.status == SequenceStatus.WAITING:
                seq.failed_compactions += 1
                if seq.failed_compactions > limit:
                    self._fail(seq, RuntimeError(f"its compaction failed {seq.failed_compactions} times: {failure}"),
                               out)
        return out

    # -- a step's results ---------------------------------------------------------------------

    def release_tail(self, chunk: Chunk) -> None:
        """The step that ran the chunk's tail was dispatched (or dropped): its scratch blocks are
        free again (every later write is dispatched after it, and the device runs them in order)."""
        self.block_manager.release_blocks(chunk.tail_blocks)
        chunk.tail_blocks = []

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> EngineCoreOutputs:
        """Applies what a step did and read back, in order: its compactions land (their blocks
        change hands), the prompt tails' scratch blocks are free, its chunks and decode rows are
        committed (their K/V are in the pool, their sampled tokens PENDING), the requests whose
        inputs failed finish with "error", then each step read back: its prompt log-probabilities
        and its tokens, by row (results of sequences that left their row since are dropped).

        A token is checked by its sequence's grammar (one it refuses fails the request), replaces
        its PENDING place, commits the blocks it completes, and may finish the sequence: EOS or a
        stop token id past min_tokens ("stop"), a completed grammar ("stop"), max_tokens or the
        length limit ("length")."""
        out = EngineCoreOutputs()
        self._finish_compressions(scheduled, out)
        self._size_budgets(scheduled.measure_rows, output.measured)
        failed = {f.chunk.seq.request_id for f in output.failures}  # the whole request fails
        for chunk in scheduled.chunks:
            self.release_tail(chunk)
            if chunk.seq.request_id not in failed:
                self._commit(chunk)
        self._commit_rows(scheduled.decode_rows)
        for failure in output.failures:
            self._fail(failure.chunk.seq, failure.error, out)
        for step in output.fetched:
            self._apply(step, out)
        self._commit_full_blocks(self.running_rows)  # blocks now full of known tokens, by row
        return out

    def _finish_compressions(self, scheduled: SchedulerOutput, out: EngineCoreOutputs) -> None:
        """The step that compacts them has been dispatched: each sequence owns its targets (an
        in-place row, its first M + 1 blocks) and keeps its budget's tokens."""
        if not scheduled.compressions and not len(scheduled.compact_rows):
            return
        for plan in scheduled.compressions:
            self.block_manager.finish_compression(plan)
        rows, b = scheduled.compact_rows, self.batch
        keep = b.budget_blocks[rows] + 1
        past = b.num_blocks[rows] > keep
        for row, n in zip(rows[past].tolist(), keep[past].tolist()):  # rare: more blocks than M + 1
            self.block_manager.release_blocks(b.block_table[row, n:b.num_blocks[row]].tolist())
            b.set_block_table(row, b.block_table[row, :n].tolist())
        rows = scheduled.compaction_rows()
        kept = b.budget_tokens[rows]
        evicted = b.num_kv_slots[rows] - kept
        b.num_kv_slots[rows] = kept
        b.history_blocks[rows] = kept // self.block_manager.block_size
        b.compressed[rows], b.compressing[rows] = True, False
        b.measured[rows] = False
        for row, n in zip(rows.tolist(), evicted.tolist()):
            metrics = b.seqs[row].metrics
            metrics.num_compressions += 1
            metrics.kv_tokens_evicted += n
        out.kv_tokens_evicted += int(evicted.sum())
        out.compressed += b.seq_id[rows].tolist()

    def _size_budgets(self, rows: np.ndarray, losses: np.ndarray | None) -> None:
        """The measured rows' next budgets (compress/auto_budget.py choose): a row compacts to its
        new budget at once (its point holds) or grows to it; either way `Sequence.budget` follows."""
        if not len(rows):
            return
        b = self.batch
        blocks, compacts = choose(losses, b.num_blocks[rows], b.budget_blocks[rows], b.auto_floor[rows],
                                  b.auto_ceiling[rows], b.auto_grow[rows], b.auto_threshold[rows],
                                  max(0, self._unowed_blocks()))
        b.measuring[rows], b.measured[rows] = False, compacts
        for row, m in zip(rows.tolist(), blocks.tolist()):
            if m != b.budget_blocks[row]:
                self._resize_budget(row, m)

    def _resize_budget(self, row: int, blocks: int) -> None:
        """An automatic budget at `blocks` blocks, in its sequence and its row."""
        seq = self.batch.seqs[row]
        seq.budget = seq.budget.resized(blocks, self.block_manager.block_size, seq.query_cache_len)
        self.batch.set_budget(row, seq.budget)

    def _commit(self, chunk: Chunk) -> None:
        """The chunk was dispatched: its K/V are in the pool for every later step, and its
        sampled token (if any) is on its way (PENDING until it reaches the host)."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        seq.num_kv_slots += chunk.num_tokens
        seq.state_fresh = True
        if chunk.samples:
            seq.append_pending()
        self.block_manager.commit_full_blocks(seq)

    def _commit_rows(self, rows: np.ndarray) -> None:
        """`_commit` of one-token chunks that sample, by row."""
        if not len(rows):
            return
        b = self.batch
        b.num_computed_tokens[rows] += 1
        b.num_kv_slots[rows] += 1
        n = b.num_tokens[rows]
        b.ensure_capacity(int(n.max()) + 1)
        b.tokens[rows, n] = PENDING
        b.num_tokens[rows] = n + 1
        b.num_pending[rows] += 1

    def _commit_full_blocks(self, rows: np.ndarray) -> None:
        """BlockManager.commit_full_blocks of the rows that have a block to hash."""
        if not self.block_manager.enable_prefix_caching:
            return
        b, bs = self.batch, self.block_manager.block_size
        known = b.num_tokens[rows] - b.num_pending[rows]
        full = np.minimum(np.minimum(b.num_computed_tokens[rows], known) // bs, b.num_blocks[rows])
        hashed = b.num_hashed_blocks[rows]
        todo = (full > hashed) & ~b.compressed[rows]
        one = todo & (full == hashed + 1)  # a decode row that filled a block: all of them at once
        if one.any():
            next_rows, index = rows[one], hashed[one]
            tokens = b.tokens[next_rows[:, None], index[:, None] * bs + np.arange(bs)].astype(np.int64)
            self.block_manager.hash_next_blocks(b.block_table[next_rows], index, tokens)
            b.num_hashed_blocks[next_rows] = index + 1
            todo &= ~one
        for row, stop in zip(rows[todo].tolist(), full[todo].tolist()):
            first = int(b.num_hashed_blocks[row])
            self.block_manager.hash_blocks(b.block_table[row], b.tokens[row, first * bs:stop * bs], first, stop)
            b.num_hashed_blocks[row] = stop

    def _apply(self, step: FetchedStep, out: EngineCoreOutputs) -> None:
        """One step's results read back: its prompt log-probabilities, then its tokens by row."""
        for res in step.prompt_logprobs:
            self._take_prompt_logprobs(res, out)
        b = self.batch
        final = np.zeros(len(step.rows), bool)  # a completed grammar ends the sequence
        keep = self._same_sequences(step)
        constrained = np.flatnonzero(keep & b.constrained[step.rows])
        for i in constrained:  # a grammar's step per token: Python, constrained rows only
            seq = b.seqs[step.rows[i]]
            if seq.is_finished:
                continue  # a sibling's rejected token failed the request
            try:
                final[i] = seq.grammar.accept(int(step.tokens[i]))
            except _token_rejected() as exc:
                self._fail(seq, exc, out)
        if len(constrained):
            keep &= self._same_sequences(step)
        picked = np.flatnonzero(keep)
        rows, tokens, final = step.rows[picked], step.tokens[picked], final[picked]
        at = b.num_tokens[rows] - b.num_pending[rows]
        b.tokens[rows, at] = tokens
        b.num_pending[rows] -= 1
        out.add_tokens(b.seq_id[rows], tokens, step.logprobs(picked) if b.wants_logprobs[rows].any() else None)
        num_out = at + 1 - b.num_prompt[rows]
        may_stop = num_out > b.min_tokens[rows]
        eos = may_stop & ~b.ignore_eos[rows] & b.is_eos(tokens)
        stop_id = may_stop & b.has_stop_ids[rows]
        if stop_id.any():
            stop_id[stop_id] = (b.suppress_ids[rows[stop_id]] == tokens[stop_id, None]).any(axis=1)
        length = (num_out >= b.max_tokens[rows]) | (at + 1 >= b.max_len[rows])
        ends = np.flatnonzero(eos | stop_id | final | length)
        if len(ends):
            self._commit_full_blocks(rows[ends])  # the last blocks of the sequences about to finish
        for i in ends:
            stop_token = bool(eos[i] or stop_id[i])
            reason = "stop" if stop_token or final[i] else "length"
            self._finish(b.seqs[rows[i]], reason, int(tokens[i]) if stop_id[i] and not eos[i] else None, out,
                         stop_token)
        departed = rows[~b.running[rows] & (b.num_pending[rows] == 0) & b.occupied[rows]]
        for row in departed:  # preempted: its last token in flight has arrived
            self.batch.detach(b.seqs[row])

    def _same_sequences(self, step: FetchedStep) -> np.ndarray:
        """Which of the step's rows still hold the sequence they held when it was dispatched."""
        b = self.batch
        return (b.epoch[step.rows] == step.epochs) & b.occupied[step.rows]

    def _take_prompt_logprobs(self, res, out: EngineCoreOutputs) -> None:
        seq = res.chunk.seq
        if seq.is_finished or not seq.computes_prompt_logprobs:
            return  # a recompute after preemption computes them again: the first ones stay
        if res.first <= seq.num_prompt_logprobs:
            seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, res.first + len(res.logprobs))
        seq.computes_prompt_logprobs = seq.num_prompt_logprobs < seq.num_prompt_tokens
        out.prompt_logprobs.append((seq.seq_id, res.first, res.logprobs, res.top_ids, res.top_logprobs))

    def _fail(self, seq: Sequence, error: Exception, out: EngineCoreOutputs) -> None:
        """A failure that belongs to one request: all its sequences still running finish with "error"."""
        out.failures.append((seq.request_id, f"{type(error).__name__}: {error}", error))
        request_seqs = [s for s in (*self.running, *self.waiting) if s.request_id == seq.request_id]
        for s in sorted(request_seqs, key=lambda s: s.index):
            self._finish(s, "error", None, out)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None, out: EngineCoreOutputs,
                stop_token: bool = False) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.kv_budget_tokens = 0 if seq.budget is None else seq.budget.tokens
        self.finish(seq)
        out.finished.append(FinishedSequence(seq.seq_id, reason, stop_reason, stop_token, seq.metrics))

    def finish(self, seq: Sequence) -> None:
        """Finished or aborted: free its blocks, query slot and row."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.drop_pending()
        self.block_manager.free(seq)
        self.query_slots.release(seq)
        self._stop_running(seq)
        seq.status = SequenceStatus.FINISHED


def _token_rejected() -> type[Exception]:
    """engine.grammar's TokenRejected, looked up only once a grammar has raised: that module
    needs jax, and the scheduler loads without it."""
    from zipage_jax.engine.grammar import TokenRejected

    return TokenRejected
