"""kv_budget="auto" in the engine: a budget that grows while compacting would evict too much
attention, stays within its ceiling, compacts rather than take a block another sequence needs,
and reports its memory (compress/auto_budget.py)."""

from __future__ import annotations

import pytest

from zipage_jax import LLM, SamplingParams

DEFAULTS = dict(kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                auto_budget_min=32, compilation_cache_dir="")
OPTIONS = {**DEFAULTS, "auto_budget_keeps_prompt": False}  # the automatic budget bounds the prompt too
PROMPTS = [[(7 * i + j) % 300 + 3 for i in range(20 + 3 * j)] for j in range(4)]


def generate(llm: LLM, prompts, **params) -> list[dict]:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 120, "ignore_eos": True, **params})
    return [r["outputs"][0] for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def engines(llama_dir):
    """threshold -> an engine (a fresh pool each): 0 accepts no loss, 0.99 almost any."""
    return {t: LLM(str(llama_dir), num_kvcache_blocks=128, auto_budget_threshold=t, **OPTIONS) for t in (0.0, 0.99)}


def test_no_acceptable_loss_grows_to_the_ceiling(engines):
    outs = generate(engines[0.0], PROMPTS, kv_budget="auto", kv_budget_max=96)  # 6 blocks
    for out in outs:  # 140+ tokens: past the ceiling, so each compacts there
        m = out["metrics"]
        assert m["kv_budget_tokens"] == 96 and m["num_compressions"] > 0
        assert m["kv_blocks_peak"] == 96 // 16 + 1


def test_a_lenient_threshold_keeps_the_floor(engines):
    outs = generate(engines[0.99], PROMPTS, kv_budget="auto", kv_budget_max=96)
    for out in outs:
        m = out["metrics"]
        assert m["kv_budget_tokens"] == 32 and m["num_compressions"] > 0  # the floor: auto_budget_min
        assert m["kv_blocks_peak"] <= -(-(len(PROMPTS[-1]) + 1) // 16) + 1  # it starts at its prompt's blocks


def test_automatic_budgets_keep_their_prompts_by_default(llama_dir):
    """By default an automatic budget keeps the prompt whole beside its floor (a lenient
    threshold), as keep_prompt=True does; keep_prompt=False, or the engine option off, bounds the
    prompt too; fixed budgets are unchanged."""
    llm = LLM(str(llama_dir), num_kvcache_blocks=128, auto_budget_threshold=0.99, **DEFAULTS)
    prompts = [PROMPTS[0], PROMPTS[0] * 3]  # 20 and 60 tokens: 2 and 4 blocks
    outs = generate(llm, prompts, kv_budget="auto", kv_budget_max=96)
    assert [o["metrics"]["kv_budget_tokens"] for o in outs] == [(2 + 2) * 16, (4 + 2) * 16]  # prompt + the floor
    assert all(o["metrics"]["num_compressions"] > 0 for o in outs)
    asked = generate(llm, prompts, kv_budget="auto", kv_budget_max=96, keep_prompt=True)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in asked]
    declined = generate(llm, prompts, kv_budget="auto", kv_budget_max=96, keep_prompt=False)  # positive control
    assert [o["metrics"]["kv_budget_tokens"] for o in declined] == [32, 32]
    off = LLM(str(llama_dir), num_kvcache_blocks=128, auto_budget_threshold=0.99, **OPTIONS)
    assert [o["metrics"]["kv_budget_tokens"] for o in generate(off, prompts, kv_budget="auto", kv_budget_max=96)] \
        == [32, 32]
    asked_off = generate(off, prompts, kv_budget="auto", kv_budget_max=96, keep_prompt=True)
    assert [o["token_ids"] for o in asked_off] == [o["token_ids"] for o in outs]
    assert generate(llm, prompts[:1], kv_budget=32)[0]["metrics"]["kv_budget_tokens"] == 32


def test_a_budget_that_never_reaches_its_ceiling_is_full_kv(engines):
    llm = engines[0.0]
    full = generate(llm, PROMPTS, kv_budget=0)
    auto = generate(llm, PROMPTS, kv_budget="auto", kv_budget_max=256)
    assert [o["token_ids"] for o in auto] == [o["token_ids"] for o in full]
    assert all(o["metrics"]["num_compressions"] == 0 for o in auto)
    # positive control: a lenient threshold compacts, and the tokens change
    lenient = generate(engines[0.99], PROMPTS, kv_budget="auto", kv_budget_max=256)
    assert all(o["metrics"]["num_compressions"] > 0 for o in lenient)
    assert [o["token_ids"] for o in lenient] != [o["token_ids"] for o in full]


def test_a_budget_that_cannot_grow_compacts(llama_dir):
    """A pool too small for every budget's growth, and for every request at once: a compressed
    sequence with no free block for its grown budget compacts to what it holds, rather than
    preempt another or wait; a request is admitted only with room to its floor, and growth takes
    only blocks no running sequence is owed, so no sequence is ever preempted."""
    llm = LLM(str(llama_dir), num_kvcache_blocks=30, auto_budget_threshold=0.0, **{**OPTIONS, "max_num_seqs": 12})
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, kv_budget="auto", kv_budget_max=256)
    prompts = [[(7 * i + j) % 300 + 3 for i in range(20 + 3 * (j % 4))] for j in range(12)]
    outs = [r["outputs"][0] for r in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(o["token_ids"]) == 160 for o in outs)
    metrics = [o["metrics"] for o in outs]
    assert all(m["num_compressions"] > 0 and m["kv_budget_tokens"] < 256 for m in metrics)  # the pool, not the ceiling
    assert sum(m["num_preemptions"] for m in metrics) == 0 and llm.engine.get_stats().num_preemptions == 0


