"""EngineReplica in this process (no Ray): its driver thread, add / poll / abort / finish_sequences,
the core's refusal, a failed step ending the requests in flight, and a core failed for good
ending the process."""

from __future__ import annotations

import os
import threading
import time

import pytest
from server_harness import ENGINE_OPTIONS, wait_for

from zipage_jax.config import EngineConfig
from zipage_jax.data_parallel.replica import Admitted, EngineReplica
from zipage_jax.engine import driver
from zipage_jax.engine.core import EngineFailed
from zipage_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(tiny_model_factory, model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield EngineReplica(EngineConfig(model=str(tiny_model_factory("qwen3")), **ENGINE_OPTIONS))
    mp.undo()


class Collected:
    """What polls brought: tokens and finishes by seq id, the requests admitted, the failed steps."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, str] = {}
        self.admitted: list[str] = []
        self.failed: list[driver.StepFailed] = []
        self.steps: list[int] = []

    def take(self, poll) -> None:
        for event in poll.events:
            if isinstance(event, Admitted):
                self.admitted.append(event.request_id)
            elif isinstance(event, driver.Outputs):
                self.steps.append(event.step)
                out = event.outputs
                for seq_id, token in zip(out.seq_ids.tolist(), out.token_ids.tolist()):
                    assert seq_id not in self.finished, "a token after its sequence's finish"
                    self.tokens.setdefault(seq_id, []).append(token)
                self.finished.update({f.seq_id: f.reason for f in out.finished})
            else:
                self.failed.append(event)


def collect(replica: EngineReplica, done, timeout: float = 60) -> Collected:
    """Polls until done(collected)."""
    collected = Collected()
    deadline = time.monotonic() + timeout
    while not done(collected):
        assert time.monotonic() < deadline, "the requests did not finish"
        collected.take(replica.poll(0.5))
    return collected


def test_requests_run_on_the_replicas_driver_and_polls_bring_their_outputs(replica):
    info, status = replica.info(), replica.ping()
    model = info.model_info
    assert model.block_size == ENGINE_OPTIONS["kvcache_block_size"] and model.max_model_len == 256
    assert model.num_kv_blocks == ENGINE_OPTIONS["num_kvcache_blocks"] - 1 and info.tokenizer is not None
    assert (status.pid, status.incarnation, status.warmup) == (info.pid, info.incarnation, None)
    a = replica.add([5, 6, 7, 8], GREEDY, "a")
    b = replica.add([9, 10, 11], GREEDY, "b")
    assert (a.request_id, a.prompt_token_ids, len(a.seq_ids)) == ("a", [5, 6, 7, 8], 1)
    seqs = a.seq_ids + b.seq_ids
    got = collect(replica, lambda c: set(seqs) <= set(c.finished))
    assert got.admitted == ["a", "b"] and got.steps == sorted(got.steps) and not got.failed
    for seq_id in seqs:
        assert len(got.tokens[seq_id]) == 6 and got.finished[seq_id] == "length"
    assert got.tokens[a.seq_ids[0]] != got.tokens[b.seq_ids[0]]  # by sequence, not mixed up
    # once idle, a poll waits for nothing more and brings the stats taken after the last step
    wait_for(lambda: (p := replica.poll(0.01)).events == [] and p.stats.num_running == 0, 10, "no idle stats")
    assert replica.poll(0.01).stats.generation_tokens >= 12
    assert replica.poll(0.01).incarnation == info.incarnation


def test_the_cores_refusal_reaches_the_caller_and_an_abort_ends_a_request(replica):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        replica.add([5, 99999], GREEDY, "bad")
    long = replica.add([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "long")
    replica.abort("long")
    got = collect(replica, lambda c: not replica.core.has_unfinished_requests(), timeout=30)
    got.take(replica.poll(0))
    assert len(got.tokens.get(long.seq_ids[0], [])) < 200
    assert "bad" not in got.admitted


def test_finish_sequences_ends_a_sequence_where_it_is(replica):
    admitted = replica.add([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=2), "two")
    first, second = admitted.seq_ids
    got = collect(replica, lambda c: len(c.tokens.get(first, [])) >= 2)
    replica.finish_sequences([first], incarnation="another process's")  # meant for another incarnation: ignored
    replica.finish_sequences([first], incarnation=replica.incarnation)
    got2 = collect(replica, lambda c: second in c.finished)
    assert first not in got2.finished  # ended by the front's stop string: the core reports no finish of its own
    assert got2.finished.get(second) == "length"
    total = len(got.tokens.get(first, [])) + len(got2.tokens.get(first, []))
    assert total < 200 and len(got.tokens.get(second, [])) + len(got2.tokens[second]) == 200


def test_a_failed_step_ends_the_requests_in_flight_and_the_replica_serves_on(replica, monkeypatch):
    core_step = replica.core.step

    def fail_once():
        monkeypatch.setattr(replica.core, "step", core_step)
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(replica.core, "step", fail_once)
    replica.add([5, 6, 7, 8], GREEDY, "doomed")
    got = collect(replica, lambda c: c.failed)
    assert got.failed[0].request_ids == ["doomed"] and "injected step failure" in got.failed[0].message
    after = replica.add([5, 6, 7, 8], GREEDY, "after")
    got = collect(replica, lambda c: after.seq_ids[0] in c.finished)
    assert got.finished[after.seq_ids[0]] == "length" and len(got.tokens[after.seq_ids[0]]) == 6


def test_output_lag_reaches_the_core_of_this_incarnation_only(replica):
    """The front's word on the steps it has processed becomes the driver's OutputLag: the core's
    output lag then counts from there (a call meant for another incarnation changes nothing)."""
    replica.add([5, 6, 7], GREEDY, "before")
    collect(replica, lambda c: not replica.core.has_unfinished_requests())
    replica.output_lag(10**9, incarnation="another process's")
    replica.add([5, 6, 7], GREEDY, "sync")  # commands run in order: the output lag's has run
    assert replica.core.scheduler.output_lag >= 0
    replica.output_lag(10**9, incarnation=replica.incarnation)
    replica.add([5, 6, 7], GREEDY, "sync again")
    assert replica.core.scheduler.output_lag < 0  # the front is ahead of every step so far
    collect(replica, lambda c: not replica.core.has_unfinished_requests())


def test_a_core_failed_for_good_ends_the_process(replica, monkeypatch):
    """Last in this module: the replica's driver has ended afterwards."""
    exits: list[int] = []
    exited = threading.Event()

    def fake_exit(status: int) -> None:
        exits.append(status)
        exited.set()

    def broken():
        replica.core.failed = RuntimeError("the device is gone")
        raise EngineFailed("the engine failed")

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(replica.core, "step", broken)
    replica.add([5, 6, 7, 8], GREEDY, "last")
    assert exited.wait(30), "the replica's process was not ended"
    assert exits == [1]
