"""EngineLoop: the one thread that owns the (not thread-safe) engine.

The event loop sends commands (add, abort) through a queue that the engine thread drains
between steps; outputs go back to per-request asyncio queues via call_soon_threadsafe. An
output whose `error` is set fails its request alone. A device failure inside a step is the
engine's to recover from (its requests go on); a step that raises anyway fails every request in
flight, and the loop keeps serving, unless the engine says it failed for good (`engine.failed`):
then `engine_error` is set and `on_engine_error` called (the server exits). The real errors go
to the log, under the engine request ids (the HTTP request id followed by the prompt's index).

With `warmup`, the engine thread starts the engine's background warm-up once the model has
loaded (`LLMEngine.start_warmup`), and refreshes its stats snapshot while the programs build;
`stop()` stops the warm-up (the programs being built finish, no other starts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.stats import EngineStats
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.server")

_FAILURE_BACKOFF_S = 0.05  # after a failed step, so a persistently broken engine does not spin
_WARMUP_POLL_S = 0.2  # while the warm-up builds programs, an idle engine thread refreshes its stats this often


class RequestFailed(Exception):
    """Delivered to every request's queue when an engine step failed (the error is logged)."""


class OutputObserver(Protocol):
    def observe(self, output: RequestOutput, now: float) -> None: ...

    def discard(self, request_id: str) -> None: ...


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    sink: asyncio.Queue
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class EngineLoop:
    def __init__(self, factory: Callable[[], LLMEngine], observer: OutputObserver | None = None,
                 on_load_error: Callable[[BaseException], None] | None = None,
                 on_loaded: Callable[[LLMEngine], None] | None = None,
                 on_engine_error: Callable[[BaseException], None] | None = None, warmup: bool = False):
        """`on_loaded(engine)` runs in the engine thread once the model has loaded, before
        `ready` is set (a failure there is a load failure); `on_engine_error(exc)` once the
        engine has become unusable. With `warmup`, the engine's background warm-up starts right
        after `on_loaded` (a failure to start it is a load failure too)."""
        self._factory = factory
        self._observer = observer
        self._on_load_error = on_load_error
        self._on_engine_error = on_engine_error
        self._on_loaded = on_loaded
        self._start_warmup = warmup
        self._warmup = None  # the engine's Warmup, once this loop started it
        self._warmup_lock = threading.Lock()  # orders starting the warm-up against stop()
        self._stopping = False
        self._warmup_settled = True  # the stats snapshot counts every program the warm-up will build
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine: LLMEngine | None = None
        self.tokenizer: Any = None  # a copy of the engine's, for the server's FormatThread alone
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None  # the engine became unusable
        self.ready = threading.Event()
        self.stats: EngineStats | None = None  # a snapshot taken by the engine thread

    # -- event-loop side ---------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="zipage-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the warm-up (waiting for the programs being built) and the engine thread."""
        with self._warmup_lock:
            self._stopping = True  # a model still loading starts no warm-up
            warmup = self._warmup
        if warmup is not None:
            warmup.stop()
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def warmup_status(self):
        """The engine's warm-up progress (its WarmupStatus), None before the model has loaded and
        when no warm-up ran. Read from any thread."""
        engine = self.engine if self.ready.is_set() else None
        return None if engine is None else engine.warmup_status

    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
            sink: asyncio.Queue) -> asyncio.Future:
        """Queues a request whose outputs (RequestOutput, or a final RequestFailed) go to `sink`;
        the future fails with the engine's ValueError for bad input."""
        done = concurrent.futures.Future()
        self._commands.put(_Add(prompt_token_ids, params, request_id, sink, done))
        return asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def fail_requests(self, error: RequestFailed) -> None:
        """Fails every request in flight now, from any thread, without the engine (its thread may
        be blocked on a device that will never answer): for a server about to exit."""
        sinks = list(self._sinks.values())  # one copy, atomic under the GIL: the engine thread owns the dict
        if sinks and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, [(sink, error) for sink in sinks])

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
            if self._on_loaded is not None:
                self._on_loaded(self.engine)
            with self._warmup_lock:
                if self._start_warmup and not self._stopping:
                    self._warmup = self.engine.start_warmup()
        except BaseException as exc:
            logger.exception("loading the model failed")
            self.load_error = exc
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self._snapshot()
        self.ready.set()
        while self._run_commands(block=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests():
                self._step()
            self._snapshot()

    def _run_commands(self, block: bool) -> bool:
        """Runs the queued commands (waiting for one if `block`, a while at most during the
        warm-up); False once told to stop."""
        try:
            command = self._commands.get(timeout=self._idle_timeout()) if block else self._commands.get_nowait()
            while True:
                if command is _STOP:
                    return False
                if isinstance(command, _Add):
                    self._add(command)
                else:
                    self._abort(command.request_id)
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _idle_timeout(self) -> float | None:
        """How long an idle engine thread waits for a command: a while during the warm-up (its
        programs then show in the stats), else until one comes."""
        return None if self._warmup_settled else _WARMUP_POLL_S

    def _add(self, command: _Add) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the client went away before the request was added
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
        except Exception as exc:  # ValueError: bad input (400); anything else fails this request only
            if not isinstance(exc, ValueError):
                logger.exception("add_request %s failed", command.request_id)
            command.done.set_exception(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        if self._observer is not None:
            self._observer.discard(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort %s failed", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if self.engine.failed is None:
                logger.exception("engine step failed; failing the requests in flight: %s", ", ".join(self._sinks))
                self._fail_all(RequestFailed("engine step failed"))
                time.sleep(_FAILURE_BACKOFF_S)
                return
            logger.exception("the engine failed and cannot serve; failing the requests in flight: %s",
                             ", ".join(self._sinks))
            self.engine_error = exc
            self._fail_all(RequestFailed("the engine failed"))
            if self._on_engine_error is not None:
                self._on_engine_error(exc)
            return
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.error is not None:
                logger.error("request %s failed: %s", out.request_id, out.error)
                self._abort(out.request_id)  # forgets it here; frees it if the engine still holds it
            elif out.finished:
                del self._sinks[out.request_id]
            if self._observer is not None and out.error is None:
                self._observer.observe(out, now)
            deliveries.append((sink, out))
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, error: RequestFailed) -> None:
        failed = list(self._sinks.items())
        for request_id, _ in failed:
            self._abort(request_id)
        if failed:
            self._loop.call_soon_threadsafe(_deliver, [(sink, error) for _, sink in failed])

    def _snapshot(self) -> None:
        try:
            settled = self._warmup is None or self._warmup.status.done  # read first: its programs are all counted
            self.stats = dataclasses.replace(self.engine.get_stats())
            self._warmup_settled = settled
        except Exception:
            logger.exception("get_stats failed")


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)
