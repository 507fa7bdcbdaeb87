"""LLMEngine.introspect() and wait_for_device(): what the tools read of an engine beyond its stats."""

from __future__ import annotations

import dataclasses

import pytest

from zipage_jax import LLM, SamplingParams

BS = 16


@pytest.mark.parametrize("profile", [pytest.param(True, marks=pytest.mark.slow), False])
def test_introspection_reports_the_model_the_pool_and_the_compactions(llama_dir, profile):
    llm = LLM(str(llama_dir), kvcache_block_size=BS, num_kvcache_blocks=32, max_num_seqs=2,
              max_cache_blocks_per_seq=2, query_cache_len=8, profile_compaction=profile)
    engine = llm.engine
    before = engine.introspect()
    assert before.compaction_seconds == 0.0
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6 * BS, ignore_eos=True),
                       use_tqdm=False)[0]
    engine.wait_for_device()
    assert out["metrics"]["num_compressions"] > 0
    after, stats = engine.introspect(), engine.get_stats()
    assert after.model_source == str(llama_dir)
    mc = engine.core.loaded.config
    assert after.kv_block_bytes == 2 * mc.num_layers * BS * mc.num_kv_heads * mc.head_dim * 4  # K and V, float32
    assert 0 < after.compaction_compile_seconds < stats.compile_seconds  # the forward programs took the rest
    assert (after.compaction_seconds > 0) is profile  # measured only when asked for
    assert stats.num_free_blocks == stats.num_kv_blocks  # every block back after the request
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.kv_block_bytes = 0
