"""Constant KV from the first token to the last: compression between prefill chunks, and
budgeted sequences bounded by positions rather than by the pool (the default model)."""

from __future__ import annotations

import pytest

from zipage_jax import LLM, SamplingParams

BS = 16
BUDGET_BLOCKS = 2
CHUNK = 64  # max_num_batched_tokens: the longest prefill chunk
TEXT = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} box holds {i * 7 % 31} stones."
                for i in range(200))


def greedy(max_tokens: int, kv_budget: int | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_budget=kv_budget)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", kvcache_block_size=BS, num_kvcache_blocks=48, max_num_seqs=4, max_num_batched_tokens=CHUNK,
               query_cache_len=8)


def prompt_ids(llm: LLM, num_tokens: int) -> list[int]:
    ids = llm.tokenizer(TEXT)["input_ids"]
    assert len(ids) >= num_tokens
    return list(ids[:num_tokens])


@pytest.mark.slow
def test_a_prompt_of_eight_budgets_peaks_at_the_budget_plus_one_chunk(llm):
    budget = BUDGET_BLOCKS * BS
    prompt = prompt_ids(llm, 8 * budget)
    compressed, full = llm.generate([prompt, prompt], [greedy(8, budget), greedy(8, 0)], use_tqdm=False)
    m = compressed["metrics"]
    assert m["kv_blocks_peak"] <= BUDGET_BLOCKS + CHUNK // BS  # 6 blocks
    assert full["metrics"]["kv_blocks_peak"] == -(-(len(prompt) + 7) // BS)  # 17: the control holds it all
    # one compaction per chunk past the budget and the next block, in prefill
    assert m["num_compressions"] >= (len(prompt) - (BUDGET_BLOCKS + 1) * BS) // CHUNK
    assert compressed["finish_reason"] == full["finish_reason"] == "length"
    assert len(compressed["token_ids"]) == 8
    assert llm.engine.core.block_manager.num_free_blocks == llm.engine.core.block_manager.num_usable_blocks


def test_a_prompt_longer_than_the_pool_runs_under_a_budget_and_is_refused_with_full_kv(llm):
    usable = llm.engine.core.block_manager.num_usable_blocks * BS  # 752 tokens
    prompt = prompt_ids(llm, usable + 100)
    out = llm.generate([prompt], greedy(4, BUDGET_BLOCKS * BS), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4 and out["metrics"]["kv_blocks_peak"] <= BUDGET_BLOCKS + CHUNK // BS
    with pytest.raises(ValueError, match="KV pool"):
        llm.engine.add_request(prompt, greedy(4, 0))


@pytest.mark.slow
def test_a_budgeted_generation_runs_several_times_past_the_pool():
    llm = LLM("default", kvcache_block_size=BS, num_kvcache_blocks=9, max_num_seqs=2, max_num_batched_tokens=CHUNK,
              query_cache_len=8)
    pool_tokens = llm.engine.core.block_manager.num_usable_blocks * BS  # 128 tokens
    assert llm.engine.max_model_len == llm.engine.core.loaded.config.max_position_embeddings  # not clamped
    out = llm.generate(["Count to a thousand:"], greedy(4 * pool_tokens, 2 * BS), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4 * pool_tokens and out["finish_reason"] == "length"
    assert out["metrics"]["kv_blocks_peak"] == 3
    full = llm.generate(["Count to a thousand:"], greedy(4 * pool_tokens, 0), use_tqdm=False)[0]
    assert full["finish_reason"] == "length"  # full KV stops where the pool ends
    assert full["metrics"]["prompt_tokens"] + len(full["token_ids"]) == pool_tokens


@pytest.mark.slow
def test_long_prompts_with_budgets_share_a_small_pool_with_full_kv_and_preemption():
    llm = LLM("default", kvcache_block_size=BS, num_kvcache_blocks=18, max_num_seqs=4, max_num_batched_tokens=CHUNK,
              query_cache_len=8)
    prompts = [prompt_ids(llm, 40), prompt_ids(llm, 48), prompt_ids(llm, 300), prompt_ids(llm, 260)]
    # the two full-KV requests grow to 15 and 11 of the 17 blocks: one of them is preempted
    params = [greedy(200, 0), greedy(120, 0), greedy(24, BUDGET_BLOCKS * BS), greedy(24, BUDGET_BLOCKS * BS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [200, 120, 24, 24]
    assert all(o["metrics"]["kv_blocks_peak"] <= BUDGET_BLOCKS + CHUNK // BS for o in outs[2:])
    assert llm.engine.get_stats().num_preemptions > 0
    for i in (0, 2):  # preemption by recompute and sharing the pool change no token
        assert llm.generate([prompts[i]], params[i], use_tqdm=False)[0]["token_ids"] == outs[i]["token_ids"]
    assert llm.engine.core.block_manager.num_free_blocks == llm.engine.core.block_manager.num_usable_blocks
