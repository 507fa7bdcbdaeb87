"""EngineCore: requests in, token ids and finish reasons out; a step is schedule, run, update.

    core = EngineCore(model="default", kvcache_block_size=32, max_cache_blocks_per_seq=8)
    admitted = core.add_request("Hello", SamplingParams(max_tokens=16))
    while core.has_unfinished_requests():
        outputs = core.step()   # EngineCoreOutputs: (seq id, token id) pairs, finished sequences

`step` schedules (Scheduler.schedule), runs what it scheduled on the device and reads back the
tokens the host may read now (ModelRunner.execute), and applies them (Scheduler.update_from_output,
the one place a step's results change sequences). Text, stop strings and `RequestOutput`s are the
output stage's (engine/output_processor.py): `LLMEngine` runs it after each step in this process,
the server in its own process (engine/core_process.py).

A step that fails past its inputs (on the device, or while its results are read) costs the
requests in flight no more than a recompute: the engine rebuilds its device state and every
sequence computes its delivered tokens again (`_recover`). Only when the rebuild fails, or steps
keep failing, does the engine become unusable (`failed`) and raise EngineFailed.
"""

from __future__ import annotations

import logging
import time
from collections import ChainMap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from zipage_jax.config import EngineConfig
from zipage_jax.engine.admission import Admission, CoreRequest
from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.core_outputs import EngineCoreOutputs
from zipage_jax.engine.pool_plan import plan_pool
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.runner.model_runner import ModelRunner
from zipage_jax.engine.runner.results import CompactionFailed, RunnerOutput
from zipage_jax.engine.runner.warmup import Warmup
from zipage_jax.engine.running_batch import RunningBatch
from zipage_jax.engine.scheduler import Scheduler
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.models.loading import LoadedModel, load_model
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax")

MAX_RECOVERIES_IN_A_ROW = 3  # failed steps recovered with no step's tokens read in between
# failed compactions of one sequence recovered from: past it, its request fails (steps in between
# read tokens, so a compaction that fails every time would otherwise be retried forever)
MAX_FAILED_COMPACTIONS_PER_SEQUENCE = 3


class EngineFailed(RuntimeError):
    """The engine cannot serve any more: rebuilding its device state failed, or steps kept failing."""


@dataclass(frozen=True)
class AdmittedRequest:
    """A request the core queued: what the output stage needs to follow it."""

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_ids: list[int]  # its n sequences, by completion index


