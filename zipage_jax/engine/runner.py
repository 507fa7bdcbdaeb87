"""The one door to the device: the donated device state, the compiled steps, host <-> device.

Per engine step: (1) one compaction of the sequences that reached their budget, (2) one prefill
step over the step's prefill rows, (3) one decode step. Each is dispatched without waiting and
donates the state it updates; `dispatch` returns handles and `fetch` turns them into tokens, so
the engine can schedule and dispatch step N+1 while the device runs step N.

Programs are compiled ahead of time and keyed by shape buckets only (`buckets`): decode rows
(up to max_num_seqs), prefill rows of `prefill_row_size` tokens (up to max_num_batched_tokens /
prefill_row_size), compression batch x table width. A forward step is three programs (embed,
a group of layers called once per group, head: engine/forward.py) and a compaction one
program called per layer, so compile time does not grow with depth. Context lengths, budgets,
policies and sampling options are values, so `warmup` can build the whole grid and a steady
workload never compiles again; built programs persist in the executable store, so a restart
loads them. While a warm-up still builds the grid, a step runs in the smallest ready bucket it
fits (padding rows). Prompt log-probabilities are values too: each position's target token, -1
where none is asked (layers/prompt_logprobs.py), fetched with the step's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from pallas_kernels.tiling import next_power_of_two
from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import RowSequence, compress_rows
from zipage_jax.compress.step import compress
from zipage_jax.config import EngineConfig
from zipage_jax.engine.block_manager import DUMMY_BLOCK, CompressionPlan
from zipage_jax.engine.executable_store import ExecutableStore, program_key, store_directory
from zipage_jax.engine.forward import StagedForward, layers_per_group
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.programs import CompiledSteps, ProgramRecord
from zipage_jax.engine.sampling_batch import SamplingArrays, SamplingRow
from zipage_jax.engine.scheduler import Chunk
from zipage_jax.engine.sequence import Sequence, query_tail_start
from zipage_jax.engine.sharding import TensorParallel, shard_model
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.paged_attention import StepInputs, uses_block_tables, xla_page_size
from zipage_jax.layers.prompt_logprobs import PromptLogprobs
from zipage_jax.layers.rotary import inv_frequencies
from zipage_jax.layers.sampler import SamplerOutput, SamplerState, record_inputs
from zipage_jax.models.decoder import stages
from zipage_jax.models.loading import LoadedModel
from zipage_jax.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

_MIN_HISTORY = 64  # tokens of the smallest history-seeding bucket


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return next_power_of_two(max(n, minimum))


def buckets(limit: int, minimum: int = 1) -> list[int]:
    """Every bucket a count in [1, limit] can fall in."""
    out = [bucket(minimum)]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


@dataclass(frozen=True)
class GridProgram:
    """One program of the warm-up grid: its kind, shape bucket and how to build it."""

    kind: str  # forward, compression, history
    key: tuple
    build: Callable[[], None]
    serving: bool = False  # in the serving set: with these ready, every step can run


class DeviceState(NamedTuple):
    kv: KVState
    sampler: SamplerState


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "tp", "rope"), donate_argnames=("kv",))
def _compress(kv: KVState, block_tables, num_blocks, query_ids, compressed, target_tables, rows, *,
              cfg: CompressionConfig, backend: Backend, tp: TensorParallel | None, rope: tuple[float, ...]) -> KVState:
    """One compaction step of one layer (`kv` holds that layer only): the runner calls the same
    program for every layer, so its compile time does not grow with depth."""
    def step(kv: KVState, block_tables, num_blocks, query_ids, compressed, target_tables, rows) -> KVState:
        queries = list(kv.queries)
        if tp is not None:
            queries, query_ids = tp.group_queries(queries, query_ids)
        pools = compress(list(kv.pools), queries, block_tables, num_blocks, query_ids, compressed, target_tables,
                         rows, cfg, backend, rope)
        return kv._replace(pools=tuple(pools))

    if tp is not None:  # each shard compresses its own kv heads
        step = tp.per_shard_kv(step, kv)
    return step(kv, block_tables, num_blocks, query_ids, compressed, target_tables, rows)


@functools.partial(jax.jit, donate_argnames=("state",))
def _seed_history(state: DeviceState, slot, tokens, num_prompt) -> DeviceState:
    """A sequence admitted with cached prefix tokens: clear its slot and count those tokens."""
    # slot, num_prompt: [1]; tokens: [1, N] (-1 padding)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    sampler = record_inputs(state.sampler, tokens, positions, tokens >= 0, slot, num_prompt,
                            jnp.ones((1,), jnp.bool_))
    return state._replace(sampler=sampler)


@dataclass
class StepResult:
    chunk: Chunk
    token_id: int
    logprob: float
    top_ids: np.ndarray  # [MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [MAX_LOGPROBS]


@dataclass
class PromptLogprobsResult:
    """Log-probabilities of prompt tokens first .. first + n - 1 of `chunk.seq`, from one chunk."""

    chunk: Chunk
    first: int  # prompt index of the first entry: the chunk's start + 1
    logprobs: np.ndarray  # [n] of each prompt token
    top_ids: np.ndarray  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, MAX_LOGPROBS]


@dataclass
class PromptChunk:
    """Where a chunk's prompt log-probabilities lie in a batch's outputs."""

    chunk: Chunk
    row: int  # the chunk's first row; its positions follow row by row
    num_entries: int


@dataclass
class PendingBatch:
    """A dispatched forward step: the sampling chunks and the output row of each, and the chunks
    with prompt log-probabilities."""

    chunks: list[Chunk]
    rows: list[int]
    outputs: SamplerOutput  # device arrays, still being computed
    prompt_chunks: list[PromptChunk]
    prompt_outputs: PromptLogprobs  # device arrays, read only when prompt_chunks is not empty


@dataclass
class RowFailure:
    """A request whose step inputs could not be built: it fails alone, the step runs without it."""

    chunk: Chunk
    error: Exception


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, pool: KVPoolPlan, *,
                 eos_token_ids: tuple[int, ...] = ()):
        self.config, self.pool = config, pool
        loaded, self.tp = shard_model(loaded, config.tensor_parallel_size)
        self.model_config = mc = loaded.config
        model = loaded.model
        if self.tp is not None:
            graphdef, params = nnx.split(model)
            model = nnx.merge(graphdef, self.tp.place_params(params))
        self.params = nnx.state(model)  # as an nnx.State (the compiled steps take them per stage)
        self.stages, stage_params = stages(model, layers_per_group(mc.num_layers))
        self.block_size = bs = pool.block_size
        self.query_cache_len = config.query_cache_len
        self.num_query_slots = pool.num_query_slots
        self.row_size = config.row_size
        self.vocab_size = mc.vocab_size
        self.backend = Backend.resolve(config.attention_backend, jax.default_backend())
        self.max_blocks = pool.max_blocks_per_seq
        self.page = xla_page_size(bs)
        self.eos_token_ids = eos_token_ids
        self.suppress_width = bucket(MAX_STOP_TOKEN_IDS + len(eos_token_ids))
        self.pad_slot = config.max_num_seqs  # the sampler state's padding row
        make_kv = functools.partial(
            KVState.zeros, num_layers=mc.num_layers, num_blocks=pool.num_blocks, block_size=bs,
            num_kv_heads=mc.num_kv_heads, num_heads=mc.num_heads, head_dim=mc.head_dim,
            num_query_slots=pool.num_query_slots, query_cache_len=self.query_cache_len, dtype=loaded.model.dtype,
            kv_dtype=pool.kv_dtype, global_score=config.compression.use_global_score)
        make_sampler = functools.partial(SamplerState.zeros, config.max_num_seqs, mc.vocab_size)
        self._make_kv, self._make_sampler = make_kv, make_sampler
        # Zeroing the pool takes seconds (its pages are touched once): it runs beside whatever
        # comes next (loading or compiling programs), and the first step waits for it.
        self.abstract_state = self._abstract_state()
        self._state: DeviceState | None = None
        self._state_future = _background(self._fresh_state)
        self.compression = config.compression
        store = self._executable_store(loaded)
        self.forward = StagedForward(self.stages, stage_params, store, backend=self.backend, tp=self.tp,
                                     replicated=self._replicated(), hidden_dtype=loaded.model.dtype)
        rope = tuple(float(f) for f in inv_frequencies(mc.head_dim, mc.rope_theta, mc.rope_scaling))
        self.compressor = CompiledSteps("compression", _compress, store, cfg=self.compression, backend=self.backend,
                                        tp=self.tp, rope=rope)
        self.seeder = CompiledSteps("history", _seed_history, store)
        self.programs = (self.forward, self.compressor, self.seeder)
        self.compress_seconds = 0.0  # measured with config.profile_compaction only

    def _executable_store(self, loaded: LoadedModel) -> ExecutableStore | None:
        root = store_directory(self.config.compilation_cache_dir)
        if root is None or jax.process_count() > 1:  # several processes: each compiles its own
            return None
        shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(self.params)]
        key = program_key(self.config, loaded.config, shapes, jax.devices()[:self.config.tensor_parallel_size])
        return ExecutableStore(root / key)

    def _fresh_state(self) -> DeviceState:
        """An empty KV pool and sampler state, placed as every compiled step expects them."""
        if self.tp is None:  # host zeros copied in: no program compiled (committed to the device, as steps expect)
            return jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), self.abstract_state)
        return DeviceState(self.tp.make_kv(self._make_kv), self.tp.replicate(self._make_sampler()))

    @property
    def state(self) -> DeviceState:
        if self._state is None:
            self._state = self._state_future.result()
        return self._state

    @state.setter
    def state(self, value: DeviceState) -> None:
        self._state = value

    def _replicated(self):
        """Where values every device holds whole live: the device, or replicated over the mesh."""
        if self.tp is None:
            return SingleDeviceSharding(jax.devices()[0])
        return self.tp.replicated_shardings(0)

    def _abstract_state(self) -> DeviceState:
        """The device state's shapes, dtypes and placement (what compiling a step needs of it)."""
        shapes = jax.eval_shape(lambda: DeviceState(self._make_kv(), self._make_sampler()))
        if self.tp is None:
            shardings = jax.tree.map(lambda _: self._replicated(), shapes)
        else:
            shardings = DeviceState(self.tp.kv_shardings(shapes.kv), self.tp.replicated_shardings(shapes.sampler))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)

    def reset_state(self) -> None:
        """After a failed step: frees what is left of the device state (a failed call may have
        consumed it, or left it holding poisoned buffers) and builds a fresh one. The compiled
        executables stay valid: the new state has the old one's shapes and placement."""
        for leaf in jax.tree.leaves(self.state):
            if not leaf.is_deleted():
                leaf.delete()  # the old pool goes before the new one is allocated
        self.state = self._fresh_state()

    @property
    def records(self) -> list[ProgramRecord]:
        """How every ready program was built (compiled or loaded), with its seconds per stage."""
        return [r for steps in self.programs for r in list(steps.records.values())]

    @property
    def num_compiles(self) -> int:
        """Programs built: compiled here or loaded from the executable store (a forward step's
        stages count one each)."""
        return sum(steps.num_built for steps in self.programs)  # every step reads it: no list built

    @property
    def compile_seconds(self) -> float:
        """Seconds spent building every program so far (tracing, lowering, compiling or loading)."""
        return sum(r.seconds for r in self.records)

    @staticmethod
    def _ready_key(steps: CompiledSteps, key: tuple) -> tuple:
        """`key`, or while the warm-up still compiles it, the smallest ready program of the same
        kind that every dimension of `key` fits in (its rows are padding)."""
        if steps.ready(key):
            return key
        fits = [k for k in list(steps.executables) if k[0::2] == key[0::2]
                and all(have >= need for have, need in zip(k[1::2], key[1::2]))]
        return min(fits, key=lambda k: math.prod(k[1::2])) if fits else key

    # -- compression ----------------------------------------------------------------------

    def compress(self, plans: list[CompressionPlan]) -> None:
        """One compaction of every sequence in `plans`, whatever their budgets and policies."""
        key = self._ready_key(self.compressor, ("batch", bucket(len(plans)),
                                                "blocks", bucket(max(len(p.source_table) for p in plans), 2)))
        b, w = key[1], key[3]
        tables = np.full((b, w), DUMMY_BLOCK, np.int32)
        targets = np.full((b, w), DUMMY_BLOCK, np.int32)
        num_blocks = np.zeros(b, np.int32)
        query_ids = np.full(b, self.num_query_slots, np.int32)  # the padding row
        compressed = np.zeros(b, bool)
        for i, plan in enumerate(plans):
            seq = plan.seq
            tables[i, :len(plan.source_table)] = plan.source_table
            targets[i, :len(plan.target_table)] = plan.target_table
            num_blocks[i] = len(plan.source_table)
            query_ids[i] = seq.query_slot
            compressed[i] = seq.compressed
        rows = compress_rows([plan.seq.budget for plan in plans], b, [
            RowSequence(seq.num_prompt_tokens, seq.num_computed_tokens - seq.num_kv_slots, seq.quote_end,
                        in_prompt=seq.num_computed_tokens <= seq.num_prefill_tokens)
            for seq in (plan.seq for plan in plans)])
        profile = self.config.profile_compaction
        if profile:  # time the compaction alone, not the forward step still in flight
            jax.block_until_ready(self.state)
        start = time.perf_counter()
        pools, queries = list(self.state.kv.pools), list(self.state.kv.queries)
        for i in range(len(pools)):  # one program, called per layer
            layer = self.compressor(key, KVState((pools[i],), (queries[i],)), tables, num_blocks, query_ids,
                                    compressed, targets, rows)
            pools[i], queries[i] = layer.pools[0], layer.queries[0]
        self.state = self.state._replace(kv=KVState(tuple(pools), tuple(queries)))
        if profile:
            jax.block_until_ready(self.state)
            self.compress_seconds += time.perf_counter() - start

    # -- forward --------------------------------------------------------------------------

    def dispatch(self, chunks: list[Chunk]) -> tuple[list[PendingBatch], list[RowFailure]]:
        """Dispatches the step's decode rows and prefill rows (at most two compiled calls). A
        chunk whose inputs cannot be built fails alone (RowFailure); the step runs without it."""
        failures: list[RowFailure] = []
        rows = []
        for chunk in chunks:
            try:
                rows.append((chunk, self._sampling_row(chunk)))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failures.append(RowFailure(chunk, exc))
        decoding_next = sum(c.num_tokens == 1 or c.samples for c, _ in rows)
        if decoding_next:  # the next step's decode program builds beside this step
            self._prefetch_decode(bucket(decoding_next))
        pending = []
        for is_decode in (True, False):
            picked = [(c, r) for c, r in rows if (c.num_tokens + c.tail == 1) == is_decode]
            if picked:
                batch = self._dispatch_batch(picked, is_decode, failures)
                if batch is not None:
                    pending.append(batch)
        return pending, failures

    def _prefetch_decode(self, r: int) -> None:
        if not self.forward.ready(self._ready_key(self.forward, ("decode rows", r))):
            self.forward.prefetch(*self._forward_shapes(r, 1))

    def _sampling_row(self, chunk: Chunk) -> SamplingRow:
        seq = chunk.seq
        params = seq.params
        forced = params.forced_token_ids
        step = seq.num_output_tokens
        reset = not seq.state_fresh
        if reset and seq.num_computed_tokens and _penalised(params):
            self.seed_history(seq)  # its cached prefix tokens never pass through a step
            reset = False
        if seq.grammar is not None and chunk.samples and seq.num_pending:
            raise RuntimeError("a structured output's mask needs its last token, still on the device")
        suppress = () if step >= params.min_tokens else (
            tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids))
        return SamplingRow(params=params, seed=seq.seed, step=step, suppress_ids=suppress,
                           forced_id=forced[step] if step < len(forced) else -1, slot=seq.state_slot,
                           num_prompt_tokens=seq.num_prompt_tokens, reset=reset, samples=chunk.samples,
                           grammar=seq.grammar)

    def fetch(self, batches: list[PendingBatch]) -> Iterator[StepResult | PromptLogprobsResult]:
        """The sampled tokens and prompt log-probabilities of dispatched batches (waits for the
        device); a batch's prompt log-probabilities come before its tokens."""
        for batch in batches:
            out = jax.device_get(batch.outputs)
            if batch.prompt_chunks:
                prompt = jax.device_get(batch.prompt_outputs)
                for p in batch.prompt_chunks:  # [R, C, ...] -> the chunk's [num_entries, ...]
                    entries = [a[p.row:].reshape(-1, *a.shape[2:])[:p.num_entries] for a in prompt]
                    yield PromptLogprobsResult(p.chunk, p.chunk.start + 1, *entries)
            for chunk, row in zip(batch.chunks, batch.rows):
                yield StepResult(chunk, int(out.token_ids[row]), float(out.logprobs[row]), out.top_ids[row],
                                 out.top_logprobs[row])

    def _dispatch_batch(self, picked: list[tuple[Chunk, SamplingRow]], is_decode: bool,
                        failures: list[RowFailure]) -> PendingBatch | None:
        chunk_len = 1 if is_decode else self.row_size
        prepared = []
        for chunk, srow in picked:
            try:  # everything that can fail happens here, before any row is written
                prepared.append((chunk, self._chunk_rows(chunk, srow, chunk_len)))
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the step goes on
                failures.append(RowFailure(chunk, exc))
        num_rows = sum(len(rows) for _, rows in prepared)
        if num_rows == 0:
            return None
        kind = "decode rows" if is_decode else "prefill rows"
        key = self._ready_key(self.forward, (kind, bucket(num_rows)))
        r = key[1]
        inputs = _InputArrays(r, chunk_len, self._table_width(chunk_len), self.num_query_slots * self.query_cache_len)
        sampling = SamplingArrays(r, self.suppress_width, self.pad_slot, self.vocab_size)
        sampled, out_rows, prompt_chunks = [], [], []
        i = 0
        for chunk, rows in prepared:
            if chunk.seq.computes_prompt_logprobs:
                num_entries = sum(int(np.count_nonzero(values["prompt_targets"] >= 0)) for values, _ in rows)
                if num_entries:
                    prompt_chunks.append(PromptChunk(chunk, i, num_entries))
            for values, srow in rows:
                inputs.write(i, values)
                sampling.set(i, srow)
                i += 1
            if chunk.samples:
                sampled.append(chunk)
                out_rows.append(i - 1)
        step_inputs, batch = inputs.step_inputs(), sampling.batch()
        # the programs first: they load or compile while the device state may still be zeroed
        self.forward.get(key, self.abstract_state, step_inputs, batch, inputs.prompt_targets)
        self.state, outputs, prompt = self.forward(key, self.state, step_inputs, batch, inputs.prompt_targets)
        return PendingBatch(sampled, out_rows, outputs, prompt_chunks, prompt)

    def _table_width(self, chunk_len: int) -> int:
        if uses_block_tables(self.backend, chunk_len):
            return self.max_blocks
        return self.max_blocks * (self.block_size // self.page)

    def _chunk_rows(self, chunk: Chunk, srow: SamplingRow, c: int) -> list[tuple[dict, SamplingRow]]:
        """The rows one chunk takes in a step of c-token rows: (input values, sampling row) each.

        A chunk with a prompt tail (engine/prompt_compaction.py) is followed by rows of the tail's
        tokens at their own positions: their K/V go to the chunk's scratch blocks (seen by the tail
        only), their last queries to the sequence's query slot, and their sampling rows are the
        padding slot's (their tokens are neither counted for penalties nor sampled)."""
        seq, n, t = chunk.seq, chunk.num_tokens, chunk.tail
        bs, ql = self.block_size, self.query_cache_len
        pad_query = self.num_query_slots * ql
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
        tokens = np.asarray(seq.token_ids[chunk.start:chunk.start + n]
                            + seq.token_ids[chunk.tail_start:chunk.tail_start + t], np.int32)  # PENDING: read on the device
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

    def seed_history(self, seq: Sequence) -> None:
        """Clears `seq`'s state slot and counts its cached prefix tokens (penalised requests
        admitted with a prefix-cache hit: those tokens never pass through a step)."""
        n = seq.num_computed_tokens
        key = self._ready_key(self.seeder, ("tokens", bucket(n, _MIN_HISTORY)))
        width = key[1]
        tokens = np.full((1, width), -1, np.int32)
        tokens[0, :n] = seq.token_ids[:n]
        self.state = self.seeder(key, self.state, np.array([seq.state_slot], np.int32), tokens,
                                 np.array([seq.num_prompt_tokens], np.int32))

    # -- warm-up --------------------------------------------------------------------------

    def step_grid(self) -> list[GridProgram]:
        """Every program the configuration can reach, the serving set first: the largest bucket of
        each kind, which every step fits in by padding, so a warm-up can serve once those are ready."""
        cfg = self.config
        grid = []
        for r in buckets(cfg.max_num_seqs):
            grid.append(GridProgram("forward", ("decode rows", r), functools.partial(self._compile_forward, r, 1)))
        for r in buckets(max(1, cfg.max_num_batched_tokens // self.row_size)):
            grid.append(GridProgram("forward", ("prefill rows", r),
                                    functools.partial(self._compile_forward, r, self.row_size)))
        for b in buckets(cfg.max_compress_seqs):
            for w in buckets(self.max_blocks, 2):
                grid.append(GridProgram("compression", ("batch", b, "blocks", w),
                                        functools.partial(self._compile_compress, b, w)))
        for n in buckets(self.pool.max_model_len, _MIN_HISTORY):
            grid.append(GridProgram("history", ("tokens", n), functools.partial(self._compile_seed, n)))
        largest = {}
        for program in grid:  # buckets ascend: the last of a kind and layout is its largest
            largest[(program.kind, program.key[0::2])] = program
        serving = [dataclasses.replace(p, serving=True) for p in largest.values()]
        return serving + [p for p in grid if p not in largest.values()]

    def _compile_forward(self, r: int, c: int) -> None:
        self.forward.get(*self._forward_shapes(r, c))

    def _forward_shapes(self, r: int, c: int) -> tuple:
        """(key, *arguments) of the forward program for r rows of c tokens."""
        inputs = _InputArrays(r, c, self._table_width(c), 0)
        sampling = SamplingArrays(r, self.suppress_width, self.pad_slot, self.vocab_size)
        return (("decode rows" if c == 1 else "prefill rows", r), self.abstract_state, inputs.step_inputs(),
                sampling.batch(), inputs.prompt_targets)

    def _compile_compress(self, b: int, w: int) -> None:
        tables = np.zeros((b, w), np.int32)
        rows = compress_rows([], b)
        layer = KVState(self.abstract_state.kv.pools[:1], self.abstract_state.kv.queries[:1])
        self.compressor.get(("batch", b, "blocks", w), layer, tables, np.zeros(b, np.int32),
                            np.zeros(b, np.int32), np.zeros(b, bool), tables, rows)

    def _compile_seed(self, n: int) -> None:
        one = np.zeros(1, np.int32)
        self.seeder.get(("tokens", n), self.abstract_state, one, np.zeros((1, n), np.int32), one)


class _InputArrays:
    """Host arrays of one StepInputs; untouched rows are padding (dummy slot, nothing visible)."""

    def __init__(self, rows: int, chunk: int, width: int, pad_query: int):
        self.pad_query = pad_query
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


def _background(fn: Callable[[], DeviceState]) -> Future:
    """fn() on a daemon thread."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised where the state is first used
            future.set_exception(exc)

    threading.Thread(target=run, name="zipage-state", daemon=True).start()
    return future


def _prompt_targets(chunk: Chunk) -> np.ndarray:
    """[num_tokens] i32: the prompt token each position of the chunk predicts (its sequence
    computes prompt log-probabilities); -1 past the prompt's second-to-last position."""
    seq = chunk.seq
    targets = np.full(chunk.num_tokens, -1, np.int32)
    predicted = seq.token_ids[chunk.start + 1:min(chunk.start + chunk.num_tokens + 1, seq.num_prompt_tokens)]
    targets[:len(predicted)] = predicted
    return targets


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
