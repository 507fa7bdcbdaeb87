"""add_request / step / abort: the engine loop over scheduler and runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import jax
import numpy as np

from zipage_jax.config import EngineConfig
from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.engine.runner import ModelRunner, StepResult
from zipage_jax.engine.scheduler import Scheduler
from zipage_jax.engine.sequence import Sequence
from zipage_jax.engine.stop_checker import StopChecker
from zipage_jax.layers.sampler import SamplingRow
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
        itemsize = np.dtype(self.loaded.model.dtype).itemsize
        kv_heads = -(-mc.num_kv_heads // config.tensor_parallel_size)  # per device (tensor parallelism)
        block_bytes = 2 * mc.num_layers * bs * kv_heads * mc.head_dim * itemsize
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
                                   num_query_slots=num_slots, max_compress_seqs=config.max_compress_seqs)
        self.runner = ModelRunner(self.loaded, config, num_blocks=num_blocks, num_query_slots=num_slots)
        eos = mc.eos_token_ids or ()
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(eos) | ({tok_eos} if tok_eos is not None else set())))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_kv_blocks=num_blocks - 1, num_query_slots=num_slots)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._last_log = time.monotonic()

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
                           seed=self._seed(params, i), query_cache_len=self.config.query_cache_len)
            seq.metrics.arrival_time = time.monotonic()
            seqs.append(seq)
            checkers.append(StopChecker(self.tokenizer, params, self.eos_token_ids, token_ids))
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
            protected = self.config.query_cache_len + self.config.sink_len
            if m * bs < protected:
                raise ValueError(f"kv_budget of {m * bs} tokens cannot hold the {protected} protected tokens "
                                 "(query_cache_len + sink_len)")
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
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.compressions:
            self.runner.compress(out.compressions)
            self.stats.kv_tokens_evicted += self.scheduler.finish_compressions(out)
            self.stats.num_compressions += len(out.compressions)
        touched: dict[str, Request] = {}
        deltas: dict[int, tuple[str, list[int]]] = {}
        if out.chunks:
            start = time.perf_counter()
            rows = [self._sampling_row(c.seq) for c in out.chunks]
            results = self.runner.run(out.chunks, rows)
            elapsed = time.perf_counter() - start
            num_decode = sum(1 for c in out.chunks if c.num_tokens == 1)
            num_prefill = sum(c.num_tokens for c in out.chunks) - num_decode
            self._account(elapsed, num_prefill, num_decode)
            for res in results:
                self._commit(res, touched, deltas)
        self._maybe_log()
        return [self._output(r, deltas) for r in touched.values()]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        forced = seq.params.forced_token_ids
        step = seq.num_output_tokens
        return SamplingRow(params=seq.params, seed=seq.seed, step=step,
                           token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                           suppress_ids=self._suppressed(seq), forced_id=forced[step] if step < len(forced) else -1)

    def _suppressed(self, seq: Sequence) -> tuple[int, ...]:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            return ()
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _commit(self, res: StepResult, touched: dict, deltas: dict) -> None:
        chunk, seq = res.chunk, res.chunk.seq
        self.scheduler.commit(chunk)
        if not chunk.samples or seq.is_finished:
            return
        request = self.requests.get(seq.request_id)
        if request is None:
            return
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.token_ids.append(res.token_id)
        self.stats.generation_tokens += 1
        if seq.params.logprobs is not None:
            top = [(int(t), float(lp)) for t, lp in zip(res.top_ids, res.top_logprobs)][: seq.params.logprobs]
            request.logprobs[seq.index].append(TokenLogprob(res.token_id, res.logprob, top))
        checker = request.checkers[seq.index]
        delta, reason = checker.append(res.token_id)
        if reason is None and len(seq) >= self.config.max_model_len:
            reason = "length"
        prev_text, prev_ids = deltas.get(seq.seq_id, ("", []))
        deltas[seq.seq_id] = (prev_text + delta, prev_ids + [res.token_id])
        if reason is not None:
            request.finish_reasons[seq.index] = reason
            request.stop_reasons[seq.index] = checker.stop_reason
            seq.metrics.finish_time = now
            self.scheduler.finish(seq)
        touched[request.request_id] = request

    def _output(self, request: Request, deltas: dict) -> RequestOutput:
        outputs = []
        for seq, checker in zip(request.seqs, request.checkers):
            text, ids = deltas.get(seq.seq_id, ("", []))
            outputs.append(CompletionOutput(
                index=seq.index, text=checker.text, token_ids=list(seq.output_token_ids),
                finish_reason=request.finish_reasons[seq.index], stop_reason=request.stop_reasons[seq.index],
                delta_text=text, delta_token_ids=ids,
                logprobs=request.logprobs[seq.index] if request.params.logprobs is not None else None,
                metrics=self._seq_metrics(seq)))
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished)

    @staticmethod
    def _seq_metrics(seq: Sequence) -> dict:
        m = seq.metrics
        end = m.finish_time or time.monotonic()
        return {
            "prompt_tokens": seq.num_prompt_tokens,
            "completion_tokens": seq.num_output_tokens,
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
