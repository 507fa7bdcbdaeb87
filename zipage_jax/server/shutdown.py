"""GracefulServer: the uvicorn server of `zipage-jax serve`, which drains before it stops.

On SIGTERM or SIGINT it stops admitting at once (`stop_admitting`: /health, generation and
tokenizer routes answer 503 "the server is shutting down", the listener staying open so that
clients see it), lets the requests in flight finish, and once `shutdown_timeout` seconds have
passed aborts those still running (`abort`: each fails with ServerShuttingDown, a 503 or an error
event that ends its stream). A second signal aborts at once. Then it stops as uvicorn does (the
app's lifespan stops the engine: its own process within ENGINE_STOP_S) and returns from `run` instead of raising
the signal again: the process exits with its own status.

The other processes of a --num-processes group stop when process 0 does (it closes their relay
once drained): `defer_signals_to_process_0` keeps a signalled follower replaying until then.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from zipage_jax.server.engine_client import RequestFailed

logger = logging.getLogger("zipage_jax.server")

SHUTTING_DOWN = "the server is shutting down"
ABORT_GRACE_S = 2.0  # after the abort, for the aborted responses' last bytes; then uvicorn cancels what is left
# once drained, the engine core process's time to end its step in progress (a compile, say); then it is killed
ENGINE_STOP_S = 3.0


class ServerShuttingDown(RequestFailed):
    """Delivered to a request still running when the drain ends: the client gets a 503."""

    def __init__(self) -> None:
        super().__init__(f"{SHUTTING_DOWN}: the request was aborted before it finished")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, stop_admitting: Callable[[], None],
                 abort: Callable[[], None]):
        """`stop_admitting()` runs in the signal handler (it must only set a flag); `abort()` on the
        event loop, at every tick from the end of the drain on (a request admitted just before the
        signal may have reached the engine since)."""
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = ABORT_GRACE_S
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._stop_admitting, self._abort = stop_admitting, abort
        self._signals: list[int] = []  # received since the drain began
        self._deadline: float | None = None  # when the drain ends: what still runs is aborted
        self._aborted_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # stopping already, each wait bounded
            return
        self._signals.append(sig)
        self._stop_admitting()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self._signals:
            return False
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.shutdown_timeout
            logger.info("%s received: the server stops admitting and drains its %d request(s) in flight for at most "
                        "%g s", signal.Signals(self._signals[0]).name, self._in_flight(), self.shutdown_timeout)
        if len(self._signals) > 1 and self._deadline > now:
            logger.info("a second signal: aborting the requests in flight now")
            self._deadline = now
        if not self._in_flight():
            self.should_exit = True
        elif now >= self._deadline:
            if self._aborted_at is None:
                logger.warning("aborting the %d request(s) still in flight", self._in_flight())
                self._aborted_at = now
            self._abort()
            self.should_exit = now - self._aborted_at >= ABORT_GRACE_S
        return self.should_exit

    def _in_flight(self) -> int:
        """HTTP requests being answered (an idle keep-alive connection is none)."""
        return len(self.server_state.tasks)


def defer_signals_to_process_0(force_exit: Callable[[], Any]) -> None:
    """A follower of a group: SIGTERM or SIGINT (a supervisor stopping the whole group) leaves it
    replaying process 0's calls while process 0 drains, until process 0 stops it; a second signal
    calls `force_exit()`. (Ended at the first, it would leave process 0 a peer short mid-drain.)"""
    received: list[int] = []

    def handle(sig: int, frame: FrameType | None) -> None:
        if received:
            force_exit()
            return
        received.append(sig)
        logger.warning("%s received: this process stops when process 0 does (a second signal ends it now)",
                       signal.Signals(sig).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
