"""Long generation at constant cost: no compiles after warm-up, asynchronous scheduling that
changes nothing, outputs that carry deltas only."""

from __future__ import annotations

import logging

import jax

from zipage_jax import LLM, SamplingParams

# small enough for a quick warm-up: decode rows {1, 2, 4}, prefill rows {1, 2}, compression
# batches {1, 2} x table widths {2, 4, 8}, history buckets {64, 128}
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128, max_cache_blocks_per_seq=2, max_compress_seqs=2, query_cache_len=4,
               auto_budget_min=32)


def mixed_workload(llm: LLM) -> list[list[int]]:
    """Budgets (default, 32 and 48 tokens, automatic, full KV), every policy, greedy / seeded / top-k / top-p /
    min-p sampling, penalties, logprobs, min_tokens with stop ids, forced tokens, prompts of 1 to
    100 tokens (chunked), 1 to 4 sequences at a time, and full-KV contexts to the model length."""
    long = [(7 * i) % 300 + 3 for i in range(100)]
    waves = [
        [([5], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))],
        [(long, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=20, kv_budget=32)),
         ([9, 8, 7], SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=40, repetition_penalty=1.3,
                                    eviction_policy="streaming")),
         (long[:40], SamplingParams(temperature=0, max_tokens=80, kv_budget=0, ignore_eos=True, logprobs=3)),
         (long[:30], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_budget="auto",
                                    kv_budget_max=64))],
        [([3, 4], SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=30, frequency_penalty=0.5,
                                 presence_penalty=0.2, eviction_policy="zipage", kv_budget=48)),
         (long[:17], SamplingParams(temperature=0, max_tokens=25, min_tokens=20, stop_token_ids=[2, 5],
                                    forced_token_ids=[10, 11, 12], eviction_policy="window")),
         ([1] * 33, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, eviction_policy="vnorm-window")),
         (long[:50], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, eviction_policy="rkv",
                                    kv_budget=32)),
         (long[:45], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, eviction_policy="triattention",
                                    kv_budget=32)),
         ([8, 9], SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=10))],
    ]
    outputs = []
    for wave in waves:
        prompts, params = zip(*wave)
        outputs += [r["token_ids"] for r in llm.generate(list(prompts), list(params), use_tqdm=False)]
    return outputs


def count_compiles(fn) -> tuple[int, object]:
    """Programs JAX compiled or loaded from its persistent cache while fn runs, from its own log
    (independent of the engine's counter): one "Finished XLA compilation" record per executable."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(r) if "Finished XLA compilation" in r.getMessage() else None
    logger = logging.getLogger("jax")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        result = fn()
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        logger.setLevel(old)
    return len(records), result


def test_warmed_up_engine_never_compiles_and_the_counter_sees_compiles(llama_dir):
    # positive control: a fresh engine without warm-up compiles while it serves, once per program
    cold = LLM(str(llama_dir), compilation_cache_dir="", **OPTIONS)  # nothing loaded from a store
    logged, expected = count_compiles(lambda: mixed_workload(cold))
    compiled = [r for r in cold.engine.core.runner.records if r.origin == "compiled"]
    assert len(compiled) > 3
    assert logged == len(compiled)  # no program compiled twice (a committed state)

    warm = LLM(str(llama_dir), warmup=True, **OPTIONS)
    assert warm.engine.warmup_status.ready == len(warm.engine.core.runner.step_grid())
    built = warm.engine.core.runner.num_compiles
    logged, outputs = count_compiles(lambda: mixed_workload(warm))
    assert logged == 0 and warm.engine.core.runner.num_compiles == built
    assert outputs == expected


def test_asynchronous_scheduling_changes_no_token(llama_dir):
    sync = LLM(str(llama_dir), async_scheduling=False, **OPTIONS)
    expected = mixed_workload(sync)
    overlapped = LLM(str(llama_dir), **OPTIONS)
    assert overlapped.engine.config.async_scheduling
    assert mixed_workload(overlapped) == expected


def test_running_outputs_carry_only_deltas(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=1)
    outputs = list(llm.stream([[5, 6, 7]], params))
    running, final = outputs[:-1], outputs[-1].outputs[0]
    assert outputs[-1].finished and not any(o.finished for o in running)
    for out in running:
        o = out.outputs[0]
        assert o.token_ids == [] and o.text == "" and o.logprobs is None  # nothing cumulative while running
        assert len(o.delta_token_ids) <= 1 and len(o.delta_logprobs) == len(o.delta_token_ids)
    streamed = [t for out in outputs for t in out.outputs[0].delta_token_ids]
    assert streamed == final.token_ids and len(final.token_ids) == 50
    assert "".join(out.outputs[0].delta_text for out in outputs) == final.text
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
