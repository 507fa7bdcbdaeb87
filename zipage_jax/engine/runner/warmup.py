"""Warm-up: builds the runner's program grid on worker threads, the serving set first.

XLA compiles outside the GIL, so programs compile side by side (tracing and lowering take
turns). The grid's serving set (the largest bucket of each kind) comes first: once it is ready
every step can run, padded up to the nearest ready bucket, while the rest compile behind it.
Run it to the end (`run`) or in the background (`start`), as the server does. In the
background it yields to requests: while `busy()` it starts no new program (those being built
finish) for up to MAX_YIELD_S per program, so the first requests of a just-started server run
without competing with compiles, and a server that is never idle still completes its grid.

A warm-up still running when the interpreter exits stops (`stop`) before the runtime shuts down:
a worker still inside a compile then would abort the process.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

from zipage_jax.engine.runner.grid import GridProgram
from zipage_jax.engine.stats import WarmupStatus

logger = logging.getLogger("zipage_jax")

MAX_WORKERS = 8
MAX_YIELD_S = 30.0  # the longest a worker waits for the engine to be idle before its next program
_POLL_S = 0.05


def default_workers() -> int:
    """One compile thread per core, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class Warmup:
    def __init__(self, grid: list[GridProgram], workers: int | None = None,
                 busy: Callable[[], bool] = lambda: False):
        self.grid = grid
        self.workers = workers or default_workers()
        self._busy = busy
        self._queue: queue.SimpleQueue[GridProgram | None] = queue.SimpleQueue()
        self._serving_left = sum(p.serving for p in grid)
        self._left = len(grid)
        self._built = self._failed = 0
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._started = self._ended = 0.0
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> "Warmup":
        """Builds the grid on daemon threads and returns at once."""
        _running.add(self)
        self._started = time.perf_counter()
        for program in self.grid:
            self._queue.put(program)
        with self._lock:  # `stop` waits for every worker started here
            for i in range(min(self.workers, len(self.grid))):
                self._queue.put(None)  # one end marker per worker
                thread = threading.Thread(target=self._work, name=f"zipage-warmup-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        if not self.grid:
            self._ended = self._started
        return self

    def run(self, on_progress: Callable[[int], None] | None = None) -> "Warmup":
        """Builds the whole grid and returns when it is done; `on_progress(n)` as n more are built."""
        return self.start().wait(on_progress)

    def wait(self, on_progress: Callable[[int], None] | None = None) -> "Warmup":
        """Returns when every program of the started warm-up is built (or failed)."""
        reported = 0
        with self._progress:
            while True:
                done = len(self.grid) - self._left
                if on_progress is not None and done > reported:
                    on_progress(done - reported)
                reported = done
                if not self._left:
                    return self
                self._progress.wait()

    def wait_serving(self, timeout: float | None = None) -> bool:
        """Waits until the serving set is built; False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self._serving_left == 0, timeout)

    def stop(self) -> None:
        """Builds nothing more (programs being built finish) and waits for the workers."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    @property
    def status(self) -> WarmupStatus:
        with self._lock:
            end = self._ended or time.perf_counter()
            return WarmupStatus(total=len(self.grid), ready=self._built,
                                serving_ready=self._serving_left == 0, done=self._left == 0,
                                seconds=end - self._started if self._started else 0.0, failed=self._failed)

    def _yield_to_requests(self) -> None:
        deadline = time.monotonic() + MAX_YIELD_S
        while not self._stopping and time.monotonic() < deadline and self._busy():
            time.sleep(_POLL_S)

    def _work(self) -> None:
        while (program := self._queue.get()) is not None:
            built = failed = False
            if not program.serving:
                self._yield_to_requests()
            if not self._stopping:
                try:
                    program.build()
                    built = True
                except Exception:  # noqa: BLE001 - a step that needs it compiles it and fails there
                    logger.exception("warm-up: building the %s program %s failed", program.kind, program.key)
                    failed = True
            with self._progress:
                self._left -= 1
                self._built += built
                self._failed += failed
                self._serving_left -= program.serving
                if self._left == 0:
                    self._ended = time.perf_counter()
                self._progress.notify_all()


_running: weakref.WeakSet[Warmup] = weakref.WeakSet()  # started warm-ups (their workers hold them while they run)


@atexit.register  # after jax registered its own exit hooks (grid.py imports it): this one runs first
def _stop_running() -> None:
    for warmup in list(_running):
        warmup.stop()
