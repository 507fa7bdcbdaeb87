"""The one door to the device: the donated device state, dispatch of the compiled programs, and
fetching what they computed.

Per engine step (`execute`): (1) one compaction of the sequences that reached their budget, (2)
one decode step over the step's decode rows, (3) one prefill step over its prefill rows. Each is
dispatched without waiting and donates the state it updates; the runner keeps the dispatched
steps' handles and reads their tokens a step later, so the engine schedules and dispatches step
N+1 while the device runs step N.

A forward program is three programs (embed, a group of layers called once per group, head:
forward.py) and a compaction one program called per layer, so compile time does not grow with
depth. Which programs exist and which one a step runs in: grid.py; its inputs: inputs.py and
compaction.py.

Served over several processes, process 0's runner relays each call that runs a program on the
mesh (the methods step_relay.RELAYED names, each taking host arguments only) to the other
processes' runners before making it (`relay`; None in a single process).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from zipage_jax.backend import Backend
from zipage_jax.config import EngineConfig
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.runner.compaction import CompactionTables, compaction_tables, measurement_tables
from zipage_jax.engine.runner.executable_store import engine_store
from zipage_jax.engine.runner.forward import StagedForward, layers_per_group
from zipage_jax.engine.runner.grid import GridProgram, ProgramGrid
from zipage_jax.engine.runner.inputs import ChunkRows, InputLayout
from zipage_jax.engine.runner.programs import CompiledPrograms, ProgramRecord
from zipage_jax.engine.runner.results import (
    CompactionFailed,
    FetchedStep,
    PendingBatch,
    PromptLogprobsResult,
    RowFailure,
    RunnerOutput,
)
from zipage_jax.engine.runner.sampling_batch import SamplingRow
from zipage_jax.engine.runner.step_relay import LeaderRelay
from zipage_jax.engine.runner.steps import DeviceState, compaction_program, seed_history
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.scheduler import Chunk, SchedulerOutput
from zipage_jax.engine.sequence import Sequence
from zipage_jax.engine.sharding import shard_model
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.paged_attention import StepInputs
from zipage_jax.layers.prompt_logprobs import PromptLogprobs
from zipage_jax.layers.rotary import inv_frequencies
from zipage_jax.layers.sampler import SamplerOutput, SamplerState, SamplingBatch
from zipage_jax.models.decoder import stages
from zipage_jax.models.loading import LoadedModel


@dataclass
class _InFlight:
    """A dispatched step whose tokens the host has not read yet."""

    batches: list[PendingBatch]
    dispatched_at: float
    num_prefill: int
    num_decode: int
    constrained: bool  # it samples a structured output's token: read at once (the next mask needs it)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, pool: KVPoolPlan, *,
                 eos_token_ids: tuple[int, ...] = (), running: RunningBatch | None = None):
        """running: the engine's running batch, whose decode rows the runner gathers (None: a
        runner that only replays another process's calls)."""
        self.config, self.pool = config, pool
        loaded, self.tp = shard_model(loaded, config.tensor_parallel_size, config.enable_expert_parallel)
        self.model_config = mc = loaded.config
        model = loaded.model
        if self.tp is not None:
            graphdef, params = nnx.split(model)
            model = nnx.merge(graphdef, self.tp.place_params(params))
        self.params = nnx.state(model)  # as an nnx.State (the compiled programs take them per stage)
        self.stages, stage_params = stages(model, layers_per_group(mc.num_layers, mc.layer_windows))
        self.row_size = config.row_size
        backend = Backend.resolve(config.attention_backend, jax.default_backend())
        self.inputs = InputLayout(pool, config, backend, mc.vocab_size, eos_token_ids)
        make_kv = functools.partial(
            KVState.zeros, num_layers=mc.num_layers, num_blocks=pool.num_blocks, block_size=pool.block_size,
            num_kv_heads=mc.num_kv_heads, num_heads=mc.num_heads, head_dim=mc.head_dim,
            num_query_slots=pool.num_query_slots, query_cache_len=config.query_cache_len, dtype=loaded.model.dtype,
            kv_dtype=pool.kv_dtype, global_score=config.compression.use_global_score)
        make_sampler = functools.partial(SamplerState.zeros, config.max_num_seqs, mc.vocab_size)
        self._make_kv, self._make_sampler = make_kv, make_sampler
        # Zeroing the pool takes seconds (its pages are touched once): it runs beside whatever
        # comes next (loading or compiling programs), and the first step waits for it.
        self.abstract_state = self._abstract_state()
        self._state: DeviceState | None = None
        self._state_future = _background(self._fresh_state)
        store = engine_store(config, mc, self.params)
        self.forward = StagedForward(self.stages, stage_params, store, backend=backend, tp=self.tp,
                                     replicated=self._replicated(), hidden_dtype=loaded.model.dtype)
        rope = tuple(float(f) for f in inv_frequencies(mc.head_dim, mc.rope_theta, mc.rope_scaling))
        self.compressor = CompiledPrograms("compression", compaction_program, store, cfg=config.compression,
                                           backend=backend, tp=self.tp, rope=rope)
        self.seeder = CompiledPrograms("history", seed_history, store)
        self.grid = ProgramGrid(self.forward, self.compressor, self.seeder, config=config, pool=pool,
                                layout=self.inputs, abstract_state=self.abstract_state)
        self.running = running
        self._in_flight: deque[_InFlight] = deque()
        self._last_fetch = time.perf_counter()
        self.compress_seconds = 0.0  # measured with config.profile_compaction only
        self.relay: LeaderRelay | None = None  # set by LeaderRelay.attach on process 0 of a multi-process group

    @property
    def backend(self) -> Backend:
        return self.inputs.backend

    # -- the device state -----------------------------------------------------------------

    def _fresh_state(self) -> DeviceState:
        """An empty KV pool and sampler state, placed as every compiled program expects them."""
        if self.tp is None:  # host zeros copied in: no program compiled (committed to the device, as programs expect)
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
        """The device state's shapes, dtypes and placement (what compiling a program needs of it)."""
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
        self._relay("reset_state")
        for leaf in jax.tree.leaves(self.state):
            if not leaf.is_deleted():
                leaf.delete()  # the old pool goes before the new one is allocated
        self.state = self._fresh_state()

    # -- programs -------------------------------------------------------------------------

    @property
    def records(self) -> list[ProgramRecord]:
        """How every ready program was built (compiled or loaded), with its seconds per stage."""
        return self.grid.records

    @property
    def num_compiles(self) -> int:
        """Programs built: compiled here or loaded from the executable store (a forward program's
        stages count one each)."""
        return self.grid.num_compiles

    @property
    def compile_seconds(self) -> float:
        """Seconds spent building every program so far (tracing, lowering, compiling or loading)."""
        return self.grid.compile_seconds

    def step_grid(self) -> list[GridProgram]:
        """Every program the configuration can reach, the serving set first (grid.py)."""
        return self.grid.step_grid()

    # -- compression ----------------------------------------------------------------------

    def compress(self, scheduled: SchedulerOutput) -> None:
        """One compaction of every sequence the step compacts, whatever their budgets and policies."""
        rows = scheduled.compaction_rows()
        key = self.grid.compress_key(len(rows), int(self.running.num_blocks[rows].max()))
        tables = compaction_tables(self.running, rows, scheduled.compressions, key[1], key[3],
                                   self.inputs.num_query_slots)
        profile = self.config.profile_compaction
        if profile:  # time the compaction alone, not the forward step still in flight
            jax.block_until_ready(self.state)
        start = time.perf_counter()
        self.run_compaction(key, tables)
        if profile:
            jax.block_until_ready(self.state)
            self.compress_seconds += time.perf_counter() - start

    def measure(self, rows: np.ndarray) -> list[jax.Array]:
        """The compaction program keeping every token of `rows` (automatic budgets sized for their
        compaction point), dispatched: per layer [shards, b, w] the attention share each row would
        evict keeping j blocks, left on the device (`read_measurement`; compress/auto_budget.py)."""
        key = self.grid.compress_key(len(rows), int(self.running.num_blocks[rows].max()))
        tables = measurement_tables(self.running, rows, key[1], key[3], self.inputs.num_query_slots)
        return self.run_compaction(key, tables)

    def read_measurement(self, lost: list[jax.Array], num_rows: int) -> np.ndarray:
        """[num_rows, w] `measure`'s shares read back, averaged over the full-attention layers: a
        sliding layer reads only its window, which every budget holds (compress/step.py
        compress_measured); all layers sliding: 0."""
        lost = np.asarray(jax.device_get(lost))  # [layers, shards, b, w]
        full = [i for i in range(len(lost)) if self.model_config.window(i) == 0]
        return (lost[full].mean(axis=(0, 1)) if full else np.zeros(lost.shape[2:], lost.dtype))[:num_rows]

    def run_compaction(self, key: tuple, tables: CompactionTables) -> list[jax.Array]:
        """The compaction program `key` over every layer of the device state; per layer [shards, b, w]
        the evicted attention shares (left on the device)."""
        kv = self.abstract_state.kv
        self.compressor.get(key, KVState(kv.pools[:1], kv.queries[:1]), *tables, np.int32(0))  # built before relayed
        self._relay("run_compaction", key, tables)
        pools, queries = list(self.state.kv.pools), list(self.state.kv.queries)
        lost = []
        for i in range(len(pools)):  # one program, called per layer, its sliding window as data
            layer, layer_lost = self.compressor(key, KVState((pools[i],), (queries[i],)), *tables,
                                                np.int32(self.model_config.window(i)))
            pools[i], queries[i] = layer.pools[0], layer.queries[0]
            lost.append(layer_lost)
        self.state = self.state._replace(kv=KVState(tuple(pools), tuple(queries)))
        return lost

    # -- a step ---------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """A step on the device: the compaction of the sequences at their budget, then the forward
        of its decode rows and chunks dispatched without waiting, then the results of the steps
        the host may read now: every one but this step's with asynchronous scheduling (the device
        computes it while the host prepares the next), all of them when this step samples a
        structured output's token (the next mask needs it). A measurement is read back once the
        forward is on its way."""
        lost = None
        if scheduled.num_compactions:
            try:
                if len(scheduled.measure_rows):
                    lost = self.measure(scheduled.measure_rows)
                if scheduled.num_compactions > len(scheduled.measure_rows):
                    self.compress(scheduled)
            except Exception as exc:
                raise self._compaction_failed(scheduled, exc) from exc
        failures: list[RowFailure] = []
        if scheduled.chunks or len(scheduled.decode_rows):
            batches, failures = self.dispatch(scheduled)
            failed = {f.chunk.seq.request_id for f in failures}
            dispatched = [c for c in scheduled.chunks if c.seq.request_id not in failed]
            self._in_flight.append(_InFlight(
                batches, time.perf_counter(),
                num_prefill=sum(c.num_tokens for c in dispatched if c.num_tokens > 1),
                num_decode=len(scheduled.decode_rows) + sum(1 for c in dispatched if c.num_tokens == 1),
                constrained=any(b.constrained for b in batches)))
        keep = 1 if self.config.async_scheduling and self._in_flight and not self._in_flight[-1].constrained \
            and (scheduled.chunks or len(scheduled.decode_rows)) else 0
        measured = None
        if lost is not None:
            try:
                measured = self.read_measurement(lost, len(scheduled.measure_rows))
            except Exception as exc:
                raise self._compaction_failed(scheduled, exc) from exc
        output = RunnerOutput(failures=failures, measured=measured)
        while len(self._in_flight) > keep:
            waiting = time.perf_counter()
            output.fetched.append(self._fetch(self._in_flight.popleft()))
            output.wait_seconds += time.perf_counter() - waiting
        return output

    def _compaction_failed(self, scheduled: SchedulerOutput, error: Exception) -> CompactionFailed:
        rows = np.concatenate([scheduled.compaction_rows(), scheduled.measure_rows])
        return CompactionFailed(self.running.seq_id[rows].tolist(), error)

    def drop_in_flight(self) -> None:
        """A step failed: the steps in flight are lost with the device state."""
        self._in_flight.clear()

    @property
    def has_in_flight(self) -> bool:
        """Some dispatched step still owes the host a token of a sequence that holds its row."""
        running = self.running
        return any(((running.epoch[b.rows] == b.epochs) & running.occupied[b.rows]).any()
                   for step in self._in_flight for b in step.batches)

    def dispatch(self, scheduled: SchedulerOutput) -> tuple[list[PendingBatch], list[RowFailure]]:
        """Dispatches the step's decode rows and chunks (at most two compiled calls: the decode step
        and the prefill step). A chunk whose inputs cannot be built fails alone (RowFailure); the
        step runs without it."""
        failures: list[RowFailure] = []
        rows = []
        for chunk in scheduled.chunks:
            try:
                seeded = self.inputs.needs_history(chunk.seq)
                if seeded:
                    self.seed_history(chunk.seq)
                rows.append((chunk, self.inputs.sampling_row(chunk, seeded)))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failures.append(RowFailure(chunk, exc))
        decode_rows = scheduled.decode_rows
        decoding_next = len(decode_rows) + sum(c.num_tokens == 1 or c.samples for c, _ in rows)
        if decoding_next:  # the next step's decode program builds beside this step
            self.prefetch_decode(decoding_next)
        pending = []
        for is_decode in (True, False):
            picked = [(c, r) for c, r in rows if (c.num_tokens + c.tail == 1) == is_decode]
            lane = decode_rows if is_decode else None
            if picked or (lane is not None and len(lane)):
                batch = self._dispatch_batch(picked, is_decode, failures, lane)
                if batch is not None:
                    pending.append(batch)
        return pending, failures

    def _fetch(self, step: _InFlight) -> FetchedStep:
        """The tokens and prompt log-probabilities of a dispatched step (waits for the device); a
        batch's prompt log-probabilities come before its tokens."""
        prompt, parts = [], []
        for batch in step.batches:
            outputs = batch.outputs if batch.wants_logprobs else batch.outputs._replace(
                top_ids=None, top_logprobs=None)  # read only what some row asked for
            out = jax.device_get(outputs)
            if batch.prompt_chunks:
                outputs = jax.device_get(batch.prompt_outputs)
                for p in batch.prompt_chunks:  # [R, C, ...] -> the chunk's [num_entries, ...]
                    entries = [a[p.row:].reshape(-1, *a.shape[2:])[:p.num_entries] for a in outputs]
                    prompt.append(PromptLogprobsResult(p.chunk, p.chunk.start + 1, *entries))
            r, k = batch.out_rows, batch.outputs.top_ids.shape[1]
            top_ids = out.top_ids[r] if batch.wants_logprobs else np.zeros((len(r), k), np.int32)
            top_logprobs = out.top_logprobs[r] if batch.wants_logprobs else np.zeros((len(r), k), np.float32)
            parts.append((batch.rows, batch.epochs, out.token_ids[r], out.logprobs[r], top_ids, top_logprobs))
        now = time.perf_counter()
        seconds = now - max(step.dispatched_at, self._last_fetch)
        self._last_fetch = now
        arrays = [np.concatenate(a) for a in zip(*parts)] if len(parts) > 1 else list(parts[0]) if parts else \
            [np.zeros(0, np.int64)] * 6
        return FetchedStep(*arrays, prompt_logprobs=prompt, num_prefill=step.num_prefill,
                           num_decode=step.num_decode, seconds=seconds)

    def _dispatch_batch(self, picked: list[tuple[Chunk, SamplingRow]], is_decode: bool,
                        failures: list[RowFailure], decode_rows: np.ndarray | None) -> PendingBatch | None:
        chunk_len = 1 if is_decode else self.row_size
        prepared: list[tuple[Chunk, ChunkRows]] = []
        for chunk, srow in picked:
            try:  # everything that can fail happens here, before any row is written
                prepared.append((chunk, self.inputs.chunk_rows(chunk, srow, chunk_len)))
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the step goes on
                failures.append(RowFailure(chunk, exc))
        num_rows = sum(len(rows) for _, rows in prepared) + (0 if decode_rows is None else len(decode_rows))
        if num_rows == 0:
            return None
        key = self.grid.forward_key(is_decode, num_rows)
        batch = self.inputs.batch(prepared, key[1], chunk_len, decode_rows, self.running)
        outputs, prompt = self.run_forward(key, batch.inputs, batch.sampling, batch.prompt_targets)
        return PendingBatch(batch.rows, self.running.epoch[batch.rows], batch.out_rows, outputs,
                            batch.prompt_chunks, prompt, batch.constrained,
                            wants_logprobs=bool(batch.sampling.wants_logprobs.any()))

    def run_forward(self, key: tuple, inputs: StepInputs, sampling: SamplingBatch, prompt_targets: np.ndarray
                    ) -> tuple[SamplerOutput, PromptLogprobs]:
        """The forward program `key` over host inputs; its sampled tokens and prompt log-probabilities
        (device arrays, still being computed)."""
        args = (inputs, sampling, prompt_targets)
        # the programs first: they load or compile while the device state may still be zeroed
        self.forward.get(key, self.abstract_state, *args)
        self._relay("run_forward", key, *args)
        self.state, outputs, prompt = self.forward(key, self.state, *args)
        return outputs, prompt

    def prefetch_decode(self, num_rows: int) -> None:
        """Builds the decode program for `num_rows` rows on a thread of its own unless one is ready."""
        self._relay("prefetch_decode", num_rows)
        self.grid.prefetch_decode(num_rows)

    def seed_history(self, seq: Sequence) -> None:
        """Clears `seq`'s state slot and counts its cached prefix tokens (penalised requests
        admitted with a prefix-cache hit: those tokens never pass through a step)."""
        n = seq.num_computed_tokens
        key = self.grid.history_key(n)
        tokens = np.full((1, key[1]), -1, np.int32)
        tokens[0, :n] = seq.tokens(0, n)
        self.run_seed(key, np.array([seq.row], np.int32), tokens, np.array([seq.num_prompt_tokens], np.int32))

    def run_seed(self, key: tuple, slot: np.ndarray, tokens: np.ndarray, num_prompt: np.ndarray) -> None:
        """The history-seeding program `key`: clears state slot `slot` and counts `tokens`."""
        self.seeder.get(key, self.abstract_state, slot, tokens, num_prompt)  # built before it is relayed
        self._relay("run_seed", key, slot, tokens, num_prompt)
        self.state = self.seeder(key, self.state, slot, tokens, num_prompt)

    def _relay(self, method: str, *args) -> None:
        """Process 0 of a multi-process group: the other processes make this call too."""
        if self.relay is not None:
            self.relay.publish(method, args)


def _background(fn: Callable[[], DeviceState]) -> Future:
    """fn() on a thread of its own. Not a daemon, even when started from one: the interpreter
    waits for it before it shuts the runtime down (a thread still inside the runtime then aborts
    the process)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised where the state is first used
            future.set_exception(exc)

    threading.Thread(target=run, name="zipage-state", daemon=False).start()
    return future
