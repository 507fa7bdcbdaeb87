"""EngineDriver: the one loop that owns an engine core, wherever it runs (a thread of the server's
process, the engine-core process, a data-parallel replica).

Commands (add, abort, finish sequences, output lag, start the warm-up, stop) come in on a queue
from any thread and run between steps; each step's outputs, and the core's stats, go out as
events through `publish` (called on the driver's thread). The failure policy is here, once: a
step that raises fails the requests in flight (their ids go out in a StepFailed event) and the
loop goes on after a short pause; a core that failed for good (`core.failed`) ends the loop with
a Fatal event.

The core is anything with EngineCore's methods (EngineCore, the data-parallel ReplicatedEngine,
the tests' fakes): `add_requests`, `abort`, `finish_sequences`, `set_output_lag`, `step`,
`has_unfinished_requests`, `get_stats`, `start_warmup`, `warmup_status`, `healthy`,
`unhealthy_reason`, `failed`, `last_step_idle` (its latest step did nothing: every sequence waits,
for a block, a slot or the output stage), and the hook `on_health_change` it calls, from any
thread, when `healthy` changes.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zipage_jax.engine.core import AdmittedRequest
from zipage_jax.engine.core_outputs import EngineCoreOutputs
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax")

FAILURE_BACKOFF_S = 0.05  # after a failed step, so a persistently broken engine does not spin
IDLE_STEP_WAIT_S = 0.01  # after a step that published nothing, at most this long for a command
IDLE_STATS_S = 0.2  # an idle driver publishes the core's stats this often while its warm-up builds
BUSY_STATS_S = 0.1  # a busy one at most this often (and once more when it goes idle)


# -- events (driver -> its owner) --------------------------------------------------------------


@dataclass
class Added:
    """The answer to an Add: the requests admitted, or the error that refused them all."""

    token: int  # the Add's
    admitted: list[AdmittedRequest] | None
    error: BaseException | None = None


@dataclass
class Outputs:
    step: int  # the driver's step number (1, 2, ...)
    outputs: EngineCoreOutputs


@dataclass
class StepFailed:
    """A step raised: these requests were aborted; the loop goes on."""

    request_ids: list[str]
    message: str


@dataclass
class Fatal:
    """The core failed for good (or its loop did): the loop has ended."""

    message: str


@dataclass
class Stats:
    stats: EngineStats
    warmup: WarmupStatus | None
    healthy: bool  # the core can serve now (not rebuilding its device state)
    unhealthy_reason: str = ""  # why not, while it cannot


Event = Added | Outputs | StepFailed | Fatal | Stats


# -- commands (anyone -> the driver) --------------------------------------------------------------


@dataclass
class Add:
    token: int
    requests: list[tuple[str | list[int], SamplingParams | None, str | None]]


@dataclass
class Abort:
    request_id: str


@dataclass
class FinishSequences:
    seq_ids: list[int]


@dataclass
class OutputLag:
    steps_processed: int  # the owner has processed the outputs of steps 1 .. this


@dataclass
class StartWarmup:
    pass


@dataclass
class Stop:
    pass


@dataclass
class Wake:
    """Nothing to do: the loop looks at its core again (the core's health changed)."""


Command = Add | Abort | FinishSequences | OutputLag | StartWarmup | Stop | Wake


class EngineDriver:
    def __init__(self, core: Any, publish: Callable[[Event], None]):
        self.core = core
        core.on_health_change = self._health_changed
        self._publish = publish
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._unfinished: dict[str, set[int]] = {}  # request id -> its unfinished seq ids (driver thread only)
        self._request_of: dict[int, str] = {}  # seq id -> request id
        self._last_stats = 0.0
        self._steps = 0
        self._processed = 0
        self._warmup = None
        self._warmup_done = True

    def submit(self, command: Command) -> None:
        """Queues a command (any thread); it runs before the next step."""
        self._commands.put(command)

    def stop(self) -> None:
        """Stops the warm-up (waiting for the programs being built) and then the loop (any thread)."""
        if self._warmup is not None:
            self._warmup.stop()
        self.submit(Stop())

    def run(self) -> None:
        """Steps until stopped or the core fails for good (on the calling thread)."""
        try:
            self._publish_stats()
            idle_step = False
            while self._run_commands(block=not self.core.has_unfinished_requests(), idle_step=idle_step):
                idle_step = False
                if self.core.has_unfinished_requests():
                    if not self._step():
                        return
                    idle_step = self.core.last_step_idle
                quiet = not self.core.has_unfinished_requests()
                if quiet or time.monotonic() - self._last_stats >= BUSY_STATS_S or not self._warmup_done:
                    self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - a loop that no longer steps holds its requests forever
            logger.exception("the engine loop failed")
            self._publish(Fatal(f"the engine loop failed: {type(exc).__name__}: {exc}"))

    def start_thread(self, name: str = "zipage-engine") -> threading.Thread:
        thread = threading.Thread(target=self.run, name=name, daemon=True)
        thread.start()
        return thread

    # -- the loop --------------------------------------------------------------------------------

    def _run_commands(self, block: bool, idle_step: bool = False) -> bool:
        """Runs the queued commands (waiting for one if `block`, a while at most during a
        warm-up, so its progress shows; briefly after a step that published nothing: every
        sequence may be waiting, for the output stage say); False once told to stop."""
        try:
            if block:
                command = self._commands.get(timeout=None if self._warmup_done else IDLE_STATS_S)
            elif idle_step:
                command = self._commands.get(timeout=IDLE_STEP_WAIT_S)
            else:
                command = self._commands.get_nowait()
            while True:
                if isinstance(command, Stop):
                    return False
                self._command(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _command(self, command: Command) -> None:
        core = self.core
        if isinstance(command, Add):
            try:
                admitted = core.add_requests(command.requests)
            except Exception as exc:  # noqa: BLE001 - ValueError: bad input; anything else fails these only
                if not isinstance(exc, ValueError):
                    logger.exception("adding request(s) %s failed", ", ".join(str(r) for _, _, r in command.requests))
                self._publish(Added(command.token, None, exc))
                return
            for request in admitted:
                self._unfinished[request.request_id] = set(request.seq_ids)
                for seq_id in request.seq_ids:
                    self._request_of[seq_id] = request.request_id
            self._publish(Added(command.token, admitted))
        elif isinstance(command, Abort):
            self._forget(command.request_id)
            core.abort(command.request_id)
        elif isinstance(command, FinishSequences):
            core.finish_sequences(command.seq_ids)
            for seq_id in command.seq_ids:
                self._finished(seq_id)
        elif isinstance(command, OutputLag):
            self._processed = max(self._processed, command.steps_processed)
            core.set_output_lag(self._steps - self._processed)
        elif isinstance(command, StartWarmup):
            if self._warmup is None:
                self._warmup = core.start_warmup()
                self._warmup_done = False
        # Wake: nothing to do

    def _step(self) -> bool:
        """One step of the core; False once the core failed for good."""
        core = self.core
        try:
            outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - the failure policy
            if core.failed is not None:
                logger.exception("the engine failed and cannot serve")
                self._publish(Fatal(f"the engine failed: {type(exc).__name__}: {exc}"))
                return False
            failed = sorted(self._unfinished)
            logger.exception("engine step failed; failing the requests in flight: %s", ", ".join(failed))
            for request_id in failed:
                self._forget(request_id)
                core.abort(request_id)
            self._publish(StepFailed(failed, f"engine step failed: {type(exc).__name__}: {exc}"))
            time.sleep(FAILURE_BACKOFF_S)
            return True
        for request_id, _, _ in outputs.failures:
            self._forget(request_id)
        for finished in outputs.finished:
            self._finished(finished.seq_id)
        if outputs.empty:
            return True
        self._steps += 1  # the steps whose outputs the owner will process, and acknowledge
        core.set_output_lag(self._steps - 1 - self._processed)
        self._publish(Outputs(self._steps, outputs))
        return True

    def _finished(self, seq_id: int) -> None:
        request_id = self._request_of.pop(seq_id, None)
        seqs = self._unfinished.get(request_id)
        if seqs is not None:
            seqs.discard(seq_id)
            if not seqs:
                del self._unfinished[request_id]

    def _forget(self, request_id: str) -> None:
        for seq_id in self._unfinished.pop(request_id, ()):
            self._request_of.pop(seq_id, None)

    def _health_changed(self) -> None:
        """The core's hook (any thread: inside a step, or the core's own threads): its health
        shows at once, and an idle loop looks at it again."""
        self._publish_stats()
        self.submit(Wake())

    def _publish_stats(self) -> None:
        self._last_stats = time.monotonic()
        warmup = self.core.warmup_status
        self._warmup_done = self._warmup is None or (warmup is not None and warmup.done)
        healthy = self.core.healthy
        self._publish(Stats(dataclasses.replace(self.core.get_stats()), warmup, healthy,
                            "" if healthy else self.core.unhealthy_reason))
