"""Continuous batching: which sequences compute which tokens this step.

FCFS; running sequences first (decodes and prefill chunks), then admission from the waiting
queue, all under `max_num_batched_tokens`. Prefill chunks are laid over rows of
`prefill_row_size` tokens, and a step holds at most max_num_batched_tokens / prefill_row_size
prefill rows, so the prefill step's shape stays within the compiled grid. A sequence at its KV
budget is compressed instead of growing, in prefill too: while a sequence computes its prompt
(after a recompute, every token it had) it compacts at the points of `PromptCompaction`
(engine/prompt_compaction.py: bounded, within the budget and one chunk, each compaction scored
by the prompt's tail; or deferred, once at the prompt's end); once past its prompt, whenever its
M + 1 blocks are full. These points depend on the sequence alone, not on how its prompt was cut
into chunks, so a request's output does not depend on the batch it ran in. Compressed sequences
are suspended, never preempted. Preemption is by recompute, the victim being the most recently
admitted sequence that may be preempted. A sequence whose last token is sampled (perhaps still
on its way to the host) is not scheduled again.

What a step's output changes (`update_from_output`) happens here too, in one place: its tokens
join their sequences, full blocks are committed to the prefix cache, and sequences that stop,
reach their length or fail are finished and freed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from zipage_jax.engine.block_manager import BlockManager, CompressionPlan
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.runner.results import PromptLogprobsResult, RunnerOutput, StepResult
from zipage_jax.engine.sequence import Sequence, SequenceStatus


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
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


@dataclass
class StepUpdate:
    """What applying a step's output changed: the tokens that joined their sequences (with the
    text each one's stop checker released), the prompt log-probabilities taken, the failures
    (each finished its request's sequences) and every sequence finished, in order."""

    tokens: list[tuple[Sequence, StepResult, str]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsResult] = field(default_factory=list)
    failures: list[tuple[Sequence, Exception]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


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
                 num_query_slots: int, max_compress_seqs: int, prefill_row_size: int = 1, prompt_window: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_compress_seqs = max_compress_seqs
        self.prefill_row_size = prefill_row_size
        self.prompt = PromptCompaction.of(block_manager.block_size, max_num_batched_tokens, prompt_window,
                                          prefill_row_size)
        self.chunk_blocks = self.prompt.chunk_blocks
        self.query_slots = Slots(num_query_slots, "query_slot")
        self.state_slots = Slots(max_num_seqs, "state_slot")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_at_budget(self) -> int:
        return sum(1 for s in self.running if s.budget_blocks is not None
                   and len(s.block_table) >= s.budget_blocks + 1)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = StepBudget(self.max_num_batched_tokens, self.max_num_batched_tokens // self.prefill_row_size,
                            self.prefill_row_size)
        self._schedule_running(out, budget)
        if out.preempted and not (out.chunks or out.compressions):
            # a sequence that preempted itself freed what the others waited for (its query slot)
            self._schedule_running(out, budget)
        self._admit(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        for seq in list(self.running):
            if budget.tokens == 0:
                break
            if seq.status != SequenceStatus.RUNNING or seq.is_complete:
                continue  # preempted earlier in this loop, or waiting for its last token
            if self._needs_compression(seq):
                if len(out.compressions) < self.max_compress_seqs:
                    plan = self.block_manager.plan_compression(seq)
                    while plan is None and self._preempt_for(seq, out):  # blocks to replace shared ones
                        plan = self.block_manager.plan_compression(seq)
                    if plan is not None:
                        seq.compressing = True
                        seq.advance_quote()
                        out.compressions.append(plan)
                continue  # decodes once the compaction has landed (next step)
            n = self._chunk_size(seq, budget)
            if n == 0:
                continue  # waits for a query slot
            n = self._allocate_or_preempt(seq, n, out)
            if n == 0:
                continue
            chunk = self._with_tail(Chunk(seq, seq.num_computed_tokens, n), out, may_preempt=True)
            if chunk is None:
                continue
            out.chunks.append(chunk)
            budget.take(chunk.num_tokens, chunk.tail)

    def _admit(self, out: SchedulerOutput, budget: StepBudget) -> None:
        # No admission in a step that preempted: the pool is full (vLLM does the same).
        while self.waiting and budget.tokens > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            parent = seq.parent
            if parent is not None and not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens:
                break  # a sibling of n > 1 shares the prompt blocks once they are cached
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
            self.state_slots.acquire(seq)  # always free: one per running sequence
            self.running.append(seq)
            chunk = self._with_tail(Chunk(seq, seq.num_computed_tokens, n), out, may_preempt=False)
            if chunk is None:
                break
            out.chunks.append(chunk)
            budget.take(chunk.num_tokens, chunk.tail)

    def _needs_compression(self, seq: Sequence) -> bool:
        """Every block full, at its compaction point in the prompt (`PromptCompaction`), at the
        budget and the next block after it: the next token needs a block."""
        m = seq.budget_blocks
        if m is None or seq.num_kv_slots != len(seq.block_table) * self.block_manager.block_size:
            return False
        if self._in_prompt(seq):
            point = self.prompt.point(seq)
            return point is not None and len(seq.block_table) >= point
        return len(seq.block_table) >= m + 1

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
        seq.metrics.kv_blocks_peak = max(seq.metrics.kv_blocks_peak, len(seq.block_table) + need)
        return chunk

    def release_tail(self, chunk: Chunk) -> None:
        """The step that ran the chunk's tail was dispatched (or dropped): its scratch blocks are
        free again (every later write is dispatched after it, and the device runs them in order)."""
        self.block_manager.free_scratch(chunk.tail_blocks)
        chunk.tail_blocks = []

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
        return len(seq.block_table) * bs - seq.num_kv_slots + self.block_manager.num_free_blocks * bs

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
        victim = next((s for s in reversed(self.running)
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
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.query_slots.release(seq)
        self.state_slots.release(seq)
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
        for seq in reversed(self.running):
            seq.drop_pending()
            self.query_slots.release(seq)
            self.state_slots.release(seq)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)
        self.running = []
        self.block_manager.reset()

    def abort_compressions(self, out: SchedulerOutput) -> None:
        """The step's compaction raised: its plans are undone (their replacement blocks freed)
        and the sequences keep their blocks."""
        for plan in out.compressions:
            self.block_manager.abort_compression(plan)
            plan.seq.compressing = False

    def finish_compressions(self, out: SchedulerOutput) -> int:
        """The step that compacts them has been dispatched. Returns the number of tokens evicted."""
        total = 0
        for plan in out.compressions:
            seq = plan.seq
            kept = seq.budget.tokens
            evicted = seq.num_kv_slots - kept
            self.block_manager.finish_compression(plan)
            seq.num_kv_slots = kept
            seq.compressed, seq.compressing = True, False
            seq.metrics.num_compressions += 1
            seq.metrics.kv_tokens_evicted += evicted
            total += evicted
        return total

    def commit(self, chunk: Chunk) -> None:
        """The chunk was dispatched: its K/V are in the pool for every later step, and its
        sampled token (if any) is on its way (PENDING until it reaches the host)."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        seq.num_kv_slots += chunk.num_tokens
        seq.state_fresh = True
        if chunk.samples:
            seq.append_pending()
        self.block_manager.commit_full_blocks(seq)

    def update_from_output(self, output: RunnerOutput) -> StepUpdate:
        """Applies what a step read back, in order. A failure finishes every sequence of its
        request ("error"). A sampled token is checked by the sequence's grammar (one it refuses
        fails the request), replaces its PENDING place, commits the blocks it completes, and goes
        to the stop checker: a stop, the length limit or a completed grammar finishes the
        sequence. Prompt log-probabilities advance how far the prompt's have arrived. Results of
        sequences finished or aborted since their step was dispatched are dropped."""
        update = StepUpdate()
        for failure in output.failures:
            self._fail(failure.chunk.seq, failure.error, update)
        for res in output.results:
            if isinstance(res, PromptLogprobsResult):
                self._take_prompt_logprobs(res, update)
            else:
                self._append_token(res, update)
        return update

    def _append_token(self, res: StepResult, update: StepUpdate) -> None:
        seq = res.chunk.seq
        if seq.is_finished:
            return
        try:
            complete = seq.grammar is not None and seq.grammar.accept(res.token_id)
        except _token_rejected() as exc:
            self._fail(seq, exc, update)
            return
        seq.resolve(res.token_id)
        self.block_manager.commit_full_blocks(seq)  # blocks whose tokens are all known now
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        checker = seq.stop_checker
        text, reason = checker.append(res.token_id, final=complete)
        if reason is None and seq.num_known_tokens >= seq.max_len:
            reason = "length"  # the sequence's length limit (max_model_len, or the pool for full KV)
        update.tokens.append((seq, res, text))
        if reason is not None:
            self._finish(seq, reason, checker.stop_reason, update)

    @staticmethod
    def _take_prompt_logprobs(res: PromptLogprobsResult, update: StepUpdate) -> None:
        seq = res.chunk.seq
        if seq.is_finished or not seq.computes_prompt_logprobs:
            return  # a recompute after preemption computes them again: the first ones stay
        if res.first <= seq.num_prompt_logprobs:
            seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, res.first + len(res.logprobs))
        seq.computes_prompt_logprobs = seq.num_prompt_logprobs < seq.num_prompt_tokens
        update.prompt_logprobs.append(res)

    def _fail(self, seq: Sequence, error: Exception, update: StepUpdate) -> None:
        """A failure that belongs to one request: all its sequences still running finish with "error"."""
        update.failures.append((seq, error))
        request_seqs = [s for s in (*self.running, *self.waiting) if s.request_id == seq.request_id]
        for s in sorted(request_seqs, key=lambda s: s.index):
            self._finish(s, "error", None, update)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None, update: StepUpdate) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finish_time = time.monotonic()
        seq.drop_pending()
        self.finish(seq)
        update.finished.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Finished or aborted: free its blocks and query slot."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.query_slots.release(seq)
        self.state_slots.release(seq)
        seq.status = SequenceStatus.FINISHED


def _token_rejected() -> type[Exception]:
    """engine.grammar's TokenRejected, looked up only once a grammar has raised: that module
    needs jax, and the scheduler loads without it."""
    from zipage_jax.engine.grammar import TokenRejected

    return TokenRejected
