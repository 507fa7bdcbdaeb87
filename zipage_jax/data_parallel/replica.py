"""EngineReplica: one engine core in its own process (a Ray actor: ReplicatedEngine makes it one),
driven by the shared EngineDriver (engine/driver.py) on a thread of that process.

Calls come in on the actor's threads and become the driver's commands: `add` (waits until the
driver has admitted the request: its AdmittedRequest, or the core's ValueError), `abort`,
`finish_sequences`, `output_lag`, `start_warmup`, `stop`. What the driver publishes waits for
the next `poll`: the requests admitted, each step's EngineCoreOutputs under the replica's step
number, the requests a failed step ended, and the latest stats and warm-up status. The failure
policy is the driver's; a core that failed for good (its Fatal event) ends the process, so that
Ray restarts the replica with a fresh engine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from zipage_jax.config import EngineConfig
from zipage_jax.engine import driver
from zipage_jax.engine.core import AdmittedRequest, EngineCore, ModelInfo
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.data_parallel")

_WARMUP_START_S = 60.0  # start_warmup waits this long at most for the driver to start it

@dataclass
class Admitted:
    """The driver admitted this request under these seq ids (this incarnation's own)."""

    request_id: str
    seq_ids: list[int]


# what a poll brings, in the order the driver published it
ReplicaEvent = Admitted | driver.Outputs | driver.StepFailed


@dataclass
class ReplicaInfo:
    """What the front needs of a replica's engine, once: its tokenizer (a copy travels) and its model."""

    tokenizer: Any
    model_info: ModelInfo
    pid: int
    incarnation: str  # new each time the process starts


@dataclass
class ReplicaStatus:
    pid: int
    incarnation: str
    warmup: WarmupStatus | None  # None when no warm-up was started


@dataclass
class ReplicaPoll:
    # Admitted, Outputs (under this incarnation's step numbers), StepFailed
    events: list[ReplicaEvent]
    stats: EngineStats
    warmup: WarmupStatus | None
    incarnation: str


class EngineReplica:
    def __init__(self, config: EngineConfig):
        """The engine core of `config` (it loads its model here), its driver started."""
        self.core = EngineCore(config)
        self.incarnation = uuid.uuid4().hex
        self._published = threading.Condition()  # _events, _stats, _warmup, _adds
        self._events: list[ReplicaEvent] = []
        self._stats = dataclasses.replace(self.core.get_stats())
        self._warmup: WarmupStatus | None = None
        self._adds: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._stopped = False
        self.driver = driver.EngineDriver(self.core, self._publish)
        self.driver.start_thread("zipage-replica")

    # -- the actor's methods (any thread) ------------------------------------------------------

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.core.tokenizer, self.core.model_info, os.getpid(), self.incarnation)

    def ping(self) -> ReplicaStatus:
        return ReplicaStatus(os.getpid(), self.incarnation, self.core.warmup_status)

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> AdmittedRequest:
        """Admits the request (between two steps); raises the core's ValueError for bad input."""
        if self._stopped:
            raise RuntimeError("the replica has stopped")
        done: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._published:
            self._adds[token] = done
        self.driver.submit(driver.Add(token, [(prompt, params, request_id)]))
        return done.result()[0]

    def abort(self, request_id: str) -> None:
        self.driver.submit(driver.Abort(request_id))

    def finish_sequences(self, seq_ids: list[int], incarnation: str | None = None) -> None:
        """The front matched a stop string in these sequences: they end where they are. Seq ids
        are an incarnation's own: a call meant for another `incarnation` is ignored."""
        if incarnation in (None, self.incarnation):
            self.driver.submit(driver.FinishSequences(list(seq_ids)))

    def output_lag(self, steps_processed: int, incarnation: str | None = None) -> None:
        """The front has processed the outputs of this replica's steps 1 .. `steps_processed` (of
        `incarnation`: a call meant for another one is ignored)."""
        if incarnation in (None, self.incarnation):
            self.driver.submit(driver.OutputLag(steps_processed))

    def poll(self, timeout: float) -> ReplicaPoll:
        """What the driver published since the last poll, waiting up to `timeout` seconds for an event."""
        with self._published:
            self._published.wait_for(lambda: self._events, timeout)
            events, self._events = self._events, []
            return ReplicaPoll(events, self._stats, self._warmup, self.incarnation)

    def start_warmup(self) -> None:
        """Starts the engine's background warm-up (once); returns when it has started."""
        self.driver.submit(driver.StartWarmup())
        with self._published:
            self._published.wait_for(lambda: self._warmup is not None, _WARMUP_START_S)

    def stop(self) -> None:
        """Stops the warm-up (the programs being built finish, no other starts) and the driver."""
        self._stopped = True
        self.driver.stop()

    # -- the driver's thread ---------------------------------------------------------------------

    def _publish(self, event: driver.Event) -> None:
        if isinstance(event, driver.Fatal):
            logger.error("%s: ending this replica's process (Ray restarts it with a fresh engine)", event.message)
            os._exit(1)
        with self._published:
            if isinstance(event, driver.Added):
                done = self._adds.pop(event.token)
                if event.error is not None:
                    done.set_exception(event.error)
                    return
                done.set_result(event.admitted)
                self._events += [Admitted(a.request_id, a.seq_ids) for a in event.admitted]
            elif isinstance(event, driver.Outputs):
                outputs = event.outputs
                if outputs.failures:  # the exceptions stay here (logged by the core): only their messages travel
                    outputs = dataclasses.replace(outputs, failures=[(r, m, None) for r, m, _ in outputs.failures])
                self._events.append(driver.Outputs(event.step, outputs))
            elif isinstance(event, driver.StepFailed):
                self._events.append(event)
            elif isinstance(event, driver.Stats):
                self._stats, self._warmup = event.stats, event.warmup
            self._published.notify_all()
