"""EngineClient: what the server drives, wherever the engine core runs; the output stage runs here.

The server needs of an engine: `add` a request (its outputs go to a sink; bad input raises the
engine's ValueError), `abort` one, its `tokenizer` and `model_info`, `stats` and `warmup_status`
for /metrics, and its state for /health (`ready`, `load_error`, `engine_error`, `healthy`,
`unhealthy_reason`). Two clients share one front end (`FrontEnd`):

- MultiProcessEngineClient (server/process_client.py, the default): the engine core in a
  process of its own, its driver's events and commands as msgpack frames over a socket pair.
- InProcessEngineClient (here): the core (any EngineCore-like object: EngineCore, the
  data-parallel ReplicatedEngine, tests' fakes) driven on a thread of this process.

Either way the core hands back token ids and finish reasons (engine/core_outputs.py), and this
process's output thread turns them into RequestOutputs (engine/output_processor.py: text, stop
strings, log-probabilities), observes them for the metrics, and hands them to the requests' sinks
on the event loop. A stop string it matches finishes its sequence in the core, and it tells the
core which step it has processed: a sequence with stop strings runs at most MAX_OUTPUT_LAG steps
ahead of it (Scheduler).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zipage_jax.engine import driver
from zipage_jax.engine.core import ModelInfo
from zipage_jax.engine.output_processor import OutputProcessor
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.server")

# a requested warm-up whose first status has not arrived: nothing built, nothing counted yet
WARMUP_STARTING = WarmupStatus(total=0, ready=0, serving_ready=False, done=False, seconds=0.0, failed=0)

class RequestFailed(Exception):
    """Delivered to a request's sink when the engine failed it (the error is logged)."""


class OutputObserver(Protocol):
    def observe(self, output: RequestOutput, now: float) -> None: ...

    def discard(self, request_id: str) -> None: ...


class EngineClient(Protocol):
    ready: threading.Event  # set once the model has loaded and the client can take requests
    load_error: BaseException | None
    engine_error: BaseException | None  # the engine became unusable
    tokenizer: Any  # this process's copy, for the server's formatting thread alone
    model_info: ModelInfo | None

    @property
    def stats(self) -> EngineStats | None: ...

    @property
    def warmup_status(self) -> WarmupStatus | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def unhealthy_reason(self) -> str: ...

    def start(self, loop: asyncio.AbstractEventLoop, *, observer: OutputObserver | None = None,
              on_loaded: Callable[[Any], None] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None,
              on_engine_error: Callable[[BaseException], None] | None = None, warmup: bool = False) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...

    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, sink: Any,
            stream: bool = True, stream_interval: int = 1) -> asyncio.Future: ...

    def abort(self, request_id: str) -> None: ...

    def fail_requests(self, error: RequestFailed) -> None: ...


@dataclass
class _Forget:
    """A request the server aborted: the output stage forgets it (on the output thread)."""

    request_id: str


