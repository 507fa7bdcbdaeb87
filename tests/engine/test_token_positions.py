"""The engine's position cache holds each kept token's true position through many compactions.

Streaming keeps the 4 sinks and the most recent tokens, so which positions a sequence holds is
known without the engine: [0, 4) and the last ones before the newest compaction."""

from __future__ import annotations

import numpy as np
import pytest

from zipage_jax import LLM, SamplingParams

BS = 16


def test_positions_follow_the_tokens_through_compaction():
    llm = LLM("default", kvcache_block_size=BS, num_kvcache_blocks=32, max_num_seqs=2, query_cache_len=8,
              compilation_cache_dir="")
    engine = llm.engine
    budget = 3 * BS
    engine.add_requests([("The river flows", SamplingParams(temperature=0, max_tokens=9 * BS, ignore_eos=True,
                                                             kv_budget=budget, eviction_policy="streaming"), None)])
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = [s for s in engine.core.scheduler.running
                   if s.compressed and not s.compressing]
        if not running:
            continue
        seq = running[0]
        state = engine.core.runner.state  # blocks on the device's work so far
        n_slots, n_computed = seq.num_kv_slots, seq.num_computed_tokens
        kept = budget - 4
        last_compaction = n_computed - (n_slots - budget)  # tokens computed when it last compacted
        expected = np.concatenate([np.arange(4), np.arange(last_compaction - kept, last_compaction)])
        for layer in (0, len(state.kv.pools) - 1):
            positions = np.asarray(state.kv.pools[layer].positions)[seq.block_table]  # [blocks, BS, Hkv]
            held = positions.reshape(-1, positions.shape[-1])[:budget]  # slots written since: not yet recorded
            for head in range(held.shape[1]):
                np.testing.assert_array_equal(held[:, head], expected, err_msg=f"layer {layer} head {head}")
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("kv_budget, beside_blocks, options", [
    (2 * BS, 2, {}),
    ("auto", 2, dict(auto_budget_threshold=0.99)),  # any loss accepted: it stays at its floor
    ("auto", 3, dict(auto_budget_threshold=0.0)),  # no loss accepted: it grows to its ceiling
], ids=["fixed", "auto-floor", "auto-ceiling"])
def test_keep_prompt_holds_the_whole_prompt_beside_the_budget(kv_budget, beside_blocks, options):
    """A fixed or automatic budget with keep_prompt: every prompt position stays held through
    every compaction, beside a budget of `beside_blocks` blocks."""
    llm = LLM("default", kvcache_block_size=BS, num_kvcache_blocks=32, max_num_seqs=2, query_cache_len=8,
              compilation_cache_dir="", auto_budget_min=2 * BS, **options)
    engine = llm.engine
    prompt = list(range(100, 137))  # 37 tokens, longer than the budget
    engine.add_requests([(prompt, SamplingParams(temperature=0, max_tokens=8 * BS, ignore_eos=True,
                                                 kv_budget=kv_budget, kv_budget_max=3 * BS if kv_budget == "auto"
                                                 else None, keep_prompt=True), None)])
    held_blocks = -(-len(prompt) // BS) + beside_blocks
    checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                metrics = out.to_dict()["metrics"]
                assert metrics["kv_blocks_peak"] == held_blocks + 1
                assert metrics["kv_budget_tokens"] == held_blocks * BS
                assert metrics["num_compressions"] > 0
        running = [s for s in engine.core.scheduler.running
                   if s.compressed and not s.compressing]
        if running:
            seq = running[0]
            positions = np.asarray(engine.core.runner.state.kv.pools[-1].positions)[seq.block_table]
            kept = positions.reshape(-1, positions.shape[-1])[:seq.budget.blocks * BS]
            for head in range(kept.shape[1]):
                assert set(range(len(prompt))) <= set(kept[:, head].tolist())
            checked += 1
    assert checked >= 3
