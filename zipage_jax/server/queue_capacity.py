"""QueueCapacity: a bound on the engine requests waiting, so that a burst of clients is told to come
back (503 with Retry-After) instead of queueing without end.

A generation request reserves its sequences (prompts x n) when it is admitted, before it is
tokenized; each prompt's n are released at that prompt's first output (it is running), and
whatever remains when the request ends, however it ends. All of it runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable

from zipage_jax.server.errors import OpenAIError

QUEUE_FLAG = "--max-queued-requests"
DEFAULT_MAX_QUEUED_REQUESTS = 1024
RETRY_AFTER_S = 1


class QueueCapacity:
    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS, on_refused: Callable[[], None] = lambda: None):
        """`on_refused()` runs for each request refused because the queue is full."""
        if max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.queued = 0
        self._on_refused = on_refused

    def reserve(self, count: int) -> Reservation:
        """`count` queued sequences; OpenAIError 400 if they can never fit, 503 while they do not."""
        if count > self.max_queued:
            raise OpenAIError(400, f"the request asks for {count} sequences (prompts x n), more than this server's "
                              f"{QUEUE_FLAG} of {self.max_queued}")
        if self.queued + count > self.max_queued:
            self._on_refused()
            raise OpenAIError(503, f"the server's queue is full ({self.queued} sequences waiting, {QUEUE_FLAG} "
                              f"{self.max_queued}): retry later", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.queued += count
        return Reservation(self, count)


class Reservation:
    """A request's place in the queue. As a context manager it is released if the block raises
    (the request never started); otherwise whoever runs the request releases it."""

    def __init__(self, capacity: QueueCapacity, count: int):
        self._capacity = capacity
        self._held = count

    def release(self, count: int) -> None:
        count = min(count, self._held)
        self._held -= count
        self._capacity.queued -= count

    def release_all(self) -> None:
        self.release(self._held)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.release_all()
