"""ReplicatedEngine through the core API alone (no driver, no server): two replicas on Ray serve the
same prompt alike under seq ids of the front's own, routing spreads equal requests over both, a
stop string's finish reaches the right replica's sequence, and the engine's refusal is a
ValueError."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray.exceptions import RayTaskError
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


class Run:
    """The outputs of steps, by front seq id, as the output stage sees them."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, str] = {}
        self.failures: dict[str, str] = {}

    def step(self, engine) -> None:
        out = engine.step()
        for seq_id, token in zip(out.seq_ids.tolist(), out.token_ids.tolist()):
            assert seq_id not in self.finished, "a token after its sequence's finish"
            self.tokens.setdefault(seq_id, []).append(token)
        self.finished.update({f.seq_id: f.reason for f in out.finished})
        self.failures.update({request_id: message for request_id, message, _ in out.failures})
        engine.set_output_lag(0)  # processed at once


def run_all(engine, run: Run | None = None, timeout: float = 60) -> Run:
    run = run or Run()
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the requests did not finish"
        run.step(engine)
    return run


def test_both_replicas_serve_the_same_prompt_alike_under_seq_ids_of_the_fronts_own(engine):
    assert engine.healthy and engine.failed is None and engine.max_model_len == 256
    assert engine.model_info.block_size == ENGINE_OPTIONS["kvcache_block_size"] and engine.tokenizer is not None
    prompt = [5, 6, 7, 8, 9]
    a, b = engine.add_requests([(prompt, GREEDY, "a"), (prompt, GREEDY, "b")])
    assert (a.request_id, b.request_id) == ("a", "b") and a.prompt_token_ids == prompt and a.prompt is None
    assert len(set(a.seq_ids + b.seq_ids)) == 2  # each replica numbers its sequences from the same start
    run = run_all(engine)
    assert set(run.tokens) == set(a.seq_ids + b.seq_ids) and not run.failures
    assert len(run.tokens[a.seq_ids[0]]) == 6 and run.tokens[a.seq_ids[0]] == run.tokens[b.seq_ids[0]]
    assert run.finished == {a.seq_ids[0]: "length", b.seq_ids[0]: "length"}
    stats = engine.get_stats()
    assert [s.generation_tokens for s in stats.replicas] == [6, 6]  # equal loads: one each
    assert stats.generation_tokens == 12 and stats.serving == [True, True]


def test_a_text_prompt_is_tokenized_by_the_front_as_by_the_replica(engine):
    (admitted,) = engine.add_requests([("Hello there", GREEDY, "text")])
    assert admitted.prompt == "Hello there"
    assert admitted.prompt_token_ids == list(engine.tokenizer("Hello there")["input_ids"])
    run = run_all(engine)
    assert len(run.tokens[admitted.seq_ids[0]]) == 6


def test_finish_sequences_ends_the_sequence_on_its_replica(engine):
    """Two requests, one per replica, of two sequences each: the front ends one sequence of the
    second request (as a stop string would); the other three run to their length."""
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, n=2)
    first, second = engine.add_requests([([5, 6, 7], long, "first"), ([5, 6, 7], long, "second")])
    run = Run()
    deadline = time.monotonic() + 60
    while len(run.tokens.get(second.seq_ids[1], [])) < 3:
        assert time.monotonic() < deadline, "no tokens came"
        run.step(engine)
    engine.finish_sequences([second.seq_ids[1]])
    ended_at = len(run.tokens[second.seq_ids[1]])
    run_all(engine, run)
    assert second.seq_ids[1] not in run.finished  # ended by the front: no finish of its replica's comes back
    assert len(run.tokens[second.seq_ids[1]]) == ended_at  # nothing of it after the front ended it
    others = first.seq_ids + second.seq_ids[:1]
    assert all(len(run.tokens[s]) == 60 and run.finished[s] == "length" for s in others)
    assert not engine.has_unfinished_requests()


def test_a_bad_request_raises_the_engines_value_error_and_is_forgotten(engine):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        engine.add_requests([([5, 99999], GREEDY, "bad")])
    assert not engine.has_unfinished_requests()
    engine.add_requests([([5, 6], GREEDY, "bad")])  # its id is free again
    with pytest.raises(ValueError, match="already in use"):
        engine.add_requests([([5, 6], GREEDY, "bad")])
    with pytest.raises(ValueError, match="prompt 1: prompt token ids must be integers"):  # all or none
        engine.add_requests([([5, 6], GREEDY, "fine"), ([5, 99999], GREEDY, "not fine")])
    run = run_all(engine)
    assert len(run.finished) == 1 and not run.failures


def test_a_call_refused_in_part_hands_on_nothing_of_the_requests_another_replica_ran(engine, monkeypatch):
    """The refusal of the second request reaches the front seconds after the first one's replica
    admitted it (and ran it to its end): the first one's outputs are never handed on."""
    real_get = ray.get

    def slow_refusal(refs, *args, **kwargs):
        try:
            return real_get(refs, *args, **kwargs)
        except RayTaskError:
            if threading.current_thread() is threading.main_thread():
                time.sleep(3)  # the first request's 6 tokens take well under a second
            raise

    monkeypatch.setattr(ray, "get", slow_refusal)
    with pytest.raises(ValueError, match="prompt 1: prompt token ids must be integers"):
        engine.add_requests([([5, 6], GREEDY, "ran"), ([5, 99999], GREEDY, "refused")])
    monkeypatch.undo()
    run = run_all(engine)
    assert not run.tokens and not run.finished and not run.failures
    (again,) = engine.add_requests([([5, 6], GREEDY, "ran")])  # its id is free again
    run = run_all(engine)
    assert run.finished == {again.seq_ids[0]: "length"} and len(run.tokens[again.seq_ids[0]]) == 6