def test_growth_changes_no_other_request(llama_dir):
    """A full-KV request beside growing budgets in a short pool gets exactly its tokens alone."""
    llm = LLM(str(llama_dir), num_kvcache_blocks=40, auto_budget_threshold=0.0, **OPTIONS)
    params = dict(temperature=0, max_tokens=200, ignore_eos=True)
    alone = generate(llm, [PROMPTS[0]], kv_budget=0, max_tokens=200)[0]
    batch = [SamplingParams(kv_budget=0, **params)] + [SamplingParams(kv_budget="auto", kv_budget_max=256,
                                                                      **params)] * 3
    outs = [r["outputs"][0] for r in llm.generate(PROMPTS, batch, use_tqdm=False)]
    assert outs[0]["token_ids"] == alone["token_ids"]
    assert all(len(o["token_ids"]) == 200 and o["finish_reason"] == "length" for o in outs)


def test_every_output_reports_its_budget(engines):
    llm = engines[0.0]
    full, fixed = generate(llm, PROMPTS[:1], kv_budget=0)[0], generate(llm, PROMPTS[:1], kv_budget=32)[0]
    assert full["metrics"]["kv_budget_tokens"] == 0 and full["metrics"]["kv_blocks_peak"] == -(-(20 + 120) // 16)
    assert fixed["metrics"]["kv_budget_tokens"] == 32 and fixed["metrics"]["kv_blocks_peak"] <= 32 // 16 + 2


def test_bad_automatic_budgets_are_refused(engines):
    llm = engines[0.0]
    for params, match in ((dict(kv_budget="auto", eviction_policy="streaming"), "does not rank tokens"),
                          (dict(kv_budget="auto", kv_budget_max=16), "below this engine's auto_budget_min=32")):
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, **params), use_tqdm=False)
    for params, match in ((dict(kv_budget="most"), "token count or \"auto\""),
                          (dict(kv_budget=64, kv_budget_max=128), "kv_budget_max bounds an automatic budget"),
                          (dict(kv_budget="auto", kv_budget_max=0), "kv_budget_max")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**params)


def test_the_engine_default_can_be_automatic(llama_dir):
    llm = LLM(str(llama_dir), num_kvcache_blocks=128, auto_budget=True, auto_budget_max=64, **OPTIONS)
    out = generate(llm, PROMPTS[:1])[0]  # no kv_budget of its own
    assert out["metrics"]["kv_budget_tokens"] in (32, 48, 64) and out["metrics"]["num_compressions"] > 0
    assert generate(llm, PROMPTS[:1], kv_budget=0)[0]["metrics"]["kv_budget_tokens"] == 0
    with pytest.raises(ValueError, match="two default budgets"):
        LLM(str(llama_dir), auto_budget=True, max_cache_blocks_per_seq=4, **OPTIONS)