@dataclass(frozen=True)
class ModelInfo:
    """What a client of the core needs to know of its model, once (plain values: it crosses processes)."""

    max_model_len: int
    eos_token_ids: tuple[int, ...]
    special_ids: tuple[int, ...]
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    max_num_seqs: int


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **options):
        self.config = config = config or EngineConfig.from_options(**options)
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, revision=config.revision,
                                           download_dir=config.download_dir)
        mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.pool = pool = plan_pool(config, mc, self.loaded.model.dtype)
        self.block_manager = BlockManager(pool.num_blocks, pool.block_size, config.enable_prefix_caching)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids or ()) | ({tok_eos} if tok_eos is not None else set())))
        self.special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        # before the runner: a default budget smaller than the model's sliding window stops the start here
        prompt = PromptCompaction.of(pool.block_size, config.max_num_batched_tokens, config.prompt_window,
                                     config.row_size)  # one rule for admission's budgets and the scheduler
        self.admission = Admission(config, pool, prompt, self.tokenizer, mc.vocab_size, self.eos_token_ids,
                                   sliding_window=max(mc.layer_windows, default=0))
        self.runner = ModelRunner(self.loaded, config, pool, eos_token_ids=self.eos_token_ids)
        self.batch = RunningBatch(config.max_num_seqs, pool.max_blocks_per_seq, self.runner.inputs.suppress_width,
                                  self.eos_token_ids)
        self.runner.running = self.batch
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_query_slots=pool.num_query_slots, max_compress_seqs=config.max_compress_seqs,
                                   prompt=prompt, prefill_row_size=config.row_size, batch=self.batch)
        self.requests: dict[str, CoreRequest] = {}
        self._request_of: dict[int, CoreRequest] = {}  # by seq id, while the request is not finished
        self.stats = EngineStats(num_kv_blocks=pool.num_usable_blocks, num_query_slots=pool.num_query_slots)
        self._last_log = time.monotonic()
        self.last_step_host_seconds = 0.0  # host work of the latest step (step() less its wait for tokens)
        self.last_step_idle = False  # the latest step scheduled nothing and read nothing back
        self.recovering = False  # rebuilding the device state after a failed step
        self.on_health_change: Callable[[], None] | None = None  # called when `healthy` changes inside a step
        self.failed: BaseException | None = None  # why the engine became unusable
        self._failures_in_a_row = 0
        self._warmup: Warmup | None = None
        if config.warmup:
            self.warmup()

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(self.max_model_len, self.eos_token_ids, tuple(sorted(self.special_ids)),
                         self.loaded.config.vocab_size, self.pool.block_size, self.pool.num_usable_blocks,
                         self.config.enable_prefix_caching, self.config.max_num_seqs)

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
    def unhealthy_reason(self) -> str:
        """Why the engine cannot serve now (while `healthy` is False)."""
        if self.failed is not None:
            return f"the engine failed: {type(self.failed).__name__}: {self.failed}"
        return "the engine is rebuilding its device state after a failed step"

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence with a KV budget may reach, prompt included (full KV: also at most
        the pool's tokens, `pool.max_full_kv_len`)."""
        return self.pool.max_model_len

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> AdmittedRequest:
        """Queues a request; raises ValueError, naming the field, for anything this engine cannot
        run (engine/admission.py), before it joins any batch."""
        return self.add_requests([(prompt, params, request_id)])[0]

    def add_requests(self, requests: Sequence[tuple[str | list[int], SamplingParams | None, str | None]]
                     ) -> list[AdmittedRequest]:
        """Queues (prompt, params, request_id) each, all or none: every one is admitted before any
        is queued (ValueError naming the field, and the position when there are several)."""
        self._check_usable()
        admitted: dict[str, CoreRequest] = {}
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
                self._request_of[seq.seq_id] = request
                self.scheduler.add(seq)
        return [AdmittedRequest(r.request_id, r.prompt, r.prompt_token_ids, r.params, [s.seq_id for s in r.seqs])
                for r in admitted.values()]

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        self._forget(request)

    def finish_sequences(self, seq_ids: Sequence[int]) -> None:
        """The output stage matched a stop string in these sequences: they end where they are
        (tokens computed past it are dropped)."""
        for seq_id in seq_ids:
            request = self._request_of.get(seq_id)
            if request is None:
                continue
            seq = request.seqs[[s.seq_id for s in request.seqs].index(seq_id)]
            if not seq.is_finished:
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
            if request.finished:
                self._forget(request)

    def _forget(self, request: CoreRequest) -> None:
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._request_of.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        """Some request is waiting, running, or still has a token on its way to the host."""
        return bool(self.requests) or self.scheduler.has_unfinished() or self.runner.has_in_flight

    def set_output_lag(self, steps: int) -> None:
        """How many steps the output stage is behind: a sequence with stop strings decodes only while
        it keeps up (Scheduler.MAX_OUTPUT_LAG)."""
        self.scheduler.output_lag = steps

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """schedule -> run -> update. With asynchronous scheduling `run` reads back the tokens of
        the step before (the device computes this one meanwhile), else this step's own."""
        self._check_usable()
        start = time.perf_counter()
        try:
            scheduled = self.scheduler.schedule()
            output = self.runner.execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - a device or runtime failure: recompute, or give up
            self._recover(exc)
            scheduled, output, failure = None, RunnerOutput(), exc
        if scheduled is not None:
            outputs = self.scheduler.update_from_output(scheduled, output)
        elif isinstance(failure, CompactionFailed):
            outputs = self.scheduler.count_failed_compaction(failure, MAX_FAILED_COMPACTIONS_PER_SEQUENCE)
        else:
            outputs = EngineCoreOutputs()
        self.last_step_idle = scheduled is not None and scheduled.empty and not output.fetched
        self._account(output, outputs)
        self._end_step(start, output.wait_seconds)
        return outputs

    def _account(self, output: RunnerOutput, outputs: EngineCoreOutputs) -> None:
        s = self.stats
        if output.fetched:
            self._failures_in_a_row = 0
        for step in output.fetched:
            s.account(step.seconds, step.num_prefill, step.num_decode)
        s.device_wait_seconds += output.wait_seconds
        s.generation_tokens += len(outputs.seq_ids)
        s.kv_tokens_evicted += outputs.kv_tokens_evicted
        s.num_compressions += len(outputs.compressed)
        for request_id, message, error in outputs.failures:
            logger.error("request %s failed: %s", request_id, message,
                         exc_info=None if error is None else (type(error), error, error.__traceback__))
        for finished in outputs.finished:
            request = self._request_of.get(finished.seq_id)
            if request is not None and request.finished:
                self._forget(request)

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
        self.runner.drop_in_flight()
        self.scheduler.requeue_all()
        if self._failures_in_a_row > MAX_RECOVERIES_IN_A_ROW:
            self.failed = error
            raise EngineFailed(f"{self._failures_in_a_row} engine steps in a row failed") from error
        self._set_recovering(True)
        try:
            self.runner.reset_state()
        except Exception as exc:
            self.failed = exc
            raise EngineFailed("rebuilding the device state after a failed step failed") from exc
        finally:
            self._set_recovering(False)
        self.stats.num_recoveries += 1
        logger.warning("device state rebuilt; %d sequences compute their tokens again", len(self.scheduler.waiting))

    def _set_recovering(self, recovering: bool) -> None:
        self.recovering = recovering
        if self.on_health_change is not None:
            self.on_health_change()

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise EngineFailed(f"the engine failed and cannot serve: {type(self.failed).__name__}: "
                               f"{self.failed}") from self.failed

    def _end_step(self, start: float, waited: float) -> None:
        s = self.stats
        elapsed = time.perf_counter() - start
        s.num_compiles = self.runner.num_compiles
        s.num_steps += 1
        s.step_seconds += elapsed
        self.last_step_host_seconds = elapsed - waited
        now = time.monotonic()
        if now - self._last_log >= self.config.log_interval_s:
            self._last_log = now
            logger.info(self.log_line())

    # -- stats ----------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s, bm, sch = self.stats, self.block_manager, self.scheduler
        s.num_running, s.num_waiting = self.batch.num_running, len(sch.waiting)
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
