"""One generated sequence as the host sees it: its tokens, its blocks, its budget.

While it runs, a sequence's fields that change every step live in its row of the engine's
`RunningBatch` (engine/running_batch.py): the `RowField`s below, its token ids and its block
table are read from and written to that row, so a step updates every decoding sequence with
array operations. While it waits (or in a test without a batch) it keeps them itself.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zipage_jax.compress.policies import KVBudget
from zipage_jax.compress.quotes import as_bytes

if TYPE_CHECKING:
    from zipage_jax.engine.running_batch import RunningBatch

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
    """What the engine counts per sequence (the output stage times it)."""

    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_compressions: int = 0
    kv_blocks_peak: int = 0
    kv_tokens_evicted: int = 0
    kv_budget_tokens: int = 0  # its budget when it finished (0: full KV; an automatic one's last size)


class RowField:
    """A running field: `RunningBatch.<name>[row]` while the sequence has a row, else its own
    attribute `_<name>`. None is stored as -1 (query_slot)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.own = name, f"_{name}"

    def __get__(self, seq: Sequence | None, owner: type | None = None) -> Any:
        if seq is None:
            return self
        batch = seq.batch
        if batch is None:
            return getattr(seq, self.own)
        value = getattr(batch, self.name)[seq.row].item()
        return None if value == -1 and self.name == "query_slot" else value

    def __set__(self, seq: Sequence, value: Any) -> None:
        batch = seq.batch
        if batch is None:
            setattr(seq, self.own, value)
        else:
            getattr(batch, self.name)[seq.row] = -1 if value is None else value


