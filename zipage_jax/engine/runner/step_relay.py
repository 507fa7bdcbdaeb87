"""One model served by several processes: process 0 runs the server and the scheduler, every
other process (a follower) makes each device call process 0's runner makes, with the same host
inputs, so the SPMD programs of a multi-process mesh run in lockstep.

The cut is the runner, the one door to the device: its methods named in RELAYED are every call
that runs a program on the mesh (a forward step, a compaction, a history seeding, a fresh device
state) or builds one ahead (the next decode step). Before process 0's runner runs one it sends
the method's name and host arguments (numpy arrays, shape keys) to every follower
(`LeaderRelay.publish`); a follower (`Follower.run`) calls the same method on its own runner,
built from the same command. Programs compile where they run (a follower builds a program when
its first call arrives, unless its own warm-up did): compiling is local, and calls that execute
arrive in process 0's order, on one connection each.

Transport: one TCP connection from each follower to process 0, on the coordinator's host at
`relay_address` (the coordinator's port + 1 unless given); each message is pickled behind an
8-byte length. Loading a pickle runs code: process 0 listens on the coordinator's host only,
and the group's network must be trusted, as it must be for jax.distributed itself.

Faults: a follower whose connection closes (it died, or its call failed: it says why first)
makes process 0 give up: `on_lost(reason)` (the server fails the requests in flight and stops)
and, EXIT_GRACE_S later if the process is still alive (blocked in a collective that waits for
the dead peer), a hard exit with status 1. A follower exits with status 1 when process 0's
connection closes, and with 0 when process 0 stops cleanly (`LeaderRelay.close`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from zipage_jax.engine.runner.executable_store import HOST_ONLY_OPTIONS
from zipage_jax.engine.runner.warmup import Warmup

logger = logging.getLogger("zipage_jax")

RELAYED = frozenset({"run_forward", "run_compaction", "run_seed", "reset_state", "prefetch_decode"})
CONNECT_TIMEOUT_S = 300.0  # how long process 0 waits for its followers once its own engine is built, and they for it
EXIT_GRACE_S = 5.0  # after a follower is lost: the longest process 0 lets the server fail requests and stop
EXIT_STATUS = 1
_STOP = "stop"  # process 0 stops cleanly
_FAILED = "failed"  # a follower's call raised: (FAILED, why), then it exits
_HEADER = struct.Struct(">Q")


class PeerLost(RuntimeError):
    """A process of the group is gone: the group cannot run another step."""


# -- messages --------------------------------------------------------------------------------


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def send_message(sock: socket.socket, message: object) -> None:
    sock.sendall(encode(message))


def recv_message(sock: socket.socket) -> Any:
    """The next message; EOFError when the peer closed the connection (also mid-message)."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise EOFError("the connection closed")
        received += n
    return bytes(buffer)


# -- where and what --------------------------------------------------------------------------


def relay_address(coordinator_address: str | None, relay_port: int | None = None) -> tuple[str, int]:
    """(host, port) of process 0's relay: the coordinator's host ("[::1]:1234" -> "::1"), and
    `relay_port`, else the coordinator's port + 1."""
    if coordinator_address is None:
        raise ValueError("several processes need --coordinator-address HOST:PORT (process 0's host)")
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"the coordinator address must be HOST:PORT, got {coordinator_address!r}")
    host = host.removeprefix("[").removesuffix("]")
    port_number = int(port) + 1 if relay_port is None else relay_port
    if not 0 < port_number < 65536:
        raise ValueError(f"the relay port must be in [1, 65535], got {port_number}")
    return host, port_number


def runner_signature(runner) -> dict[str, str]:
    """What must be equal in every process's runner for their programs to match: the engine
    options that shape programs, the KV pool and the model's config."""
    options = {k: repr(v) for k, v in dataclasses.asdict(runner.config).items() if k not in HOST_ONLY_OPTIONS}
    return {**options, "KV pool": repr(runner.pool), "model config": repr(runner.model_config)}


# -- process 0 -------------------------------------------------------------------------------


