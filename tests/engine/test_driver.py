"""EngineDriver, the one loop around an engine core, over a fake core: commands run between steps,
outputs and stats go out as events, and the failure policy holds (a failed step fails the requests
in flight and the loop goes on; a core failed for good ends it)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from zipage_jax.engine import driver
from zipage_jax.engine.core import AdmittedRequest
from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.engine.stats import EngineStats
from zipage_jax.sampling_params import SamplingParams


class FakeCore:
    """Each request's one sequence gets token 7 per step until it has `max_tokens`."""

    def __init__(self):
        self.left: dict[int, int] = {}  # seq id -> tokens left
        self.ids: dict[str, int] = {}
        self.fail_next = 0
        self.failed = None
        self.healthy, self.unhealthy_reason = True, ""
        self.on_health_change = None
        self.warmup_status = None
        self.finished_by_stop: list[int] = []
        self.lags: list[int] = []
        self.steps = 0
        self.delay = 0.0
        self.last_step_idle = False

    def add_requests(self, requests):
        admitted = []
        for prompt, params, request_id in requests:
            if not prompt:
                raise ValueError("prompt is empty")
            seq_id = len(self.ids) + 100
            self.ids[request_id] = seq_id
            self.left[seq_id] = params.max_tokens
            admitted.append(AdmittedRequest(request_id, None, list(prompt), params, [seq_id]))
        return admitted

    def abort(self, request_id):
        self.left.pop(self.ids.get(request_id), None)

    def finish_sequences(self, seq_ids):
        self.finished_by_stop += seq_ids
        for seq_id in seq_ids:
            self.left.pop(seq_id, None)

    def set_output_lag(self, steps):
        self.lags.append(steps)

    def has_unfinished_requests(self):
        return bool(self.left)

    def get_stats(self):
        return EngineStats(num_running=len(self.left), num_steps=self.steps)

    def start_warmup(self):
        return threading.Event()  # has no stop(); the driver only stops what it started

    def step(self):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected")
        self.steps += 1
        time.sleep(self.delay)
        seq_ids = sorted(self.left)
        finished = []
        for seq_id in seq_ids:
            self.left[seq_id] -= 1
            if not self.left[seq_id]:
                del self.left[seq_id]
                finished.append(FinishedSequence(seq_id, "length", None, False, SequenceMetrics()))
        return EngineCoreOutputs(seq_ids=np.array(seq_ids, np.int64), token_ids=np.full(len(seq_ids), 7, np.int32),
                                 finished=finished)


def started(core):
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = driver.EngineDriver(core, events.put)
    thread = engine.start_thread()
    return engine, events, thread


def collect(events, until) -> list:
    got = []
    while True:
        event = events.get(timeout=30)
        got.append(event)
        if until(event):
            return got


def test_requests_run_to_their_end_and_the_core_goes_idle():
    core = FakeCore()
    engine, events, thread = started(core)
    engine.submit(driver.Add(1, [([1, 2], SamplingParams(max_tokens=3), "a"),
                                 ([3], SamplingParams(max_tokens=1), "b")]))
    got = collect(events, lambda e: isinstance(e, driver.Stats) and e.stats.num_steps == 3 and not e.stats.num_running)
    added = next(e for e in got if isinstance(e, driver.Added))
    assert added.token == 1 and [r.request_id for r in added.admitted] == ["a", "b"]
    steps = [e for e in got if isinstance(e, driver.Outputs)]
    assert [e.step for e in steps] == [1, 2, 3]
    assert [e.outputs.seq_ids.tolist() for e in steps] == [[100, 101], [100], [100]]
    assert [f.seq_id for e in steps for f in e.outputs.finished] == [101, 100]
    engine.submit(driver.Add(2, [([], SamplingParams(), "bad")]))
    refused = collect(events, lambda e: isinstance(e, driver.Added))[-1]
    assert refused.admitted is None and isinstance(refused.error, ValueError)
    engine.stop()
    thread.join(10)
    assert not thread.is_alive()


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_goes_on():
    core = FakeCore()
    core.fail_next = 1
    engine, events, thread = started(core)
    engine.submit(driver.Add(1, [([1], SamplingParams(max_tokens=5), "a"), ([2], SamplingParams(max_tokens=5), "b")]))
    failed = collect(events, lambda e: isinstance(e, driver.StepFailed))[-1]
    assert failed.request_ids == ["a", "b"] and "injected" in failed.message
    assert not core.left  # aborted in the core
    engine.submit(driver.Add(2, [([1], SamplingParams(max_tokens=2), "c")]))
    got = collect(events, lambda e: isinstance(e, driver.Outputs) and e.outputs.finished)
    assert got[-1].outputs.finished[0].seq_id == 102
    engine.stop()
    thread.join(10)


def test_a_core_failed_for_good_ends_the_loop():
    core = FakeCore()
    core.fail_next = 1
    core.failed = RuntimeError("the device is gone")
    engine, events, thread = started(core)
    engine.submit(driver.Add(1, [([1], SamplingParams(max_tokens=5), "a")]))
    fatal = collect(events, lambda e: isinstance(e, driver.Fatal))[-1]
    assert "injected" in fatal.message
    thread.join(10)
    assert not thread.is_alive()


def test_stop_string_finishes_and_the_output_lag_reach_the_core():
    core = FakeCore()
    core.delay = 0.001
    engine, events, thread = started(core)
    engine.submit(driver.Add(1, [([1], SamplingParams(max_tokens=10**6), "a")]))
    collect(events, lambda e: isinstance(e, driver.Outputs) and e.step >= 5)
    engine.submit(driver.OutputLag(2))
    engine.submit(driver.FinishSequences([100]))
    collect(events, lambda e: isinstance(e, driver.Stats) and not e.stats.num_running)
    assert core.finished_by_stop == [100]
    assert max(core.lags) >= 3  # steps ran ahead of what the owner processed
    engine.stop()
    thread.join(10)