class FrontEnd:
    """The part of a client in the server's process: the output stage, the sinks, the engine's
    state as its events report it. A subclass starts the core and implements `_send` (a command
    to the core's driver); the events reach `_handle` (on the output thread)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None
        self.tokenizer: Any = None
        self.model_info: ModelInfo | None = None
        self._stats: EngineStats | None = None
        self._warmup: WarmupStatus | None = None
        self._core_healthy = True
        self.unhealthy_reason = ""  # why the core cannot serve, while it cannot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._observer: OutputObserver | None = None
        self._on_loaded = self._on_load_error = self._on_engine_error = None
        self._warmup_requested = False
        self._processor: OutputProcessor | None = None
        self._sinks: dict[str, Any] = {}  # request id -> sink (output thread, and `fail_requests`)
        self._adds: dict[int, tuple[concurrent.futures.Future, Any, tuple[bool, int], str]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()  # _adds and _sinks between the event loop and the output thread
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._processed = 0  # the last step whose outputs this stage has processed
        self._output_thread: threading.Thread | None = None
        self._stopping = False

    # -- the EngineClient API -----------------------------------------------------------------

    @property
    def stats(self) -> EngineStats | None:
        return self._stats

    @property
    def warmup_status(self) -> WarmupStatus | None:
        """None without a warm-up; a requested one counts as not ready from the start, before the
        core has reported its first status."""
        if not self._warmup_requested:
            return None
        return self._warmup or WARMUP_STARTING

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self.engine_error is None and self._core_healthy

    def start(self, loop: asyncio.AbstractEventLoop, *, observer: OutputObserver | None = None,
              on_loaded: Callable[[Any], None] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None,
              on_engine_error: Callable[[BaseException], None] | None = None, warmup: bool = False) -> None:
        """Starts loading the model (ready once loaded); `on_loaded(tokenizer)` runs before `ready`
        is set (its failure is a load failure); with `warmup` the engine builds its programs in
        the background once loaded."""
        self._loop, self._observer = loop, observer
        self._on_loaded, self._on_load_error, self._on_engine_error = on_loaded, on_load_error, on_engine_error
        self._warmup_requested = warmup
        self._output_thread = threading.Thread(target=self._run_outputs, name="zipage-outputs", daemon=True)
        self._output_thread.start()
        self._start_core()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._stop_core(timeout)
        self._events.put(None)
        if self._output_thread is not None:
            self._output_thread.join(timeout)

    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, sink: Any,
            stream: bool = True, stream_interval: int = 1) -> asyncio.Future:
        """Queues a request whose outputs (RequestOutput, or a final RequestFailed) go to `sink`
        (its `put_nowait`, on the event loop): streamed, one whenever it has advanced by
        `stream_interval` tokens, else its first and last; the future fails with the engine's
        ValueError for bad input."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            self._adds[token] = (done, sink, (stream, stream_interval), request_id)
        self._send(driver.Add(token, [(prompt_token_ids, params, request_id)]))
        return asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        self._send(driver.Abort(request_id))
        self._events.put(_Forget(request_id))

    def fail_requests(self, error: RequestFailed) -> None:
        """Fails every request in flight now, from any thread, without the engine (it may never
        answer again): for a server about to exit."""
        with self._lock:
            sinks = list(self._sinks.values())
        self._deliver([(sink, error) for sink in sinks])

    # -- a subclass's part ---------------------------------------------------------------------------

    def _start_core(self) -> None:
        raise NotImplementedError

    def _stop_core(self, timeout: float) -> None:
        raise NotImplementedError

    def _send(self, command: driver.Command) -> None:
        raise NotImplementedError

    # -- loading ----------------------------------------------------------------------------------

    def _loaded(self, tokenizer: Any, model_info: ModelInfo) -> None:
        """The core has loaded its model (any thread): the output stage and the server's copies."""
        try:
            self.model_info = model_info
            self._processor = OutputProcessor(copy.deepcopy(tokenizer), model_info.special_ids)
            self.tokenizer = copy.deepcopy(tokenizer)
            if self._on_loaded is not None:
                self._on_loaded(tokenizer)
            if self._warmup_requested and not self._stopping:
                self._send(driver.StartWarmup())
        except BaseException as exc:  # noqa: BLE001 - the server cannot serve without it
            self._load_failed(exc)
            return
        self.ready.set()

    def _load_failed(self, exc: BaseException) -> None:
        logger.error("loading the model failed: %s: %s", type(exc).__name__, exc)
        self.load_error = exc
        if self._on_load_error is not None:
            self._on_load_error(exc)

    # -- the output thread --------------------------------------------------------------------------

    def _publish(self, event: driver.Event) -> None:
        """The core's driver published `event` (any thread)."""
        self._events.put(event)

    def _run_outputs(self) -> None:
        """Handles the events as they come. When several wait, the steps' outputs in a row are
        processed as one (one RequestOutput per request for all of them), and everything is
        handed to the event loop at once."""
        while (event := self._events.get()) is not None:
            waiting = [event]
            while True:
                try:
                    waiting.append(self._events.get_nowait())
                except queue.Empty:
                    break
            deliveries: list[tuple[Any, object]] = []
            for event in _merge_outputs(waiting):
                if event is None:
                    self._events.put(None)  # stop after this batch
                    break
                try:
                    self._handle(event, deliveries)
                except Exception:  # noqa: BLE001 - the output stage must go on
                    logger.exception("handling the engine's event %s failed", type(event).__name__)
            self._deliver(deliveries)

    def _handle(self, event: Any, deliveries: list[tuple[Any, object]]) -> None:
        if isinstance(event, driver.Outputs):
            self._outputs(event, deliveries)
        elif isinstance(event, driver.Stats):
            self._stats, self._warmup = event.stats, event.warmup
            self._core_healthy, self.unhealthy_reason = event.healthy, event.unhealthy_reason
        elif isinstance(event, driver.Added):
            self._added(event)
        elif isinstance(event, driver.StepFailed):
            logger.error("%s; failing the requests in flight: %s", event.message, ", ".join(event.request_ids))
            self._fail(event.request_ids, RequestFailed("engine step failed"))
        elif isinstance(event, driver.Fatal):
            self._fatal(RuntimeError(event.message))
        elif isinstance(event, _Forget):
            self._forget(event.request_id)

    def _added(self, event: driver.Added) -> None:
        with self._lock:
            done, sink, stream, request_id = self._adds.pop(event.token)
        if not done.set_running_or_notify_cancel():  # the client went away first
            for request in event.admitted or ():
                self._send(driver.Abort(request.request_id))
            return
        if event.error is not None:
            if not isinstance(event.error, ValueError):
                logger.error("adding request %s failed: %s", request_id, event.error)
            done.set_exception(event.error)
            return
        for request in event.admitted:
            self._processor.add_request(request.request_id, request.prompt, request.prompt_token_ids,
                                        request.params, request.seq_ids, stream[0], stream_interval=stream[1])
            with self._lock:
                self._sinks[request.request_id] = sink
            if request.params.stop:  # the core learns how far this stage is from here on
                self._send(driver.OutputLag(self._processed))
        done.set_result(None)

    def _outputs(self, event: driver.Outputs, deliveries: list[tuple[Any, object]]) -> None:
        outputs, stopped = self._processor.process(event.outputs)
        if stopped:
            self._send(driver.FinishSequences(stopped))
        self._processed = event.step
        if self._processor.num_stop_string_requests:  # the core holds those while this stage lags
            self._send(driver.OutputLag(event.step))
        now = time.monotonic()
        for out in outputs:
            with self._lock:
                sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.error is not None:
                logger.error("request %s failed: %s", out.request_id, out.error)
                self._forget(out.request_id)
                self._send(driver.Abort(out.request_id))
            elif out.finished:
                self._forget(out.request_id)
            if self._observer is not None and out.error is None:
                self._observer.observe(out, now)
            deliveries.append((sink, out))

    def _fail(self, request_ids: list[str], error: RequestFailed) -> None:
        deliveries = []
        for request_id in request_ids:
            with self._lock:
                sink = self._sinks.get(request_id)
            self._forget(request_id)
            if sink is not None:
                deliveries.append((sink, error))
        self._deliver(deliveries)

    def _fatal(self, error: BaseException) -> None:
        if self.engine_error is not None:
            return
        self.engine_error = error
        with self._lock:
            request_ids = list(self._sinks)
        logger.error("the engine cannot serve any more: %s; failing the requests in flight: %s", error,
                     ", ".join(request_ids))
        self._fail(request_ids, RequestFailed("the engine failed"))
        if self._on_engine_error is not None:
            self._on_engine_error(error)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
        if self._processor is not None:
            self._processor.abort(request_id)
        if self._observer is not None:
            self._observer.discard(request_id)

    def _deliver(self, items: list[tuple[Any, object]]) -> None:
        loop = self._loop
        if items and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_deliver, items)


