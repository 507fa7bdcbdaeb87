"""Question-aware compaction inside a long prompt, on the default model: the prompt's tail runs at
its own positions and its queries score each compaction; deferred prompts compact once; the
prefix cache and repeated requests give the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from zipage_jax import LLM, SamplingParams
from zipage_jax.layers.rotary import apply_rope, inv_frequencies, rope_cos_sin

BS = 16
CHUNK = 64
QL = 8
WINDOW = 16
BUDGET = 2 * BS
TEXT = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} box holds {i * 7 % 31} stones."
                for i in range(120))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", kvcache_block_size=BS, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=CHUNK,
               query_cache_len=QL, prompt_window=WINDOW, compilation_cache_dir="")


def greedy(max_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_budget=BUDGET, **kw)


def prompt_ids(llm: LLM, n: int) -> list[int]:
    return list(llm.tokenizer(TEXT)["input_ids"][:n])


def layer0_queries(llm: LLM, tokens: list[int], positions: list[int]) -> np.ndarray:
    """[T, Hq, D] the first layer's queries of `tokens` at `positions` (they depend on nothing else)."""
    model, cfg = llm.engine.core.loaded.model, llm.engine.core.loaded.config
    layer = model.layers[0]
    h = layer.input_layernorm(model.embed_tokens(np.asarray([tokens])))
    g = cfg.num_heads // cfg.num_kv_heads
    qkv = layer.self_attn.qkv_proj(h).reshape(1, len(tokens), cfg.num_kv_heads, g + 2, cfg.head_dim)
    q = qkv[:, :, :, :g].reshape(1, len(tokens), cfg.num_heads, cfg.head_dim)
    cos, sin = rope_cos_sin(np.asarray([positions]), inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    return np.asarray(apply_rope(q, cos, sin))[0]


def test_each_compaction_in_the_prompt_scores_with_the_prompts_last_queries(llm, monkeypatch):
    prompt = prompt_ids(llm, 300)
    runner = llm.engine.core.runner
    seen = []
    compress = runner.compress

    def capture(scheduled):
        for plan in scheduled.all_compressions(runner.running):
            seq = plan.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                seen.append((seq.num_computed_tokens, np.asarray(runner.state.kv.queries[0][seq.query_slot])))
        compress(scheduled)

    monkeypatch.setattr(runner, "compress", capture)
    out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    # room between compactions: 4 chunk blocks less the tail's one; the first at the budget and 3 blocks
    assert [n for n, _ in seen] == list(range(BUDGET + 3 * BS, 300, 3 * BS))
    expected = layer0_queries(llm, prompt[-QL:], list(range(300 - QL, 300)))
    for _, cached in seen:
        np.testing.assert_allclose(cached, expected, rtol=1e-4, atol=1e-4)
    assert out["metrics"]["kv_blocks_peak"] == BUDGET // BS + CHUNK // BS  # the tail's block within one chunk


def test_a_deferred_prompt_holds_it_whole_then_compacts_once(llm):
    prompt = prompt_ids(llm, 300)
    deferred, bounded = llm.generate([prompt, prompt], [greedy(1, prompt_compression="deferred"), greedy(1)],
                                     use_tqdm=False)
    assert deferred["metrics"]["kv_blocks_peak"] == -(-300 // BS)  # 18 full blocks and the tail's
    assert deferred["metrics"]["num_compressions"] == 1
    assert bounded["metrics"]["kv_blocks_peak"] == 6 and bounded["metrics"]["num_compressions"] >= 5


def test_the_engine_default_and_a_request_choose_the_mode():
    llm = LLM("default", kvcache_block_size=BS, num_kvcache_blocks=40, max_num_seqs=2, max_num_batched_tokens=CHUNK,
              query_cache_len=QL, prompt_compression="deferred", compilation_cache_dir="")
    prompt = prompt_ids(llm, 300)
    by_default, bounded = llm.generate([prompt, prompt], [greedy(), greedy(prompt_compression="bounded")],
                                       use_tqdm=False)
    assert by_default["metrics"]["kv_blocks_peak"] == 19 and bounded["metrics"]["kv_blocks_peak"] <= 6
    with pytest.raises(ValueError, match=r"needs 40 blocks at its peak \(the whole prompt"):
        llm.engine.add_request(prompt_ids(llm, 630), greedy())  # 39 usable blocks
    llm.engine.add_request(prompt_ids(llm, 630), greedy(prompt_compression="bounded"))  # fits in 6
    with pytest.raises(ValueError, match="prompt_compression must be bounded or deferred"):
        SamplingParams(prompt_compression="lazy")


def test_a_prefix_cache_hit_stops_before_the_first_compaction_and_keeps_the_tokens(llm):
    prompt = prompt_ids(llm, 300)
    llm.engine.core.block_manager.reset()  # an empty prefix cache (nothing runs)
    alone = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    llm.engine.core.block_manager.reset()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, kv_budget=0), use_tqdm=False)  # caches all 18
    shared = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert alone["metrics"]["cached_prompt_tokens"] == 0
    # 4 blocks: one less than the first compaction point (the budget and 3 blocks), so the chunk that
    # reaches it, and its tail, are computed as without the cache
    assert shared["metrics"]["cached_prompt_tokens"] == 4 * BS
    assert shared["token_ids"] == alone["token_ids"]


@pytest.mark.slow
def test_the_prompts_end_keeps_a_passkey_the_chunks_own_queries_lose():
    """Positive control beside the design: scoring each compaction by its chunk's own queries
    without pooling (the design before) loses a key that the prompt's tail keeps."""
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 100
    text = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            + filler[:2000] + " The pass key is 58213. Remember it. 58213 is the pass key. " + filler[:7000]
            + " What is the pass key? The pass key is")
    params = SamplingParams(temperature=0, max_tokens=8, kv_budget=256)
    answers = {}
    for name, options in {"tail": {}, "chunk": dict(prompt_window=0, prompt_pooling_size=1)}.items():
        llm = LLM("default", kvcache_block_size=32, num_kvcache_blocks=100, max_num_seqs=1, max_num_batched_tokens=512,
                  compilation_cache_dir="", **options)
        answers[name] = llm.generate([text], params, use_tqdm=False)[0]["text"]
    full = LLM("default", kvcache_block_size=32, num_kvcache_blocks=100, max_num_seqs=1, max_num_batched_tokens=512,
               compilation_cache_dir="").generate([text], SamplingParams(temperature=0, max_tokens=8, kv_budget=0),
                                                  use_tqdm=False)[0]["text"]
    assert "58213" in full and "58213" in answers["tail"]
    assert "58213" not in answers["chunk"]
