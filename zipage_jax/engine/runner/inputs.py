"""A forward step's host inputs, assembled from the scheduler's decode rows and chunks: the rows
each takes (tokens, positions, KV slots, block tables, query-cache rows, prompt log-probability
targets) and their sampling rows, packed into one batch of a compiled bucket. Untouched rows are
padding: the dummy slot, nothing visible, the sampler's padding slot.

Decode rows (Scheduler.decode_mask) are gathered from the running batch's arrays in one go
(`write_decode_rows`): no Python per row, but for a teacher-forced or constrained one. A chunk
of n tokens takes ceil(n / c) rows of c tokens (c = 1: the decode step; prefill_row_size:
prefill rows), built from its sequence (`chunk_rows`). Prompt log-probabilities are values too:
each position's target token, -1 where none is asked (layers/prompt_logprobs.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from pallas_kernels.tiling import next_power_of_two
from zipage_jax.backend import Backend
from zipage_jax.config import EngineConfig
from zipage_jax.engine.block_manager import DUMMY_BLOCK
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.runner.results import PromptChunk
from zipage_jax.engine.runner.sampling_batch import SamplingArrays, SamplingRow
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.scheduler import Chunk
from zipage_jax.engine.sequence import Sequence, query_tail_start
from zipage_jax.layers.paged_attention import StepInputs, uses_block_tables, xla_page_size
from zipage_jax.layers.sampler import SamplingBatch
from zipage_jax.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

ChunkRows = list[tuple[dict, SamplingRow]]  # (input values, sampling row) of each row a chunk takes


class InputArrays:
    """Host arrays of one StepInputs; untouched rows are padding (dummy slot, nothing visible)."""

    def __init__(self, rows: int, chunk: int, width: int, pad_query: int):
        self.tokens = np.zeros((rows, chunk), np.int32)
        self.positions = np.zeros((rows, chunk), np.int32)
        self.slots = np.full((rows, chunk), DUMMY_BLOCK, np.int32)
        self.query_index = np.full((rows, chunk), pad_query, np.int32)
        self.block_tables = np.full((rows, width), DUMMY_BLOCK, np.int32)
        self.kv_lens = np.zeros((rows, chunk), np.int32)
        self.last_index = np.zeros(rows, np.int32)
        self.prompt_targets = np.full((rows, chunk), -1, np.int32)

    def write(self, row: int, values: dict) -> None:
        for name, value in values.items():
            target = getattr(self, name)
            if target.ndim == 1:
                target[row] = value
            else:
                target[row, :len(value)] = value

    def step_inputs(self) -> StepInputs:
        return StepInputs(self.tokens, self.positions, self.slots, self.query_index, self.block_tables,
                          self.kv_lens, self.last_index)


class StepBatch(NamedTuple):
    """One forward step's arguments, and where its outputs go."""

    inputs: StepInputs
    sampling: SamplingBatch
    prompt_targets: np.ndarray  # [R, C] i32
    rows: np.ndarray  # [n] the running-batch rows that sample
    out_rows: np.ndarray  # [n] the output row of each
    prompt_chunks: list[PromptChunk]
    constrained: bool  # a structured output's row samples: its next mask needs this token


