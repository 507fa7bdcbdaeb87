"""Compressed PagedAttention in the engine, on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import pytest

from zipage_jax import LLM, SamplingParams

BS = 16
PROMPTS = ["The history of the Roman Empire begins", "def quicksort(items):", "Once upon a time, in a quiet village,"]


def greedy(max_tokens: int, kv_budget: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_budget=kv_budget)


def make_llm(**options) -> LLM:
    defaults = dict(kvcache_block_size=BS, num_kvcache_blocks=96, max_num_seqs=8, max_num_batched_tokens=256,
                    query_cache_len=8, use_global_score=True, enable_pooling=True, redundancy="lightning")
    return LLM("default", **{**defaults, **options})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.mark.slow
def test_long_generation_stays_within_budget(llm):
    budget = 2 * BS  # M = 2 blocks: at most 3 blocks held
    out = llm.generate([PROMPTS[0]], greedy(8 * budget + 7, kv_budget=budget), use_tqdm=False)[0]
    m = out["metrics"]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8 * budget + 7
    assert m["kv_blocks_peak"] == 3
    computed = m["prompt_tokens"] + m["completion_tokens"] - 1  # the last token's K/V is never computed
    # slots fill to (M+1)*BS; each further block's worth of tokens first compacts back to M*BS
    assert m["num_compressions"] == -(-(computed - budget - BS) // BS)
    assert m["kv_tokens_evicted"] == m["num_compressions"] * BS
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks


def test_budget_larger_than_generation_is_full_kv(llm):
    full = llm.generate(PROMPTS, greedy(40, kv_budget=0), use_tqdm=False)
    roomy = llm.generate(PROMPTS, greedy(40, kv_budget=8 * BS), use_tqdm=False)
    assert [o["token_ids"] for o in roomy] == [o["token_ids"] for o in full]
    assert all(o["metrics"]["num_compressions"] == 0 for o in roomy)


def test_mixed_batch_gives_each_request_its_solo_output(llm):
    params = [greedy(60, kv_budget=0), greedy(60, kv_budget=2 * BS), greedy(60, kv_budget=3 * BS)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(PROMPTS, params)]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o["token_ids"] for o in together] == alone
    assert together[0]["metrics"]["num_compressions"] == 0
    assert together[1]["metrics"]["num_compressions"] > 0


@pytest.mark.slow
def test_per_request_eviction_policy_matches_an_engine_with_that_policy(llm):
    budget = 2 * BS
    policies = ["streaming", "window", None]  # None: the engine's eviction_policy
    params = [SamplingParams(temperature=0, max_tokens=70, ignore_eos=True, kv_budget=budget, eviction_policy=p)
              for p in policies]
    together = [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, policy, tokens in zip(PROMPTS[:2], policies, together):
        alone = make_llm(eviction_policy=policy).generate([prompt], greedy(70, kv_budget=budget), use_tqdm=False)
        assert alone[0]["token_ids"] == tokens
    assert together[2] == llm.generate([PROMPTS[2]], greedy(70, kv_budget=budget), use_tqdm=False)[0]["token_ids"]
    streamed = llm.generate([PROMPTS[0]] * 2, [params[0], params[1]], use_tqdm=False)
    assert streamed[0]["token_ids"] != streamed[1]["token_ids"]  # the policies do differ here


def test_new_policies_compress_with_the_models_rope(llm):
    from zipage_jax.layers.rotary import inv_frequencies

    mc = llm.engine.loaded.config
    rope = llm.engine.runner.compressor.static["rope"]
    assert rope == tuple(float(f) for f in inv_frequencies(mc.head_dim, mc.rope_theta, mc.rope_scaling))
    assert rope != tuple(float(f) for f in inv_frequencies(mc.head_dim, 10000.0))  # SmolLM2: theta 100,000
    budget = 2 * BS
    params = [SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, kv_budget=budget, eviction_policy=p)
              for p in ("rkv", "triattention", "window")]
    outs = llm.generate([PROMPTS[1]] * 3, params, use_tqdm=False)
    full = llm.generate([PROMPTS[1]], greedy(90, kv_budget=0), use_tqdm=False)[0]["token_ids"]
    tokens = [o["token_ids"] for o in outs]
    assert all(len(t) == 90 for t in tokens)
    assert len({tuple(t) for t in tokens}) == 3 and all(t != full for t in tokens)  # each policy evicts its own way


def test_forced_tokens_are_decoded_through_compression(llm):
    """Teacher forcing the tokens greedy decoding chose reproduces its tokens and log-probabilities,
    compactions included; then generation goes on greedily from there."""
    budget = 2 * BS
    plain = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, logprobs=0,
                                                      kv_budget=budget), use_tqdm=False)[0]
    forced = SamplingParams(temperature=0.9, seed=3, max_tokens=90, ignore_eos=True, logprobs=0, kv_budget=budget,
                            forced_token_ids=plain["token_ids"][:80])
    out = llm.generate([PROMPTS[1]], forced, use_tqdm=False)[0]
    assert out["token_ids"][:80] == plain["token_ids"][:80]
    assert out["metrics"]["num_compressions"] == plain["metrics"]["num_compressions"] > 0
    lp = [d["logprob"] for d in out["logprobs"][:80]]
    assert lp == pytest.approx([d["logprob"] for d in plain["logprobs"][:80]], abs=1e-5)
    with pytest.raises(ValueError, match="forced_token_ids must be integers in"):
        llm.generate(["hi"], SamplingParams(forced_token_ids=[10**9]), use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_tokens"):
        SamplingParams(max_tokens=2, forced_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        SamplingParams(eviction_policy="h2o")


def run_two_overlapping(llm: LLM, prompt: str, params: SamplingParams) -> list:
    """The second request arrives once the first has prefilled, so it can share its prompt blocks."""
    engine = llm.engine
    first = engine.add_request(prompt, params)
    engine.step()
    second = engine.add_request(prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    return [outs[first], outs[second]]


def test_prefix_caching_does_not_change_compressed_output():
    prompt = "Summarise the following text. " * 6  # two full blocks, shared by both requests
    params = greedy(70, kv_budget=2 * BS)
    cached = make_llm(enable_prefix_caching=True)
    first, second = run_two_overlapping(cached, prompt, params)
    plain_first, plain_second = run_two_overlapping(make_llm(enable_prefix_caching=False), prompt, params)
    assert second.metrics["cached_prompt_tokens"] == 2 * BS
    assert plain_second.metrics["cached_prompt_tokens"] == 0
    assert second.metrics["num_compressions"] > 0 and first.metrics["num_compressions"] > 0
    assert first.token_ids == second.token_ids == plain_first.token_ids == plain_second.token_ids
    bm = cached.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_many_compressing_requests_in_a_tiny_pool(llm):
    tiny = make_llm(num_kvcache_blocks=17, max_num_seqs=8, max_cache_blocks_per_seq=1)  # 16 usable blocks
    prompts = [f"Story number {i}: the" for i in range(8)]
    outs = tiny.generate(prompts, greedy(50), use_tqdm=False)
    assert all(len(o["token_ids"]) == 50 for o in outs)
    assert all(o["metrics"]["kv_blocks_peak"] <= 2 for o in outs)
    assert all(o["metrics"]["num_compressions"] >= 2 for o in outs)
    bm = tiny.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    stats = tiny.engine.get_stats()
    assert stats.num_compressions == sum(o["metrics"]["num_compressions"] for o in outs)


@pytest.mark.slow
def test_int8_pool_under_compression_and_prefix_caching_is_deterministic(llm):
    """An int8 pool (per-token scales) with compression, prefix caching and overlapping requests:
    the same engine run twice gives the same tokens, close to the float pool's own output."""
    prompt = "Summarise the following text. " * 6
    params = greedy(50, kv_budget=2 * BS)
    int8 = make_llm(kv_cache_dtype="int8")
    runs = [run_two_overlapping(int8, prompt, params) for _ in range(2)]
    assert runs[0][0].token_ids == runs[0][1].token_ids == runs[1][0].token_ids == runs[1][1].token_ids
    assert runs[0][1].metrics["cached_prompt_tokens"] == 2 * BS and runs[0][0].metrics["num_compressions"] > 0
    floats = run_two_overlapping(llm, prompt, params)[0].token_ids
    same = sum(a == b for a, b in zip(runs[0][0].token_ids, floats))
    assert same >= 10  # greedy text diverges eventually; the first tokens agree
    assert int8.engine.runner.state.kv.pools[0].k.dtype == "int8"


def test_kv_cache_memory_buys_blocks_by_bytes():
    gb = 0.05
    f32 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb).engine
    int8 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb, kv_cache_dtype="int8").engine
    mc = f32.loaded.config
    per_token_f32 = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    per_token_int8 = 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 4)  # int8 values + a float32 scale
    assert f32.pool.block_bytes == BS * per_token_f32 and int8.pool.block_bytes == BS * per_token_int8
    ratio = int8.stats.num_kv_blocks / f32.stats.num_kv_blocks
    assert ratio == pytest.approx(per_token_f32 / per_token_int8, rel=0.02)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_llm(kv_cache_dtype="int4")
