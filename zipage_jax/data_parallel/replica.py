"""EngineReplica: one LLMEngine in its own process (a Ray actor: ReplicatedEngine makes it one),
stepped by its own thread.

Calls come in on the actor's threads: `add` (waits until the stepping thread has admitted the
request, raising its ValueError), `abort`, `poll` (the outputs since the last poll, with the
engine's latest stats), `ping`, `start_warmup` / `stop_warmup`. The stepping thread runs them
between steps, as the server's EngineLoop does. A step that raises fails the requests in
flight here (their outputs carry the error); an engine that failed for good, or a stepping thread
that failed, ends the process, so that Ray restarts the replica with a fresh engine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.runner.warmup import WarmupStatus
from zipage_jax.engine.stats import EngineStats
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.data_parallel")

_IDLE_S = 0.5  # an idle stepping thread refreshes its stats this often (a warm-up's progress shows)
_FAILURE_BACKOFF_S = 0.05  # after a failed step, so a persistently broken engine does not spin


@dataclass
class ReplicaInfo:
    """What the front needs of a replica's engine, once: its tokenizer (a copy travels), limits
    and the prefix cache's geometry."""

    tokenizer: Any
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    pid: int
    incarnation: str  # new each time the process starts


@dataclass
class ReplicaStatus:
    pid: int
    incarnation: str
    warmup: WarmupStatus | None  # None when no warm-up was started


@dataclass
class ReplicaPoll:
    outputs: list[RequestOutput]
    stats: EngineStats
    warmup: WarmupStatus | None


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


_START_WARMUP = object()


class EngineReplica:
    def __init__(self, config: EngineConfig):
        """The engine of `config` (it loads its model here)."""
        self.engine = LLMEngine(config)
        self.incarnation = uuid.uuid4().hex
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[RequestOutput] = []
        self._published = threading.Condition()
        self._requests: set[str] = set()  # stepping thread only
        self._stats = dataclasses.replace(self.engine.get_stats())
        self._warmup = None
        threading.Thread(target=self._run, name="zipage-replica", daemon=True).start()

    # -- the actor's methods (any thread) ------------------------------------------------------

    def info(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(engine.tokenizer, engine.max_model_len, engine.pool.block_size,
                           engine.pool.num_usable_blocks, engine.config.enable_prefix_caching, os.getpid(),
                           self.incarnation)

    def ping(self) -> ReplicaStatus:
        return ReplicaStatus(os.getpid(), self.incarnation, self.engine.warmup_status)

    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Admits the request (between two steps); raises the engine's ValueError for bad input."""
        done = concurrent.futures.Future()
        self._commands.put(_Add(prompt_token_ids, params, request_id, done))
        done.result()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def poll(self, timeout: float) -> ReplicaPoll:
        """The outputs produced since the last poll, waiting up to `timeout` seconds for one."""
        with self._published:
            self._published.wait_for(lambda: self._outbox, timeout)
            outputs, self._outbox = self._outbox, []
            return ReplicaPoll(outputs, self._stats, self.engine.warmup_status)

    def start_warmup(self) -> None:
        """Starts the engine's background warm-up (once); returns when it has started."""
        done = concurrent.futures.Future()
        self._commands.put((_START_WARMUP, done))
        done.result()

    def stop_warmup(self) -> None:
        warmup = self._warmup
        if warmup is not None:
            warmup.stop()

    # -- the stepping thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._run_commands(block=not engine.has_unfinished_requests())
                outputs = self._step() if engine.has_unfinished_requests() else []
                self._publish(outputs, dataclasses.replace(engine.get_stats()))
        except BaseException:  # a replica that no longer steps would hold its requests forever
            logger.exception("the replica's stepping thread failed: ending its process (Ray restarts it)")
            os._exit(1)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_S) if block else self._commands.get_nowait()
            while True:
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Abort):
                    self._requests.discard(command.request_id)
                    self.engine.abort(command.request_id)
                else:
                    _, done = command
                    if self._warmup is None:
                        self._warmup = self.engine.start_warmup()
                    done.set_result(None)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
        except Exception as exc:  # ValueError: bad input (a 400); anything else fails this request only
            if not isinstance(exc, ValueError):
                logger.exception("add_request %s failed", command.request_id)
            command.done.set_exception(exc)
            return
        self._requests.add(command.request_id)
        command.done.set_result(None)

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception:
            if self.engine.failed is not None:
                logger.exception("the engine failed and cannot serve: ending this replica's process (Ray restarts "
                                 "it with a fresh engine)")
                os._exit(1)
            logger.exception("engine step failed; failing the requests in flight: %s", ", ".join(self._requests))
            outputs = [RequestOutput(request_id, None, [], [], finished=True, error="engine step failed")
                       for request_id in self._requests]
            for request_id in self._requests:
                self.engine.abort(request_id)
            time.sleep(_FAILURE_BACKOFF_S)
        for out in outputs:
            if out.error is not None:
                self.engine.abort(out.request_id)  # frees it if the engine still holds it
            if out.finished or out.error is not None:
                self._requests.discard(out.request_id)
        return outputs

    def _publish(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """The outputs for the next poll, with the stats taken after them."""
        with self._published:
            self._stats = stats
            if outputs:
                self._outbox.extend(outputs)
                self._published.notify_all()
