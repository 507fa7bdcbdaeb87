"""Compressed PagedAttention in the engine, on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import difflib

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
    assert llm.engine.core.block_manager.num_free_blocks == llm.engine.core.block_manager.num_usable_blocks


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

    mc = llm.engine.core.loaded.config
    rope = llm.engine.core.runner.compressor.static["rope"]
    assert rope == tuple(float(f) for f in inv_frequencies(mc.head_dim, mc.rope_theta, mc.rope_scaling))
    assert rope != tuple(float(f) for f in inv_frequencies(mc.head_dim, 10000.0))  # SmolLM2: theta 100,000
    budget = 4 * BS  # 75% protected as recent: 12 tokens chosen by each policy's score
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, kv_budget=budget, eviction_policy=p)
              for p in ("rkv", "triattention", "window")]
    outs = llm.generate([PROMPTS[0]] * 3, params, use_tqdm=False)
    full = llm.generate([PROMPTS[0]], greedy(120, kv_budget=0), use_tqdm=False)[0]["token_ids"]
    tokens = [o["token_ids"] for o in outs]
    assert all(len(t) == 120 for t in tokens)
    assert tokens[1] != tokens[2] and tokens[1] != full  # the predicted attention keeps other tokens than the observed


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
    bm = cached.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_many_compressing_requests_in_a_tiny_pool(llm):
    tiny = make_llm(num_kvcache_blocks=17, max_num_seqs=8, max_cache_blocks_per_seq=1)  # 16 usable blocks
    prompts = [f"Story number {i}: the" for i in range(8)]
    outs = tiny.generate(prompts, greedy(50), use_tqdm=False)
    assert all(len(o["token_ids"]) == 50 for o in outs)
    assert all(o["metrics"]["kv_blocks_peak"] <= 2 for o in outs)
    assert all(o["metrics"]["num_compressions"] >= 2 for o in outs)
    bm = tiny.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    stats = tiny.engine.get_stats()
    assert stats.num_compressions == sum(o["metrics"]["num_compressions"] for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype, stored", [("int8", "int8"), ("int4", "uint8")])
def test_quantized_pool_under_compression_and_prefix_caching_is_deterministic(llm, kv_cache_dtype, stored):
    """A quantized pool (int8: per-token scales; int4: packed, per-group scales) with compression,
    prefix caching and overlapping requests: the same engine run twice gives the same tokens,
    close to the float pool's own output."""
    prompt = "Summarise the following text. " * 6
    params = greedy(50, kv_budget=2 * BS)
    quantized = make_llm(kv_cache_dtype=kv_cache_dtype)
    runs = [run_two_overlapping(quantized, prompt, params) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]  # deterministic
    # the prefix-cached request computes its own tokens in another chunk: a last-bit difference
    # can round a value to the other level of a 4-bit grid, so only its start must agree
    cached, uncached = runs[0][1].token_ids, runs[0][0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(cached, uncached)) if a != b), len(cached))
    assert agree == len(cached) if kv_cache_dtype == "int8" else agree >= 30, agree
    assert runs[0][1].metrics["cached_prompt_tokens"] == 2 * BS and runs[0][0].metrics["num_compressions"] > 0
    floats = run_two_overlapping(llm, prompt, params)[0].token_ids
    # greedy text diverges eventually; a run of early tokens agrees (int4 sooner: 16 levels a value)
    run = difflib.SequenceMatcher(None, runs[0][0].token_ids, floats).find_longest_match()
    assert run.size >= (10 if kv_cache_dtype == "int8" else 5) and run.a <= 2, run
    assert quantized.engine.core.runner.state.kv.pools[0].k.dtype == stored


def test_kv_cache_memory_buys_blocks_by_bytes():
    gb = 0.05
    f32 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb).engine.core
    int8 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb, kv_cache_dtype="int8").engine.core
    mc = f32.loaded.config
    per_token_f32 = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    per_token_int8 = 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 4)  # int8 values + a float32 scale
    assert f32.pool.block_bytes == BS * per_token_f32 and int8.pool.block_bytes == BS * per_token_int8
    ratio = int8.stats.num_kv_blocks / f32.stats.num_kv_blocks
    assert ratio == pytest.approx(per_token_f32 / per_token_int8, rel=0.02)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_llm(kv_cache_dtype="int2")


def test_kv_cache_memory_buys_int4_blocks_by_bytes(tiny_model_factory):
    """int4 against bfloat16 at head_dim 64: 32 packed bytes + 2 float16 scales = 36 bytes a token
    and kv head for K (and for V) against 128, so the same bytes buy 128 / 36 times the blocks."""
    gb = 0.05
    bf16 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb, dtype="bfloat16").engine.core
    int4 = make_llm(num_kvcache_blocks=None, kvcache_memory_gb=gb, dtype="bfloat16", kv_cache_dtype="int4").engine.core
    mc = bf16.loaded.config
    assert mc.head_dim == 64
    per_token = 2 * mc.num_layers * mc.num_kv_heads  # K and V of every layer and kv head
    assert bf16.pool.block_bytes == BS * per_token * 128 and int4.pool.block_bytes == BS * per_token * 36
    assert int4.stats.num_kv_blocks / bf16.stats.num_kv_blocks == pytest.approx(128 / 36, rel=0.02)
    pool = int4.runner.state.kv.pools[0]
    assert (pool.k.dtype, pool.k.shape[-1], pool.k_scales.dtype, pool.k_scales.shape[-1]) == ("uint8", 32, "float16", 2)
    with pytest.raises(ValueError, match="power-of-two head_dim of at least 64"):  # the tiny llama's head_dim is 16
        LLM(str(tiny_model_factory("llama")), kv_cache_dtype="int4", compilation_cache_dir="")
