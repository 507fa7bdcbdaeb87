"""A failed device step: the engine rebuilds its device state and the requests in flight finish as
if nothing had happened; a rebuild that fails leaves the engine unusable. The failures are
injected inside the real compiled calls, after they consumed the donated state."""

from __future__ import annotations

import dataclasses

import pytest
from device_failures import FailingCalls, InjectedFailure

from zipage_jax import LLM, SamplingParams
from zipage_jax.engine.core import MAX_FAILED_COMPACTIONS_PER_SEQUENCE, MAX_RECOVERIES_IN_A_ROW, EngineFailed

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
               query_cache_len=4)
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37,
           [200, 201]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# M = 2 blocks; a policy without a prompt reserve, so that a recomputed sequence and a fresh prompt of
# its tokens keep the same ones (a reserve keeps the original prompt's tokens, not the fresh one's)
BUDGETED = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, kv_budget=32, eviction_policy="vnorm-window")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), **OPTIONS)


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    """The fresh engine's greedy tokens, before any failure."""
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def failing_calls(monkeypatch, llm: LLM, steps, at) -> FailingCalls:
    """FailingCalls that observe how many output tokens each request had received."""
    def delivered() -> dict[str, int]:
        return {rid: r.seqs[0].num_known_tokens - r.seqs[0].num_prompt_tokens
                for rid, r in llm.engine.core.requests.items()}

    return FailingCalls(monkeypatch, steps, at, delivered)


def streamed(llm: LLM, prompts, params) -> list[list[int]]:
    """Each request's tokens as its outputs delivered them (deltas, concatenated: none twice),
    checked against its final output; in the order of `prompts`."""
    engine = llm.engine
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = engine.add_requests([(p, sp, None) for p, sp in zip(prompts, params)])
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].delta_token_ids)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert all(finals[rid].token_ids == tokens[rid] and finals[rid].finish_reason == "length" for rid in ids)
    return [tokens[rid] for rid in ids]


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.core.requests == {}
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_usable_blocks
    assert engine.core.scheduler.query_slots.in_use == engine.core.batch.num_running == 0
    assert len(engine.core.batch.free_rows) == engine.core.batch.num_rows


@pytest.mark.parametrize("failing_call", [1, 4])  # the prefill; a decode, with tokens delivered before it
def test_requests_in_flight_finish_with_a_fresh_engines_tokens(llm, expected, monkeypatch, failing_call):
    recoveries = llm.engine.stats.num_recoveries
    failure = failing_calls(monkeypatch, llm, llm.engine.core.runner.forward, {failing_call})
    assert streamed(llm, PROMPTS, GREEDY) == expected
    assert failure.donated == [True]  # the failure came after the call consumed the state
    delivered = sum(failure.observed[0].values())
    assert (delivered == 0) if failing_call == 1 else (0 < delivered < 12 * len(PROMPTS))
    assert llm.engine.stats.num_recoveries == recoveries + 1 and llm.engine.healthy
    assert_no_leaks(llm)


def test_a_failure_while_reading_a_steps_tokens(llm, expected, monkeypatch):
    runner, calls = llm.engine.core.runner, []
    fetch = runner._fetch

    def failing_fetch(step):
        results = fetch(step)  # the device finished the step; its tokens are lost in transit
        calls.append(len(results.rows))
        if len(calls) == 3:
            raise InjectedFailure("injected failure while reading a step's tokens")
        return results

    monkeypatch.setattr(runner, "_fetch", failing_fetch)
    assert streamed(llm, PROMPTS, GREEDY) == expected
    assert len(calls) > 3 and llm.engine.healthy
    assert_no_leaks(llm)


def test_a_failure_inside_compaction(llm, expected, monkeypatch):
    """The compressed request recomputes its delivered tokens under its budget, as a fresh
    request with those tokens as its prompt would (more than a prefill chunk of them: it
    compacts where such a prompt does); the full-KV one beside it is unaffected."""
    third = 2 * llm.engine.core.runner.model_config.num_layers + 1  # the third compaction's first layer
    failure = failing_calls(monkeypatch, llm, llm.engine.core.runner.compressor, {third})
    got = streamed(llm, [PROMPTS[0], PROMPTS[1]], [BUDGETED, GREEDY])
    assert failure.donated == [True]
    monkeypatch.undo()
    assert got[1] == expected[1]
    k = next(iter(failure.observed[0].values()))  # the budgeted request's tokens when compaction failed
    assert len(PROMPTS[0]) + k > OPTIONS["max_num_batched_tokens"]
    uninterrupted = llm.generate([PROMPTS[0]], BUDGETED, use_tqdm=False)[0]
    assert got[0][:k] == uninterrupted["token_ids"][:k]
    rest = llm.generate([PROMPTS[0] + got[0][:k]], dataclasses.replace(BUDGETED, max_tokens=BUDGETED.max_tokens - k),
                        use_tqdm=False)[0]
    assert rest["metrics"]["num_compressions"] > 0 and got[0][k:] == rest["token_ids"]
    assert_no_leaks(llm)


