"""add_request / step / abort: the engine loop over scheduler and runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from pallas_kernels import kv_quant
from zipage_jax.compress.policies import num_recent
from zipage_jax.config import EngineConfig
from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.engine.runner import ModelRunner, PendingBatch, StepResult
from zipage_jax.engine.sampling_batch import SamplingRow
from zipage_jax.engine.scheduler import Chunk, Scheduler
from zipage_jax.engine.sequence import Sequence
from zipage_jax.engine.stop_checker import StopChecker
from zipage_jax.models.loading import LoadedModel, load_model
from zipage_jax.models.param_cache import default_cache_dir
from zipage_jax.sampling_params import SamplingParams, check_text

logger = logging.getLogger("zipage_jax")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    checkers: list[StopChecker]
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_compressions: int = 0
    kv_tokens_evicted: int = 0
    seqs_at_budget: int = 0
    query_slots_in_use: int = 0
    num_query_slots: int = 0
    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_compiles: int = 0  # programs compiled since the engine started (warm-up included)
    num_steps: int = 0
    step_seconds: float = 0.0  # wall time inside step()
    device_wait_seconds: float = 0.0  # of which waiting for the device's tokens (the rest is host work)


@dataclass
class _InFlight:
    """A dispatched step whose tokens the host has not read yet."""

    batches: list[PendingBatch]
    dispatched_at: float
    num_prefill: int
    num_decode: int


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype) -> int:
    """Bytes of one block of the pool, K and V of every layer, with the per-token scales of a
    quantized pool (one float32 per token per kv head, for K and for V)."""
    per_token = 2 * num_kv_heads * head_dim * np.dtype(kv_dtype).itemsize
    if kv_quant.is_quantized(kv_dtype):
        per_token += 2 * num_kv_heads * 4
    return num_layers * block_size * per_token


def check_platform_runs(kv_dtype) -> None:
    """ValueError when the device cannot hold this pool type (fp8 needs compute capability >= 8.9)."""
    if np.dtype(kv_dtype) != np.dtype(jnp.float8_e4m3fn) or jax.default_backend() != "gpu":
        return
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None and tuple(int(x) for x in str(capability).split(".")[:2]) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"this one is {capability}: use 'int8'")


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache, so a restart does not compile every bucket again."""
    if directory == "" or jax.config.jax_compilation_cache_dir:
        return
    if directory is None:
        directory = str(default_cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **options):
        self.config = config = config or EngineConfig.from_options(**options)
        enable_compilation_cache(config.compilation_cache_dir)
        self.loaded = loaded or load_model(config.model, dtype=config.dtype)
        mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        bs = config.kvcache_block_size
        kv_heads = -(-mc.num_kv_heads // config.tensor_parallel_size)  # per device (tensor parallelism)
        kv_dtype = kv_quant.kv_storage_dtype(config.kv_cache_dtype, self.loaded.model.dtype)
        check_platform_runs(kv_dtype)
        self.block_bytes = block_bytes = kv_block_bytes(mc.num_layers, bs, kv_heads, mc.head_dim, kv_dtype)
        num_blocks = config.num_kvcache_blocks or int(config.kvcache_memory_gb * 2**30 // block_bytes) + 1
        usable_tokens = (num_blocks - 1) * bs
        model_len = config.max_model_len or mc.max_position_embeddings
        if model_len > usable_tokens:
            logger.warning("max_model_len %d exceeds the KV pool (%d tokens); using %d", model_len, usable_tokens,
                           usable_tokens)
            model_len = usable_tokens
        config.max_model_len = min(model_len, mc.max_position_embeddings)
        m = config.max_cache_blocks_per_seq
        num_slots = config.max_num_seqs
        if m is not None and config.enable_hybrid_engine:
            num_slots = max(1, min(config.max_num_seqs, (num_blocks - 1) // (m + 1)))
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_query_slots=num_slots, max_compress_seqs=config.max_compress_seqs,
                                   prefill_row_size=config.row_size)
        eos = mc.eos_token_ids or ()
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(eos) | ({tok_eos} if tok_eos is not None else set())))
        self.special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self.runner = ModelRunner(self.loaded, config, num_blocks=num_blocks, num_query_slots=num_slots,
                                  eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_kv_blocks=num_blocks - 1, num_query_slots=num_slots)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._last_log = time.monotonic()
        self._in_flight: deque[_InFlight] = deque()
        self.last_step_host_seconds = 0.0  # host work of the latest step (step() less its wait for tokens)
        self._last_fetch = time.perf_counter()
        if config.warmup:
            self.warmup()

    def warmup(self, progress: bool = True) -> int:
        """Compiles every step shape the configuration can reach (persistent cache: a restart
        loads them). Returns the number of programs compiled now."""
        grid = self.runner.step_grid()
        before = self.runner.num_compiles
        start = time.perf_counter()
        for _, _, compile_step in tqdm(grid, desc="Compiling", unit="program", disable=not progress,
                                       dynamic_ncols=True):
            compile_step()
        compiled = self.runner.num_compiles - before
        self.stats.num_compiles = self.runner.num_compiles
        logger.info("warm-up: %d programs ready (%d compiled) in %.1f s", len(grid), compiled,
                    time.perf_counter() - start)
        return compiled

    # -- requests -----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; raises ValueError, naming the field, for anything this engine cannot run.

        Beyond SamplingParams' own bounds: token ids (prompt, stop_token_ids, forced_token_ids)
        must lie in the vocabulary, n at most max_num_seqs, the prompt under max_model_len, and
        kv_budget within the KV pool; top_k at or above the vocabulary size keeps every token, as
        top_k = 0 does (it is stored as 0). A request admitted here cannot overflow a step's inputs."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        token_ids, text = self._tokenize(prompt)
        params = self._admissible(params)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {limit} "
                             "(at least one token must be generated)")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        budget = self._budget_blocks(params)
        seqs, checkers = [], []
        for i in range(params.n):
            seq = Sequence(list(token_ids), self.config.kvcache_block_size, budget_blocks=budget, params=params,
                           request_id=request_id, index=i, parent=seqs[0] if seqs else None,
                           seed=self._seed(params, i), query_cache_len=self.config.query_cache_len,
                           max_len=min(len(token_ids) + params.max_tokens, limit))
            seq.metrics.arrival_time = time.monotonic()
            seqs.append(seq)
            checkers.append(StopChecker(self.tokenizer, params, self.eos_token_ids, token_ids, self.special_ids))
        request = Request(request_id, text, list(token_ids), params, seqs, checkers,
                          logprobs=[[] for _ in seqs], finish_reasons=[None] * len(seqs),
                          stop_reasons=[None] * len(seqs))
        self.requests[request_id] = request
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text("prompt", prompt)
            return list(self.tokenizer(prompt)["input_ids"]), prompt
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        self._check_vocab("prompt token ids", prompt)
        return [int(t) for t in prompt], None

    def _admissible(self, params: SamplingParams) -> SamplingParams:
        """params checked against this engine (see add_request), top_k >= vocabulary stored as 0."""
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.config.max_num_seqs} (the sequences this engine "
                             f"runs at once), got {params.n}")
        self._check_vocab("stop_token_ids", params.stop_token_ids)
        self._check_vocab("forced_token_ids", params.forced_token_ids)
        if params.top_k >= self.loaded.config.vocab_size:
            params = dataclasses.replace(params, top_k=0)
        return params

    def _check_vocab(self, name: str, token_ids) -> None:
        # ids the model has a row for and the tokenizer a token for (a model may pad its vocabulary)
        vocab = min(self.loaded.config.vocab_size, len(self.tokenizer))
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"{name} must be integers in [0, {vocab}), got {t!r}")

    def _budget_blocks(self, params: SamplingParams) -> int | None:
        bs = self.config.kvcache_block_size
        if params.kv_budget is None:
            m = self.config.max_cache_blocks_per_seq
        elif params.kv_budget == 0:
            return None
        else:
            m = -(-params.kv_budget // bs)
        if m is not None:
            policy = params.eviction_policy or self.config.eviction_policy
            options = self.config.policy_options(policy)
            protected = options.sinks + num_recent(options, m * bs, self.config.query_cache_len)
            if m * bs < protected:
                raise ValueError(f"kv_budget of {m * bs} tokens cannot hold the {protected} tokens policy "
                                 f"{policy!r} protects (sinks and recent window)")
            if m + 1 > self.block_manager.num_usable_blocks:
                raise ValueError(f"kv_budget of {m} blocks does not fit in the KV pool")
        return m

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return int(self._rng.integers(0, 2**31))
        return (params.seed * 1_000_003 + index) % 2**32

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
        """Schedules and dispatches one step, then hands back what the host learnt: with
        asynchronous scheduling the tokens of the step before (the device computes this one
        meanwhile), else this step's own."""
        start = time.perf_counter()
        wait_before = self.stats.device_wait_seconds
        out = self.scheduler.schedule()
        if out.compressions:
            self.runner.compress(out.compressions)
            self.stats.kv_tokens_evicted += self.scheduler.finish_compressions(out)
            self.stats.num_compressions += len(out.compressions)
        touched: dict[str, Request] = {}
        deltas: dict[int, tuple[str, list[int], list[TokenLogprob]]] = {}
        if out.chunks:
            self._dispatch(out.chunks, touched)
        keep = 1 if self.config.async_scheduling and out.chunks else 0
        while len(self._in_flight) > keep:
            self._resolve(self._in_flight.popleft(), touched, deltas)
        outputs = [self._output(r, deltas) for r in touched.values()]
        s = self.stats
        s.num_compiles = self.runner.num_compiles
        s.num_steps += 1
        s.step_seconds += time.perf_counter() - start
        self.last_step_host_seconds = time.perf_counter() - start - (s.device_wait_seconds - wait_before)
        self._maybe_log()
        return outputs

    def _dispatch(self, chunks: list[Chunk], touched: dict) -> None:
        rows, ready = [], []
        for chunk in chunks:
            try:
                rows.append(self._sampling_row(chunk))
                ready.append(chunk)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._fail(chunk.seq, exc, touched)
        batches, failures = self.runner.dispatch(ready, rows)
        failed = {id(f.chunk) for f in failures}
        for f in failures:
            self._fail(f.chunk.seq, f.error, touched)
        num_prefill = num_decode = 0
        for chunk in ready:
            if id(chunk) in failed or chunk.seq.is_finished:
                continue
            seq = chunk.seq
            self.scheduler.commit(chunk)
            seq.state_fresh = True
            if chunk.samples:
                seq.append_pending()
            if chunk.num_tokens == 1:
                num_decode += 1
            else:
                num_prefill += chunk.num_tokens
        self._in_flight.append(_InFlight(batches, time.perf_counter(), num_prefill, num_decode))

    def _sampling_row(self, chunk: Chunk) -> SamplingRow:
        seq = chunk.seq
        forced = seq.params.forced_token_ids
        step = seq.num_output_tokens
        reset = not seq.state_fresh
        if reset and seq.num_computed_tokens and _penalised(seq.params):
            self.runner.seed_history(seq)  # its cached prefix tokens never pass through a step
            reset = False
        return SamplingRow(params=seq.params, seed=seq.seed, step=step, suppress_ids=self._suppressed(seq),
                           forced_id=forced[step] if step < len(forced) else -1, slot=seq.state_slot,
                           num_prompt_tokens=seq.num_prompt_tokens, reset=reset, samples=chunk.samples)

    def _suppressed(self, seq: Sequence) -> tuple[int, ...]:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            return ()
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _resolve(self, step: _InFlight, touched: dict, deltas: dict) -> None:
        waiting = time.perf_counter()
        results = list(self.runner.fetch(step.batches))
        now = time.perf_counter()
        self.stats.device_wait_seconds += now - waiting
        self._account(now - max(step.dispatched_at, self._last_fetch), step.num_prefill, step.num_decode)
        self._last_fetch = now
        for res in results:
            self._commit(res, touched, deltas)

    def _commit(self, res: StepResult, touched: dict, deltas: dict) -> None:
        seq = res.chunk.seq
        if seq.is_finished:
            return  # finished or aborted since this step was dispatched: its token is dropped
        request = self.requests.get(seq.request_id)
        if request is None:
            return
        seq.resolve(res.token_id)
        self.block_manager.commit_full_blocks(seq)  # blocks whose tokens are all known now
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        self.stats.generation_tokens += 1
        logprob = None
        if seq.params.logprobs is not None:
            top = [(int(t), float(lp)) for t, lp in zip(res.top_ids, res.top_logprobs)][: seq.params.logprobs]
            logprob = TokenLogprob(res.token_id, res.logprob, top)
            request.logprobs[seq.index].append(logprob)
        checker = request.checkers[seq.index]
        delta, reason = checker.append(res.token_id)
        if reason is None and seq.num_known_tokens >= self.config.max_model_len:
            reason = "length"
        text, ids, lps = deltas.setdefault(seq.seq_id, ("", [], []))
        ids.append(res.token_id)
        if logprob is not None:
            lps.append(logprob)
        deltas[seq.seq_id] = (text + delta, ids, lps)
        if reason is not None:
            request.finish_reasons[seq.index] = reason
            request.stop_reasons[seq.index] = checker.stop_reason
            self._finish_seq(seq)
        touched[request.request_id] = request

    def _finish_seq(self, seq: Sequence) -> None:
        seq.metrics.finish_time = time.monotonic()
        seq.drop_pending()
        self.scheduler.finish(seq)

    def _fail(self, seq: Sequence, error: Exception, touched: dict) -> None:
        """A failure that belongs to one request: all its sequences finish with "error"."""
        request = self.requests.get(seq.request_id)
        logger.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                     exc_info=(type(error), error, error.__traceback__))
        if request is None:
            return
        request.error = f"{type(error).__name__}: {error}"
        for s in request.seqs:
            if request.finish_reasons[s.index] is None:
                request.finish_reasons[s.index] = "error"
                self._finish_seq(s)
        touched[request.request_id] = request

    def _output(self, request: Request, deltas: dict) -> RequestOutput:
        finished = request.finished
        wants_logprobs = request.params.logprobs is not None
        outputs = []
        for seq, checker in zip(request.seqs, request.checkers):
            text, ids, lps = deltas.get(seq.seq_id, ("", [], []))
            done = finished  # the cumulative fields cost O(length): only in the request's final output
            outputs.append(CompletionOutput(
                index=seq.index, text=checker.text if done else "",
                token_ids=seq.token_ids[seq.num_prompt_tokens:] if done else [],
                finish_reason=request.finish_reasons[seq.index], stop_reason=request.stop_reasons[seq.index],
                delta_text=text, delta_token_ids=ids,
                logprobs=request.logprobs[seq.index] if wants_logprobs and done else None,
                delta_logprobs=lps if wants_logprobs else None,
                metrics=self._seq_metrics(seq)))
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             error=request.error)

    @staticmethod
    def _seq_metrics(seq: Sequence) -> dict:
        m = seq.metrics
        end = m.finish_time or time.monotonic()
        return {
            "prompt_tokens": seq.num_prompt_tokens,
            "completion_tokens": seq.num_known_tokens - seq.num_prompt_tokens,
            "cached_prompt_tokens": m.num_cached_prompt_tokens,
            "ttft_s": None if m.first_token_time is None else m.first_token_time - m.arrival_time,
            "latency_s": end - m.arrival_time,
            "num_preemptions": m.num_preemptions,
            "num_compressions": m.num_compressions,
            "kv_blocks_peak": m.kv_blocks_peak,
            "kv_tokens_evicted": m.kv_tokens_evicted,
        }

    # -- stats ----------------------------------------------------------------------------

    def _account(self, elapsed: float, num_prefill: int, num_decode: int) -> None:
        s = self.stats
        s.prompt_tokens += num_prefill
        if num_prefill:
            s.prefill_seconds += elapsed
            s.prefill_tokens += num_prefill
        else:
            s.decode_seconds += elapsed
            s.decode_tokens += num_decode

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
        return s

    def log_line(self) -> str:
        s = self.get_stats()
        return (f"running {s.num_running}, waiting {s.num_waiting}, KV usage {100 * s.kv_usage:.1f}%, "
                f"prefix-cache hit rate {100 * s.prefix_cache_hit_rate:.1f}%, compressions {s.num_compressions}, "
                f"evicted tokens {s.kv_tokens_evicted}, at budget {s.seqs_at_budget}, "
                f"query slots {s.query_slots_in_use}/{s.num_query_slots}, preemptions {s.num_preemptions}")

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.config.log_interval_s:
            self._last_log = now
            logger.info(self.log_line())


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
