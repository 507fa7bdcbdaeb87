"""Where a prompt longer than its KV budget compacts, and which queries score it.

Two modes, per sequence (`KVBudget.deferred`):

- bounded (memory first): the sequence compacts whenever it holds its budget and `room_blocks`
  more, between prefill chunks, so it never holds more than budget + one chunk. Every such
  compaction scores with the prompt's own end: the chunk that reaches the compaction point
  carries the prompt's last `window` tokens (the *tail*, where the question usually is) as rows
  of their own at their true positions. Their K/V go to scratch blocks held for that step only,
  they touch no sequence's sampling state, and their last queries fill the observation window.
  The peak is budget + room + tail blocks = budget + one chunk (a chunk of one block: budget + 1 + tail blocks).
- deferred (SnapKV): no compaction until the prompt's last full block; that one compaction
  scores with the tail too (the prompt's remaining tokens, less than a block, follow it). The
  peak is the whole prompt.

Both points depend on the sequence alone, never on how a batch cut its prompt into chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage_jax.engine.sequence import Sequence


@dataclass(frozen=True)
class PromptCompaction:
    block_size: int
    chunk_blocks: int  # max_num_batched_tokens / block size (at least 1)
    window: int = 0  # tail tokens scoring each compaction inside the prompt; 0: the chunk's own queries

    @classmethod
    def of(cls, block_size: int, max_num_batched_tokens: int, window: int = 0,
           row_size: int = 1) -> "PromptCompaction":
        """The rule for a step of `max_num_batched_tokens` tokens in prefill rows of `row_size`: the
        tail is at most half a step, and it and a chunk's row fit in one step (else no tail)."""
        rows = max_num_batched_tokens // row_size
        window = max(0, min(window, max_num_batched_tokens // 2, (rows - 1) * row_size))
        return cls(block_size, max(1, max_num_batched_tokens // block_size), window)

    @property
    def tail_blocks(self) -> int:
        return -(-self.window // self.block_size)

    @property
    def room_blocks(self) -> int:
        """Blocks a bounded sequence computes between two compactions inside its prompt."""
        return max(1, self.chunk_blocks - self.tail_blocks)

    def point(self, seq: Sequence) -> int | None:
        """Blocks a sequence computing its prompt holds when it compacts; None: it does not
        compact before its prompt ends (full KV, or a deferred prompt within a block of its end)."""
        m = seq.budget_blocks
        if m is None:
            return None
        if seq.budget.deferred:
            last_full = seq.num_prefill_tokens // self.block_size
            return last_full if last_full > m else None
        return m + self.room_blocks

    def tail(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """(first position, tokens) of the tail to run after a chunk of `num_tokens` (from
        num_kv_slots): the last `window` tokens of what the sequence computes as its prompt (after a
        recompute, every token it had), those not computed yet, when the chunk ends at the compaction
        point before that prompt does; else no tokens (the chunk's own queries score the next
        compaction)."""
        point = self.point(seq)
        if not self.window or point is None or seq.num_kv_slots + num_tokens != point * self.block_size:
            return 0, 0
        end = min(seq.num_prefill_tokens, seq.num_known_tokens)
        tokens = max(0, min(self.window, end - seq.num_computed_tokens - num_tokens))
        return end - tokens, tokens

    def peak_blocks(self, budget_blocks: int, prompt_len: int, deferred: bool) -> int:
        """The most blocks a sequence of this prompt and budget holds (its scratch tail included)."""
        prompt = -(-prompt_len // self.block_size)
        tail = self.tail_blocks if self.window else 0
        if deferred:  # a tail after its last full block is less than a block
            return max(budget_blocks + 1, prompt)
        if prompt <= budget_blocks + self.room_blocks:
            return max(budget_blocks + 1, prompt)
        return budget_blocks + self.room_blocks + tail

    def max_cached_blocks(self, seq: Sequence) -> int | None:
        """Prefix-cache blocks a fresh sequence may share: fewer than its first compaction point, so
        a chunk (and its tail) is computed before that compaction, at the same point as without
        the cache."""
        point = self.point(seq)
        return None if point is None else point - 1
