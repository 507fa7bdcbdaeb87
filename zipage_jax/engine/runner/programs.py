"""Ahead-of-time compiled programs of one jitted function, keyed by their shape bucket.

A program is loaded from the executable store when it holds it, else traced, lowered and
compiled (each phase timed) and stored. Several threads may ask for programs at once (the
background warm-up and the engine): each program is built once, the others wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from zipage_jax.engine.runner.executable_store import ExecutableStore

logger = logging.getLogger("zipage_jax")


@dataclass(frozen=True)
class ProgramRecord:
    """How one program became ready: compiled (trace + lower + compile) or loaded from the store."""

    name: str  # the kind of program: forward, compression, history
    key: tuple
    origin: str  # "compiled" or "loaded"
    trace_seconds: float = 0.0
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.trace_seconds + self.lower_seconds + self.compile_seconds + self.load_seconds


class CompiledPrograms:
    def __init__(self, name: str, fn, store: ExecutableStore | None = None, **static):
        self.name, self.fn, self.store, self.static = name, fn, store, static
        self.executables: dict[tuple, object] = {}
        self.records: dict[tuple, ProgramRecord] = {}
        self._building: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    @property
    def num_built(self) -> int:
        return len(self.records)

    @property
    def seconds(self) -> float:
        """Seconds spent building this function's programs (tracing, lowering, compiling, loading)."""
        return sum(r.seconds for r in list(self.records.values()))

    def __call__(self, key: tuple, *args):
        return self.get(key, *args)(*args)

    def ready(self, key: tuple) -> bool:
        return key in self.executables

    def get(self, key: tuple, *args):
        """The executable for `key`, built from `args` (arrays or ShapeDtypeStructs) on a miss."""
        exe = self.executables.get(key)
        if exe is not None:
            return exe
        with self._lock:
            future = self._building.get(key)
            owner = future is None
            if owner:
                future = self._building[key] = Future()
        if not owner:
            return future.result()
        try:
            exe, record = self._build(key, args)
        except BaseException as exc:
            future.set_exception(exc)
            with self._lock:
                del self._building[key]
            raise
        self.records[key] = record
        self.executables[key] = exe
        future.set_result(exe)
        with self._lock:
            del self._building[key]
        return exe

    def _build(self, key: tuple, args: tuple):
        start = time.perf_counter()
        exe = self.store.load(self.name, key) if self.store is not None else None
        if exe is not None:
            record = ProgramRecord(self.name, key, "loaded", load_seconds=time.perf_counter() - start)
            logger.debug("loaded the %s program for %s in %.2f s", self.name, describe(key), record.load_seconds)
            return exe, record
        t0 = time.perf_counter()
        traced = self.fn.trace(*args, **self.static)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        exe = lowered.compile()
        t3 = time.perf_counter()
        record = ProgramRecord(self.name, key, "compiled", t1 - t0, t2 - t1, t3 - t2)
        logger.info("compiled the %s program for %s in %.1f s", self.name, describe(key), record.seconds)
        if self.store is not None:
            self.store.save(self.name, key, exe)
        return exe, record


def describe(key: tuple) -> str:
    return ", ".join(f"{name} {value}" for name, value in zip(key[::2], key[1::2]))
