"""Admission against a model with sliding-window layers: every budget must hold the largest
window (a sliding layer keeps a sequence's most recent budget tokens and reads the last window of
them), the engine's defaults when it starts, each request's before it joins a batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import build_tokenizer

from zipage_jax import LLM, SamplingParams
from zipage_jax.config import EngineConfig
from zipage_jax.engine.admission import Admission
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.prompt_compaction import PromptCompaction
from zipage_jax.models.loading import load_model

BS, WINDOW = 16, 32
VOCAB = 300
TOKENIZER = build_tokenizer(VOCAB)


def _admission(window: int = WINDOW, num_blocks: int = 64, **options) -> Admission:
    options.setdefault("auto_budget_keeps_prompt", False)  # automatic bounds read alone, no prompt beside them
    config = EngineConfig.from_options(kvcache_block_size=BS, query_cache_len=8, compilation_cache_dir="", **options)
    pool = KVPoolPlan(BS, np.dtype(np.float32), 2, 1024, num_blocks, 4, 4096, (num_blocks - 1) * BS)
    prompt = PromptCompaction.of(BS, config.max_num_batched_tokens, config.prompt_window, config.row_size)
    return Admission(config, pool, prompt, TOKENIZER, VOCAB, (TOKENIZER.eos_token_id,), sliding_window=window)


def test_a_budget_smaller_than_the_window_is_refused_and_the_window_itself_accepted():
    admission = _admission()
    with pytest.raises(ValueError, match="kv_budget 16 is smaller than the model's sliding window 32"):
        admission.admit("hello", SamplingParams(kv_budget=16), None, ())
    assert admission.admit("hello", SamplingParams(kv_budget=WINDOW), None, ()).seqs[0].budget.tokens == WINDOW
    assert admission.budget(SamplingParams(kv_budget=0)) is None  # full KV holds every window
    assert _admission(window=0).budget(SamplingParams(kv_budget=16)).tokens == 16  # positive control: no window


def test_an_engine_default_budget_smaller_than_the_window_stops_the_start():
    with pytest.raises(ValueError, match=r"max_cache_blocks_per_seq 1 \(16 tokens\) is smaller than the model's "
                                         "sliding window 32"):
        _admission(max_cache_blocks_per_seq=1)
    with pytest.raises(ValueError, match="auto_budget_max 16 is smaller than the model's sliding window 32"):
        _admission(auto_budget=True, auto_budget_min=16, auto_budget_max=16)
    assert _admission(max_cache_blocks_per_seq=2).budget(SamplingParams()).tokens == WINDOW
    assert _admission(window=0, max_cache_blocks_per_seq=1).budget(SamplingParams()).tokens == BS  # control


def test_an_automatic_budget_floor_rises_to_the_window_and_its_ceiling_may_not_be_below():
    admission = _admission(auto_budget_min=16)
    auto = admission.budget(SamplingParams(kv_budget="auto", kv_budget_max=128)).auto
    assert auto.floor * BS == WINDOW and auto.ceiling * BS == 128
    assert _admission(window=0, auto_budget_min=16).budget(
        SamplingParams(kv_budget="auto", kv_budget_max=128)).auto.floor == 1  # control: the engine's floor
    with pytest.raises(ValueError, match="kv_budget_max 16 is smaller than the model's sliding window 32"):
        admission.admit("hello", SamplingParams(kv_budget="auto", kv_budget_max=16), None, ())
    with pytest.raises(ValueError, match="auto_budget_max 16 is smaller than the model's sliding window 32"):
        _admission(auto_budget_min=16, auto_budget_max=16).admit("hello", SamplingParams(kv_budget="auto"), None, ())
    with pytest.raises(ValueError, match="sliding window 32 does not fit in the KV pool"):
        _admission(num_blocks=3, auto_budget_min=16).admit("hello", SamplingParams(kv_budget="auto"), None, ())


@pytest.fixture(scope="module")
def windowed(llama_dir):
    """The tiny llama with a sliding first layer (window 32) and a full-attention second one."""
    loaded = load_model(str(llama_dir))
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, layer_windows=(WINDOW, 0)))


def test_a_refused_budget_leaves_the_engine_and_its_other_requests_alone(windowed, llama_dir):
    llm = LLM(str(llama_dir), loaded=windowed, kvcache_block_size=BS, num_kvcache_blocks=48, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=256, compilation_cache_dir="")
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    good = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_budget=WINDOW)
    alone = llm.generate(prompt, good, use_tqdm=False)[0]
    assert alone["metrics"]["num_compressions"] > 0  # the windowed layer went through compaction

    engine = llm.engine
    rid = engine.add_request(prompt, good, stream=False)
    with pytest.raises(ValueError, match="kv_budget 16 is smaller than the model's sliding window 32"):
        engine.add_request(prompt, dataclasses.replace(good, kv_budget=16))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == [rid]
    assert finals[0].to_dict()["token_ids"] == alone["token_ids"]


def test_an_engine_whose_default_budget_cannot_hold_the_window_does_not_start(windowed, llama_dir):
    with pytest.raises(ValueError, match="smaller than the model's sliding window 32"):
        LLM(str(llama_dir), loaded=windowed, kvcache_block_size=BS, num_kvcache_blocks=48,
            max_cache_blocks_per_seq=1, compilation_cache_dir="")