def test_a_prompt_kept_whole_must_leave_room_for_the_automatic_budget(llama_dir):
    llm = LLM(str(llama_dir), num_kvcache_blocks=12, **DEFAULTS)
    params = SamplingParams(max_tokens=2, kv_budget="auto")  # the prompt kept whole by default
    with pytest.raises(ValueError, match="kept whole \\(keep_prompt\\) leaves no block"):
        llm.generate([list(range(3, 173))], params, use_tqdm=False)  # 11 blocks of the pool's 11
    assert len(llm.generate([list(range(3, 40))], params, use_tqdm=False)[0]["outputs"][0]["token_ids"]) == 2



def test_a_sequence_at_its_floor_in_a_full_pool_takes_a_block_as_any_does(llama_dir):
    """A pool too short for every prompt kept whole beside its floor, full-KV requests taking
    what is free: a sequence that holds no more than its floor (here just its prompt) when no
    block is free cannot compact below it; it preempts or is preempted as any sequence is, and
    every request completes (compacting to its prompt, it used to loop without end)."""
    llm = LLM(str(llama_dir), num_kvcache_blocks=9, auto_budget_threshold=0.0, **{**DEFAULTS, "max_num_seqs": 8})
    engine = llm.engine
    params = dict(temperature=0, max_tokens=80, ignore_eos=True)
    auto, full = SamplingParams(kv_budget="auto", kv_budget_max=64, **params), SamplingParams(kv_budget=0, **params)
    ids = [engine.add_request([(5 * i + j) % 300 + 3 for i in range(16 * (1 + j % 3))],  # 1-3 full blocks
                              (full, auto)[j % 2 or j == 4]) for j in range(6)]
    done = {}
    for _ in range(1000):  # about 400 steps
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert sorted(done) == sorted(ids) and all(len(o.outputs[0].token_ids) == 80 for o in done.values())
    assert engine.get_stats().num_preemptions > 0  # the pool was short: the path ran


def test_waiting_requests_do_not_shrink_a_running_budget(llama_dir):
    """A budget that must grow (threshold 0) grows into the free blocks the running sequences
    are not owed even while requests wait with a row free for them: the budgets of two requests
    are the same alone and with two more waiting behind them (which then run the same way)."""
    llm = LLM(str(llama_dir), num_kvcache_blocks=9, auto_budget_threshold=0.0, **OPTIONS)  # 8 usable
    prompts = [[(7 * i + j) % 300 + 3 for i in range(20)] for j in range(4)]  # 2 blocks each
    alone = generate(llm, prompts[:2], kv_budget="auto", kv_budget_max=96)
    crowded = generate(llm, prompts, kv_budget="auto", kv_budget_max=96)
    budgets = [o["metrics"]["kv_budget_tokens"] for o in alone]
    assert budgets[0] > 32 and budgets == budgets[::-1]  # grown past the floor (auto_budget_min), into the pool
    assert [o["metrics"]["kv_budget_tokens"] for o in crowded] == budgets * 2
    assert all(o["metrics"]["num_compressions"] > 0 and o["metrics"]["num_preemptions"] == 0 for o in crowded)



@pytest.mark.parametrize(("threshold", "settles_at"), [(0.99, 32), (0.0, 96)])
def test_a_measurement_moves_nothing(engines, threshold, settles_at):
    """An automatic budget that settles where a fixed one is (a lenient threshold: the floor at
    every point; none: grown to its ceiling) generates what that fixed budget does: measuring
    first (the compaction program keeping every token) moves no token and leaves the global
    score and position caches as they were."""
    params = dict(temperature=0, max_tokens=200, ignore_eos=True)
    auto, fixed = (engines[threshold].generate([PROMPTS[0]], SamplingParams(**budget, **params), use_tqdm=False)
                   for budget in (dict(kv_budget="auto", kv_budget_max=96), dict(kv_budget=settles_at)))
    auto, fixed = auto[0]["outputs"][0], fixed[0]["outputs"][0]
    assert auto["metrics"]["kv_budget_tokens"] == fixed["metrics"]["kv_budget_tokens"] == settles_at
    assert auto["metrics"]["num_compressions"] == fixed["metrics"]["num_compressions"] > 3
    assert auto["token_ids"] == fixed["token_ids"]