class LeaderRelay:
    """Process 0's side: listens at once (followers connect when their engine is built),
    `attach` waits for them all and hooks the runner, `publish` sends one call to every follower."""

    def __init__(self, host: str, port: int, num_followers: int, on_lost: Callable[[str], None], *,
                 exit_grace_s: float = EXIT_GRACE_S, hard_exit: Callable[[int], object] = os._exit):
        self.num_followers = num_followers
        self._on_lost, self._exit_grace_s, self._hard_exit = on_lost, exit_grace_s, hard_exit
        self._listener = socket.create_server((host, port), family=_family(host), backlog=num_followers)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]  # port 0: the one the system chose
        self._followers: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        self._lost_lock = threading.Lock()
        self.lost: str | None = None  # why the group broke
        self._closing = False

    def attach(self, runner, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Waits until every follower has connected and checked in with the same runner as this
        one's, then relays `runner`'s device calls; TimeoutError / ValueError say which process
        did not come or differs."""
        mine = runner_signature(runner)
        deadline = time.monotonic() + timeout_s
        while len(self._followers) < self.num_followers:
            left = deadline - time.monotonic()
            missing = sorted(set(range(1, self.num_followers + 1)) - set(self._followers))
            if left <= 0:
                raise TimeoutError(f"process(es) {', '.join(map(str, missing))} did not connect to the relay at "
                                   f"{_show(self.address)} within {timeout_s:.0f} s (every process runs the same "
                                   "command, with its own --process-id; is the port reachable?)")
            self._listener.settimeout(left)
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(left)
            try:
                process_id, theirs = recv_message(sock)
                theirs = dict(theirs)
            except Exception as exc:  # noqa: BLE001 - not one of ours: the wait goes on
                sock.close()
                logger.warning("a relay connection that did not check in was dropped: %s", exc)
                continue
            if process_id not in missing:
                sock.close()
                raise ValueError(f"process {process_id!r} connected to the relay, which waits for process(es) "
                                 f"{', '.join(map(str, missing))} (each of 1 .. {self.num_followers} once)")
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differ:
                sock.close()
                raise ValueError(f"process {process_id} built a different engine than process 0 ({', '.join(differ)} "
                                 "differ): every process must run the same command")
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._followers[process_id] = sock
        self._listener.close()
        for process_id, sock in self._followers.items():
            threading.Thread(target=self._watch, args=(process_id, sock), name=f"zipage-relay-watch-{process_id}",
                             daemon=True).start()
        runner.relay = self
        logger.info("relay: %d follower process(es) connected at %s", self.num_followers, _show(self.address))

    def publish(self, method: str, args: tuple) -> None:
        """Sends one runner call to every follower; PeerLost once one is gone."""
        message = encode((method, args))
        with self._send_lock:
            if self.lost is not None:
                raise PeerLost(self.lost)
            for process_id, sock in self._followers.items():
                try:
                    sock.sendall(message)
                except OSError as exc:
                    self._lose(f"sending to process {process_id} failed: {exc}")
                    raise PeerLost(self.lost) from exc

    def close(self) -> None:
        """A clean stop: every follower returns (status 0)."""
        self._closing = True
        with self._send_lock:
            for sock in self._followers.values():
                try:
                    send_message(sock, (_STOP, ()))
                except OSError:
                    pass  # it is gone already
                sock.close()
        self._listener.close()

    def _watch(self, process_id: int, sock: socket.socket) -> None:
        """Followers send nothing after checking in but why their call failed; a closed
        connection is a lost follower."""
        try:
            kind, why = recv_message(sock)
            reason = f"process {process_id} failed: {why}" if kind == _FAILED else f"process {process_id}: {kind}"
        except Exception as exc:  # noqa: BLE001 - whatever broke the connection, the follower is gone
            reason = f"the connection to process {process_id} closed ({type(exc).__name__}: {exc})"
        if not self._closing:
            self._lose(reason)

    def _lose(self, reason: str) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = reason
        logger.error("relay: %s; failing the requests in flight and exiting (status %d)", reason, EXIT_STATUS)
        for sock in self._followers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a send in progress fails now
            except OSError:
                pass
        threading.Thread(target=self._exit_after_grace, name="zipage-relay-exit", daemon=True).start()
        self._on_lost(reason)

    def _exit_after_grace(self) -> None:
        time.sleep(self._exit_grace_s)
        logger.error("relay: still running %.0f s after losing a follower: exiting", self._exit_grace_s)
        exit_now(self._hard_exit)


def exit_now(hard_exit: Callable[[int], object] = os._exit) -> None:
    """Exits with EXIT_STATUS at once (output flushed): neither waiting for threads blocked on
    the device nor for jax.distributed's shutdown barrier, which a lost process never reaches."""
    sys.stdout.flush()
    sys.stderr.flush()
    hard_exit(EXIT_STATUS)


# -- the other processes ---------------------------------------------------------------------


class Follower:
    """A follower process's side: connects to process 0 and replays its runner's calls."""

    def __init__(self, runner, address: tuple[str, int], process_id: int):
        self.runner, self.address, self.process_id = runner, address, process_id
        self._last_call = 0.0

    def busy(self) -> bool:
        """Calls arrived within the last second (a warm-up then starts no program)."""
        return time.monotonic() - self._last_call < 1.0

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
        """The connection to process 0, checked in (retried until process 0 listens)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"process 0's relay at {_show(self.address)} did not answer within "
                                       f"{timeout_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_message(sock, (self.process_id, runner_signature(self.runner)))
        return sock

    def run(self, sock: socket.socket) -> int:
        """Replays calls until process 0 stops: 0 when it stopped cleanly, EXIT_STATUS when its
        connection closed or a call failed (process 0 is told why)."""
        while True:
            try:
                method, args = recv_message(sock)
            except (OSError, EOFError) as exc:
                logger.error("relay: process 0's connection closed (%s: %s): exiting", type(exc).__name__, exc)
                return EXIT_STATUS
            if method == _STOP:
                logger.info("relay: process 0 stopped")
                sock.close()
                return 0
            self._last_call = time.monotonic()
            try:
                if method not in RELAYED:
                    raise ValueError(f"{method!r} is not a relayed runner call")
                getattr(self.runner, method)(*args)
            except Exception as exc:  # noqa: BLE001 - this process cannot follow any more: process 0 learns why
                logger.exception("relay: replaying %s failed: exiting", method)
                try:
                    send_message(sock, (_FAILED, f"{method}: {type(exc).__name__}: {exc}"))
                except OSError:
                    pass
                return EXIT_STATUS


def follow(runner, address: tuple[str, int], process_id: int, warmup: bool) -> int:
    """A follower's life: connects to process 0, builds the program grid in the background like
    process 0 (`warmup`), and replays calls until process 0 stops (Follower.run's status)."""
    follower = Follower(runner, address, process_id)
    sock = follower.connect()
    if warmup:
        Warmup(runner.step_grid(), busy=follower.busy).start()
    return follower.run(sock)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _show(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
