"""add_request / step / abort: the engine loop over scheduler, runner and postprocessing.

A step schedules, runs (the runner dispatches it and fetches what the host may read now), hands
what it read to the scheduler (`Scheduler.update_from_output`, the one place a step's output
changes sequences) and turns what that changed into outputs; requests that finished are forgotten.

A step that fails past its inputs (on the device, or while its results are read) costs the
requests in flight no more than a recompute: the engine rebuilds its device state and every
sequence computes its delivered tokens again (`_recover`). Only when the rebuild fails, or steps
keep failing, does the engine become unusable (`failed`) and raise EngineFailed.
"""

from __future__ import annotations

import logging
import time
from collections import ChainMap, deque
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from zipage_jax.config import EngineConfig
from zipage_jax.engine.admission import Admission
from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.pool_plan import plan_pool
from zipage_jax.engine.postprocess import StepOutputs
from zipage_jax.engine.request import Request
from zipage_jax.engine.runner.model_runner import ModelRunner
from zipage_jax.engine.runner.results import PendingBatch, PromptLogprobsResult, RowFailure, RunnerOutput, StepResult
from zipage_jax.engine.runner.warmup import Warmup, WarmupStatus
from zipage_jax.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
from zipage_jax.engine.stats import EngineStats
from zipage_jax.models.loading import LoadedModel, load_model
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax")

MAX_RECOVERIES_IN_A_ROW = 3  # failed steps recovered with no step's tokens read in between


class EngineFailed(RuntimeError):
    """The engine cannot serve any more: rebuilding its device state failed, or steps kept failing."""


