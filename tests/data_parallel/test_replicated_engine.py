"""ReplicatedEngine through the engine API alone (no server): two replicas on Ray serve the same
prompt alike, routing spreads equal requests over both, and the engine's refusal is a ValueError."""

from __future__ import annotations

import time

import pytest
from server_harness import ENGINE_OPTIONS

from zipage_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(ray_instance, tiny_model_factory, model_cache_dir):
    from zipage_jax.data_parallel.replicated_engine import ReplicatedEngine

    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))  # the replicas inherit it
    replicated = ReplicatedEngine(model=str(tiny_model_factory("qwen3")), data_parallel_size=2, **ENGINE_OPTIONS)
    yield replicated
    replicated.shutdown()
    mp.undo()


def run_all(engine, timeout: float = 60) -> dict[str, list[int]]:
    finals = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the requests did not finish"
        finals.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
    return finals


def test_both_replicas_serve_the_same_prompt_alike(engine):
    assert engine.healthy and engine.failed is None and engine.max_model_len == 256
    prompt = [5, 6, 7, 8, 9]
    for request_id in ("a", "b"):
        engine.add_request(prompt, GREEDY, request_id)
    finals = run_all(engine)
    assert len(finals["a"]) == 6 and finals["a"] == finals["b"]
    stats = engine.get_stats()
    assert [s.generation_tokens for s in stats.replicas] == [6, 6]  # equal loads: one each
    assert stats.generation_tokens == 12 and stats.serving == [True, True]


def test_a_bad_request_raises_the_engines_value_error_and_is_forgotten(engine):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        engine.add_request([5, 99999], GREEDY, "bad")
    assert not engine.has_unfinished_requests()
    engine.add_request([5, 6], GREEDY, "bad")  # its id is free again
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], GREEDY, "bad")
    assert set(run_all(engine)) == {"bad"}
