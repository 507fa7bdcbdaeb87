"""The running sequences' state in numpy arrays, one row per sequence (its sampler state slot).

A running sequence's fields that change every step (its tokens, pending and computed counts, KV
slots, block table, hashed blocks) live in its row, and what the step inputs and the stop checks
read of its request (sampling options, stop token ids, limits) is copied there once, when it is
admitted. So a decoding row costs array work only: the scheduler picks decode rows by mask
(`decode_mask`), the runner gathers their inputs by row, and a step's tokens are written back
and checked by row (`Scheduler.update_from_output`). Python runs per row only on events: a new
block, a full block to hash, a compaction, a finish, a preemption, a grammar's token.

`Sequence` reads its running fields through `RowField` descriptors: from its row while it has
one, from itself while it waits. `attach` copies a sequence into a free row; `detach` copies it
back and frees the row. A row's `epoch` changes at every attach, so a step's results read back
after their sequence left (finished, aborted) are recognised and dropped. A preempted sequence
keeps its row, no longer `running`, until its tokens in flight have arrived.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from zipage_jax.engine.block_manager import DUMMY_BLOCK

if TYPE_CHECKING:
    from zipage_jax.compress.policies import KVBudget
    from zipage_jax.engine.sequence import Sequence

MIN_TOKEN_CAPACITY = 256  # token columns at first; the array doubles when a sequence outgrows it

# a request's sampler options (layers.sampler.SamplingBatch's fields of the same names): dtype and
# the value of a greedy row without penalties
SAMPLER_OPTIONS = {"temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
                   "min_p": (np.float32, 0.0), "repetition_penalty": (np.float32, 1.0),
                   "presence_penalty": (np.float32, 0.0), "frequency_penalty": (np.float32, 0.0),
                   "seed": (np.uint32, 0), "wants_logprobs": (bool, False)}


def sampler_option_arrays(owner: object, num_rows: int) -> None:
    """`owner.<option>`: an array of `num_rows` default values for each of SAMPLER_OPTIONS."""
    for name, (dtype, default) in SAMPLER_OPTIONS.items():
        setattr(owner, name, np.full(num_rows, default, dtype))


# the running fields a sequence keeps in its row (Sequence's RowField descriptors), by dtype
ROW_FIELDS = {"num_tokens": np.int64, "num_pending": np.int64, "num_computed_tokens": np.int64,
              "num_kv_slots": np.int64, "num_hashed_blocks": np.int64, "num_prefill_tokens": np.int64,
              "state_fresh": bool, "compressed": bool, "compressing": bool, "query_slot": np.int64,
              "quote_end": np.int64, "history_blocks": np.int64}


class RunningBatch:
    """Rows 0 .. num_rows - 1 (max_num_seqs); `suppress_width` columns of suppressed token ids per
    row (stop ids, then EOS), `max_blocks` of block table."""

    def __init__(self, num_rows: int, max_blocks: int, suppress_width: int, eos_token_ids: tuple[int, ...]):
        r = num_rows
        self.num_rows = r
        self.eos_token_ids = np.asarray(eos_token_ids, np.int64)
        self.seqs: list[Sequence | None] = [None] * r
        self.free_rows: deque[int] = deque(range(r))
        self.epoch = np.zeros(r, np.int64)
        self.occupied = np.zeros(r, bool)  # a sequence holds the row
        self.running = np.zeros(r, bool)  # ... and is running (not preempted, waiting for its tokens in flight)
        for name, dtype in ROW_FIELDS.items():
            setattr(self, name, np.zeros(r, dtype))
        self.query_slot[:] = -1
        self.num_blocks = np.zeros(r, np.int64)
        self.kv_blocks_peak = np.zeros(r, np.int64)  # the most blocks it held (SequenceMetrics.kv_blocks_peak)
        self.block_table = np.full((r, max_blocks), DUMMY_BLOCK, np.int32)
        self.tokens = np.zeros((r, MIN_TOKEN_CAPACITY), np.int32)
        # copied at attach, read-only while the sequence runs
        self.num_prompt = np.zeros(r, np.int64)
        self.max_len = np.zeros(r, np.int64)
        self.budget_blocks = np.full(r, -1, np.int64)  # -1: full KV
        self.budget_tokens = np.zeros(r, np.int64)
        # the rest of its KVBudget (compress/policies.py), what a compaction's CompressRows reads
        self.budget_sinks = np.zeros(r, np.int64)
        self.budget_recent = np.zeros(r, np.int64)
        self.budget_score = np.zeros(r, np.int64)
        self.budget_reserve = np.zeros(r, np.int64)
        # an automatic budget's bounds (compress/auto_budget.py AutoBudget; floor -1: a fixed budget)
        self.auto_floor = np.full(r, -1, np.int64)
        self.auto_ceiling = np.zeros(r, np.int64)
        self.auto_grow = np.zeros(r, np.int64)
        self.auto_threshold = np.zeros(r, np.float64)
        self.measuring = np.zeros(r, bool)  # its measurement runs this step
        self.measured = np.zeros(r, bool)  # it compacts to its budget at its next point without measuring
        self.query_tail = np.zeros(r, np.int64)  # first in-block offset whose query is cached
        self.min_tokens = np.zeros(r, np.int64)
        self.max_tokens = np.zeros(r, np.int64)
        self.ignore_eos = np.zeros(r, bool)
        self.has_stop_ids = np.zeros(r, bool)
        self.forced = np.zeros(r, bool)  # teacher-forced output tokens
        self.constrained = np.zeros(r, bool)  # a structured output's grammar
        self.held = np.zeros(r, bool)  # stop strings: waits while the output stage lags (Scheduler.output_lag)
        self.seq_id = np.zeros(r, np.int64)
        self.suppress_ids = np.full((r, suppress_width), -1, np.int32)  # stop ids, then EOS unless ignore_eos
        sampler_option_arrays(self, r)

    @property
    def num_running(self) -> int:
        return int(np.count_nonzero(self.running))

    # -- rows ------------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> bool:
        """Gives `seq` a free row (its running fields move there) and marks it running; False when
        none is free. A sequence that has a row (preempted, its tokens still in flight) keeps it."""
        if seq.row is not None:
            self.running[seq.row] = True
            return True
        if not self.free_rows:
            return False
        row = self.free_rows.popleft()
        fields = {name: getattr(seq, name) for name in ROW_FIELDS}
        table, tokens = seq.block_table, seq.token_ids
        self.seqs[row] = seq
        self.epoch[row] += 1
        self.occupied[row] = self.running[row] = True
        seq.attach(self, row)
        for name, value in fields.items():
            getattr(self, name)[row] = -1 if value is None else value
        self.set_block_table(row, table)
        self.kv_blocks_peak[row] = seq.metrics.kv_blocks_peak
        self.ensure_capacity(len(tokens) + 1)
        self.tokens[row, :len(tokens)] = tokens
        self._copy_request(row, seq)
        return True

    def detach(self, seq: Sequence) -> None:
        """Frees `seq`'s row; its running fields move back to it."""
        row = seq.row
        if row is None:
            return
        fields = {name: getattr(seq, name) for name in ROW_FIELDS}
        table, tokens = seq.block_table, seq.token_ids
        seq.metrics.kv_blocks_peak = max(seq.metrics.kv_blocks_peak, int(self.kv_blocks_peak[row]))
        seq.detach(fields, table, tokens)
        self.seqs[row] = None
        self.occupied[row] = self.running[row] = False
        self.num_blocks[row] = 0
        self.held[row] = False
        self.free_rows.append(row)

    def is_eos(self, token_ids: np.ndarray) -> np.ndarray:
        """Which of `token_ids` are EOS."""
        eos = self.eos_token_ids
        if len(eos) > 2:
            return np.isin(token_ids, eos)
        found = np.zeros(len(token_ids), bool)
        for token in eos.tolist():
            found |= token_ids == token
        return found

    def set_block_table(self, row: int, table: list[int]) -> None:
        n = len(table)
        self.block_table[row, :n] = table
        self.block_table[row, n:self.num_blocks[row]] = DUMMY_BLOCK
        self.num_blocks[row] = n

    def set_budget(self, row: int, budget: KVBudget | None) -> None:
        """The row's copy of its sequence's budget (at attach, and when an automatic one changes)."""
        self.budget_blocks[row] = -1 if budget is None else budget.blocks
        self.budget_tokens[row] = 0 if budget is None else budget.tokens
        if budget is not None:
            self.budget_sinks[row], self.budget_recent[row] = budget.sinks, budget.recent
            self.budget_score[row], self.budget_reserve[row] = int(budget.policy.score), budget.prompt_reserve
        auto = None if budget is None else budget.auto
        self.auto_floor[row] = -1 if auto is None else auto.floor
        if auto is not None:
            self.auto_ceiling[row], self.auto_grow[row], self.auto_threshold[row] = auto.ceiling, auto.grow, \
                auto.threshold

    def ensure_capacity(self, num_tokens: int) -> None:
        """Token columns for `num_tokens` in every row (the array doubles until it fits)."""
        capacity = self.tokens.shape[1]
        if num_tokens <= capacity:
            return
        while capacity < num_tokens:
            capacity *= 2
        grown = np.zeros((self.num_rows, capacity), np.int32)
        grown[:, :self.tokens.shape[1]] = self.tokens
        self.tokens = grown

    def _copy_request(self, row: int, seq: Sequence) -> None:
        params, budget = seq.params, seq.budget
        self.num_prompt[row], self.max_len[row] = seq.num_prompt_tokens, seq.max_len
        self.set_budget(row, budget)
        self.measuring[row] = self.measured[row] = False
        self.query_tail[row] = seq.block_size - seq.query_cache_len
        self.seq_id[row] = seq.seq_id
        self.constrained[row] = seq.grammar is not None
        self.suppress_ids[row] = -1
        if params is None:  # a sequence built without a request (the scheduler's tests)
            self.min_tokens[row], self.max_tokens[row], self.ignore_eos[row] = 0, seq.max_len, True
            self.has_stop_ids[row] = self.forced[row] = self.wants_logprobs[row] = False
            return
        stop_ids = tuple(params.stop_token_ids)
        suppressed = stop_ids + (() if params.ignore_eos else tuple(int(t) for t in self.eos_token_ids))
        self.suppress_ids[row, :len(suppressed)] = suppressed
        self.min_tokens[row], self.max_tokens[row] = params.min_tokens, params.max_tokens
        self.ignore_eos[row], self.has_stop_ids[row] = params.ignore_eos, bool(stop_ids)
        self.forced[row] = bool(params.forced_token_ids)
        self.held[row] = False
        greedy = params.greedy
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.top_k[row] = 0 if greedy else max(params.top_k, 0)
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.seed[row] = seq.seed % 2**32
        self.wants_logprobs[row] = params.logprobs is not None