@dataclass
class _InFlight:
    """A dispatched step whose tokens the host has not read yet."""

    batches: list[PendingBatch]
    dispatched_at: float
    num_prefill: int
    num_decode: int
    constrained: bool  # some token it samples is a structured output's: the next mask needs it


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **options):
        self.config = config = config or EngineConfig.from_options(**options)
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, revision=config.revision,
                                           download_dir=config.download_dir)
        mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.pool = pool = plan_pool(config, mc, self.loaded.model.dtype)
        self.block_manager = BlockManager(pool.num_blocks, pool.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_query_slots=pool.num_query_slots, max_compress_seqs=config.max_compress_seqs,
                                   prefill_row_size=config.row_size, prompt_window=config.prompt_window)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids or ()) | ({tok_eos} if tok_eos is not None else set())))
        special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self.admission = Admission(config, pool, self.tokenizer, mc.vocab_size, self.eos_token_ids, special_ids)
        self.runner = ModelRunner(self.loaded, config, pool, eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_kv_blocks=pool.num_usable_blocks, num_query_slots=pool.num_query_slots)
        self._last_log = time.monotonic()
        self._in_flight: deque[_InFlight] = deque()
        self.last_step_host_seconds = 0.0  # host work of the latest step (step() less its wait for tokens)
        self._last_fetch = time.perf_counter()
        self.recovering = False  # rebuilding the device state after a failed step
        self.failed: BaseException | None = None  # why the engine became unusable
        self._failures_in_a_row = 0
        self._warmup: Warmup | None = None
        if config.warmup:
            self.warmup()

    def warmup(self, progress: bool = True) -> int:
        """Builds every step shape the configuration can reach, on parallel threads, and returns
        the number of programs built now (compiled, or loaded from the executable store)."""
        before = self.runner.num_compiles
        self._warmup = Warmup(self.runner.step_grid())
        with tqdm(total=len(self._warmup.grid), desc="Compiling", unit="program", disable=not progress,
                  dynamic_ncols=True) as bar:
            self._warmup.run(bar.update)
        built = self.runner.num_compiles - before
        self.stats.num_compiles = self.runner.num_compiles
        logger.info("warm-up: %d programs ready (%d built) in %.1f s", len(self._warmup.grid), built,
                    self._warmup.status.seconds)
        return built

    def start_warmup(self) -> Warmup:
        """Builds the grid in the background, the serving set first (`warmup_status`): steps run
        meanwhile, padded up to the nearest ready bucket, or compiling the one they need. Past
        the serving set it starts no program while requests run (warmup.MAX_YIELD_S at most)."""
        # `requests` holds every request not yet finished; reading its size is safe from a worker thread
        self._warmup = Warmup(self.runner.step_grid(), busy=lambda: bool(self.requests)).start()
        return self._warmup

    @property
    def warmup_status(self) -> WarmupStatus | None:
        """The latest warm-up's progress; None when none was started."""
        return None if self._warmup is None else self._warmup.status

    @property
    def healthy(self) -> bool:
        """The engine can serve now: not rebuilding its device state, and not failed."""
        return not self.recovering and self.failed is None

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence with a KV budget may reach, prompt included (full KV: also at most
        the pool's tokens, `pool.max_full_kv_len`)."""
        return self.pool.max_model_len

    # -- requests -----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; raises ValueError, naming the field, for anything this engine cannot
        run (engine/admission.py), before it joins any batch."""
        return self.add_requests([(prompt, params, request_id)])[0]

    def add_requests(self, requests: Sequence[tuple[str | list[int], SamplingParams | None, str | None]]
                     ) -> list[str]:
        """Queues (prompt, params, request_id) each, all or none: every one is admitted before any
        is queued (ValueError naming the field, and the position when there are several)."""
        self._check_usable()
        admitted: dict[str, Request] = {}
        in_use = ChainMap(self.requests, admitted)
        for i, (prompt, params, request_id) in enumerate(requests):
            try:
                request = self.admission.admit(prompt, params, request_id, in_use)
            except ValueError as exc:
                if len(requests) == 1:
                    raise
                raise ValueError(f"prompt {i}: {exc}") from exc
            admitted[request.request_id] = request
        for request in admitted.values():
            self.requests[request.request_id] = request
            for seq in request.seqs:
                self.scheduler.add(seq)
        return list(admitted)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.drop_pending()
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        """Some request is waiting, running, or still has a token on its way to the host."""
        return self.scheduler.has_unfinished() or any(
            not chunk.seq.is_finished for step in self._in_flight for batch in step.batches for chunk in batch.chunks)

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update -> postprocess. With asynchronous scheduling `run` hands back
        the tokens of the step before (the device computes this one meanwhile), else this step's
        own; while a structured output's token is in flight, that step is read before scheduling."""
        self._check_usable()
        start, wait_before = time.perf_counter(), self.stats.device_wait_seconds
        updates: list[StepUpdate] = []
        try:
            self._resolve_constrained(updates)
            output = self._run(self.scheduler.schedule())
        except Exception as exc:  # noqa: BLE001 - a device or runtime failure: recompute, or give up
            self._recover(exc)
            output = RunnerOutput()  # what `updates` holds was delivered before the failure
        updates.append(self.scheduler.update_from_output(output))
        outputs = self._postprocess(updates)
        self._end_step(start, wait_before)
        return outputs

    def _resolve_constrained(self, updates: list[StepUpdate]) -> None:
        """A constrained sequence's next mask follows from its last token: when a step in flight
        sampled one, every step in flight is read and applied first (no overlap then)."""
        if any(step.constrained for step in self._in_flight):
            while self._in_flight:
                results = self._fetch(self._in_flight.popleft())
                updates.append(self.scheduler.update_from_output(RunnerOutput(results)))

    def _run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Compaction, then this step's forward dispatched, then the tokens of the steps the
        host may read now."""
        if scheduled.compressions:
            try:
                self.runner.compress(scheduled.compressions)
            except Exception:
                self.scheduler.abort_compressions(scheduled)
                raise
            self.stats.kv_tokens_evicted += self.scheduler.finish_compressions(scheduled)
            self.stats.num_compressions += len(scheduled.compressions)
        failures: list[RowFailure] = []
        if scheduled.chunks:
            batches, failures = self.runner.dispatch(scheduled.chunks)
            for chunk in scheduled.chunks:
                self.scheduler.release_tail(chunk)
            failed = {f.chunk.seq.request_id for f in failures}  # the whole request fails
            dispatched = [c for c in scheduled.chunks if c.seq.request_id not in failed]
            for chunk in dispatched:
                self.scheduler.commit(chunk)
            num_decode = sum(1 for c in dispatched if c.num_tokens == 1)
            num_prefill = sum(c.num_tokens for c in dispatched if c.num_tokens > 1)
            constrained = any(c.seq.grammar is not None for batch in batches for c in batch.chunks)
            self._in_flight.append(_InFlight(batches, time.perf_counter(), num_prefill, num_decode, constrained))
        keep = 1 if self.config.async_scheduling and scheduled.chunks else 0
        results = []
        while len(self._in_flight) > keep:
            results += self._fetch(self._in_flight.popleft())
        return RunnerOutput(results, failures)

    def _fetch(self, step: _InFlight) -> list[StepResult | PromptLogprobsResult]:
        waiting = time.perf_counter()
        results = list(self.runner.fetch(step.batches))
        self._failures_in_a_row = 0
        now = time.perf_counter()
        self.stats.device_wait_seconds += now - waiting
        self.stats.account(now - max(step.dispatched_at, self._last_fetch), step.num_prefill, step.num_decode)
        self._last_fetch = now
        return results

    def _recover(self, error: Exception) -> None:
        """A step failed past its inputs (inside a compiled call, after it consumed the donated
        state, or while its results were read): the steps in flight are dropped, every block is
        freed and the prefix cache cleared (their KV is gone), every sequence is queued again
        to compute its delivered tokens (Scheduler.requeue_all), and the runner builds a fresh
        device state. EngineFailed, the engine unusable from then on, if that fails or steps
        keep failing with no tokens read in between."""
        self._failures_in_a_row += 1
        logger.error("engine step failed: %s: %s; rebuilding the device state", type(error).__name__, error,
                     exc_info=(type(error), error, error.__traceback__))
        self._in_flight.clear()
        self.scheduler.requeue_all()
        if self._failures_in_a_row > MAX_RECOVERIES_IN_A_ROW:
            self.failed = error
            raise EngineFailed(f"{self._failures_in_a_row} engine steps in a row failed") from error
        self.recovering = True
        try:
            self.runner.reset_state()
        except Exception as exc:
            self.failed = exc
            raise EngineFailed("rebuilding the device state after a failed step failed") from exc
        finally:
            self.recovering = False
        self.stats.num_recoveries += 1
        logger.warning("device state rebuilt; %d sequences compute their tokens again", len(self.scheduler.waiting))

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise EngineFailed(f"the engine failed and cannot serve: {type(self.failed).__name__}: "
                               f"{self.failed}") from self.failed

    def _postprocess(self, updates: list[StepUpdate]) -> list[RequestOutput]:
        """The step's outputs; then the requests it finished are forgotten."""
        collected = StepOutputs(self.requests)
        for update in updates:
            collected.add(update)
        self.stats.generation_tokens += collected.num_tokens
        outputs = collected.outputs()
        for update in updates:
            for seq in update.finished:
                request = self.requests.get(seq.request_id)
                if request is not None and request.finished:
                    del self.requests[seq.request_id]
        return outputs

    def _end_step(self, start: float, wait_before: float) -> None:
        s = self.stats
        elapsed = time.perf_counter() - start
        s.num_compiles = self.runner.num_compiles
        s.num_steps += 1
        s.step_seconds += elapsed
        self.last_step_host_seconds = elapsed - (s.device_wait_seconds - wait_before)
        now = time.monotonic()
        if now - self._last_log >= self.config.log_interval_s:
            self._last_log = now
            logger.info(self.log_line())

    # -- stats ----------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s, bm, sch = self.stats, self.block_manager, self.scheduler
        s.num_running, s.num_waiting = len(sch.running), len(sch.waiting)
        s.kv_usage = bm.usage()
        s.prefix_cache_queries, s.prefix_cache_hits = bm.prefix_queries, bm.prefix_hits
        s.prefix_cache_hit_rate = bm.prefix_hit_rate()
        s.num_preemptions = sch.num_preemptions
        s.seqs_at_budget = sch.num_at_budget()
        s.query_slots_in_use = sch.query_slots.in_use
        s.num_free_blocks = bm.num_free_blocks
        s.num_compiles = self.runner.num_compiles
        s.num_programs_loaded = sum(r.origin == "loaded" for r in self.runner.records)
        s.compile_seconds = self.runner.compile_seconds
        return s

    def log_line(self) -> str:
        return self.get_stats().log_line()