class InputLayout:
    """How this engine lays a step's inputs out: its pool's blocks and pages, its query cache,
    its sampler's rows."""

    def __init__(self, pool: KVPoolPlan, config: EngineConfig, backend: Backend, vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self.block_size = pool.block_size
        self.page = xla_page_size(pool.block_size)
        self.max_blocks = pool.max_blocks_per_seq
        self.query_cache_len = config.query_cache_len
        self.num_query_slots = pool.num_query_slots
        self.pad_query = pool.num_query_slots * config.query_cache_len  # the query cache's padding row
        self.pad_slot = config.max_num_seqs  # the sampler state's padding row
        self.backend = backend
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.suppress_width = next_power_of_two(MAX_STOP_TOKEN_IDS + len(eos_token_ids))

    def table_width(self, chunk_len: int) -> int:
        if uses_block_tables(self.backend, chunk_len):
            return self.max_blocks
        return self.max_blocks * (self.block_size // self.page)

    def arrays(self, rows: int, chunk_len: int) -> tuple[InputArrays, SamplingArrays]:
        """Padding inputs of a step of `rows` rows of `chunk_len` tokens."""
        return (InputArrays(rows, chunk_len, self.table_width(chunk_len), self.pad_query),
                SamplingArrays(rows, self.suppress_width, self.pad_slot, self.vocab_size))

    @staticmethod
    def needs_history(seq: Sequence) -> bool:
        """A penalised sequence starting a fresh state slot past tokens it does not compute (a
        prefix-cache hit): those tokens must be counted first (the runner seeds its history)."""
        return not seq.state_fresh and seq.num_computed_tokens > 0 and _penalised(seq.params)

    def sampling_row(self, chunk: Chunk, seeded: bool) -> SamplingRow:
        """The chunk's sampling row; `seeded`: its state slot was just cleared and seeded."""
        seq = chunk.seq
        params = seq.params
        forced = params.forced_token_ids
        step = seq.num_output_tokens
        if seq.grammar is not None and chunk.samples and seq.num_pending:
            raise RuntimeError("a structured output's mask needs its last token, still on the device")
        suppress = () if step >= params.min_tokens else (
            tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids))
        return SamplingRow(params=params, seed=seq.seed, step=step, suppress_ids=suppress,
                           forced_id=forced[step] if step < len(forced) else -1, slot=seq.row,
                           num_prompt_tokens=seq.num_prompt_tokens, reset=not seq.state_fresh and not seeded,
                           samples=chunk.samples, grammar=seq.grammar)

    def chunk_rows(self, chunk: Chunk, srow: SamplingRow, c: int) -> ChunkRows:
        """The rows one chunk takes in a step of c-token rows: (input values, sampling row) each.

        A chunk with a prompt tail (engine/prompt_compaction.py) is followed by rows of the tail's
        tokens at their own positions: their K/V go to the chunk's scratch blocks (seen by the tail
        only), their last queries to the sequence's query slot, and their sampling rows are the
        padding slot's (their tokens are neither counted for penalties nor sampled)."""
        seq, n, t = chunk.seq, chunk.num_tokens, chunk.tail
        bs, ql = self.block_size, self.query_cache_len
        pad_query = self.pad_query
        table = np.asarray(seq.block_table, np.int32)
        end = seq.num_kv_slots + n
        used = np.concatenate([table[:-(-end // bs)], np.asarray(chunk.tail_blocks, np.int32)])
        by_block = uses_block_tables(self.backend, c)
        if by_block:
            tables = used
        else:
            per_block = bs // self.page
            tables = (used[:, None] * per_block + np.arange(per_block, dtype=np.int32)).reshape(-1)
        tables = tables[:-(-(end + t) // (bs if by_block else self.page))]
        phys = seq.num_kv_slots + np.arange(n + t)  # the tail's slots follow the chunk's, in its scratch blocks
        # a PENDING token is read on the device
        tokens = np.asarray(seq.tokens(chunk.start, chunk.start + n)
                            + seq.tokens(chunk.tail_start, chunk.tail_start + t), np.int32)
        slots = used[phys // bs] * bs + phys % bs
        query_index = np.full(n + t, pad_query, np.int32)
        if seq.query_slot is not None and t:
            row = np.arange(n + t) - (n + t - ql)  # the last ql queries, the tail's last
            query_index = np.where(row >= 0, seq.query_slot * ql + row, pad_query)
        elif seq.query_slot is not None:
            # the query tail of the chunk's last block that has one: a compaction scores with the
            # queries of the sequence's newest full block (one write per query row and step)
            offset = phys % bs - query_tail_start(bs, ql)
            tails = phys[offset >= 0] // bs
            if len(tails):
                cached = (offset >= 0) & (phys // bs == tails.max())
                query_index = np.where(cached, seq.query_slot * ql + offset, pad_query)
        positions = np.concatenate([chunk.start + np.arange(n), chunk.tail_start + np.arange(t)])
        prompt_targets = None
        if seq.computes_prompt_logprobs:  # else all -1
            prompt_targets = np.concatenate([_prompt_targets(chunk), np.full(t, -1, np.int32)])
        SamplingArrays.check(srow, self.suppress_width)
        parts = [slice(j, min(n, j + c)) for j in range(0, n, c)]
        tail_row = dataclasses.replace(srow, slot=self.pad_slot, reset=False, samples=False)
        rows = []
        for j, part in enumerate(parts + [slice(k, min(n + t, k + c)) for k in range(n, n + t, c)]):
            values = dict(tokens=tokens[part], positions=positions[part], slots=slots[part],
                          query_index=query_index[part], kv_lens=phys[part] + 1, block_tables=tables,
                          last_index=part.stop - part.start - 1)
            if prompt_targets is not None:
                values["prompt_targets"] = prompt_targets[part]
            if j >= len(parts):
                rows.append((values, tail_row))
            else:
                last = j == len(parts) - 1
                rows.append((values, dataclasses.replace(srow, reset=srow.reset and j == 0,
                                                         samples=srow.samples and last)))
        return rows

    def write_decode_rows(self, inputs: InputArrays, sampling: SamplingArrays, rows: np.ndarray,
                          running: RunningBatch) -> None:
        """Step rows 0 .. len(rows) - 1 decode the running batch's `rows`: each its last token, at
        its next KV slot, seeing its blocks in use; sampled with its request's options."""
        n = len(rows)
        if not n:
            return
        b, bs, ql = running, self.block_size, self.query_cache_len
        # a row compacting in place this step decodes after its compaction, past the tokens it keeps
        kv = np.where(b.compressing[rows], b.budget_tokens[rows], b.num_kv_slots[rows])
        position = b.num_computed_tokens[rows]
        inputs.tokens[:n, 0] = b.tokens[rows, position]  # PENDING (-1): read on the device
        inputs.positions[:n, 0] = position
        inputs.slots[:n, 0] = b.block_table[rows, kv // bs] * bs + kv % bs
        offset = kv % bs - b.query_tail[rows]  # its query is cached: the sequence may compress this block
        query_slot = b.query_slot[rows]
        inputs.query_index[:n, 0] = np.where((query_slot >= 0) & (offset >= 0), query_slot * ql + offset,
                                             self.pad_query)
        inputs.kv_lens[:n, 0] = kv + 1
        tables = b.block_table[rows]  # [n, max_blocks]
        if uses_block_tables(self.backend, 1):
            used = -(-(kv + 1) // bs)
        else:
            per_block = bs // self.page
            tables = (tables[:, :, None] * per_block + np.arange(per_block, dtype=np.int32)).reshape(n, -1)
            used = -(-(kv + 1) // self.page)
        width = tables.shape[1]
        inputs.block_tables[:n, :width] = np.where(np.arange(width) < used[:, None], tables, DUMMY_BLOCK)
        step = b.num_tokens[rows] - b.num_prompt[rows]
        sampling.write_rows(n, running, rows, step)
        for i in np.flatnonzero(b.forced[rows]):  # teacher forcing: its next forced token
            forced = running.seqs[rows[i]].params.forced_token_ids
            sampling.forced[i] = forced[step[i]] if step[i] < len(forced) else -1
        for i in np.flatnonzero(b.constrained[rows]):
            seq = running.seqs[rows[i]]
            if seq.num_pending:
                raise RuntimeError("a structured output's mask needs its last token, still on the device")
            sampling.constrained.append((int(i), seq.grammar))

    def batch(self, prepared: list[tuple[Chunk, ChunkRows]], num_rows: int, chunk_len: int,
              decode_rows: np.ndarray | None = None, running: RunningBatch | None = None) -> StepBatch:
        """The decode rows (a decode step's, gathered from `running`), then the chunks' rows in
        order, packed into a step of `num_rows` rows (its bucket)."""
        inputs, sampling = self.arrays(num_rows, chunk_len)
        rows = np.zeros(0, np.int64) if decode_rows is None else decode_rows
        if len(rows):
            self.write_decode_rows(inputs, sampling, rows, running)
        sampled, out_rows, prompt_chunks = [], [], []
        i = len(rows)
        for chunk, chunk_rows in prepared:
            if chunk.seq.computes_prompt_logprobs:
                num_entries = sum(int(np.count_nonzero(values["prompt_targets"] >= 0)) for values, _ in chunk_rows)
                if num_entries:
                    prompt_chunks.append(PromptChunk(chunk, i, num_entries))
            for values, srow in chunk_rows:
                inputs.write(i, values)
                sampling.set(i, srow)
                i += 1
            if chunk.samples:
                sampled.append(chunk.seq.row)
                out_rows.append(i - 1)
        constrained = bool(sampling.constrained)
        sample_rows = np.concatenate([rows, np.asarray(sampled, np.int64)]) if sampled else rows
        all_out = np.concatenate([np.arange(len(rows)), np.asarray(out_rows, np.int64)]) if out_rows \
            else np.arange(len(rows))
        return StepBatch(inputs.step_inputs(), sampling.batch(), inputs.prompt_targets, sample_rows, all_out,
                         prompt_chunks, constrained)


def _prompt_targets(chunk: Chunk) -> np.ndarray:
    """[num_tokens] i32: the prompt token each position of the chunk predicts (its sequence
    computes prompt log-probabilities); -1 past the prompt's second-to-last position."""
    seq = chunk.seq
    targets = np.full(chunk.num_tokens, -1, np.int32)
    predicted = seq.tokens(chunk.start + 1, min(chunk.start + chunk.num_tokens + 1, seq.num_prompt_tokens))
    targets[:len(predicted)] = predicted
    return targets


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