class Sequence:
    """Token ids plus KV bookkeeping.

    Logical length (`num_computed_tokens`: tokens whose K/V were computed, i.e. RoPE positions
    0..n-1) and physical length (`num_kv_slots`: pool slots used in `block_table`) differ once
    a sequence has been compressed.

    With asynchronous scheduling the last `num_pending` token ids are PENDING: sampled on the
    device, not yet seen by the host. Lengths count them; only their values are unknown.
    """

    num_tokens = RowField()  # len(token_ids), pending ones included
    num_pending = RowField()
    num_computed_tokens = RowField()
    num_kv_slots = RowField()
    num_hashed_blocks = RowField()  # leading blocks registered in the prefix cache
    # tokens computed as a prompt is (chunks up to the budget's peak): the prompt, and after a
    # recompute every token the sequence had then
    num_prefill_tokens = RowField()
    state_fresh = RowField()  # the state row was cleared and seeded for this admission
    compressed = RowField()
    compressing = RowField()  # a compaction is planned (it lands with the step that runs it)
    query_slot = RowField()  # row of the query cache while it may compress, else None
    quote_end = RowField()  # the answer has quoted its prompt up to this position (compress/quotes.py)
    history_blocks = RowField()  # blocks kept at its last compaction (the global score's history)

    def __init__(self, token_ids: list[int], block_size: int, *, budget: KVBudget | None = None, params=None,
                 grammar=None, request_id: str = "", index: int = 0, parent: Sequence | None = None,
                 num_prompt_tokens: int = 0, max_len: int = 0, seed: int = 0, query_cache_len: int = 16,
                 computes_prompt_logprobs: bool = False):
        """budget: resolved at admission (None = full KV); params: its SamplingParams; grammar: the
        engine.grammar.SequenceGrammar of a structured-outputs request; parent: the first of its
        request's n sequences, whose prompt blocks it waits to share; max_len: prompt + max_tokens,
        capped at max_model_len (no token is computed past it)."""
        self.batch: RunningBatch | None = None
        self.row: int | None = None  # its row of the batch (and sampler state slot) while running
        self._tokens = list(token_ids)
        self._block_table: list[int] = []
        self._num_tokens = len(self._tokens)
        self._num_pending = self._num_computed_tokens = self._num_kv_slots = self._num_hashed_blocks = 0
        self._state_fresh = self._compressed = self._compressing = False
        self._query_slot = None
        self.block_size, self.budget, self.params, self.grammar = block_size, budget, params, grammar
        self.request_id, self.index, self.parent = request_id, index, parent
        self.seq_id = next(_ids)
        self.status = SequenceStatus.WAITING
        self.num_prompt_tokens = num_prompt_tokens or len(self._tokens)
        self._num_prefill_tokens = self.num_prompt_tokens
        self._quote_end = self._history_blocks = 0
        self._prompt_bytes: bytes | None = None
        # its prefill computes the prompt's log-probabilities (so it takes no prefix-cache hit),
        # until the host has them all
        self.computes_prompt_logprobs = computes_prompt_logprobs
        self.num_prompt_logprobs = 1  # the prompt's log-probabilities [0, n) have reached the host
        self.max_len = max_len or (1 << 62)
        self.seed, self.query_cache_len = seed, query_cache_len
        self.finish_reason: str | None = None  # "stop", "length" or "error" once finished (None: running, or aborted)
        self.stop_reason: str | int | None = None  # the stop string or stop token id that finished it
        self.metrics = SequenceMetrics()
        self.failed_compactions = 0  # compactions of it that failed on the device (it recomputed after each)

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, tokens={self.num_tokens})"

    # -- the batch row ------------------------------------------------------------------------

    def attach(self, batch: RunningBatch, row: int) -> None:
        """Called by RunningBatch.attach: from now on the row holds the running fields."""
        self.batch, self.row = batch, row

    def detach(self, fields: dict, block_table: list[int], token_ids: list[int]) -> None:
        """Called by RunningBatch.detach with the row's values, which the sequence keeps again."""
        self.batch = self.row = None
        for name, value in fields.items():
            setattr(self, name, value)
        self._block_table, self._tokens = block_table, token_ids

    # -- tokens -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """Every token id, PENDING ones included (a copy: O(length))."""
        return self.tokens(0, self.num_tokens)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) (clipped to the sequence)."""
        stop = min(stop, self.num_tokens)
        if self.batch is None:
            return self._tokens[start:stop]
        return self.batch.tokens[self.row, start:stop].tolist()

    def token_array(self, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) as an array (a view of the row while it runs: do not keep it)."""
        stop = min(stop, self.num_tokens)
        if self.batch is None:
            return np.asarray(self._tokens[start:stop], np.int64)
        return self.batch.tokens[self.row, start:stop]

    @property
    def block_table(self) -> list[int]:
        """Its KV blocks in order (a copy: set it to change it)."""
        if self.batch is None:
            return list(self._block_table)
        return self.batch.block_table[self.row, :self.batch.num_blocks[self.row]].tolist()

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        if self.batch is None:
            self._block_table = list(table)
        else:
            self.batch.set_block_table(self.row, table)

    def append_blocks(self, block_ids: list[int]) -> None:
        if self.batch is None:
            self._block_table.extend(block_ids)
        else:
            row, n = self.row, int(self.batch.num_blocks[self.row])
            self.batch.block_table[row, n:n + len(block_ids)] = block_ids
            self.batch.num_blocks[row] = n + len(block_ids)

    @property
    def num_blocks(self) -> int:
        return len(self._block_table) if self.batch is None else int(self.batch.num_blocks[self.row])

    def append_pending(self) -> None:
        self._append(PENDING)
        self.num_pending += 1

    def _append(self, token_id: int) -> None:
        n = self.num_tokens
        if self.batch is None:
            self._tokens.append(token_id)
        else:
            self.batch.ensure_capacity(n + 1)
            self.batch.tokens[self.row, n] = token_id
        self.num_tokens = n + 1

    def resolve(self, token_id: int) -> None:
        """The oldest pending token's value has arrived."""
        at = self.num_tokens - self.num_pending
        if self.batch is None:
            self._tokens[at] = token_id
        else:
            self.batch.tokens[self.row, at] = token_id
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Finished: tokens sampled after the last one it keeps are discarded."""
        self.num_tokens -= self.num_pending
        if self.batch is None:
            del self._tokens[self.num_tokens:]
        self.num_pending = 0

    # -- lengths --------------------------------------------------------------------------------

    @property
    def budget_blocks(self) -> int | None:
        """M: the budget in blocks (None = full KV)."""
        return None if self.budget is None else self.budget.blocks

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - self.num_pending

    @property
    def is_complete(self) -> bool:
        """Its last token has been sampled (perhaps still pending): nothing more to compute."""
        return self.num_tokens >= self.max_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than the last token still needs its K/V computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def block_tokens(self, i: int) -> list[int]:
        """Token ids of logical block i (only meaningful before compression)."""
        return self.tokens(i * self.block_size, (i + 1) * self.block_size)

    def first_query_tail_slot(self) -> int | None:
        """First physical slot >= num_kv_slots whose query must be cached: the last
        `query_cache_len` slots of a block that is compressed when it fills (index >= M)."""
        if self.budget is None:
            return None
        bs = self.block_size
        start = max(self.num_kv_slots, self.budget.tokens)
        return max(start, (start // bs) * bs + query_tail_start(bs, self.query_cache_len))

    def prompt_bytes(self) -> bytes:
        """The prompt as the quote search reads it (compress/quotes.py; kept once: the prompt never changes)."""
        if self._prompt_bytes is None:
            self._prompt_bytes = as_bytes(self.token_array(0, self.num_prompt_tokens))
        return self._prompt_bytes

    def reset_for_recompute(self) -> None:
        """Forget all KV, keep the tokens generated so far: they are computed again as a prompt
        (preemption by recompute, recovery from a failed step)."""
        self.status = SequenceStatus.WAITING
        self.num_prefill_tokens = self.num_tokens
        self.num_computed_tokens = 0
        self.num_kv_slots = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.compressed = False
        self.compressing = False
        self.state_fresh = False
