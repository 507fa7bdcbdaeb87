"""Admission: a request is validated against this engine and resolved, once, before it joins a batch.

Everything a request can get wrong raises ValueError naming the field, here, so a request
admitted cannot overflow a step's inputs or harm another one. Its eviction policy, the
policy's options and its token budget are resolved into a `KVBudget` carried by its
sequences: the scheduler and the runner only read it.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from zipage_jax.compress import auto_budget
from zipage_jax.compress.policies import (
    POLICIES,
    KVBudget,
    Policy,
    PolicyOptions,
    Score,
    keep_prompt_on_top,
    resolve_budget,
)
from zipage_jax.config import EngineConfig
from zipage_jax.engine.grammar import GrammarCompiler
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.engine.sequence import Sequence
from zipage_jax.sampling_params import SamplingParams, check_text


def check_prompt_length(prompt_len: int, limit: int, *, at_least: bool = False, full_kv: bool = False) -> int:
    """The tokens a prompt of `prompt_len` tokens (`at_least`: of that many or more) leaves to
    generate within the context `limit`; ValueError naming the prompt when it leaves none.
    `full_kv`: the limit is the KV pool's tokens (a full-KV request's), not max_model_len."""
    if prompt_len >= limit:
        whose = "a full-KV request's" if full_kv else "this model's"
        pool = ", the KV pool's tokens" if full_kv else ""
        raise ValueError(f"prompt has {'at least ' if at_least else ''}{prompt_len} tokens but {whose} maximum "
                         f"context length is {limit} tokens{pool} (at least one token must be generated)")
    return limit - prompt_len


@dataclass
class CoreRequest:
    """One request as the engine core holds it while it runs: its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Admission:
    def __init__(self, config: EngineConfig, pool: KVPoolPlan, prompt: PromptCompaction, tokenizer, vocab_size: int,
                 eos_token_ids: tuple[int, ...], sliding_window: int = 0):
        """prompt: the rule of compaction inside a prompt, the scheduler's (a budget's peak blocks);
        sliding_window: the model's largest sliding window in tokens (0: none). Every budget must
        hold it, the engine's default budgets included (ValueError here, when the engine starts)."""
        self.config, self.pool, self.tokenizer = config, pool, tokenizer
        self.sliding_window = sliding_window
        if config.max_cache_blocks_per_seq is not None:
            blocks = config.max_cache_blocks_per_seq
            self._check_window(f"max_cache_blocks_per_seq {blocks} ({blocks * pool.block_size} tokens)",
                               blocks * pool.block_size)
        if config.auto_budget:
            self._check_window(f"auto_budget_max {config.auto_budget_max}", config.auto_budget_max)
        self.vocab = min(vocab_size, len(tokenizer))  # ids the model has a row for and the tokenizer a token for
        self.model_vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.prompt = prompt
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()

    def admit(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
              in_use: Container[str]) -> CoreRequest:
        """The request, ready to schedule; ValueError for anything this engine cannot run.

        Beyond SamplingParams' own bounds: token ids (prompt, stop_token_ids, forced_token_ids)
        must lie in the vocabulary, n at most max_num_seqs, the prompt under max_model_len, and
        kv_budget within the KV pool, structured_outputs must compile (one matcher per sequence);
        top_k at or above the vocabulary size keeps every token, as top_k = 0 does (it is stored as 0)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        token_ids, text = self._tokenize(prompt)
        params = self._admissible(params)
        budget = self.budget(params, len(token_ids))
        limit = self.pool.max_model_len if budget is not None else self.pool.max_full_kv_len
        check_prompt_length(len(token_ids), limit, full_kv=limit != self.pool.max_model_len)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        spec = params.structured_outputs
        grammars = [None] * params.n if spec is None else self.grammars.compile(spec, params.n)
        seqs: list[Sequence] = []
        for i, grammar in enumerate(grammars):
            seq = Sequence(list(token_ids), self.pool.block_size, budget=budget, params=params, grammar=grammar,
                           request_id=request_id, index=i, parent=seqs[0] if seqs else None,
                           seed=self._seed(params, i), query_cache_len=self.config.query_cache_len,
                           max_len=min(len(token_ids) + params.max_tokens, limit),
                           computes_prompt_logprobs=params.prompt_logprobs is not None and not seqs)
            seqs.append(seq)
        return CoreRequest(request_id, text, list(token_ids), params, seqs)

    def budget(self, params: SamplingParams, prompt_len: int = 1) -> KVBudget | None:
        """The request's compression plan: its policy (the request's or the engine's), that
        policy's options with the engine's sink_len / recent_fraction / prompt_fraction, and its
        budget in blocks (kv_budget tokens rounded up, or max_cache_blocks_per_seq; with
        keep_prompt, the prompt's tokens on top, all in the prompt reserve); None = full KV. The pool
        must hold the budget and the next block, and with a longer prompt its peak
        (`PromptCompaction.peak_blocks`: the budget and one prefill chunk, or the whole prompt
        when deferred)."""
        config, bs = self.config, self.pool.block_size
        if params.kv_budget == 0:
            return None
        policy = POLICIES[params.eviction_policy or config.eviction_policy]
        options = policy.options(config.sink_len, config.recent_fraction, config.prompt_fraction)
        keep = bool(params.keep_prompt)  # the prompt kept whole beside the budget
        if params.kv_budget == "auto" or (params.kv_budget is None and config.auto_budget):
            keep = config.auto_budget_keeps_prompt if params.keep_prompt is None else keep
            on_top = prompt_len if keep else 0
            budget = self._auto_budget(params, policy, options, prompt_len, on_top)
        else:
            blocks = config.max_cache_blocks_per_seq if params.kv_budget is None else -(-params.kv_budget // bs)
            if blocks is None:
                return None
            self._check_window(f"kv_budget {params.kv_budget}", blocks * bs)
            budget = resolve_budget(policy, options, blocks, bs, config.query_cache_len)
            if keep:
                budget = keep_prompt_on_top(budget, prompt_len, bs)
        blocks = budget.blocks
        deferred = (params.prompt_compression or config.prompt_compression) == "deferred"
        budget = dataclasses.replace(budget, deferred=deferred)
        peak = self.prompt.peak_blocks(blocks, prompt_len, deferred)
        if blocks + 1 > self.pool.num_usable_blocks:
            raise ValueError(f"kv_budget of {blocks} blocks does not fit in the KV pool")
        if peak > self.pool.num_usable_blocks:
            how = ("the whole prompt (prompt_compression deferred)" if deferred else
                   f"the budget and one prefill chunk of max_num_batched_tokens={config.max_num_batched_tokens}")
            raise ValueError(f"a prompt of {prompt_len} tokens with a kv_budget of {blocks} blocks needs {peak} "
                             f"blocks at its peak ({how}); the KV pool has {self.pool.num_usable_blocks}")
        return budget

    def _auto_budget(self, params: SamplingParams, policy: Policy, options: PolicyOptions,
                     prompt_len: int, on_top: int) -> KVBudget:
        """An automatic budget (compress/auto_budget.py): bounds from the engine's auto_budget_min
        and auto_budget_max (or the request's kv_budget_max, within the pool), starting at the
        prompt's blocks within them. With `on_top` (keep_prompt, auto_budget_keeps_prompt) the
        bounds are of what it keeps beside the prompt, which it keeps whole, and it starts at its
        floor."""
        config, bs, ql = self.config, self.pool.block_size, self.config.query_cache_len
        prompt_blocks = -(-on_top // bs)
        if policy.score in (Score.POSITION, Score.FUTURE):
            raise ValueError(f"kv_budget=\"auto\" measures the attention a compaction would evict; policy "
                             f"{policy.name!r} does not rank tokens by their observed attention")
        ceiling = params.kv_budget_max or config.auto_budget_max
        if ceiling < config.auto_budget_min:
            raise ValueError(f"kv_budget_max={ceiling} is below this engine's auto_budget_min={config.auto_budget_min}")
        self._check_window(f"{'kv_budget_max' if params.kv_budget_max else 'auto_budget_max'} {ceiling}", ceiling)
        ceiling = min(ceiling, (self.pool.num_usable_blocks - 1 - prompt_blocks) * bs)
        if on_top and ceiling < bs:
            raise ValueError(f"a prompt of {prompt_len} tokens kept whole (keep_prompt) leaves no block of the "
                             f"KV pool for its automatic budget")
        if ceiling < self.sliding_window:
            raise ValueError(f"the model's sliding window {self.sliding_window} does not fit in the KV pool "
                             f"({ceiling} tokens per sequence)")

        def holds_protected(blocks: int) -> bool:
            try:
                resolve_budget(policy, options, blocks, bs, ql)
            except ValueError:
                return False
            return True

        # the floor is raised to the sliding window (a ceiling below it was refused above)
        floor = max(config.auto_budget_min, self.sliding_window)
        auto = auto_budget.bounds(min(floor, ceiling), ceiling, config.auto_budget_min,
                                  config.auto_budget_threshold, bs, holds_protected)
        blocks = auto.floor if on_top else min(auto.ceiling, max(auto.floor, -(-prompt_len // bs)))
        budget = resolve_budget(policy, options, blocks, bs, ql)
        if on_top:
            budget = keep_prompt_on_top(budget, on_top, bs)
            auto = dataclasses.replace(auto, floor=auto.floor + prompt_blocks, ceiling=auto.ceiling + prompt_blocks)
        return dataclasses.replace(budget, auto=auto, options=options)

    def _check_window(self, budget: str, tokens: int) -> None:
        """ValueError naming `budget` when its `tokens` cannot hold the model's sliding window: a
        sliding layer keeps a sequence's most recent budget tokens (compress/step.py) and reads its
        last window of them."""
        if tokens < self.sliding_window:
            raise ValueError(f"{budget} is smaller than the model's sliding window {self.sliding_window}")

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
        """params checked against this engine, top_k >= vocabulary stored as 0."""
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.config.max_num_seqs} (the sequences this engine "
                             f"runs at once), got {params.n}")
        self._check_vocab("stop_token_ids", params.stop_token_ids)
        self._check_vocab("forced_token_ids", params.forced_token_ids)
        if params.top_k >= self.model_vocab_size:
            params = dataclasses.replace(params, top_k=0)
        return params

    def _check_vocab(self, name: str, token_ids) -> None:
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab:
                raise ValueError(f"{name} must be integers in [0, {self.vocab}), got {t!r}")

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return int(self._rng.integers(0, 2**31))
        return (params.seed * 1_000_003 + index) % 2**32