def test_a_compaction_that_always_fails_fails_its_request_alone(llm, monkeypatch):
    """The full-KV request beside it reads tokens between the failures, so the engine's count of
    failures in a row starts over each time: the budgeted request fails once its compaction has
    failed MAX_FAILED_COMPACTIONS_PER_SEQUENCE + 1 times, rather than be retried forever; the
    full-KV one keeps a fresh engine's tokens, and the engine serves on."""
    longer = dataclasses.replace(GREEDY, max_tokens=150)
    fresh = llm.generate([PROMPTS[1]], longer, use_tqdm=False)[0]["token_ids"]
    failure = failing_calls(monkeypatch, llm, llm.engine.core.runner.compressor, range(1, 10**6))
    ids = llm.engine.add_requests([(PROMPTS[1], longer, None), (PROMPTS[0], BUDGETED, None)])
    finals = {}
    for _ in range(3000):
        if not llm.engine.has_unfinished_requests():
            break
        finals.update({out.request_id: out for out in llm.engine.step() if out.finished})
    assert not llm.engine.has_unfinished_requests(), "retried forever"
    failures = len(failure.donated)
    monkeypatch.undo()
    full, failed = finals[ids[0]].outputs[0], finals[ids[1]]
    assert full.finish_reason == "length" and full.token_ids == fresh
    assert failed.outputs[0].finish_reason == "error" and failures == MAX_FAILED_COMPACTIONS_PER_SEQUENCE + 1
    assert f"its compaction failed {failures} times: InjectedFailure: injected device failure" in failed.error
    assert llm.engine.healthy and llm.engine.stats.num_recoveries >= failures
    assert_no_leaks(llm)


def test_a_bad_later_prompt_queues_nothing(llm, monkeypatch):
    added = []
    add = llm.engine.core.scheduler.add
    monkeypatch.setattr(llm.engine.core.scheduler, "add", lambda seq: added.append(seq) or add(seq))
    bad = [PROMPTS[0], PROMPTS[1], [10**9]]
    with pytest.raises(ValueError, match=r"prompt 2: prompt token ids must be integers"):
        llm.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 2: prompt token ids must be integers"):
        next(llm.stream(bad, GREEDY))
    assert added == [] and llm.engine.core.requests == {} and not llm.engine.has_unfinished_requests()


@pytest.mark.slow  # engines of their own (they end unusable): their compiles
def test_a_failed_rebuild_leaves_the_engine_unusable(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), **OPTIONS)
    failing_calls(monkeypatch, llm, llm.engine.core.runner.forward, {2})

    def broken_rebuild():
        raise MemoryError("injected: no room for a fresh KV pool")

    monkeypatch.setattr(llm.engine.core.runner, "_fresh_state", broken_rebuild)
    with pytest.raises(EngineFailed, match="rebuilding the device state") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert isinstance(info.value.__cause__, MemoryError)
    engine = llm.engine
    assert not engine.healthy and isinstance(engine.failed, MemoryError) and not engine.core.recovering
    assert engine.core.requests == {} and not engine.has_unfinished_requests()  # generate gave its requests up
    with pytest.raises(EngineFailed, match="the engine failed and cannot serve: MemoryError: injected"):
        engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineFailed, match="cannot serve"):
        engine.step()

    # a device that keeps failing: the engine gives up rather than recompute forever
    stubborn = LLM(str(llama_dir), **OPTIONS)
    failure = failing_calls(monkeypatch, stubborn, stubborn.engine.core.runner.forward, set(range(1, 100)))
    with pytest.raises(EngineFailed, match=f"{MAX_RECOVERIES_IN_A_ROW + 1} engine steps in a row failed"):
        stubborn.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert failure.calls == MAX_RECOVERIES_IN_A_ROW + 1
    assert stubborn.engine.stats.num_recoveries == MAX_RECOVERIES_IN_A_ROW
    assert isinstance(stubborn.engine.failed, InjectedFailure)
