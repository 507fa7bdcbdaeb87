"""Admission resolves a request's policy, options and budget once (engine/admission.py)."""

import numpy as np
import pytest
from tiny_models import build_tokenizer

from zipage_jax.compress.policies import POLICIES, Score
from zipage_jax.config import EngineConfig
from zipage_jax.engine.admission import Admission
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.sampling_params import SamplingParams

BS, QL = 16, 8


VOCAB = 300
TOKENIZER = build_tokenizer(VOCAB)


def _admission(num_blocks: int = 64, **options) -> Admission:
    config = EngineConfig.from_options(kvcache_block_size=BS, query_cache_len=QL, compilation_cache_dir="",
                                       **options)
    pool = KVPoolPlan(BS, np.dtype(np.float32), 2, 1024, num_blocks, 4, 4096, (num_blocks - 1) * BS)
    prompt = PromptCompaction.of(BS, config.max_num_batched_tokens, config.prompt_window, config.row_size)
    return Admission(config, pool, prompt, TOKENIZER, VOCAB, (TOKENIZER.eos_token_id,))


def test_engine_policy_options_and_budget_reach_the_sequences():
    admission = _admission(max_cache_blocks_per_seq=4, eviction_policy="vnorm-window", recent_fraction=0.25,
                           sink_len=2)
    request = admission.admit("hello", SamplingParams(n=2), None, ())
    budget = request.seqs[0].budget
    assert all(seq.budget is budget for seq in request.seqs)  # resolved once for the request
    assert (budget.policy.name, budget.blocks, budget.tokens) == ("vnorm-window", 4, 64)
    assert (budget.sinks, budget.recent) == (2, 16)  # 0.25 of 64 tokens, more than the query tail
    assert budget.policy.score == Score.VALUE_NORM


def test_request_policy_overrides_the_engine_and_keeps_its_own_rules():
    admission = _admission(max_cache_blocks_per_seq=4, recent_fraction=0.25, sink_len=2)
    zipage = admission.budget(SamplingParams(eviction_policy="zipage"))
    assert (zipage.policy, zipage.sinks, zipage.recent) == (POLICIES["zipage"], 2, QL)  # no recent window
    streaming = _admission(max_cache_blocks_per_seq=4).budget(SamplingParams(eviction_policy="streaming"))
    assert (streaming.sinks, streaming.recent) == (POLICIES["streaming"].defaults.sinks, QL)


def test_kv_budget_in_tokens_rounds_up_to_blocks_and_zero_is_full_kv():
    admission = _admission(max_cache_blocks_per_seq=4)
    assert admission.budget(SamplingParams(kv_budget=0)) is None
    assert admission.budget(SamplingParams(kv_budget=33)).blocks == 3
    assert _admission().budget(SamplingParams()) is None  # no engine budget: full KV


@pytest.mark.parametrize("options, params, message", [
    (dict(sink_len=13), SamplingParams(kv_budget=16), "protects"),  # 16 tokens < 13 sinks + the query tail
    ({}, SamplingParams(kv_budget=63 * BS), "does not fit"),  # 63 + 1 blocks in a pool of 63
])
def test_bad_budgets_are_refused_before_any_sequence_exists(options, params, message):
    admission = _admission(**options)
    with pytest.raises(ValueError, match=message):
        admission.admit("hello", params, None, ())


def test_scoring_options_default_in_one_place():
    assert EngineConfig().compression.use_global_score is True
    assert EngineConfig.from_options(use_global_score=False).compression.use_global_score is False
    with pytest.raises(ValueError, match="pooling_size"):
        EngineConfig.from_options(pooling_size=4)
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_options(block_size=16)


def test_budgeted_requests_reach_the_positions_and_full_kv_requests_the_pool():
    # a pool of 15 blocks (240 tokens), positions up to 4096, prefill chunks of 64 tokens
    admission = _admission(num_blocks=16, max_cache_blocks_per_seq=2, max_num_batched_tokens=64)
    prompt = [5 + i % 200 for i in range(500)]
    budgeted = admission.admit(prompt, SamplingParams(max_tokens=1000), None, ())
    assert budgeted.seqs[0].max_len == 1500  # past the pool: it never holds more than 2 + 4 blocks
    with pytest.raises(ValueError, match="KV pool's tokens"):
        admission.admit(prompt, SamplingParams(kv_budget=0), None, ())
    full = admission.admit(prompt[:10], SamplingParams(kv_budget=0, max_tokens=1000), None, ())
    assert full.seqs[0].max_len == 240  # full KV stops where the pool does


def test_a_long_prompt_whose_prefill_chunk_cannot_fit_is_refused():
    admission = _admission(num_blocks=16, max_cache_blocks_per_seq=2, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="needs 32 blocks at its peak"):  # the chunk is the whole prompt
        admission.admit([5 + i % 200 for i in range(500)], SamplingParams(), None, ())
    assert admission.admit([5] * 30, SamplingParams(), None, ()).seqs[0].budget.blocks == 2  # fits its budget