def _merge_outputs(events: list[Any]) -> list[Any]:
    """`events` with each run of consecutive Outputs merged into one (the last step's number)."""
    merged: list[Any] = []
    for event in events:
        if isinstance(event, driver.Outputs) and merged and isinstance(merged[-1], driver.Outputs):
            outputs = merged[-1].outputs
            outputs.extend(event.outputs)
            merged[-1] = driver.Outputs(event.step, outputs)
        else:
            merged.append(event)
    return merged


def _deliver(items: list[tuple[Any, object]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


class InProcessEngineClient(FrontEnd):
    """The core built by `factory` and driven on a thread of this process (its outputs still
    processed on the output thread): for the data-parallel front, a model spread over processes,
    and tests."""

    def __init__(self, factory: Callable[[], Any]):
        super().__init__()
        self._factory = factory
        self._driver: driver.EngineDriver | None = None
        self._thread: threading.Thread | None = None
        self._pending: list[driver.Command] = []  # commands sent before the driver exists
        self.core: Any = None  # the core, once loaded (tests reach into it)

    def _start_core(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zipage-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            core = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported as the load failure
            logger.exception("loading the model failed")
            self._load_failed(exc)
            return
        self.core = core
        self._driver = driver.EngineDriver(core, self._publish)
        with self._lock:
            pending, self._pending = self._pending, []
        for command in pending:
            self._driver.submit(command)
        self._loaded(core.tokenizer, core.model_info)
        if self.load_error is None and not self._stopping:
            self._driver.run()

    def _stop_core(self, timeout: float) -> None:
        if self._driver is not None:
            self._driver.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, command: driver.Command) -> None:
        if self._driver is None:
            with self._lock:
                if self._driver is None:
                    self._pending.append(command)
                    return
        self._driver.submit(command)
