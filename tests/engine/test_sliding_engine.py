"""Gemma 3's sliding-window layers through the engine under a KV budget: a model whose every layer
slides reads only its window, which a compacted sequence keeps (most recent tokens, in order), so
its greedy tokens under a budget equal full KV's; a model with a full-attention layer loses tokens
that layer reads (the positive control) and still runs."""

from __future__ import annotations

import pytest

from zipage_jax import LLM, SamplingParams

ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=256, dtype="float32", compilation_cache_dir="")
PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for i in range(40 + 9 * j)] for j in range(2)]  # longer than the budget
GREEDY = dict(temperature=0, max_tokens=60, ignore_eos=True)
WINDOW = 24  # more than the recent tokens a policy protects at this budget (16), so that only keeping
BUDGET = 32  # the most recent tokens keeps every layer's window whole


@pytest.fixture(scope="module")
def gemma_models(tiny_model_factory, model_cache_dir):
    """The tiny Gemma 3 (windows of WINDOW tokens) with 2 layers (both sliding: the pattern's full
    layer is the third) and with 3 (sliding, sliding, full)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield {depth: tiny_model_factory("gemma3", num_hidden_layers=depth, sliding_window=WINDOW) for depth in (2, 3)}
    mp.undo()


def _generate(llm: LLM, **params) -> list[dict]:
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY, **params), use_tqdm=False)
    return [o["outputs"][0] for o in outs]


@pytest.mark.slow
def test_sliding_layers_under_a_budget_generate_what_full_kv_does(gemma_models):
    llm = LLM(str(gemma_models[2]), **ENGINE)
    assert llm.engine.core.loaded.config.layer_windows == (WINDOW, WINDOW)
    full = _generate(llm, kv_budget=0)
    budgeted = _generate(llm, kv_budget=BUDGET)
    assert all(o["metrics"]["num_compressions"] > 2 for o in budgeted)
    assert [o["token_ids"] for o in budgeted] == [o["token_ids"] for o in full]


@pytest.mark.slow
def test_a_full_attention_layer_under_a_budget_loses_what_it_read(gemma_models):
    llm = LLM(str(gemma_models[3]), **ENGINE)
    assert llm.engine.core.loaded.config.layer_windows == (WINDOW, WINDOW, 0)
    full = _generate(llm, kv_budget=0)
    budgeted = _generate(llm, kv_budget=BUDGET)
    assert all(o["metrics"]["num_compressions"] > 2 and len(o["token_ids"]) == 60 for o in budgeted)
    assert [o["token_ids"] for o in budgeted] != [o["token_ids"] for o in full]
