"""One generated sequence as the host sees it: its tokens, its blocks, its budget."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zipage_jax.compress.policies import KVBudget
from zipage_jax.compress.quotes import advance_quote_end

if TYPE_CHECKING:
    from zipage_jax.engine.stop_checker import StopChecker

_ids = itertools.count()
PENDING = -1  # a sampled token the host has not received yet (asynchronous scheduling)


def query_tail_start(block_size: int, query_cache_len: int) -> int:
    """First in-block offset whose query is cached: the last `query_cache_len` slots of a block
    that is compressed when it fills (docs/ALGORITHM.md section 1). The one place of this rule:
    the runner writes query i of the tail at offset query_tail_start + i."""
    return block_size - query_cache_len


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class SequenceMetrics:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_compressions: int = 0
    kv_blocks_peak: int = 0
    kv_tokens_evicted: int = 0


@dataclass(eq=False)
class Sequence:
    """Token ids plus KV bookkeeping.

    Logical length (`num_computed_tokens`: tokens whose K/V were computed, i.e. RoPE positions
    0..n-1) and physical length (`num_kv_slots`: pool slots used in `block_table`) differ once
    a sequence has been compressed.

    With asynchronous scheduling the last `num_pending` token ids are PENDING: sampled on the
    device, not yet seen by the host. Lengths count them; only their values are unknown.
    """

    token_ids: list[int]
    block_size: int
    budget: KVBudget | None = None  # resolved at admission; None = full KV
    params: object = None  # SamplingParams
    grammar: object = None  # engine.grammar.SequenceGrammar of a structured-outputs request, else None
    stop_checker: StopChecker | None = None  # its text and stop conditions (engine/stop_checker.py)
    request_id: str = ""
    index: int = 0  # which of the request's n completions
    parent: "Sequence | None" = None  # waits until the parent's prompt is in the prefix cache
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = 0
    # tokens computed as a prompt is (chunks up to the budget's peak): the prompt, and after a
    # recompute every token the sequence had then
    num_prefill_tokens: int = 0
    num_computed_tokens: int = 0
    num_kv_slots: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    compressed: bool = False
    compressing: bool = False
    query_slot: int | None = None
    quote_end: int = 0  # the answer has quoted its prompt up to this position (compress/quotes.py)
    state_slot: int | None = None  # row of the device's per-sequence sampling state while running
    state_fresh: bool = False  # the state row was cleared and seeded for this admission
    # its prefill computes the prompt's log-probabilities (so it takes no prefix-cache hit), until
    # the host has them all
    computes_prompt_logprobs: bool = False
    num_prompt_logprobs: int = 1  # the prompt's log-probabilities [0, n) have reached the host
    num_pending: int = 0
    max_len: int = 0  # prompt + max_tokens, capped at max_model_len: no token is computed past it
    seed: int = 0
    query_cache_len: int = 16
    finish_reason: str | None = None  # "stop", "length" or "error" once finished (None: running, or aborted)
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        self.num_prefill_tokens = self.num_prefill_tokens or self.num_prompt_tokens
        self.max_len = self.max_len or (1 << 62)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def budget_blocks(self) -> int | None:
        """M: the budget in blocks (None = full KV)."""
        return None if self.budget is None else self.budget.blocks

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def is_complete(self) -> bool:
        """Its last token has been sampled (perhaps still pending): nothing more to compute."""
        return len(self.token_ids) >= self.max_len

    def append_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve(self, token_id: int) -> None:
        """The oldest pending token's value has arrived."""
        self.token_ids[len(self.token_ids) - self.num_pending] = token_id
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Finished: tokens sampled after the last one it keeps are discarded."""
        del self.token_ids[len(self.token_ids) - self.num_pending:]
        self.num_pending = 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than the last token still needs its K/V computed."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block_tokens(self, i: int) -> list[int]:
        """Token ids of logical block i (only meaningful before compression)."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def first_query_tail_slot(self) -> int | None:
        """First physical slot >= num_kv_slots whose query must be cached: the last
        `query_cache_len` slots of a block that is compressed when it fills (index >= M)."""
        if self.budget is None:
            return None
        bs = self.block_size
        start = max(self.num_kv_slots, self.budget.tokens)
        return max(start, (start // bs) * bs + query_tail_start(bs, self.query_cache_len))

    def advance_quote(self) -> None:
        """Before a compaction: how far the answer has quoted the prompt so far, for a budget
        with a prompt reserve (compress/quotes.py)."""
        if self.budget is not None and self.budget.prompt_reserve and self.num_output_tokens:
            answer = self.token_ids[self.num_prompt_tokens:self.num_known_tokens]
            self.quote_end = advance_quote_end(self.token_ids[:self.num_prompt_tokens], answer, self.quote_end)

    def reset_for_recompute(self) -> None:
        """Forget all KV, keep the tokens generated so far: they are computed again as a prompt
        (preemption by recompute, recovery from a failed step)."""
        self.status = SequenceStatus.WAITING
        self.num_prefill_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_kv_slots = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.compressed = False
        self.compressing = False
        self.state_fresh = False
